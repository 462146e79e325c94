r"""Continuous batching vs fixed batches on a MATH500-shaped workload, for any decoding
method (issue 39): random bf16 weights, each method at its library defaults
(`hyperparameters_for(method)`, changed only by --set): degs_mcmc (beta 5) and power_mcmc
(16 blocks x 192 = 3072 new-token slots, 10 MH steps, one chain per problem); power_smc
and degs_smc (N = 16 particles, budget 3072, ramp 400, ESS checked every 64 tokens);
scalable_power (budget 3072, blocks of 192, L 32 candidates, K 8 kept, M 8 rollouts of
horizon 192); the sampling methods as well. Prompts of 128..320 tokens; every method sees
the same problems and per-problem keys.

Schedules (--schedules, both by default, in the same call on the same problems):
  fixed    batches of --batch problems, each lasting as long as its slowest problem
           (`decode` without slots; the schedule before issue 39)
  refill   the problems stream through --batch problem slots; a finished problem's slot
           takes the next one at once (`decode(..., slots=--batch)`, issue 39); once none waits
           and at most --tail-fraction of the slots are live, those go on in a smaller carry
           (run twice, with --tail-fraction 0 and the default, to see what the tail costs)
--batch counts problems, not rows: a slot (and a fixed batch's problem) holds the
method's `pool_size` rows: 1 for the MCMC methods (one chain) and scalable_power (its
main row), n_particles (16) for power_smc / degs_smc, n for best_of_n. So --batch 16 is
16 MCMC rows, 256 SMC rows; scalable_power's block additionally runs, per problem, L
candidate rows then K·M rollout rows, each with its own KV cache (1 + L + K(1 + M) = 105
sequences per problem at the defaults: the record's `kv_sequences`). A slot is refilled
when the method's `advance` returns (`decode_stream`): an MCMC chain's after the block that
ended it, an SMC problem's at the end of the ESS interval that finished it (up to
resample_every - 1 idle steps; a fixed batch stops at its last token), an SPS problem's
after its last block.

Per method and schedule: seconds per problem, and the fraction of row-steps that did
useful work (decode steps x rows, of which the active rows: counted by the model, see
`common.PromptCodedEOSLM`; for scalable_power the candidate and rollout steps count too,
and a rollout that ended before its horizon idles like a finished chain); then the ratio
of the two schedules' seconds per problem and whether their chosen completions are equal
(bitwise only under a batch-invariant model; in bf16 on a GPU a problem's rows share their
steps with other neighbours in the two schedules, so draws may differ).

Completion lengths: EOS is forced at each problem's target and impossible before, in every
decode step (an MCMC draft and proposal, every SMC particle, every SPS candidate and
rollout); a random model never ends on its own. The target is encoded in the prompt's
first tokens and its end position travels in a cache leaf at the rows' axis, so it follows
the problem into any slot, particle copy (SMC resampling) or candidate / rollout row
(`lengths_match_targets` checks the chosen completions):
  --lengths fixed:576             every completion 576 tokens = 3 blocks (the MCMC runs of
                                  docs/benchmarks.md before issue 17)
  --lengths lognormal:600:0.7:3072   per-problem targets, lognormal with median 600 and
                                  sigma 0.7, capped at 3072 (bench/real_shape.py's workload)
Every target must fit every method's budget (`max_new_tokens`).

    python bench/refill_workload.py --problems 256 --batch 64 --lengths lognormal:600:0.7:3072 --warmup
    python bench/refill_workload.py --shape qwen2.5-1.5b --methods power_smc,degs_smc --problems 32 \
        --batch 16 --lengths lognormal:600:0.7:3072 --warmup --repeats 1      # 256 particle rows
    python bench/refill_workload.py --shape qwen2.5-1.5b --methods scalable_power --problems 12 \
        --batch 4 --lengths lognormal:600:0.7:3072 --warmup --repeats 1       # 420 KV sequences
CPU checks (tiny shape, every target within the small budgets; their seconds say nothing of speed):
    python bench/refill_workload.py --shape tiny --problems 12 --batch 4 --lengths lognormal:12:0.7:32 \
        --set block_len=8 --set num_blocks=4 --set mh_steps=2 --prompt-range 4 12 --repeats 1
    python bench/refill_workload.py --shape tiny --problems 8 --batch 2 --lengths lognormal:12:0.7:32 \
        --methods power_smc,degs_smc,scalable_power --set max_new_tokens=32 --set n_particles=4 \
        --set resample_every=4 --set ramp_tokens=8 --set block_len=8 --set candidate_pool=4 \
        --set candidates_kept=2 --set rollouts=2 --set rollout_horizon=8 --prompt-range 4 12 \
        --warmup --repeats 1

Prints JSON records (and appends them to $OUT/refill.jsonl when $OUT is set).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from common import ROW_STEPS, PromptCodedEOSLM, emit, encode_target, environment, random_model, target_lengths
from degs_jax.decoders import TAIL_FRACTION, decode
from degs_jax.methods import METHODS, field_names, hyperparameters_for, method_record

OUT_NAME = "refill.jsonl"


def parse_lengths(text: str, problems: int) -> tuple[np.ndarray, str]:
    kind, *values = text.split(":")
    if kind == "fixed" and len(values) == 1:
        return np.full(problems, int(values[0]), np.int32), text
    if kind == "lognormal" and len(values) == 3:
        median, sigma, cap = float(values[0]), float(values[1]), int(values[2])
        return target_lengths(problems, median, sigma, cap), text
    raise ValueError(f"--lengths must be fixed:N or lognormal:MEDIAN:SIGMA:CAP, got {text!r}")


def parse_settings(pairs: list[str], methods: list[str]) -> dict[str, dict]:
    """Per method, the --set NAME=VALUE overrides it takes (VALUE read as JSON: 8, 0.5,
    true; else the string). ValueError for a pair without '=' or a name no method takes."""
    overrides = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--set takes NAME=VALUE, got {pair!r}")
        try:
            overrides[name] = json.loads(text)
        except json.JSONDecodeError:
            overrides[name] = text
    unused = sorted(name for name in overrides if not any(name in field_names(m) for m in methods))
    if unused:
        raise ValueError(f"--set {', '.join(unused)}: no method of {', '.join(methods)} takes it")
    return {m: {k: v for k, v in overrides.items() if k in field_names(m)} for m in methods}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--problems", type=int, default=64)
    ap.add_argument("--batch", type=int, default=None,
                    help="problems per fixed batch, and problem slots of the refill (default: every "
                         "problem); rows = this x the method's pool_size")
    ap.add_argument("--lengths", default="fixed:576")
    ap.add_argument("--methods", default="power_mcmc,degs_mcmc", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--schedules", default="fixed,refill", help="comma-separated: fixed, refill")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
                    help="a hyperparameter for every method that takes it (repeatable), e.g. --set "
                         "mh_steps=2; the others keep the library's defaults")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per method and schedule; the last is reported (the first compiles, "
                         "unless --warmup ran first)")
    ap.add_argument("--warmup", action="store_true",
                    help="before the timed runs, each schedule decodes the first --batch problems (the "
                         "refill: one more, so a slot is refilled; the fixed schedule: also a batch of "
                         "the remainder, when --problems is not a multiple of --batch) with their "
                         "targets cut to 8 tokens: the same programs compile outside the timed runs; "
                         "with --repeats 1 a long workload is timed once")
    ap.add_argument("--tail-fraction", type=float, default=TAIL_FRACTION,
                    help="the refill's tail: once no problem waits and at most this share of the slots "
                         "are live, they go on in a smaller carry (decode_stream; 0: never; default "
                         "%(default)s, the library's)")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[128, 321], metavar=("LO", "HI"),
                    help="prompt lengths drawn uniformly in [LO, HI)")
    args = ap.parse_args()
    schedules, methods = args.schedules.split(","), args.methods.split(",")
    if not set(schedules) <= {"fixed", "refill"} or args.repeats < 1:
        ap.error("--schedules takes fixed and/or refill; --repeats must be >= 1")
    if not set(methods) <= set(METHODS):
        ap.error(f"--methods takes {', '.join(METHODS)}; got {args.methods}")
    batch = args.batch or args.problems
    try:
        targets, lengths = parse_lengths(args.lengths, args.problems)
        configs = {m: hyperparameters_for(m, **overrides)
                   for m, overrides in parse_settings(args.settings, methods).items()}
    except ValueError as e:
        ap.error(str(e))
    for method, config in configs.items():
        if targets.max() > config.max_new_tokens:
            ap.error(f"the longest target ({targets.max()} tokens) exceeds {method}'s budget "
                     f"({config.max_new_tokens}): lower the cap of --lengths or --set its budget")
    emit({"bench": "environment", **environment()}, OUT_NAME)
    cfg, params = random_model(args.shape)
    eos = cfg.vocab_size - 1  # never in a prompt
    rng = np.random.default_rng(0)
    prompts = [encode_target(rng.integers(0, eos, rng.integers(*args.prompt_range)).tolist(), int(t), eos)
               for t in targets]
    keys = jax.numpy.stack([jax.random.fold_in(jax.random.key(0), i) for i in range(args.problems)])
    model = PromptCodedEOSLM(cfg=cfg, eos=eos, count_row_steps=True)
    for method, config in configs.items():
        hyperparameters = method_record(config)["hyperparameters"]
        shared = {"method": method, "shape": args.shape, "problems": args.problems, "batch": batch,
                  "rows": batch * config.pool_size, "kv_sequences": batch * config.sequences_per_prompt,
                  "lengths": lengths}
        per_schedule = {}
        for schedule in schedules:
            def run(problem_prompts):
                """(outputs, counters summed over the calls) of the problems' decode."""
                if schedule == "refill":
                    results = [decode(model, params, problem_prompts, config, keys=keys[:len(problem_prompts)],
                                      eos_ids=(eos,), slots=batch, tail_fraction=args.tail_fraction)]
                else:
                    results = [decode(model, params, problem_prompts[s:s + batch], config, keys=keys[s:s + batch],
                                      eos_ids=(eos,)) for s in range(0, len(problem_prompts), batch)]
                counters = {}
                for result in results:
                    for name, value in result.counters.items():
                        counters[name] = counters.get(name, 0) + value
                return [o for result in results for o in result.outputs], counters

            warm_count = batch + (1 if schedule == "refill" else args.problems % batch)
            warmup = [encode_target(p, 8, eos) for p in prompts[:warm_count]] if args.warmup else []
            t = time.perf_counter()
            if warmup:
                run(warmup)
            warmup_seconds = time.perf_counter() - t
            for attempt in range(args.repeats):  # the first includes compilation unless warmed up
                ROW_STEPS.update(rows=0, active=0)
                t = time.perf_counter()
                outputs, counters = run(prompts)
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
                "completion_tokens": float(done.mean()), "counters": counters,
                "tokens": [o.chosen.tokens for o in outputs]}
            if schedule == "refill":
                record["tail_fraction"] = args.tail_fraction
            emit({"bench": "refill_workload", "schedule": schedule, **shared, **hyperparameters,
                  "buffer_new_slots": config.max_new_tokens,
                  **{k: v for k, v in record.items() if k != "tokens"}}, OUT_NAME)
        if len(per_schedule) == 2:
            fixed, refill = per_schedule["fixed"], per_schedule["refill"]
            emit({"bench": "refill_vs_fixed", **shared,
                  "seconds_per_problem": {"fixed": fixed["seconds_per_problem"],
                                          "refill": refill["seconds_per_problem"]},
                  "speedup": fixed["seconds_per_problem"] / refill["seconds_per_problem"],
                  "useful_row_step_fraction": {"fixed": fixed["useful_row_step_fraction"],
                                               "refill": refill["useful_row_step_fraction"]},
                  "same_completions": fixed["tokens"] == refill["tokens"]}, OUT_NAME)


if __name__ == "__main__":
    main()
