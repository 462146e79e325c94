"""The MATH500-shaped MCMC workload: degs_mcmc (beta = 5) vs power_mcmc (beta = 0) on the
same keys, random bf16 weights, the library's default buffer (16 blocks x 192 = 3072
new-token slots, `mcmc.MCMCConfig`), 10 MH steps per block, one chain per problem, all
problems in one batch; prompts of 128..320 tokens.

Completion lengths (EOS forced at each problem's target and impossible before, for the
first draft and every MH proposal; a random model never ends on its own):
  --lengths fixed:576             every completion 576 tokens = 3 blocks (the runs of
                                  docs/benchmarks.md before issue 17, then with a 576-slot buffer)
  --lengths lognormal:600:0.7:3072   per-problem targets, lognormal with median 600 and
                                  sigma 0.7, capped at 3072 (bench/real_shape.py's workload)

    python bench/mcmc_workload.py --problems 64
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from common import emit, environment, force_eos, random_model, target_lengths
from degs_jax.decoders import decode
from degs_jax.mcmc import MCMCConfig
from degs_jax.model_api import TransformerLM


def parse_lengths(text: str, problems: int) -> tuple[np.ndarray, str]:
    kind, *values = text.split(":")
    if kind == "fixed" and len(values) == 1:
        return np.full(problems, int(values[0]), np.int32), text
    if kind == "lognormal" and len(values) == 3:
        median, sigma, cap = float(values[0]), float(values[1]), int(values[2])
        return target_lengths(problems, median, sigma, cap), text
    raise ValueError(f"--lengths must be fixed:N or lognormal:MEDIAN:SIGMA:CAP, got {text!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--lengths", default="fixed:576")
    ap.add_argument("--methods", default="power_mcmc,degs_mcmc")
    args = ap.parse_args()
    emit({"bench": "environment", **environment()}, "mcmc.jsonl")
    cfg, params = random_model(args.shape)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size - 1, rng.integers(128, 321)).tolist()
               for _ in range(args.problems)]
    targets, lengths = parse_lengths(args.lengths, args.problems)
    eos = cfg.vocab_size - 1  # never in a prompt
    mc = MCMCConfig(beta=0.0)  # the default sizes
    hp = dict(block_len=mc.block_len, num_blocks=mc.num_blocks, mh_steps=mc.mh_steps)
    undo = force_eos(targets, np.array([len(p) for p in prompts]), eos)
    try:
        for method in args.methods.split(","):
            extra = dict(beta=0.0) if method == "power_mcmc" else dict(beta=5.0)
            runs = []
            for attempt in range(2):  # the first includes compilation
                t = time.perf_counter()
                res = decode(TransformerLM(cfg), params, prompts, method, jax.random.key(0), eos_ids=(eos,), **hp, **extra)
                runs.append((time.perf_counter() - t, res))
            (first, _), (sec, res) = runs
            acc = [a for o in res.outputs for a in (o.chosen.acceptance or [])]
            done = np.array([len(o.chosen.tokens) for o in res.outputs])
            emit({"bench": "mcmc", "method": method, "shape": args.shape, "problems": args.problems,
                  **hp, "buffer_new_slots": mc.max_new_tokens, "lengths": lengths,
                  "lengths_match_targets": bool((done == targets).all()),
                  "seconds": sec, "seconds_with_compile": first,
                  "seconds_per_problem": sec / args.problems,
                  "generated_tokens": res.counters["generated_tokens"],
                  "generated_tokens_per_s": res.counters["generated_tokens"] / sec,
                  "forward_equivalents": res.forward_equivalents(cfg.num_layers),
                  "mean_acceptance": float(np.mean(acc)) if acc else None,
                  "completion_tokens": float(done.mean())}, "mcmc.jsonl")
    finally:
        undo()


if __name__ == "__main__":
    main()
