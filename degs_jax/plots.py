"""Figures for the lens analyses (matplotlib, Agg; never touches pyplot's global state)."""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def save_png(fig: Figure, path: str | os.PathLike, title: str = "") -> str:
    """Give `fig` its suptitle (if any), lay it out and write it as a PNG; returns the path."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, format="png")
    return path


def plot_entropy_trajectories(
        curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
        path: str | os.PathLike, title: str = "", *,
        normalize_depth: Optional[bool] = None,
        num_layers: Optional[Mapping[str, int]] = None,
        tau: Optional[float] = None, ylabel: str = "mean layer entropy $H_l$ (nats)") -> str:
    """Overlay layer-entropy trajectories (the paper's Figure 1) and save a PNG.

    curves: label -> (layers [K], mean entropy [K]), e.g. from
      `lens.entropy_trajectory` (`.layers`, `.mean`) for two models or two groups.
    normalize_depth: plot against l / L instead of l; default: only when the curves'
      depths L differ. L of a curve is `num_layers[label]` if given, else its largest
      layer index.
    tau: draw the collapse threshold as a dashed horizontal line.
    Returns the path written.
    """
    if not curves:
        raise ValueError("plot_entropy_trajectories needs at least one curve")
    data = {}
    for label, (layers, mean) in curves.items():
        layers, mean = np.asarray(layers, float), np.asarray(mean, float)
        if layers.ndim != 1 or layers.shape != mean.shape or layers.size == 0:
            raise ValueError(f"curve {label!r}: layers {layers.shape} and entropies "
                             f"{mean.shape} must be equal non-empty 1-D shapes")
        depth = (num_layers or {}).get(label, layers.max())
        data[label] = (layers, mean, float(depth))
    if normalize_depth is None:
        normalize_depth = len({d for _, _, d in data.values()}) > 1

    fig = Figure(figsize=(6.0, 4.0), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, (layers, mean, depth) in data.items():
        x = layers / depth if normalize_depth else layers
        ax.plot(x, mean, marker="o", markersize=3, linewidth=1.8, label=label)
    if tau is not None:
        ax.axhline(tau, color="grey", linestyle="--", linewidth=1.0, label=f"$\\tau$ = {tau:g}")
    ax.set_xlabel("normalised depth $l / L$" if normalize_depth else "layer $l$")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0.0)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    return save_png(fig, path)


TRAINING_PANELS = (("reward_mean", "mean reward"), ("kl", "KL(π ‖ π_ref) (k3)"), ("loss", "loss"),
                   ("completion_tokens", "completion tokens"), ("entropy", "token entropy (nats)"))


def plot_training_curve(log: Sequence[Mapping], path: str | os.PathLike, title: str = "", *,
                        smooth: int = 5) -> str:
    """The GRPO training curve from the trainer's `log.jsonl` records (one per step): reward,
    KL to the reference, loss, completion length and token entropy against the step, each
    raw (faint) and as a `smooth`-step running mean. A missing metric (None, e.g. KL when
    it is not measured) is left blank. Returns the path written."""
    if not log:
        raise ValueError("plot_training_curve needs at least one step record")
    steps = np.array([r["step"] for r in log], float)
    fig = Figure(figsize=(3.0 * len(TRAINING_PANELS), 3.3), dpi=130)
    FigureCanvasAgg(fig)
    for ax, (key, label) in zip(fig.subplots(1, len(TRAINING_PANELS)), TRAINING_PANELS):
        y = np.array([np.nan if r.get(key) is None else r[key] for r in log], float)
        ax.plot(steps, y, color="tab:blue", alpha=0.35, linewidth=1)
        if len(y) >= smooth > 1:
            ax.plot(steps[smooth - 1:], np.convolve(y, np.ones(smooth) / smooth, mode="valid"),
                    color="tab:blue", linewidth=1.8, label=f"{smooth}-step mean")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return str(path)
