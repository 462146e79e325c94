"""`degs reproduce` (registered by `degs_jax.cli`): the command-line front end of
:mod:`degs_jax.reproduce`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from .. import reproduce  # its report (scipy, matplotlib) loads on first use
from ..eval.benchmarks import canonical_name, load_benchmark
from ..eval.processes import PeerProcessError, publish_failure
from ..reproduce.regrade import regrade_study
from ..reproduce.study import (DEFAULT_BATCH_SIZE, STUDY_FILE, TABLE1_ORDER, Budget, StudyRequest,
                              available_methods, format_plan, plan_table, read_study_file, run_study)
from ..reproduce.study import recorded_dtype as study_dtype
from .distributed import LAUNCH_HELP, add_distributed_args, distributed_options, join_job
from .options import (REFILL_HELP, _add_model_args, add_unsafe_grading_flag, check_output_dir, check_seed, code_isolation,
                      keep_recorded_dtype, parse_lsub_sweep)

DESCRIPTION = """Run the paper's study for one model into one directory, resumably, and report it.

Table 1 (every decoder on every benchmark; Best-of-N-Entropy, DEGS reranking and depth-only
are selected from the Best-of-N run's kept candidates), the predictive-validity pool
(N = 16, T = 0.8, top-p 0.9; problem-demeaned AUC and AUC with problem-level cluster-bootstrap
intervals, Spearman, mean gap, pairwise accuracy, accuracy by D(x) quartile), one
teacher-forced pass over the pool with the lens at every layer (the L_sub ablation and the
layer-entropy trajectories of correct vs incorrect candidates), the compute accounting,
paired tests (exact McNemar with Holm's adjustment, Newcombe's paired interval), the
deviations from the paper's settings and OUT/report.md with tables and figures.

Rerun the same command to continue after an interruption; a later invocation may raise
--limit or add methods. With --time-budget the study starts a batch only if its measured
cost fits, then stops cleanly and reports on what finished (say so in the report). Hyper-
parameters default to the paper's (HumanEval: alpha 2, low temperature 0.5); --hp changes
them and the report lists every deviation.

examples:
  degs reproduce --model qwen2.5-coder-0.5b --out runs/study --limit 50
  degs reproduce --out runs/study --plan                  # what is left, with measured costs
  degs reproduce --model M --out runs/study --benchmarks gsm8k,humaneval \\
      --methods greedy,power_mcmc,degs_mcmc --hp max_new_tokens=768 --hp num_blocks=4 \\
      --batch-size 64 --time-budget 480
  degs reproduce --out runs/study --report-only          # rewrite the report (no model)
  degs reproduce --out runs/study --export docs/reproduction/NAME   # compact copy to commit
  degs reproduce --out docs/reproduction/NAME --regrade  # verdicts by today's grader

In a job of several processes (below), process 0 decides each step and keeps study.json;
each step gives every process one batch of the same job (or one group of the layer
pass), and process 0 writes the report. --plan, --report-only, --export and --regrade run
in one process.

""" + LAUNCH_HELP.format(command="degs reproduce --model M --out runs/study")

ALL_BENCHMARKS = "math500,deepmind500,gsm8k,humaneval,gpqa"
PAPER_POOL_BENCHMARKS = "math500,deepmind500"


def add_commands(sub, load_model) -> None:
    """Register `degs reproduce` on the `degs` subparsers object; `load_model(args)` loads
    the model the options name."""
    r = sub.add_parser("reproduce", help="the paper's study for one model (resumable) and its report",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--out", required=True, help="study directory (created; continued if it exists)")
    _add_model_args(r)
    g = r.add_argument_group("what to run")
    g.add_argument("--benchmarks", default=ALL_BENCHMARKS,
                   help=f"comma-separated, in priority order ({ALL_BENCHMARKS}); 'none' for no "
                        "Table 1 runs")
    g.add_argument("--raw-prompts", default="none", metavar="BENCHMARKS",
                   help="comma-separated benchmarks whose prompts go as raw text while the others "
                        "use the chat template, so that one study holds each benchmark in its own "
                        "format: 'humaneval' for the paper's HumanEval (the model completes the "
                        "signature and docstring); --no-chat makes every prompt raw")
    g.add_argument("--methods", default=None,
                   help="rows, comma-separated, in priority order (default: the paper's Table 1, "
                        f"{', '.join(TABLE1_ORDER)}); the methods of installed packages "
                        f"({', '.join(m for m in available_methods() if m not in TABLE1_ORDER) or 'none'}) run only "
                        "where named here")
    g.add_argument("--limit", action="append", default=[], metavar="[BENCH=]N",
                   help="first N problems of every benchmark, or of BENCH (repeatable)")
    g.add_argument("--pool-benchmarks", default=PAPER_POOL_BENCHMARKS,
                   help=f"benchmarks of the predictive-validity pool ({PAPER_POOL_BENCHMARKS}, the "
                        "paper's); 'none' to skip")
    g.add_argument("--pool-limit", action="append", default=[], metavar="[BENCH=]N",
                   help="problems in the pool (default: the benchmark's --limit)")
    g.add_argument("--hp", action="append", default=[], metavar="[SCOPE.]NAME=VALUE",
                   help="hyperparameter override: NAME=VALUE for every decoder that takes NAME "
                        "(beta never for a beta = 0 baseline), METHOD.NAME=VALUE for one, "
                        "pool.NAME=VALUE for the pool; e.g. max_new_tokens=768, num_blocks=4, "
                        "lsub=4,8,12 (repeatable)")
    g.add_argument("--seed", type=int, default=0, help="PRNG seed (problem i: fold_in(key(seed), i))")
    g.add_argument("--lsub-sets", default="paper",
                   help="probe sets of the L_sub ablation: 'paper' (its ten sets, mapped to the "
                        "model's depth) or e.g. '4,8,12;16,20,24;all;default'")
    g.add_argument("--no-layer-pass", action="store_true",
                   help="skip the layer pass (no L_sub ablation, no trajectories)")
    s = r.add_argument_group("scheduling")
    s.add_argument("--batch-size", action="append", default=[], metavar="[SCOPE=]N",
                   help="problems per decode call for every decoder, or SCOPE=N for one "
                        "method or the pool (rows per call = N x candidates/chains); kept as "
                        "given (with a warning where the memory estimate fits fewer). "
                        f"Default: {DEFAULT_BATCH_SIZE}, or fewer where the memory estimate "
                        "of degs eval's --batch-size auto says that many do not fit (the study "
                        "prints the size it took)")
    s.add_argument("--no-refill", dest="refill", action="store_false", help=REFILL_HELP)
    s.add_argument("--round-size", type=int, default=None, metavar="N",
                   help="problems per benchmark per round: every job finishes a round before the "
                        "next starts (default: one round)")
    s.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no batch whose measured cost would end past this many seconds "
                        "after the command started; then report on what finished")
    s.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persistent XLA compilation cache (default: <degs_jax cache>/xla; 'none' "
                        "to disable): a resumed study does not compile the same shapes again")
    m = r.add_argument_group("modes")
    m.add_argument("--plan", action="store_true",
                   help="print the jobs, what is done, worst-case tokens and measured cost per "
                        "problem with the estimate of what is left (MCMC with refill: at least the "
                        "job's slowest chain alone, from the measured seconds per decode step; a "
                        "checkpointed chain: the blocks it has left); "
                        "load nothing, run nothing")
    m.add_argument("--report-only", action="store_true",
                   help="rewrite OUT/report.md, tables/ and figures/ from the stored files (no model)")
    m.add_argument("--no-report", action="store_true", help="run without writing the report")
    m.add_argument("--regrade", action="store_true",
                   help="grade the stored answers of every MATH500, DeepMind500 and GSM8K run "
                        "and pool again with the current grader, in place (a study, its "
                        "export, or one `degs eval` directory; no model), print every verdict "
                        "that changes (run, problem, chosen or candidate, old -> new), record "
                        "it in study.json and rewrite the report (not with --no-report)")
    m.add_argument("--export", metavar="DEST", default=None,
                   help="write a compact copy of the study (no candidate tokens) and its report "
                        "into DEST, for committing (no model)")
    m.add_argument("--data-dir", default=None, help="benchmark files (default $DEGS_JAX_DATA, else "
                                                    "the copies installed with degs_jax)")
    m.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_unsafe_grading_flag(m)
    add_distributed_args(r)
    r.set_defaults(func=lambda args: cmd_reproduce(args, load_model))


def _split(text: str) -> list[str]:
    return [] if text.strip().lower() == "none" else [x.strip() for x in text.split(",") if x.strip()]


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text!r}") from None


def _scoped_ints(specs, what: str) -> dict[str, int]:
    """["16", "best_of_n=4"] -> {"*": 16, "best_of_n": 4}."""
    out = {}
    for spec in specs:
        scope, _, value = spec.rpartition("=")
        out[scope or "*"] = _int(value, what)
    return out


def parse_value(text: str) -> Any:
    """A hyperparameter value: true/false/none, an int, a float, or comma-separated ints."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if "," in text:
        return tuple(_int(x, "a comma-separated value") for x in text.split(",") if x.strip())
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"cannot read hyperparameter value {text!r} (a number, true/false, none or "
                     "comma-separated layers)")


