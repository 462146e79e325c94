"""The scale trend of the reproduction studies (issue 27, item 3): for each committed study
directory, the predictive validity of D(x) (problem-demeaned AUC with its cluster-bootstrap
interval), the effect of the depth term in MCMC (DEGS-MCMC − power MCMC: paired difference
with Newcombe's interval, and how many chains ended identical), and the MH acceptance of
DEGS-MCMC (accepted proposals / MH steps, pooled over every chain), against the model's
parameter count. Reads only each study's `tables/*.json`
(written by `degs reproduce --report-only`), so it needs no model and no GPU.

Prints one JSON record and writes a three-panel PNG:

  python bench/scale_trend.py --benchmark math500 \\
      --study 0.63:docs/reproduction/qwen2.5-coder-0.5b-full \\
      --study 1.78:docs/reproduction/qwen2.5-coder-1.5b \\
      --png docs/reproduction/scale_trend_math500.png --out docs/reproduction/scale_trend_math500.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py


def study_point(directory: Path, benchmark: str) -> dict:
    """The three quantities of one study on one benchmark (None where the study lacks it)."""
    tables = directory / "tables"
    validity = json.loads((tables / "predictive_validity.json").read_text()).get(benchmark)
    paired = json.loads((tables / "paired.json").read_text())
    compute = json.loads((tables / "compute.json").read_text())
    study = json.loads((directory / "study.json").read_text())
    beta = next((c for c in paired["comparisons"] if c["benchmark"] == benchmark
                 and (c["baseline"], c["treatment"]) == ("power_mcmc", "degs_mcmc")), None)
    same = next((c for c in paired["common_random_numbers"] if c["benchmark"] == benchmark
                 and (c["baseline"], c["treatment"]) == ("power_mcmc", "degs_mcmc")), None)
    degs = next((r for r in compute["rows"] if r["benchmark"] == benchmark and r["method"] == "degs_mcmc"), None)
    hyper = json.loads((directory / "runs" / benchmark / "degs_mcmc" / "run.json").read_text())["config"][
        "hyperparameters"] if (directory / "runs" / benchmark / "degs_mcmc" / "run.json").exists() else {}
    return {
        "study": str(directory), "model": study.get("model"), "benchmark": benchmark,
        "mcmc": {key: hyper.get(key) for key in ("num_blocks", "block_len", "mh_steps", "alpha", "beta")},
        "demeaned_auc": None if validity is None else validity["demeaned_auc"],
        "demeaned_auc_ci": None if validity is None else [validity["demeaned_auc_ci_low"],
                                                          validity["demeaned_auc_ci_high"]],
        "pool_candidates": None if validity is None else validity["n"],
        "beta_difference": None if beta is None else beta["difference"],
        "beta_ci": None if beta is None else [beta["ci_low"], beta["ci_high"]],
        "beta_problems": None if beta is None else beta["n"],
        "identical_completions": None if same is None else same["identical_completions"],
        "acceptance": None if degs is None else degs["acceptance_pooled"],
    }


def plot(points: list[dict], path: Path, benchmark: str) -> str:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.3), dpi=130)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    size = np.array([p["parameters_b"] for p in points])
    panels = [("demeaned_auc", "demeaned_auc_ci", "D(x): problem-demeaned AUC", 0.5),
              ("beta_difference", "beta_ci", "DEGS-MCMC − power MCMC (accuracy)", 0.0),
              ("acceptance", None, "MH acceptance (pooled over steps), DEGS-MCMC", None)]
    for ax, (key, ci, title, reference) in zip(axes, panels):
        have = [i for i, p in enumerate(points) if p[key] is not None]
        y = np.array([points[i][key] for i in have], float)
        if ci is not None:
            low = np.array([points[i][ci][0] for i in have])
            high = np.array([points[i][ci][1] for i in have])
            ax.errorbar(size[have], y, yerr=[y - low, high - y], fmt="o", capsize=4, color="tab:blue")
        else:
            ax.plot(size[have], y, "o", color="tab:blue")
        if reference is not None:
            ax.axhline(reference, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xticks(size, [f"{s:g}B" for s in size])
        ax.minorticks_off()
        ax.set_xlabel("parameters")
        ax.set_title(title, fontsize=9)
    axes[2].axhspan(0.57, 0.78, color="tab:orange", alpha=0.15, label="paper: 57–78%")
    axes[2].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{benchmark}: the paper's configuration (16 × 192 tokens), by model size", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def main(argv=None) -> int:
    from common import environment, write_record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", action="append", required=True, metavar="BILLIONS:DIR",
                    help="a study directory and its model's parameter count in billions, as loaded (the "
                         "built-in Qwen2.5-Coder GGUFs have an untied output matrix: 0.63 and 1.78) (repeat)")
    ap.add_argument("--benchmark", default="math500")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON record here too")
    args = ap.parse_args(argv)
    points = []
    for item in args.study:
        billions, _, directory = item.partition(":")
        if not directory or not (Path(directory) / "tables").is_dir():
            ap.error(f"--study takes BILLIONS:DIR with DIR/tables from `degs reproduce --report-only`, got {item!r}")
        points.append({"parameters_b": float(billions), **study_point(Path(directory), args.benchmark)})
    points.sort(key=lambda p: p["parameters_b"])
    record = {"bench": "scale_trend", "benchmark": args.benchmark, "points": points}
    if args.png is not None:
        record["png"] = plot(points, args.png, args.benchmark)
    write_record({**record, **environment()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
