"""The MATH500-shaped MCMC workload: degs_mcmc (beta = 5) vs power_mcmc (beta = 0) on
the same keys, random Qwen2.5-7B-shaped weights, bf16.

Problems have prompts of 128..320 tokens; EOS is suppressed so every chain runs all
`--num-blocks` blocks of 192 tokens (3 blocks = 576 tokens, the paper's completions
average ~600); 10 MH steps per block; one chain per problem, all problems in one batch.

    python bench/mcmc_workload.py --problems 64
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from common import emit, environment, random_model
from degs_jax.decoders import decode
from degs_jax.model_api import TransformerLM


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--block-len", type=int, default=192)
    ap.add_argument("--num-blocks", type=int, default=3)
    ap.add_argument("--mh-steps", type=int, default=10)
    ap.add_argument("--methods", default="power_mcmc,degs_mcmc")
    args = ap.parse_args()
    emit({"bench": "environment", **environment()}, "mcmc.jsonl")
    cfg, params = random_model(args.shape)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, rng.integers(128, 321)).tolist()
               for _ in range(args.problems)]
    hp = dict(block_len=args.block_len, num_blocks=args.num_blocks, mh_steps=args.mh_steps)
    for method in args.methods.split(","):
        extra = dict(beta=0.0) if method == "power_mcmc" else dict(beta=5.0)
        runs = []
        for attempt in range(2):  # the first includes compilation
            t = time.perf_counter()
            res = decode(TransformerLM(cfg), params, prompts, method, jax.random.key(0), eos_ids=(), **hp, **extra)
            runs.append((time.perf_counter() - t, res))
        (first, _), (sec, res) = runs
        acc = [a for o in res.outputs for a in (o.chosen.acceptance or [])]
        emit({"bench": "mcmc", "method": method, "shape": args.shape, "problems": args.problems,
              **hp, "seconds": sec, "seconds_with_compile": first,
              "seconds_per_problem": sec / args.problems,
              "generated_tokens": res.counters["generated_tokens"],
              "generated_tokens_per_s": res.counters["generated_tokens"] / sec,
              "forward_equivalents": res.forward_equivalents(cfg.num_layers),
              "mean_acceptance": float(np.mean(acc)) if acc else None,
              "completion_tokens": int(np.mean([len(o.chosen.tokens) for o in res.outputs]))},
             "mcmc.jsonl")


if __name__ == "__main__":
    main()
