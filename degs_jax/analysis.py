"""The paper's analyses of collapse depth as a predictor of correctness (docs/design.md §5).

Statistics over a pool of graded candidates, each with a score ``D(x)`` and a verdict:

- AUC = the Mann–Whitney statistic normalised, ``P(D_c > D_w) + ½·P(D_c = D_w)`` over
  all (correct, incorrect) pairs of the pool (ties count one half), with a 95%
  interval from the problem-level cluster bootstrap (:func:`degs_jax.stats.cluster_bootstrap_auc`:
  problems resampled with all their candidates, 10,000 resamples, seed 0);
- the problem-demeaned AUC (D minus its problem's mean D, then the AUC over all
  candidates; the headline: it ranks candidates against their own problem, as a
  decoder choosing among them does) with the same interval; NaN when no problem has
  two candidates;
- mean gap ``mean D(correct) − mean D(incorrect)`` and a two-sided Mann–Whitney U test.
  The test (and Spearman's p) treats every candidate as independent, which the N
  candidates of one problem are not: its p-value is too small and is reported only as
  a footnote to the cluster intervals;
- Spearman ρ between ``D`` and correctness (0/1);
- pairwise ranking accuracy: the same quantity as the AUC but only over pairs of one
  correct and one incorrect candidate *of the same problem* (ties count one half; the
  tie fraction is reported separately);
- accuracy by ``D`` quantile bucket (quartiles by default): bucket ``b`` holds
  ``q_b < D ≤ q_{b+1}`` (the first bucket also ``D = q_0``), where ``q`` are the pool's
  quantiles (numpy's linear interpolation), so equal scores always share a bucket and a
  bucket may be empty when many scores tie.

``analyze_run`` reads a ``degs eval --keep-candidates`` directory (every candidate graded)
and writes ``analysis.json`` and ``analysis.png``; ``lsub_sweep`` re-scores the kept
candidates with :func:`degs_jax.scoring.score_sequences` for each probe set ``L_sub`` and
reports the predictive statistics and DEGS-rerank accuracy per set (the paper's L_sub
table). The statistics themselves are :mod:`degs_jax.stats`'s. The evaluation harness
(``degs_jax.eval``, whose package imports the sandbox and the graders) is not loaded with
this module: the functions that read run directories import it when called;
``degs_jax.eval`` never imports this module (the CLI does).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from degs_jax.decisions import (decision_anatomy, decision_table, departures, format_anatomy,
                                has_decision_records, plot_decisions)
from degs_jax.methods import DegsMCMC, DegsRerank, method_from_record
from degs_jax.lens import LensConfig
from degs_jax.models import with_tuned_lens
from degs_jax.plots import save_png
from degs_jax.scoring import score_sequences

from degs_jax.stats import (BOOTSTRAP_RESAMPLES, CONFIDENCE, auc, bucket_accuracy, cluster_bootstrap_auc,
                            mann_whitney, mean_gap, pairwise_ranking_accuracy, rerank_accuracy, spearman)

__all__ = [
    "Pool", "predictive_validity", "pool_from_records", "load_run", "analyze_run", "format_report",
    "format_interval", "plot_predictive_validity", "lsub_sweep", "format_lsub_table", "analyze_decisions",
    "analyze_departures",
]


# --------------------------------------------------------------------------- pools


@dataclass
class Pool:
    """Graded candidates of a run, flattened: one entry per candidate.

    problem: problem id of each candidate; D, log_p, correct: its score, log p(x) and
    verdict; unit: "candidates" (kept pools) or "chosen" (one output per problem).
    """

    problem: list[str]
    D: np.ndarray
    log_p: np.ndarray
    correct: np.ndarray
    unit: str

    def groups(self, scores: Optional[np.ndarray] = None) -> list[dict[str, np.ndarray]]:
        """Per-problem dicts (``id``, ``D``, ``log_p``, ``correct``), in first-seen order."""
        scores = self.D if scores is None else np.asarray(scores, np.float64)
        order: dict[str, list[int]] = {}
        for i, pid in enumerate(self.problem):
            order.setdefault(pid, []).append(i)
        return [{"id": pid, "D": scores[idx], "log_p": self.log_p[idx], "correct": self.correct[idx]}
                for pid, idx in ((p, np.asarray(i)) for p, i in order.items())]


def pool_from_records(records: Sequence[Mapping[str, Any]]) -> Pool:
    """Candidates of ``degs eval --keep-candidates`` records (every candidate graded), or,
    for runs that did not keep candidates, the chosen output of each problem."""
    if not records:
        raise ValueError("no results to analyse")
    kept = all("candidates" in r for r in records)
    problem, d, logp, correct = [], [], [], []
    for r in records:
        items = r["candidates"] if kept else [{"D": r.get("D"), "log_p": r.get("log_p"),
                                               "correct": r["correct"]}]
        for c in items:
            if c.get("D") is None:
                raise ValueError(
                    f"problem {r['id']!r} has a candidate without D(x) (the method did not probe, "
                    "e.g. power_mcmc); re-score it with `degs analyze DIR --lsub-sweep default`")
            if c.get("correct") is None:
                raise ValueError(f"problem {r['id']!r} has an ungraded candidate")
            problem.append(r["id"])
            d.append(float(c["D"]))
            logp.append(float(c["log_p"]))
            correct.append(bool(c["correct"]))
    return Pool(problem, np.asarray(d), np.asarray(logp), np.asarray(correct, bool),
                "candidates" if kept else "chosen")


def predictive_validity(pool: Pool, scores: Optional[Sequence[float]] = None,
                        n_buckets: int = 4,
                        n_resamples: Optional[int] = None) -> dict[str, Any]:
    """Every statistic of the module docstring for ``pool`` (scored by ``scores``, default
    the pool's own D(x)), as a JSON-able dict. ``n_resamples``: of the cluster bootstrap
    (default :data:`degs_jax.stats.BOOTSTRAP_RESAMPLES`; 0: no intervals)."""
    d = pool.D if scores is None else np.asarray(scores, np.float64)
    y = pool.correct
    u, p = mann_whitney(d, y)
    rho, rho_p = spearman(d, y)
    pw = pairwise_ranking_accuracy((g["D"], g["correct"]) for g in pool.groups(d))
    resamples = BOOTSTRAP_RESAMPLES if n_resamples is None else n_resamples
    whole = cluster_bootstrap_auc(d, y, pool.problem, n_resamples=resamples)
    demeaned = cluster_bootstrap_auc(d, y, pool.problem, demean=True, n_resamples=resamples)
    return {
        "unit": pool.unit,
        "n": int(len(d)), "n_correct": int(y.sum()), "n_problems": len(set(pool.problem)),
        "accuracy": float(y.mean()) if len(y) else math.nan,
        "mean_D_correct": float(d[y].mean()) if y.any() else math.nan,
        "mean_D_incorrect": float(d[~y].mean()) if (~y).any() else math.nan,
        "demeaned_auc": demeaned.estimate,
        "demeaned_auc_ci_low": demeaned.ci_low, "demeaned_auc_ci_high": demeaned.ci_high,
        "auc": auc(d, y), "auc_ci_low": whole.ci_low, "auc_ci_high": whole.ci_high,
        "cluster_bootstrap": {"unit": "problem", "clusters": whole.clusters,
                              "resamples": whole.resamples, "seed": whole.seed,
                              "confidence": CONFIDENCE, "interval": "percentile",
                              "undefined_resamples": {"auc": whole.undefined_resamples,
                                                      "demeaned_auc": demeaned.undefined_resamples}},
        "gap": mean_gap(d, y),
        "mann_whitney_u": u, "mann_whitney_p": p,
        "spearman_rho": rho, "spearman_p": rho_p,
        "pairwise": asdict(pw),
        "buckets": [asdict(b) for b in bucket_accuracy(d, y, n_buckets)],
    }


# --------------------------------------------------------------------------- runs


def load_run(run_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
    """(run.json, result records) of a ``degs eval`` directory."""
    # the harness when a run is read, not when this module is imported (module docstring)
    from degs_jax.eval.results import EVAL_RECORD_FIELDS, read_records, read_run_file

    run_dir = Path(run_dir)
    run_file, results = run_dir / "run.json", run_dir / "results.jsonl"
    if not run_file.exists() or not results.exists():
        raise FileNotFoundError(f"{run_dir} is not a `degs eval` directory (needs run.json and "
                                "results.jsonl)")
    return read_run_file(run_file), read_records(results, fields=EVAL_RECORD_FIELDS)


def _write_json(path: str | os.PathLike, obj: Any) -> None:
    """The harness's atomic JSON writer (`degs_jax.eval.results.write_json`)."""
    # the harness when a result is written, not when this module is imported (module docstring)
    from degs_jax.eval.results import write_json as write

    write(path, obj)


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _p(p: Optional[float]) -> str:
    return "n/a" if p is None or math.isnan(p) else f"{p:.3g}"


def format_interval(stats: Mapping[str, Any], name: str) -> str:
    """``estimate [low, high]`` of a statistic with ``name_ci_low`` / ``name_ci_high``."""
    low, high = stats[f"{name}_ci_low"], stats[f"{name}_ci_high"]
    if low is None or math.isnan(low):
        return _fmt(stats[name])
    return f"{_fmt(stats[name])} [{_fmt(low)}, {_fmt(high)}]"


def format_report(stats: Mapping[str, Any], title: str = "") -> str:
    """A plain-text table of :func:`predictive_validity`'s output."""
    pw = stats["pairwise"]
    p = stats["mann_whitney_p"]
    lines = [title] if title else []
    lines += [
        f"pool: {stats['n']} {stats['unit']} of {stats['n_problems']} problems, "
        f"{stats['n_correct']} correct (accuracy {_fmt(stats['accuracy'])})",
        f"problem-demeaned AUC {format_interval(stats, 'demeaned_auc')}   AUC "
        f"{format_interval(stats, 'auc')}   (95% cluster bootstrap over problems)",
        f"Spearman rho {_fmt(stats['spearman_rho'])}   pairwise ranking accuracy "
        f"{_fmt(pw['accuracy'])} ({pw['pairs']} pairs in {pw['problems']} problems, "
        f"{_fmt(pw['tie_fraction'])} of them tied)",
        f"mean D(x)  correct {_fmt(stats['mean_D_correct'], 4)}  incorrect "
        f"{_fmt(stats['mean_D_incorrect'], 4)}  gap {_fmt(stats['gap'], 4)}  "
        f"(Mann-Whitney U {_fmt(stats['mann_whitney_u'], 1)}, p = {_p(p)}; candidates "
        "taken as independent, which one problem's are not)",
        "accuracy by D(x) bucket:",
        f"  {'bucket':>6}  {'D range':>17}  {'n':>5}  {'accuracy':>8}  95% interval",
    ]
    for b in stats["buckets"]:
        lines.append(f"  {b['bucket'] + 1:>6}  [{b['low']:.4f}, {b['high']:.4f}]  {b['n']:>5}  "
                     f"{_fmt(b['accuracy']):>8}  [{_fmt(b['ci_low'])}, {_fmt(b['ci_high'])}]")
    return "\n".join(lines)


def plot_predictive_validity(pool: Pool, stats: Mapping[str, Any], path: str | os.PathLike,
                             title: str = "") -> str:
    """The paper's three panels: D(x) of correct vs incorrect, accuracy by D bucket, and
    the predictive statistics. Writes a PNG (Agg) and returns its path."""
    fig = Figure(figsize=(13.0, 4.0), dpi=130)
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.2, 1.0, 0.8]})
    d, y = pool.D, pool.correct
    lo, hi = (float(d.min()), float(d.max())) if len(d) else (0.0, 1.0)
    bins = np.linspace(lo, hi if hi > lo else lo + 1e-3, 21)
    for sel, label, color in ((y, "correct", "tab:green"), (~y, "incorrect", "tab:red")):
        if sel.any():
            ax1.hist(d[sel], bins=bins, alpha=0.5, density=True, color=color,
                     label=f"{label} (n={int(sel.sum())})")
            ax1.axvline(float(d[sel].mean()), color=color, linestyle="--", linewidth=1.2)
    ax1.set_xlabel("collapse depth $D(x)$")
    ax1.set_ylabel("density")
    ax1.set_title("(a) $D(x)$ of correct vs incorrect")
    ax1.legend(frameon=False, fontsize=8)

    buckets = stats["buckets"]
    xs = np.arange(len(buckets))
    acc = np.array([b["accuracy"] for b in buckets], float)
    err = np.array([[b["accuracy"] - b["ci_low"], b["ci_high"] - b["accuracy"]]
                    if b["n"] else [0.0, 0.0] for b in buckets], float).T
    err = np.clip(err, 0.0, None)  # Wilson bounds can miss p = 0 or 1 by rounding
    ax2.bar(xs, np.nan_to_num(acc), yerr=err, capsize=3, color="tab:blue", alpha=0.75)
    for x, b in zip(xs, buckets):
        ax2.text(x, 0.02, f"n={b['n']}", ha="center", va="bottom", fontsize=8, color="white"
                 if b["n"] and b["accuracy"] > 0.1 else "black")
    ax2.set_xticks(xs, [f"Q{b['bucket'] + 1}\n≤{b['high']:.3f}" for b in buckets], fontsize=8)
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("$D(x)$ quantile bucket")
    ax2.set_ylabel("accuracy")
    ax2.set_title("(b) accuracy by $D(x)$ bucket")

    ax3.axis("off")
    pw = stats["pairwise"]
    p = stats["mann_whitney_p"]
    text = "\n".join([
        "(c) predictive statistics", "",
        "95% cluster bootstrap (problems):",
        f"demeaned AUC  {format_interval(stats, 'demeaned_auc')}",
        f"AUC           {format_interval(stats, 'auc')}", "",
        f"Spearman \u03c1          {_fmt(stats['spearman_rho'])}",
        f"mean gap \u0394D         {_fmt(stats['gap'], 4)}",
        f"pairwise rank acc.  {_fmt(pw['accuracy'])}",
        f"Mann-Whitney p*     {_p(p)}", "",
        f"{stats['n']} {stats['unit']}, {stats['n_problems']} problems",
        f"{pw['pairs']} within-problem pairs",
        "* candidates taken as independent",
    ])
    ax3.text(0.0, 1.0, text, va="top", ha="left", family="monospace", fontsize=9,
             transform=ax3.transAxes)
    return save_png(fig, path, title)


