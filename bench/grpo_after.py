"""The GRPO reference row (issue 29): a GRPO checkpoint evaluated after training with the
study's harness, paired against the base model's rows of the same study.

The base model's rows ("before") are a `degs reproduce` run directory (the 0.5B study:
`docs/reproduction/qwen2.5-coder-0.5b/runs`); the trained model's ("after") are the same
`degs reproduce` command with `--model CHECKPOINT` and the same settings (benchmarks,
limits, --hp, batch size), so problem i of both draws with the same key
fold_in(key(seed), i) and the two differ only by the weights. For every (benchmark,
method) present in both: accuracy before and after over the problems both graded, the
paired table (both right / only before / only after / both wrong), exact McNemar p,
Newcombe's paired 95% interval of after - before, and Holm's adjustment over the whole
family of comparisons made. `--cross` adds the paper's comparison: DEGS-MCMC on the base
model against the trained model decoded greedily, per benchmark. `--check` names another run of the base model with the same
settings (e.g. one committed earlier): the number of identical completions and verdicts
says whether that older "before" still describes today's code and device.

Also draws the training curve (`degs_jax.plots.plot_training_curve`) of the trainer's
log. Prints one JSON record (bench/common.environment: device, versions, date, command)
and writes it to --out.

  python bench/grpo_after.py --before docs/reproduction/qwen2.5-coder-0.5b/runs \\
      --after docs/training/grpo-0.5b/after/runs --check docs/training/grpo-0.5b/before-check/runs \\
      --log docs/training/grpo-0.5b/log.jsonl --png docs/training/grpo-0.5b/training_curve.png \\
      --out docs/training/grpo-0.5b/after_vs_before.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py


def results(run_dir: Path) -> dict[int, dict]:
    """Problem index -> its graded record (results.jsonl; a resumed run's last record of an
    index wins, as the harness's summary counts it)."""
    records = {}
    for line in (run_dir / "results.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[record["index"]] = record
    return records


def cells(root: Path) -> dict[tuple[str, str], Path]:
    """(benchmark, method) -> run directory, for every ROOT/<benchmark>/<method>/results.jsonl."""
    return {(p.parent.parent.name, p.parent.name): p.parent for p in sorted(root.glob("*/*/results.jsonl"))}


def compare(before_root: Path, after_root: Path, cross: tuple[tuple[str, str], ...] = ()) -> list[dict]:
    """Same method before vs after for every cell in both; then each (before method, after
    method) of `cross` per benchmark, e.g. ("degs_mcmc", "greedy"): decoding the base model
    with DEGS against decoding the trained model greedily (the paper's GRPO comparison)."""
    from degs_jax.stats import compare_paired, holm

    before, after = cells(before_root), cells(after_root)
    pairs = [(key, key) for key in sorted(set(before) & set(after))]
    for bench in sorted({b for b, _ in before}):
        pairs += [((bench, m_before), (bench, m_after)) for m_before, m_after in cross
                  if (bench, m_before) in before and (bench, m_after) in after]
    rows = []
    for key_before, key_after in pairs:
        a, b = results(before[key_before]), results(after[key_after])
        shared = sorted(set(a) & set(b))
        paired = compare_paired([a[i]["correct"] for i in shared], [b[i]["correct"] for i in shared])
        rows.append({"benchmark": key_before[0], "before": key_before[1], "after": key_after[1],
                     "problems": [shared[0], shared[-1]] if shared else [], **dataclasses.asdict(paired)})
    for row, adjusted in zip(rows, holm([r["p_value"] for r in rows])):
        row["p_holm"] = adjusted
    return rows


def agreement(committed_root: Path, rerun_root: Path) -> list[dict]:
    """Per cell of the rerun: how many problems got the identical completion and verdict."""
    committed, rerun = cells(committed_root), cells(rerun_root)
    rows = []
    for key in sorted(set(committed) & set(rerun)):
        a, b = results(committed[key]), results(rerun[key])
        shared = sorted(set(a) & set(b))
        rows.append({"benchmark": key[0], "method": key[1], "n": len(shared),
                     "same_completion": sum(a[i]["completion"] == b[i]["completion"] for i in shared),
                     "same_verdict": sum(a[i]["correct"] == b[i]["correct"] for i in shared)})
    return rows


def main(argv=None) -> int:
    from common import environment, write_record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="runs/ of the base model's study")
    ap.add_argument("--after", type=Path, required=True, help="runs/ of the trained checkpoint, same settings")
    ap.add_argument("--check", type=Path, default=None, help="runs/ of another run of the base model, same settings (optional)")
    ap.add_argument("--log", type=Path, default=None, help="the trainer's log.jsonl (for the curve)")
    ap.add_argument("--png", type=Path, default=None, help="write the training curve here (needs --log)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON record here too")
    ap.add_argument("--cross", default="degs_mcmc:greedy",
                    help="also compare BEFORE_METHOD:AFTER_METHOD per benchmark, comma-separated "
                         "(default degs_mcmc:greedy: DEGS on the base model vs the trained model greedy; "
                         "'' for none)")
    args = ap.parse_args(argv)
    for path in (args.before, args.after, args.check, args.log):
        if path is not None and not path.exists():
            ap.error(f"{path} does not exist")
    cross = tuple(tuple(pair.split(":")) for pair in args.cross.split(",") if pair)
    if any(len(pair) != 2 for pair in cross):
        ap.error(f"--cross takes BEFORE_METHOD:AFTER_METHOD pairs, got {args.cross!r}")
    rows = compare(args.before, args.after, cross)
    if not rows:
        ap.error(f"no benchmark/method run is in both {args.before} and {args.after}")
    record = {"bench": "grpo_after", "comparisons": rows, "family_size": len(rows)}
    if args.check is not None:
        record["before_rerun"] = agreement(args.before, args.check)
    if args.log is not None:
        log = [json.loads(x) for x in args.log.read_text().splitlines() if x.strip()]
        first, last = log[:10], log[-10:]
        mean = lambda rows_, key: sum(r[key] for r in rows_) / len(rows_)
        record["training"] = {
            "steps": len(log), "reward_first10": mean(first, "reward_mean"), "reward_last10": mean(last, "reward_mean"),
            "groups_without_signal_mean": mean(log, "groups_without_signal"),
            "kl_last": log[-1]["kl"], "completion_tokens_first10": mean(first, "completion_tokens"),
            "completion_tokens_last10": mean(last, "completion_tokens")}
        if args.png is not None:
            from degs_jax.plots import plot_training_curve

            record["png"] = plot_training_curve(log, args.png, f"GRPO on GSM8K train, {len(log)} steps")
    write_record({**record, **environment()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
