"""The study's layer pass: every layer's logit-lens entropy at a pool's completion tokens.
`scoring.completion_layer_entropies` (the prompts without the lens, then the completions on
their cache; what `reproduce.study.sequence_layer_statistics` runs) against
`scoring.layer_entropies` over the whole right-padded sequences (what the pass ran before),
on the same rows and padded as the pass pads them (`study.padded_length`, LENGTH_BUCKET):
median seconds after a compiling call, and the largest difference between the two at the
scored tokens. Random weights of a model shape, float32; one JSON line per completion length.

    python bench/layer_pass.py [--shape smollm2-135m] [--rows 4] [--prompt 150] [--completions 8,128]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from common import emit, environment, shape_config, timed
from degs_jax.models import TransformerLM, init_params
from degs_jax.reproduce.study import LENGTH_BUCKET, padded_length
from degs_jax.scoring import completion_layer_entropies, layer_entropies


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", help="a model shape of bench/common.py")
    ap.add_argument("--rows", type=int, default=4, help="sequences per call (the pass's rows)")
    ap.add_argument("--prompt", type=int, default=150, help="prompt tokens of every row")
    ap.add_argument("--completions", default="8,128",
                    help="completion lengths, comma-separated (8: the tests' pools)")
    ap.add_argument("--repeats", type=int, default=1, help="timed calls after the compiling one")
    args = ap.parse_args()
    emit({"bench": "environment", **environment()}, "layer_pass.jsonl")
    cfg = shape_config(args.shape)
    lm, params = TransformerLM(cfg), init_params(cfg, jax.random.key(0), jnp.float32)
    layers = tuple(range(cfg.num_layers + 1))
    rng = np.random.default_rng(0)
    for n in map(int, args.completions.split(",")):
        width = padded_length(args.prompt + n, LENGTH_BUCKET)
        whole = np.zeros((args.rows, width), np.int32)
        whole[:, :args.prompt + n] = rng.integers(0, cfg.vocab_size, (args.rows, args.prompt + n))
        prompts = np.zeros((args.rows, padded_length(args.prompt, LENGTH_BUCKET)), np.int32)
        prompts[:, :args.prompt] = whole[:, :args.prompt]
        completions = np.zeros((args.rows, padded_length(n, LENGTH_BUCKET)), np.int32)
        completions[:, :n] = whole[:, args.prompt:args.prompt + n]
        prompt_lengths, completion_lengths = np.full(args.rows, args.prompt), np.full(args.rows, n)
        before = lambda: layer_entropies(lm, params, whole, layers)
        after = lambda: completion_layer_entropies(lm, params, prompts, prompt_lengths, completions,
                                                   completion_lengths, layers)
        whole_s, completion_s = timed(before, repeats=args.repeats), timed(after, repeats=args.repeats)
        difference = np.abs(np.asarray(before())[:, :, args.prompt:args.prompt + n]
                            - np.asarray(after())[:, :, :n]).max()
        emit({"bench": "layer_pass", "shape": args.shape, "rows": args.rows, "prompt": args.prompt,
              "completion": n, "layers": len(layers), "whole_padded": list(whole.shape),
              "prompt_padded": list(prompts.shape), "completion_padded": list(completions.shape),
              "whole_sequences_s": round(whole_s, 3), "completion_only_s": round(completion_s, 3),
              "speedup": round(whole_s / completion_s, 2), "max_abs_difference_nats": float(difference)},
             "layer_pass.jsonl")


if __name__ == "__main__":
    main()