def _run_title(cfg: Mapping[str, Any]) -> str:
    """'model · benchmark · method' of a run's configuration."""
    return f"{cfg.get('model', {}).get('name', '?')} · {cfg.get('benchmark', '?')} · {cfg.get('method', '?')}"


def _output_dir(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None) -> Path:
    """Where an analysis of `run_dir` writes (created): `out_dir`, default the run's."""
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def analyze_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                n_buckets: int = 4, quiet: bool = False) -> dict[str, Any]:
    """Predictive validity of D(x) on a ``degs eval`` run: prints the report and writes
    ``analysis.json`` and ``analysis.png`` into ``out_dir`` (default ``run_dir``)."""

    run, records = load_run(run_dir)
    pool = pool_from_records(records)
    stats = predictive_validity(pool, n_buckets=n_buckets)
    cfg = run.get("config", {})
    title, out = _run_title(cfg), _output_dir(run_dir, out_dir)
    _write_json(out / "analysis.json", {"run": cfg, "predictive_validity": stats})
    png = plot_predictive_validity(pool, stats, out / "analysis.png", title=title)
    if not quiet:
        print(format_report(stats, title=f"collapse depth as a predictor of correctness: {title}"))
        if pool.unit == "chosen":
            print("note: the run did not keep candidates; statistics are over one output per "
                  "problem (no within-problem pairs). Use `degs eval --keep-candidates`.")
        print(f"wrote {out / 'analysis.json'} and {png}", file=sys.stderr)
    return stats


