"""The report's figures (PNG, matplotlib's Agg canvas, no pyplot state).

:func:`write_figures` draws Table 1 with its Wilson intervals, the paired differences with
their Newcombe intervals (red where Holm's adjusted McNemar p < 0.05), and per pool
benchmark the predictive validity of D(x) (:func:`degs_jax.analysis.plot_predictive_validity`)
and the layer-entropy trajectories of correct and incorrect candidates
(:func:`degs_jax.plots.plot_entropy_trajectories`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from degs_jax.analysis import plot_predictive_validity, pool_from_records
from degs_jax.plots import plot_entropy_trajectories
from degs_jax.reproduce import paper
from degs_jax.reproduce.study_files import Study, pool_sampling


def _figure(width: float, height: float):
    fig = Figure(figsize=(width, height), dpi=130)
    FigureCanvasAgg(fig)
    return fig


def plot_table1(t1: Mapping, path: Path, title: str) -> Optional[str]:
    rows = [r for r in t1["rows"] if r["cells"]]
    if not rows:
        return None
    benchmarks = t1["benchmarks"]
    fig = _figure(max(6.0, 1.6 * len(benchmarks) + 2), 4.2)
    ax = fig.add_subplot()
    width = 0.8 / len(rows)
    for k, r in enumerate(rows):
        xs, ys, lo, hi = [], [], [], []
        for j, b in enumerate(benchmarks):
            c = r["cells"].get(b)
            if c and c["n"]:
                xs.append(j + (k - (len(rows) - 1) / 2) * width)
                ys.append(c["accuracy"])
                lo.append(max(0.0, c["accuracy"] - c["ci_low"]))
                hi.append(max(0.0, c["ci_high"] - c["accuracy"]))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=r["label"])
    ax.set_xticks(range(len(benchmarks)),
                  [paper.BENCHMARK_LABELS.get(b, b) for b in benchmarks], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy (95% Wilson interval)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, frameon=False, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return str(path)


def plot_paired(paired: Mapping, path: Path, title: str) -> Optional[str]:
    comps, family = paired["comparisons"], paired["holm_family"]
    if not comps:
        return None
    fig = _figure(7.0, 0.35 * len(comps) + 1.4)
    ax = fig.add_subplot()
    ys = np.arange(len(comps))[::-1]
    for y, c in zip(ys, comps):
        ax.errorbar(c["difference"], y, xerr=[[c["difference"] - c["ci_low"]],
                                              [c["ci_high"] - c["difference"]]],
                    fmt="o", color="tab:blue" if c["p_holm"] >= 0.05 else "tab:red", capsize=3)
    ax.axvline(0.0, color="grey", linewidth=1)
    ax.set_yticks(ys, [f"{c['treatment']} − {c['baseline']} · {c['benchmark']} (n={c['n']})"
                       for c in comps], fontsize=7)
    ax.set_xlabel(f"accuracy difference, 95% Newcombe paired score interval\n(red: exact "
                  f"McNemar p < 0.05 after Holm over the {family} comparisons)", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return str(path)


def write_figures(study: Study, tables: Mapping[str, Any], directory: Path) -> dict[str, str]:
    """Every figure of the report into ``directory``: name -> path of its PNG (a figure
    with nothing to draw is left out)."""
    model = study.meta["model"]["name"]
    figures = {}
    f = plot_table1(tables["table1"], directory / "table1.png", f"{model}: accuracy")
    if f:
        figures["table1"] = f
    f = plot_paired(tables["paired"], directory / "paired.png", f"{model}: paired differences")
    if f:
        figures["paired"] = f
    for b, stats in tables["predictive_validity"].items():
        pool = pool_from_records(study.pools[b]["records"])
        figures[f"predictive_validity_{b}"] = plot_predictive_validity(
            pool, stats, directory / f"predictive_validity_{b}.png",
            title=f"{model} · {b} · pool: {pool_sampling(study.pools[b]['decoder'])}")
    for b, traj in tables["trajectories"].items():
        curves = {f"{name} ({g['candidates']} candidates)": (traj["layers"], g["mean_entropy"])
                  for name, g in traj["groups"].items()}
        if curves:
            figures[f"trajectory_{b}"] = plot_entropy_trajectories(
                curves, directory / f"trajectory_{b}.png",
                title=f"{model} · {b}: layer entropy of pool candidates", tau=traj["tau"])
    return figures