def parse_overrides(specs) -> dict[str, dict[str, Any]]:
    """["max_new_tokens=768", "degs_mcmc.beta=2"] -> {"*": {...}, "degs_mcmc": {...}}."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"--hp needs [SCOPE.]NAME=VALUE, got {spec!r}")
        scope, _, name = name.rpartition(".")
        out.setdefault(scope or "*", {})[name] = parse_value(value)
    return out


def build_request(args):
    """The :class:`StudyRequest` of the command line (validated; no model needed)."""
    benchmarks = _split(args.benchmarks)
    pool = _split(args.pool_benchmarks)
    limits = _scoped_ints(args.limit, "--limit")
    pool_limits = _scoped_ints(args.pool_limit, "--pool-limit")

    def limit(table, b, fallback=None):
        canonical = {canonical_name(k) if k != "*" else "*": v for k, v in table.items()}
        return canonical.get(canonical_name(b), canonical.get("*", fallback))

    methods = tuple(_split(args.methods)) if args.methods is not None else TABLE1_ORDER
    return StudyRequest(
        benchmarks={b: limit(limits, b) for b in benchmarks},
        methods=methods,
        pool_benchmarks={b: limit(pool_limits, b, limit(limits, b)) for b in pool},
        overrides=parse_overrides(args.hp), batch_sizes=_scoped_ints(args.batch_size, "--batch-size"),
        seed=args.seed, round_size=args.round_size, layer_pass=not args.no_layer_pass,
        chat=not args.no_chat, raw_benchmarks=tuple(_split(args.raw_prompts)))


def cmd_reproduce(args, load_model) -> int:
    budget = Budget(args.time_budget)  # counted from here: loading and compiling included
    out = check_output_dir(Path(args.out))
    check_seed(args.seed)
    if (out / STUDY_FILE).exists():
        read_study_file(out / STUDY_FILE)  # before the model loads
    options = distributed_options(args)
    single = [flag for flag, on in (("--plan", args.plan), ("--report-only", args.report_only),
                                    ("--export", args.export), ("--regrade", args.regrade)) if on]
    if options is not None and single:
        raise ValueError(f"{single[0]} runs in one process: leave out --coordinator, "
                         "--num-processes, --process-id and --distributed")
    if args.regrade:
        if len(single) > 1:
            raise ValueError(f"--regrade is a mode of its own; leave out "
                             f"{', '.join(f for f in single if f != '--regrade')}")
        regrade_study(out, data_dir=args.data_dir)
        if not args.no_report and (out / "study.json").exists():  # not a single `degs eval` run
            print(f"report: {reproduce.write_report(out)['report']}")
        return 0
    if args.export:
        result = reproduce.export_study(out, args.export)
        print(f"exported {out} to {args.export}; report: {result['report']}")
        return 0
    if args.report_only:
        print(f"report: {reproduce.write_report(out)['report']}")
        return 0
    request = build_request(args)
    if args.plan:
        print(format_plan(plan_table(out, request, data_dir=args.data_dir)))
        return 0
    benchmarks = {**request.benchmarks, **request.pool_benchmarks}
    args.scope.enter_context(code_isolation(benchmarks, args.unsafe_unsandboxed_grading))
    if options is not None:  # before any JAX computation (the model load)
        join_job(options)
    try:
        for benchmark in benchmarks:
            load_benchmark(benchmark, data_dir=args.data_dir)  # present and verified, before the model
        keep_recorded_dtype(args, study_dtype(out), args.out)  # after joining (see cmd_eval)
        model = load_model(args)  # turns the --compilation-cache on (cli._persistent_cache)
        if args.lsub_sets != "paper":
            request = dataclasses.replace(
                request, lsub_sets=tuple(parse_lsub_sweep(args.lsub_sets, model.lm.num_layers)))
    except BaseException as e:  # e.g. data or a model path missing on one host: stop the others
        publish_failure(e)
        raise
    try:
        study = run_study(model, out, request, budget=budget, progress=not args.no_progress,
                          data_dir=args.data_dir, argv=sys.argv[1:],
                          allow_unsandboxed=args.unsafe_unsandboxed_grading, refill=args.refill)
    except PeerProcessError as e:  # the failing process reports the details
        print(f"degs: error: {e}", file=sys.stderr)
        return 2
    if study is not None and not args.no_report:  # process 0 of a job writes the report
        t0 = time.perf_counter()
        result = reproduce.write_report(out)
        print(f"report: {result['report']} ({time.perf_counter() - t0:.1f} s)")
    return 0
