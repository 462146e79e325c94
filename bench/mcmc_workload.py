"""The MATH500-shaped MCMC workload: degs_mcmc (beta = 5) vs power_mcmc (beta = 0) on the
same per-problem keys, random bf16 weights, the library's default buffer (16 blocks x 192 =
3072 new-token slots, `hyperparameters_for("power_mcmc")`), 10 MH steps per block, one
chain per problem; prompts of 128..320 tokens.

Schedules (--schedules, both by default, in the same call on the same problems):
  fixed    batches of --batch problems, each lasting as long as its slowest chain
           (`decode` without slots; the schedule before issue 39)
  refill   the problems stream through --batch slots; a finished problem's slot takes the
           next one at once (`decode(..., slots=--batch)`, issue 39)
Per method and schedule: seconds per problem, and the fraction of row-steps that did useful
work (decode steps x batch rows, of which the active rows: counted by the model, see
`common.PromptCodedEOSLM`); then the ratio of the two schedules' seconds per problem.

Completion lengths (EOS forced at each problem's target and impossible before, for the
first draft and every MH proposal; a random model never ends on its own; the target is
encoded in the prompt's first tokens, so it follows the problem into any slot):
  --lengths fixed:576             every completion 576 tokens = 3 blocks (the runs of
                                  docs/benchmarks.md before issue 17, then with a 576-slot buffer)
  --lengths lognormal:600:0.7:3072   per-problem targets, lognormal with median 600 and
                                  sigma 0.7, capped at 3072 (bench/real_shape.py's workload)

    python bench/mcmc_workload.py --problems 256 --batch 64 --lengths lognormal:600:0.7:3072
    python bench/mcmc_workload.py --shape tiny --problems 12 --batch 4 --lengths lognormal:12:0.7:32 \
        --block-len 8 --num-blocks 4 --mh-steps 2 --prompt-range 4 12 --repeats 1  # CPU smoke test
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from common import ROW_STEPS, PromptCodedEOSLM, emit, encode_target, environment, random_model, target_lengths
from degs_jax.decoders import decode
from degs_jax.hyperparameters import hyperparameters_for


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
    ap.add_argument("--batch", type=int, default=None,
                    help="problems per fixed batch, and slots of the refill (default: every problem)")
    ap.add_argument("--lengths", default="fixed:576")
    ap.add_argument("--methods", default="power_mcmc,degs_mcmc")
    ap.add_argument("--schedules", default="fixed,refill", help="comma-separated: fixed, refill")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per method and schedule; the last is reported (the first compiles, "
                         "unless --warmup ran first)")
    ap.add_argument("--warmup", action="store_true",
                    help="before the timed runs, each schedule decodes the first --batch problems (the "
                         "refill: one more, so a slot is refilled) with their targets cut to 8 tokens: "
                         "the same programs compile outside the timed runs; with --repeats 1 a long "
                         "workload is timed once")
    ap.add_argument("--block-len", type=int, default=None, help="tokens per block (default: the library's)")
    ap.add_argument("--num-blocks", type=int, default=None, help="blocks (default: the library's)")
    ap.add_argument("--mh-steps", type=int, default=None, help="MH steps per block (default: the library's)")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[128, 321], metavar=("LO", "HI"),
                    help="prompt lengths drawn uniformly in [LO, HI)")
    args = ap.parse_args()
    schedules = args.schedules.split(",")
    if not set(schedules) <= {"fixed", "refill"} or args.repeats < 1:
        ap.error("--schedules takes fixed and/or refill; --repeats must be >= 1")
    batch = args.batch or args.problems
    sizes = {name: value for name, value in (("block_len", args.block_len), ("num_blocks", args.num_blocks),
                                             ("mh_steps", args.mh_steps)) if value is not None}
    emit({"bench": "environment", **environment()}, "mcmc.jsonl")
    cfg, params = random_model(args.shape)
    eos = cfg.vocab_size - 1  # never in a prompt
    targets, lengths = parse_lengths(args.lengths, args.problems)
    rng = np.random.default_rng(0)
    prompts = [encode_target(rng.integers(0, eos, rng.integers(*args.prompt_range)).tolist(), int(t), eos)
               for t in targets]
    keys = jax.numpy.stack([jax.random.fold_in(jax.random.key(0), i) for i in range(args.problems)])
    defaults = hyperparameters_for("power_mcmc", **sizes)
    chain_sizes = dict(block_len=defaults.block_len, num_blocks=defaults.num_blocks, mh_steps=defaults.mh_steps)
    model = PromptCodedEOSLM(cfg=cfg, eos=eos, count_row_steps=True)
    for method in args.methods.split(","):
        extra = dict(beta=0.0) if method == "power_mcmc" else dict(beta=5.0)
        per_schedule = {}
        for schedule in schedules:
            def run(problem_prompts):
                if schedule == "refill":
                    return decode(model, params, problem_prompts, method, keys=keys[:len(problem_prompts)],
                                  eos_ids=(eos,), slots=batch, **chain_sizes, **extra).outputs
                return [o for s in range(0, len(problem_prompts), batch)
                        for o in decode(model, params, problem_prompts[s:s + batch], method,
                                        keys=keys[s:s + batch], eos_ids=(eos,), **chain_sizes, **extra).outputs]

            warmup = [encode_target(p, 8, eos) for p in prompts[:batch + (schedule == "refill")]] if args.warmup else []
            t = time.perf_counter()
            if warmup:
                run(warmup)
            warmup_seconds = time.perf_counter() - t
            for attempt in range(args.repeats):  # the first includes compilation unless warmed up
                ROW_STEPS.update(rows=0, active=0)
                t = time.perf_counter()
                outputs = run(prompts)
                seconds = time.perf_counter() - t
                if attempt == 0:
                    first = seconds
            acc = [a for o in outputs for a in (o.chosen.acceptance or [])]
            done = np.array([len(o.chosen.tokens) for o in outputs])
            per_schedule[schedule] = record = {
                "seconds": seconds, "seconds_first_run": first, "warmup_problems": len(warmup),
                "warmup_seconds": warmup_seconds, "seconds_per_problem": seconds / args.problems,
                "useful_row_step_fraction": ROW_STEPS["active"] / max(ROW_STEPS["rows"], 1),
                "row_steps": ROW_STEPS["rows"], "active_row_steps": ROW_STEPS["active"],
                "lengths_match_targets": bool((done == targets).all()),
                "mean_acceptance": float(np.mean(acc)) if acc else None,
                "completion_tokens": float(done.mean()),
                "tokens": [o.chosen.tokens for o in outputs]}
            emit({"bench": "mcmc", "method": method, "schedule": schedule, "shape": args.shape,
                  "problems": args.problems, "batch": batch, **chain_sizes,
                  "buffer_new_slots": defaults.max_new_tokens, "lengths": lengths,
                  **{k: v for k, v in record.items() if k != "tokens"}}, "mcmc.jsonl")
        if len(per_schedule) == 2:
            fixed, refill = per_schedule["fixed"], per_schedule["refill"]
            emit({"bench": "mcmc_refill_vs_fixed", "method": method, "shape": args.shape,
                  "problems": args.problems, "batch": batch, "lengths": lengths,
                  "seconds_per_problem": {"fixed": fixed["seconds_per_problem"],
                                          "refill": refill["seconds_per_problem"]},
                  "speedup": fixed["seconds_per_problem"] / refill["seconds_per_problem"],
                  "useful_row_step_fraction": {"fixed": fixed["useful_row_step_fraction"],
                                               "refill": refill["useful_row_step_fraction"]},
                  "same_completions": fixed["tokens"] == refill["tokens"]}, "mcmc.jsonl")


if __name__ == "__main__":
    main()
