"""`degs eval` and `degs analyze` (registered by `degs_jax.cli`).

  degs eval --benchmark math500 --method degs_mcmc --out runs/m500   resumable benchmark run
  degs analyze runs/pool                                             D(x) as a predictor of correctness
  degs analyze runs/pool --lsub-sweep "4,8,12;16,20,24,28;default"   re-score per probe set
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..batching import parse_batch_size
from ..eval import runner
from ..eval.benchmarks import load_benchmark
from ..eval.processes import PeerProcessError, publish_failure
from ..models.loading import BUILTIN_MODELS
from ..train.tuned_lens import resolve_lens
from .distributed import LAUNCH_HELP, add_distributed_args, distributed_options, join_job
from .options import (BATCH_SIZE_HELP, REFILL_HELP, _add_decoder_args, _add_model_args, add_unsafe_grading_flag,
                      check_output_dir, check_seed, code_isolation, finite_float, keep_recorded_dtype,
                      method_value, parse_lsub_sweep)

BENCHMARK_CHOICES = ("math500", "deepmind500", "gsm8k", "humaneval", "gpqa", "gpqa_diamond")

EVAL_DESCRIPTION = """Run a decoder over a benchmark, grade every answer and record it.

Results are appended per problem to OUT/results.jsonl (resumable: rerun the same command
after an interruption; finished problems are skipped). OUT/run.json holds the exact
configuration; OUT/summary.json the accuracy (95% interval) and per-problem means.
Problem i uses the PRNG key fold_in(key(seed), i), independent of batching and restarts.

For the predictive-validity analysis (`degs analyze`) keep and grade every candidate:
  degs eval --benchmark math500 --method best_of_n --n 16 --temperature 0.8 --top-p 0.9 \\
            --keep-candidates --out runs/pool

In a job of several processes (below), each claims batches in turn and writes
OUT/results.process-K-of-N.jsonl; process 0 merges them into OUT/results.jsonl (records
as from a single process) and prints the summary. Resuming works with any number of
processes.

""" + LAUNCH_HELP.format(command="degs eval --benchmark math500 --out runs/m500")

ANALYZE_DESCRIPTION = """Collapse depth D(x) as a predictor of correctness, on a `degs eval` run
(best with --keep-candidates): D of correct vs incorrect (mean gap, Mann-Whitney U), AUC,
Spearman rho, within-problem pairwise ranking accuracy and accuracy by D quartile; writes
analysis.json and analysis.png.

An MCMC run also gets the anatomy of its Metropolis-Hastings decisions (decisions.json,
decisions.png): null moves, |log r_0| (the beta = 0 log ratio) beside |beta·ΔD|, and per
beta the decisions the depth term would flip at the states the chains visited, expected
over u and realized with the run's own u, and the chains that would depart from the power
chain (degs_jax.decisions).

