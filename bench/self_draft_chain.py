r"""The slowest chain alone, with and without self-drafted proposals (issue 55): one problem
of a committed run, decoded again at batch 1 with the run's own method, hyperparameters,
prompt format and seed, once per `draft_tokens` value (`MCMCMethod.draft_tokens`: verify
up to k tokens of the chain's own suffix per forward; 0 is the undrafted chain), with
`--draft-lookup N` the drafted values also guess from n-gram lookups where the suffix
guesses nothing (`MCMCMethod.draft_lookup`).

    python bench/self_draft_chain.py docs/reproduction/qwen2.5-coder-1.5b-whole/runs/math500/degs_mcmc \
        --problem test/intermediate_algebra/834.json --draft-tokens 16,0 --out /tmp/draft_chain
    python bench/self_draft_chain.py docs/reproduction/qwen2.5-coder-1.5b-whole/runs/humaneval/power_mcmc \
        --problem HumanEval/115 --draft-tokens 16,0 --out /tmp/draft_chain

Each value is one `degs_jax.eval.run_eval` of that problem alone (batch 1, refill as the
library does it) into its own directory under --out; the values run in the order given, in
one process (the model loaded once), and each prints its JSON record as soon as it is done
(and appends it to $OUT/self_draft_chain.jsonl), so a call killed during the last one keeps
the others. Per value: the record's decode seconds, the compilation inside them (JAX's
compile-duration events while the value ran, summed: a new k is a new program), the
generated tokens, the decode steps (forwards the row ran: `GenState.n_steps`), generated
tokens per decode step, whether the completion ended and was graded correct. A drafted
chain is another chain of the same target (other tokens for the same seed), so its length
may differ from the undrafted one's: compare seconds per generated token as well as
seconds. The undrafted value reproduces the run's own chain only up to the bf16 rounding
of batch neighbours (the run decoded it beside other problems).

CPU check (SmolLM2-135M, a short chain; its seconds say nothing of speed):
    degs eval --model smollm2-135m --benchmark math500 --method power_mcmc --limit 1 --out /tmp/pm \
        --num-blocks 2 --block-len 16 --mh-steps 2
    python bench/self_draft_chain.py /tmp/pm --problem test/precalculus/807.json --draft-tokens 4,0
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax

from common import emit, environment
from degs_jax.eval.runner import run_eval
from degs_jax.eval.benchmarks import load_benchmark
from degs_jax.methods import as_method
from degs_jax.models import load


def _draft_values(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"--draft-tokens takes comma-separated ints >= 0, got {text!r}")
    return values


class CompileSeconds:
    """The seconds JAX reports compiling (its '/jax/core/compile/...' duration events)."""

    def __init__(self):
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration: float, **_):
        if event.startswith("/jax/core/compile/"):
            self.seconds += duration


def _setting(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not value.strip().lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"--set takes NAME=INT (e.g. num_blocks=8), got {text!r}")
    return name.strip(), int(value)


def run_value(model, run_config: dict, index: int, draft_tokens: int, draft_lookup: int, out: Path,
              compiles: CompileSeconds, data_dir) -> dict:
    """One problem decoded alone with `draft_tokens` (and `draft_lookup` where it drafts);
    the record of the bench."""
    draft_lookup = draft_lookup if draft_tokens else 0
    method = as_method(run_config["method"], {**run_config["hyperparameters"], "draft_tokens": draft_tokens,
                                              "draft_lookup": draft_lookup})
    before, t0 = compiles.seconds, time.perf_counter()
    summary = run_eval(model, out, benchmark=run_config["benchmark"], method=method, seed=run_config["seed"],
                       indices=[index], batch_size=1, chat=run_config["chat"], print_table=False,
                       data_dir=data_dir)
    wall = time.perf_counter() - t0
    (record,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    compile_s = compiles.seconds - before
    steps = record["decode_steps"]
    run_s = record["decode_s"] - compile_s
    return {
        "draft_tokens": draft_tokens, "draft_lookup": draft_lookup, "wall_s": wall, "decode_s": record["decode_s"],
        "compile_s": compile_s,
        "decode_s_without_compile": run_s, "generated_tokens": record["generated_tokens"], "decode_steps": steps,
        "tokens_per_decode_step": record["generated_tokens"] / steps, "ms_per_decode_step": 1000 * run_s / steps,
        "ms_per_generated_token": 1000 * run_s / record["generated_tokens"], "n_tokens": record["n_tokens"],
        "ended_by": record["ended_by"], "correct": record["correct"], "mean_acceptance": record["mean_acceptance"],
        "accuracy_check": summary["accuracy"]["correct"] == int(record["correct"]),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run directory (its run.json: benchmark, method, hyperparameters, "
                                           "prompt format, seed, model)")
    ap.add_argument("--problem", required=True, help="the problem's id in that benchmark")
    ap.add_argument("--draft-tokens", type=_draft_values, default=[16, 0], metavar="K,K,...",
                    help="the values to run, in this order (default: 16,0)")
    ap.add_argument("--draft-lookup", type=int, default=0, metavar="N",
                    help="draft_lookup of the drafted values (n-gram lookups where the suffix guesses nothing; "
                         "default 0: off)")
    ap.add_argument("--model", default=None, help="what `degs_jax.models.load` takes (default: the run's model)")
    ap.add_argument("--out", type=Path, default=None, help="directory for the per-value runs (default: a temporary one)")
    ap.add_argument("--data-dir", default=None, help="benchmark files (default: those installed with degs_jax)")
    ap.add_argument("--set", type=_setting, action="append", default=[], metavar="NAME=INT",
                    help="override an integer hyperparameter of the run (e.g. num_blocks=8: the chain's first "
                         "8 blocks, a shorter chain of the same problem); repeatable")
    args = ap.parse_args()
    run_config = json.loads((args.run / "run.json").read_text())["config"]
    unknown = [name for name, _ in args.set if name not in run_config["hyperparameters"]]
    if unknown:
        ap.error(f"--set: the run's method has no {', '.join(unknown)} "
                 f"(it has {', '.join(sorted(run_config['hyperparameters']))})")
    run_config["hyperparameters"].update(dict(args.set))
    problems = load_benchmark(run_config["benchmark"], args.data_dir)
    ids = [p.id for p in problems]
    if args.problem not in ids:
        ap.error(f"{args.problem!r} is not a problem of {run_config['benchmark']} (first ids: {ids[:3]})")
    index = ids.index(args.problem)
    out = args.out or Path(tempfile.mkdtemp(prefix="self_draft_chain_"))
    compiles = CompileSeconds()
    model = load(args.model or run_config["model"]["name"])
    head = {"bench": "self_draft_chain", **environment(), "run": str(args.run), "problem": args.problem,
            "index": index, "benchmark": run_config["benchmark"], "method": run_config["method"],
            "hyperparameters": run_config["hyperparameters"], "chat": run_config["chat"], "seed": run_config["seed"],
            "batch": 1}
    for k in args.draft_tokens:
        name = f"draft_{k}" + (f"_lookup_{args.draft_lookup}" if k and args.draft_lookup else "")
        emit({**head, **run_value(model, run_config, index, k, args.draft_lookup, out / name, compiles,
                                  args.data_dir)}, "self_draft_chain.jsonl")


if __name__ == "__main__":
    main()
