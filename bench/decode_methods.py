"""`decode` end to end, as a user calls it: the host loop, its chunking and donation
included (random bf16 weights; the library's default buffer of each method).

    python decode_methods.py --shape qwen2.5-7b --batch 64 --completion 384 --methods greedy degs_mcmc

`--batch` prompts of `--prompt` random tokens; every completion ends with EOS at exactly
`--completion` tokens (`ForcedEOSLM`; the random model never ends on its own), for the
first draft and every MCMC proposal alike. Per method: the first call (compilation
included) and the median of `--repeats` further calls, and a sha256 of the chosen
tokens (equal across code versions means the same tokens). Methods with one row per
prompt only (the forced-EOS targets are per row).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import emit, environment, forced_eos_model, shape_config
from degs_jax.decoders import decode
from degs_jax.methods import hyperparameters_for
from degs_jax.models import init_params

OUT = "decode_methods.jsonl"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--methods", nargs="+", default=["greedy", "degs_mcmc"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--tag", default="", help="a label stored in each record (e.g. the code version)")
    args = ap.parse_args()
    emit({"bench": "environment", **environment(), "tag": args.tag}, OUT)
    cfg = shape_config(args.shape)
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    eos = cfg.vocab_size - 1
    prompts = np.random.default_rng(0).integers(0, eos, (args.batch, args.prompt)).tolist()
    for method in args.methods:
        config = hyperparameters_for(method)
        if config.pool_size != 1:
            raise SystemExit(f"{method}: {config.pool_size} rows per prompt; this bench takes one")
        model = forced_eos_model(cfg, [args.completion] * args.batch, [args.prompt] * args.batch, eos)

        def run():
            t = time.perf_counter()
            result = decode(model, params, prompts, config, jax.random.key(1), eos_ids=(eos,))
            return time.perf_counter() - t, result

        first, _ = run()
        times, result = [], None
        for _ in range(args.repeats):
            seconds, result = run()
            times.append(seconds)
        chosen = np.concatenate([np.asarray(o.chosen.tokens, np.int32) for o in result.outputs])
        emit({"bench": "decode_methods", "tag": args.tag, "shape": args.shape, "method": method,
              "batch": args.batch, "prompt": args.prompt, "completion": args.completion,
              "max_new_tokens": config.max_new_tokens, "seconds_first_call": first,
              "seconds": sorted(times)[len(times) // 2], "all_seconds": times,
              "tokens_sha256": hashlib.sha256(chosen.tobytes()).hexdigest()}, OUT)


if __name__ == "__main__":
    main()