--lsub-sweep re-scores every kept candidate with each probe set (needs the model; default
the run's) and reports AUC, pairwise accuracy and DEGS-rerank accuracy per set. Sets are
separated by ';', layers by ','; 'all' = every layer, 'default' = the default grid.
--lens tuned / both re-scores them under a tuned lens (`degs train-lens`), alone or next
to the logit lens, e.g. `degs analyze runs/pool --lens both`.
"""


def add_commands(sub, load_model) -> None:
    """Register the evaluation subcommands on the `degs` subparsers object; `load_model(args)`
    loads the model the options name."""
    e = sub.add_parser("eval", help="evaluate a decoder on a benchmark (resumable)",
                       description=EVAL_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(e)
    _add_decoder_args(e, "degs_mcmc")
    g = e.add_argument_group("evaluation")
    g.add_argument("--benchmark", required=True, choices=BENCHMARK_CHOICES)
    g.add_argument("--out", required=True, help="run directory (created; resumed if it exists)")
    g.add_argument("--limit", type=int, default=None, help="only the first N problems")
    g.add_argument("--batch-size", default="auto", metavar="N|auto",
                   help=BATCH_SIZE_HELP.format(what="problems"))
    g.add_argument("--no-refill", dest="refill", action="store_false", help=REFILL_HELP)
    g.add_argument("--keep-candidates", action="store_true",
                   help="grade and store every candidate (tokens, log p, D, final entropy, verdict)")
    g.add_argument("--data-dir", default=None, help="benchmark files (default $DEGS_JAX_DATA, else "
                                                    "the copies installed with degs_jax)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_unsafe_grading_flag(g)
    add_distributed_args(e)
    e.set_defaults(func=lambda args: cmd_eval(args, load_model))

    a = sub.add_parser("analyze", help="D(x) as a predictor of correctness; L_sub sweep",
                       description=ANALYZE_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("run_dir", help="a `degs eval` directory")
    a.add_argument("--out", default=None, help="where to write the analysis (default RUN_DIR)")
    a.add_argument("--buckets", type=int, default=4, help="D(x) quantile buckets (4)")
    a.add_argument("--departures-from", default=None, metavar="BASE_RUN",
                   help="a degs_mcmc run of the same problems and seed at a beta that decided no MH "
                        "decision: check that RUN_DIR's chains depart from the power chains exactly "
                        "where BASE_RUN's decision records predict (departures.json)")
    a.add_argument("--lsub-sweep", default=None,
                   help='probe sets to re-score with, e.g. "4,8,12;16,20,24,28;all;default"')
    a.add_argument("--alpha", type=finite_float, default=None,
                   help="DEGS-rerank likelihood weight in the sweep (the run's, else 4)")
    a.add_argument("--beta", type=finite_float, default=None,
                   help="DEGS-rerank depth weight in the sweep (the run's, else 5)")
    a.add_argument("--batch-size", type=int, default=8, help="sequences per scoring call (8)")
    a.add_argument("--data-dir", default=None, help="benchmark files (for the sweep's prompts)")
    a.add_argument("--lens", choices=["logit", "tuned", "both"], default=None,
                   help="re-score the kept candidates under this lens (both: logit and tuned side "
                        "by side, AUC and Spearman per lens); implies --lsub-sweep default")
    a.add_argument("--tuned-lens", default=None, metavar="FILE",
                   help="tuned-lens file (default: the one cached for the model's weights)")
    _add_model_args(a)
    a.set_defaults(dtype=None, func=lambda args: cmd_analyze(args, load_model))


def cmd_eval(args, load_model) -> int:
    # Everything that can be checked without the model, before loading it.
    check_seed(args.seed)
    args.batch_size = parse_batch_size(args.batch_size)
    if args.limit is not None and args.limit < 0:  # 0: the configuration only (an empty summary)
        raise ValueError(f"--limit must be 0 or more, got {args.limit}")
    check_output_dir(Path(args.out))
    level = args.scope.enter_context(code_isolation([args.benchmark],
                                                    args.unsafe_unsandboxed_grading))
    runner.check_run_directory(Path(args.out), level)  # what a resume would read
    method = method_value(args)  # (after: resuming a method not installed names its package)
    options = distributed_options(args)
    if options is not None:  # first: a process that fails before joining leaves the others
        join_job(options)    # waiting in jax.distributed.initialize
    try:
        load_benchmark(args.benchmark, data_dir=args.data_dir)  # data files present and verified
        # after joining: auto's choice asks JAX for its platform, which starts its backend
        keep_recorded_dtype(args, runner.recorded_dtype(Path(args.out)), args.out)
        model = load_model(args)
        tuned_lens = resolve_lens(args.lens, model, args.tuned_lens)
    except BaseException as e:  # e.g. data or a model path missing on one host: stop the others
        publish_failure(e)
        raise
    try:
        runner.run_eval(model, Path(args.out), benchmark=args.benchmark, method=method,
                        seed=args.seed, limit=args.limit,
                        batch_size=args.batch_size, keep_candidates=args.keep_candidates,
                        chat=not args.no_chat, progress=not args.no_progress, data_dir=args.data_dir,
                        argv=sys.argv[1:], tuned_lens=tuned_lens,
                        allow_unsandboxed=args.unsafe_unsandboxed_grading, refill=args.refill)
    except PeerProcessError as e:  # the failing process reports the details
        print(f"degs: error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_analyze(args, load_model) -> int:
    # the analyses' figures and statistics (matplotlib, scipy): seconds of start-up that
    # the other commands do not pay
    from ..analysis import analyze_decisions, analyze_departures, analyze_run, load_run, lsub_sweep

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir
    run, records = load_run(run_dir)
    has_decisions = analyze_decisions(run_dir, out) is not None
    if args.departures_from is not None:
        analyze_departures(run_dir, args.departures_from, out)
    if records and all(c.get("D") is not None for r in records
                       for c in r.get("candidates", [r])):
        analyze_run(run_dir, out, n_buckets=args.buckets)
    elif not args.lsub_sweep and not args.lens and not has_decisions:
        raise ValueError(f"{run_dir}: the outputs have no D(x) (the method did not probe); "
                         "use --lsub-sweep default to re-score them")
    if args.lens and not args.lsub_sweep:
        args.lsub_sweep = "default"
    if args.lsub_sweep:
        model_cfg = run["config"].get("model")
        if not (isinstance(model_cfg, dict) and isinstance(model_cfg.get("name"), str)):
            raise ValueError(f"{run_dir / 'run.json'}: 'config' has no model name to re-score "
                             "with; repair it")
        if args.model is None:  # the run's model: a built-in name, else its recorded path
            source = (run.get("invocations") or [{}])[-1].get("model_source")
            args.model = (model_cfg["name"] if model_cfg["name"] in BUILTIN_MODELS or not source
                          else source)
        if args.dtype is None:
            args.dtype = model_cfg.get("dtype") or "bfloat16"
        model = load_model(args)
        sets = parse_lsub_sweep(args.lsub_sweep, model.lm.num_layers)
        lenses = None
        if args.lens in ("tuned", "both"):
            tuned = resolve_lens("tuned", model, args.tuned_lens)
            lenses = {"tuned": tuned} if args.lens == "tuned" else {"logit": None, "tuned": tuned}
        elif args.tuned_lens is not None:
            raise ValueError("--tuned-lens needs --lens tuned or --lens both")
        lsub_sweep(model, run_dir, sets, alpha=args.alpha, beta=args.beta,
                   batch_size=args.batch_size, out_dir=out, data_dir=args.data_dir, lenses=lenses)
    return 0