def analyze_decisions(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                      quiet: bool = False) -> Optional[dict[str, Any]]:
    """The anatomy of an MCMC run's MH decisions (`degs_jax.decisions`): prints it and
    writes ``decisions.json`` and ``decisions.png`` into ``out_dir`` (default ``run_dir``).
    None (nothing written) when the run holds no decision records."""

    run, records = load_run(run_dir)
    cfg = run.get("config", {})
    beta = cfg.get("hyperparameters", {}).get("beta")
    if not has_decision_records(records):
        return None
    table = decision_table(records)
    anatomy = decision_anatomy(table, beta=beta or None)
    title, out = _run_title(cfg), _output_dir(run_dir, out_dir)
    _write_json(out / "decisions.json", {"run": cfg, "decisions": anatomy})
    png = plot_decisions(table, anatomy, out / "decisions.png", title=title)
    if not quiet:
        print(f"MH decisions: {title}")
        print(format_anatomy(anatomy))
        print(f"wrote {out / 'decisions.json'} and {png}", file=sys.stderr)
    return anatomy


def analyze_departures(run_dir: str | os.PathLike, base_dir: str | os.PathLike,
                       out_dir: str | os.PathLike | None = None, quiet: bool = False) -> dict[str, Any]:
    """Check the decision records' prediction (`degs_jax.decisions.departures`): the
    chains of `run_dir` (DEGS-MCMC at some beta) depart from the power chains exactly
    where the records of `base_dir` (the same problems and keys at a beta that decided
    nothing) say. Writes ``departures.json`` into ``out_dir`` (default ``run_dir``)."""

    run, records = load_run(run_dir)
    base_run, base_records = load_run(base_dir)
    records, base_records = (sorted(r, key=lambda record: record["index"]) for r in (records, base_records))
    for name, directory, cfg in (("run", run_dir, run["config"]), ("base", base_dir, base_run["config"])):
        if not isinstance(method_from_record(cfg, Path(directory) / "run.json"), DegsMCMC):
            raise ValueError(f"the {name} is a {cfg.get('method')} run; both must be DEGS-MCMC runs "
                             "(degs_mcmc or a method of its class)")
    same = ("benchmark", "seed", "model", "key_derivation")
    if any(run["config"].get(k) != base_run["config"].get(k) for k in same) or \
            [r["id"] for r in records] != [r["id"] for r in base_records]:
        raise ValueError(f"{run_dir} and {base_dir} are not the same problems, model and keys "
                         f"({', '.join(same)} and the problem order must agree)")
    beta = run["config"]["hyperparameters"]["beta"]
    result = departures(decision_table(base_records), decision_table(records), beta)
    result["base_beta"] = base_run["config"]["hyperparameters"]["beta"]
    out = _output_dir(run_dir, out_dir)
    _write_json(out / "departures.json", result)
    if not quiet:
        print(f"chains departing from the power chain at beta = {beta:g}: predicted by the records at "
              f"beta = {result['base_beta']:g}: {result['predicted_departing']} of {result['chains']}; "
              f"departed: {result['departed_count']}; every one where predicted: {result['all_as_predicted']}")
        for chain, (predicted, actual) in result["mismatches"].items():
            print(f"  chain {chain}: predicted {predicted}, departed {actual}")
        print(f"wrote {out / 'departures.json'}", file=sys.stderr)
    return result


# --------------------------------------------------------------------------- L_sub sweep


def lsub_sweep(model, run_dir: str | os.PathLike, lsub_sets: Sequence[Sequence[int]], *,
               alpha: Optional[float] = None, beta: Optional[float] = None,
               batch_size: int = 8, out_dir: str | os.PathLike | None = None,
               data_dir: str | os.PathLike | None = None, quiet: bool = False,
               lenses: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Re-score every kept candidate of a run with each probe set and report, per set, the
    predictive statistics of D(x) and the accuracy of DEGS reranking
    (argmax ``alpha·log p + beta·D``, log p as recorded at generation).

    lenses: name -> lens to read the layers with (None: the logit lens; a
    ``train.tuned_lens.TunedLens``); every probe set is scored under each, one row per
    (lens, set). Default: the logit lens only.

    alpha/beta default to the run's own (degs_rerank runs), else degs_rerank's defaults. Also reports the
    likelihood-only (Best-of-N) and depth-only choices and the oracle (any candidate
    correct) for reference. Writes ``lsub_sweep.json`` into ``out_dir`` (default the run).
    """
    from degs_jax.eval import load_benchmark, prompts, results  # when called (module docstring)

    run, records = load_run(run_dir)
    cfg_run = run["config"]
    if not records or not all("candidates" in r for r in records):
        raise ValueError(f"{run_dir}: the L_sub sweep needs kept candidates "
                         "(`degs eval --keep-candidates`)")
    if cfg_run["model"]["name"] != model.name or cfg_run["model"]["num_layers"] != model.lm.num_layers:
        raise ValueError(f"the run used model {cfg_run['model']['name']!r}; --model gave {model.name!r}")
    recorded = method_from_record(cfg_run, Path(run_dir) / "run.json")
    rerank = recorded if isinstance(recorded, DegsRerank) else DegsRerank()  # else the defaults
    alpha = float(rerank.alpha if alpha is None else alpha)
    beta = float(rerank.beta if beta is None else beta)
    tau = float(recorded.tau)
    problems = {p.id: p for p in load_benchmark(cfg_run["benchmark"], data_dir=data_dir)}
    prompt_ids, completions, owner = [], [], []
    for r in records:
        ids = prompts.problem_prompt_ids(problems[r["id"]], model.tokenizer, cfg_run["chat"])
        for c in r["candidates"]:
            prompt_ids.append(ids)
            completions.append(results.candidate_tokens(c))
            owner.append(r["id"])
    eos = model.eos_ids
    base = pool_from_records([{**r, "candidates": [{**c, "D": 0.0} for c in r["candidates"]]}
                              for r in records])
    groups = base.groups()
    reference = {
        "best_of_n": rerank_accuracy(groups, 1.0, 0.0),
        "oracle": float(np.mean([bool(np.any(g["correct"])) for g in groups])),
        "mean_candidate": float(base.correct.mean()),
    }
    rows = []
    lenses = {"logit": None} if lenses is None else dict(lenses)
    for (lens_name, tuned), lsub in ((item, lsub) for item in lenses.items() for lsub in lsub_sets):
        lens = LensConfig(lsub=tuple(lsub), tau=tau).validate_for(model.lm.num_layers)
        # Compile outside the timing (first batch once); the timed pass is warm.
        lm, params = with_tuned_lens(model.lm, model.params, tuned)
        score_sequences(lm, params, prompt_ids[:batch_size], completions[:batch_size],
                        lens, eos, batch_size=batch_size)
        t0 = time.perf_counter()
        scored = score_sequences(lm, params, prompt_ids, completions, lens, eos,
                                 batch_size=batch_size)
        seconds = time.perf_counter() - t0
        d = np.array([s["depth"] for s in scored])
        stats = predictive_validity(base, scores=d, n_resamples=0)
        rows.append({
            "lens": lens_name, "lsub": list(lsub), "K": len(lsub),
            "probe_forward_equivalents_per_token": len(lsub) / model.lm.num_layers,
            "seconds": seconds, "demeaned_auc": stats["demeaned_auc"],
            "auc": stats["auc"], "spearman_rho": stats["spearman_rho"], "gap": stats["gap"],
            "pairwise_accuracy": stats["pairwise"]["accuracy"],
            "degs_rerank_accuracy": rerank_accuracy(base.groups(d), alpha, beta),
            "depth_only_accuracy": rerank_accuracy(base.groups(d), 0.0, 1.0),
            "mean_D": float(d.mean()),
        })
    result = {"run": cfg_run, "alpha": alpha, "beta": beta, "tau": tau,
              "n_candidates": len(completions), "n_problems": len(records),
              "reference": reference, "rows": rows}
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    results.write_json(out / "lsub_sweep.json", result)
    if not quiet:
        print(format_lsub_table(result))
        print(f"wrote {out / 'lsub_sweep.json'}", file=sys.stderr)
    return result


def format_lsub_table(result: Mapping[str, Any]) -> str:
    """The sweep as a plain-text table (one row per probe set)."""
    ref = result["reference"]
    lines = [
        f"L_sub sweep: {result['n_candidates']} candidates of {result['n_problems']} problems; "
        f"DEGS rerank = argmax {result['alpha']:g}·log p + {result['beta']:g}·D, tau {result['tau']:g}",
        f"reference: Best-of-N (log p) {_fmt(ref['best_of_n'])}, oracle {_fmt(ref['oracle'])}, "
        f"mean candidate {_fmt(ref['mean_candidate'])}",
        f"{'lens':<6} {'L_sub':<28} {'K':>3} {'K/L':>6} {'dm AUC':>6} {'AUC':>6} {'pairwise':>8} {'rho':>7} "
        f"{'DEGS rerank':>11} {'depth-only':>10} {'mean D':>7} {'seconds':>8}",
    ]
    for r in result["rows"]:
        lsub = "{" + ",".join(map(str, r["lsub"])) + "}"
        if len(lsub) > 28:
            lsub = "{" + f"{r['lsub'][0]},...,{r['lsub'][-1]}" + "}"
        lines.append(
            f"{r.get('lens', 'logit'):<6} {lsub:<28} {r['K']:>3} {r['probe_forward_equivalents_per_token']:>6.3f} "
            f"{_fmt(r['demeaned_auc']):>6} {_fmt(r['auc']):>6} {_fmt(r['pairwise_accuracy']):>8} "
            f"{_fmt(r['spearman_rho']):>7} "
            f"{_fmt(r['degs_rerank_accuracy']):>11} {_fmt(r['depth_only_accuracy']):>10} "
            f"{r['mean_D']:>7.4f} {r['seconds']:>8.1f}")
    lines.append("(dm AUC: problem-demeaned AUC; seconds: re-scoring every candidate, after "
                 "compiling on the first batch; other sequence-length buckets may still compile)")
    return "\n".join(lines)
