"""The study's report, computed from its files alone (no model, no benchmark data).

Reads a `degs reproduce` directory (:mod:`degs_jax.reproduce.study`) and writes

- ``tables/*.json``: ``status`` (what ran, per job: target and finished problems, per
  invocation: device, time, why it stopped), ``deviations`` (every setting where the
  study could differ from the paper's, from its recorded configuration, with the effect
  the records measure), ``table1`` (accuracy with a 95% Wilson interval per row and
  benchmark), ``paired`` (paired comparisons on the problems both rows answered:
  accuracy difference with Newcombe's 95% paired score interval, the exact McNemar test
  and its Holm adjustment over the table's comparisons; the sign test over benchmarks of
  beta = 5 vs beta = 0; the common random numbers of each beta pair, with how many final
  completions are identical), ``predictive_validity`` (headline: the problem-demeaned
  AUC; intervals from the problem-level cluster bootstrap), ``lsub`` (the L_sub ablation
  on the pool), ``trajectories`` (mean lens entropy per layer of correct and incorrect
  pool candidates), ``compute`` (tokens, forward-equivalents, wall-clock and acceptance
  per problem; probe overhead) and ``claims`` (the paper's four checkable claims next to
  what this study measured); the statistics are :mod:`degs_jax.stats`'s;
- ``figures/*.png``: Table 1 with intervals, the paired differences, predictive validity
  and layer-entropy trajectories per pool benchmark;
- ``report.md``: every table, the figures, and the paper's numbers for reference.

The reranking rows Best-of-N-Entropy, DEGS reranking and depth-only are selected here
from the Best-of-N run's kept candidates with the decoders' own rules (first candidate
on ties): argmin of the mean final-layer entropy; argmax of ``alpha·log p + beta·D``
(depth-only: alpha = 0), with the weights the study recorded.

Everything except timings is a function of the stored records, so an interrupted and
resumed study gives the same tables as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from degs_jax.analysis import format_interval
from degs_jax.eval.results import write_json
from degs_jax.reproduce import paper
from degs_jax.reproduce.accuracy import paired_table, table1, verdicts
from degs_jax.reproduce.compute_accounting import compute_table
from degs_jax.reproduce.deviations import deviations_table
from degs_jax.reproduce.figures import write_figures
from degs_jax.reproduce.pool_tables import lsub_table, predictive_validity_table, trajectory_table
from degs_jax.reproduce.study import LAYERS_FILE, LAYERS_META, STUDY_FILE, read_records
from degs_jax.reproduce.study_files import Study, load_study, status_table
from degs_jax.stats import sign_test

TIMING_FIELDS = ("decode_s_per_problem", "grade_s_per_problem", "wall_clock_s_per_problem",
                 "decode_s_per_1k_generated_tokens", "layer_pass_s_per_candidate",
                 "wall_clock_overhead_per_generated_token")


# --------------------------------------------------------------------------- claims


def beta_verdict(cells: Sequence[Mapping[str, Any]], family: int) -> str:
    """The beta = 5 vs beta = 0 claim over paired comparisons: a cell counts as positive or
    negative by the sign of its difference; a zero difference (a tie) has no direction.
    ``family``: the comparisons Holm's adjustment ran over (the whole paired table)."""
    pos = sum(c["difference"] > 0 for c in cells)
    neg = sum(c["difference"] < 0 for c in cells)
    zero = len(cells) - pos - neg
    sign = sign_test([c["difference"] for c in cells], alternative="greater")
    sig = [c["benchmark"] for c in cells if c["p_holm"] < 0.05]
    if pos == len(cells):
        head = "positive in every cell, as the paper"
    elif neg == len(cells):
        head = "negative in every cell, against the paper"
    elif pos == neg == 0:
        head = "no difference in any cell"
    else:
        head = "not positive in every cell"
    return (f"{head}: {pos} positive, {neg} negative, {zero} zero of {len(cells)} "
            f"cell{'s' if len(cells) != 1 else ''}; "
            f"one-sided sign test over the {pos + neg} non-zero cell{'s' if pos + neg != 1 else ''} p = "
            f"{_f(sign['p_value'], 3, 'g')}; significant at 5% after Holm over the {family} "
            f"comparisons of the paired table: {', '.join(sig) or 'none'}")


def claims_table(paired: Mapping, validity: Mapping, compute: Mapping) -> list[dict]:
    """The paper's four checkable claims next to what this study measured."""
    out = []
    beta = [c for c in paired["comparisons"]
            if (c["treatment"], c["baseline"]) == ("degs_mcmc", "power_mcmc")]
    if beta:
        out.append({
            "claim": "beta = 5 improves on beta = 0 (DEGS-MCMC vs power sampling) in every cell",
            "paper": "12 of 12 cells positive, median +4 points; sign test p = 2^-12",
            "measured": "; ".join(f"{c['benchmark']}: {c['difference']:+.3f} [{c['ci_low']:+.3f}, "
                                  f"{c['ci_high']:+.3f}], n = {c['n']}, discordant "
                                  f"{c['only_a']} / {c['only_b']}, p = {c['p_value']:.3g} "
                                  f"(Holm {c['p_holm']:.3g})" for c in beta),
            "verdict": beta_verdict(beta, paired["holm_family"])})
    else:
        out.append({"claim": "beta = 5 improves on beta = 0", "paper": "12 of 12 cells positive",
                    "measured": "not run", "verdict": "not measured"})
    if validity:
        parts, above, below = [], 0, 0
        for b, s in validity.items():
            buckets = s["buckets"]
            parts.append(f"{b}: problem-demeaned AUC {format_interval(s, 'demeaned_auc')}, AUC "
                         f"{format_interval(s, 'auc')} (95% cluster bootstrap), rho "
                         f"{_f(s['spearman_rho'])}, gap {_f(s['gap'], 4)}, pairwise "
                         f"{_f(s['pairwise']['accuracy'])}, bucket accuracy "
                         f"{_f(buckets[0]['accuracy'])} -> {_f(buckets[-1]['accuracy'])}, "
                         f"{s['n']} candidates of {s['n_problems']} problems")
            above += bool(s["demeaned_auc_ci_low"] > 0.5)
            below += bool(s["demeaned_auc_ci_high"] < 0.5)
        out.append({"claim": "D(x) predicts correctness weakly but positively",
                    "paper": "AUC ≈ 0.6, Spearman ≈ 0.15, gap > 0 with p < 0.001, bucket "
                             "accuracy 0.17 -> 0.41 (Qwen2.5-Math-7B / MATH500, 8000 candidates)",
                    "measured": "; ".join(parts),
                    "verdict": f"problem-demeaned AUC interval above 0.5 in {above}, below 0.5 in "
                               f"{below} of {len(validity)} pools"})
    else:
        out.append({"claim": "D(x) predicts correctness", "paper": "AUC ≈ 0.6",
                    "measured": "not run", "verdict": "not measured"})
    acc = [r for r in compute["rows"] if r["method"] == "degs_mcmc" and r["acceptance_pooled"] is not None]
    out.append({
        "claim": "MH acceptance rate 57-78% at alpha 4, beta 5",
        "paper": "57% (Qwen2.5-Math-7B / MATH500), 78% (DeepSeek-Math-7B / DeepMind500)",
        "measured": "; ".join(f"{r['benchmark']}: {r['acceptance_pooled']:.3f} pooled over "
                              f"{r['mh_steps_total']:,} MH steps (mean of per-problem means "
                              f"{r['mean_acceptance']:.3f})" for r in acc) or "not run",
        "verdict": ("not measured" if not acc else
                    f"{sum(57 <= round(100 * r['acceptance_pooled']) <= 78 for r in acc)} of "
                    f"{len(acc)} benchmarks inside 57-78% (pooled, at the paper's precision of "
                    "whole percents)")})
    ov = [o for o in compute["probe_overhead"] if o["treatment"] == "degs_mcmc"]
    out.append({
        "claim": "probing adds ≈ 8.8% wall-clock to DEGS-MCMC over power sampling",
        "paper": "+8.8% per problem (Qwen2.5-Math-7B / MATH500, RTX 3090)",
        "measured": "; ".join(
            f"{o['benchmark']}: {_pct(o['wall_clock_overhead_per_generated_token'])} wall-clock per "
            f"generated token, {_pct(o['forward_equivalents_per_generated_token'])} "
            "forward-equivalents per generated token" for o in ov) or "not run",
        "verdict": "see measured (per generated token: the two chains generate different lengths)"
                   if ov else "not measured"})
    return out


def _f(x, digits: int = 3, kind: str = "f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}{kind}}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


# --------------------------------------------------------------------------- report


def build_tables(study: Study) -> dict[str, Any]:
    """Every table of the report as JSON-able dicts (see the module docstring)."""
    verdict = verdicts(study)
    t1 = table1(study, verdict)
    paired = paired_table(study, verdict)
    validity = predictive_validity_table(study)
    compute = compute_table(study)
    status = status_table(study)
    return {"status": status, "deviations": deviations_table(study, status, verdict),
            "table1": t1, "paired": paired,
            "predictive_validity": validity, "lsub": lsub_table(study),
            "trajectories": trajectory_table(study), "compute": compute,
            "claims": claims_table(paired, validity, compute)}


def write_report(study_dir, out_dir=None) -> dict[str, Any]:
    """Write ``tables/``, ``figures/`` and ``report.md`` for the study in ``study_dir``
    (into ``out_dir``, default the study directory). Returns the tables and, under
    ``"figures"``, the PNG paths and, under ``"report"``, the path of report.md."""
    study = load_study(study_dir)
    out = Path(out_dir) if out_dir is not None else study.directory
    (out / "tables").mkdir(parents=True, exist_ok=True)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    tables = build_tables(study)
    for name, table in tables.items():
        write_json(out / "tables" / f"{name}.json", table)
    figures = write_figures(study, tables, out / "figures")
    text = render_markdown(tables, {k: os.path.relpath(v, out) for k, v in figures.items()})
    (out / "report.md").write_text(text)
    return {**tables, "figures": figures, "report": str(out / "report.md")}


def _collapse_text(trajectory: Mapping, group: Mapping) -> str:
    """A group's mean collapse layer, naming the grid it is on: D(x)'s probe grid (a token
    collapses at a grid layer or at L), then all layers where the layer pass has them."""
    grid = trajectory["probe_grid"]
    text = (f"{_f(group['mean_collapse_layer'], 2)} of {trajectory['num_layers']} on the probe "
            "grid {" + ",".join(map(str, grid)) + "}" if grid is not None
            else f"n/a of {trajectory['num_layers']} (the pool's probe grid was not scored)")
    if group.get("mean_collapse_layer_all_layers") is not None:
        text += f", {_f(group['mean_collapse_layer_all_layers'], 2)} on all layers"
    return text


def _cell(c: Optional[Mapping]) -> str:
    if not c or not c["n"]:
        return "not run"
    return f"{c['accuracy']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}] ({c['correct']}/{c['n']})"


def _md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(tables: Mapping[str, Any], figures: Mapping[str, str]) -> str:
    """report.md from the tables (figure paths relative to the report)."""
    st = tables["status"]
    model = st["model"]["name"]
    md = [f"# Reproduction study: {model}", ""]
    last = st["invocations"][-1]
    md += [f"Model `{model}` ({st['model']['num_layers']} layers). "
           f"{len(st['invocations'])} invocation(s); the last on {last['device']}, started "
           f"{last['started']}, status: **{last['status']}**."]
    for r in st["regrades"]:
        changed = (f"{r['changed']} stored verdicts changed (chosen completions and kept "
                   "candidates; study.json lists them)" if r["changed"]
                   else "no stored verdict changed")
        md += ["", f"Verdicts re-graded on {r['when']} with grading rules version "
                   f"{r['rules_version']} (`degs reproduce --regrade`): {changed}"
                   + (f"; {r['timeouts_kept']} timed out and were kept" if r["timeouts_kept"]
                      else "") + "."]
    if not st["complete"]:
        md += ["", "**Partial results**: not every job reached its target (see *What ran*); "
                   "every number below is over the problems that finished, and paired "
                   "comparisons use the problems both methods finished."]
    md += ["", "## What ran", ""]
    md.append(_md_table(
        ["job", "target", "done"],
        [[r["directory"], r["target"],
          f"{r['done']}" + (f" (layer pass {r['layer_pass_done']})" if "layer_pass_done" in r else "")]
         for r in st["jobs"]]))
    skipped = last.get("skipped") or []
    if skipped:
        md.append("\nLeft for a later invocation (time budget): " + "; ".join(skipped))

    md += ["", "## Deviations from the paper", "",
           "Every setting this study could change, from its recorded configuration "
           "(`study.json`, each run's `run.json`) against the paper's; deviations first.", ""]
    dev = sorted(tables["deviations"], key=lambda r: not r["deviates"])
    md.append(_md_table(
        ["setting", "paper", "this study", "deviates", "measured effect"],
        [[r["setting"], r["paper"], r["used"], "**yes**" if r["deviates"] else "no",
          r["effect"] or ""] for r in dev]))

    t1 = tables["table1"]
    md += ["", "## Table 1: accuracy", "",
           "Accuracy [95% Wilson interval] (correct/n). Best-of-N-Entropy, DEGS reranking and "
           "depth-only are selections from the Best-of-N run's candidates (same pool)."]
    md.append("")
    md.append(_md_table(["method"] + [paper.BENCHMARK_LABELS.get(b, b) for b in t1["benchmarks"]],
                        [[r["label"]] + [_cell(r["cells"].get(b)) for b in t1["benchmarks"]]
                         for r in t1["rows"]]))
    if "table1" in figures:
        md += ["", f"![Table 1]({figures['table1']})"]
    md += ["", "The paper's Table 1 (7B models; no GSM8K column) for reference:", ""]
    bs = ("math500", "deepmind500", "humaneval", "gpqa_diamond")
    rows = []
    for model_name, table in paper.TABLE1.items():
        for m, cells in table.items():
            rows.append([model_name, paper.METHOD_LABELS[m]] + [f"{cells[b]:.3f}" for b in bs])
    md.append(_md_table(["model", "method"] + [paper.BENCHMARK_LABELS[b] for b in bs], rows))

    p = tables["paired"]
    md += ["", "## Paired comparisons", "", p["note"] + ".", ""]
    if p["comparisons"]:
        md.append(f"**{p['comparisons_made']} comparisons** in this table.")
        md.append("")
        md.append(_md_table(
            ["treatment − baseline", "benchmark", "n", "baseline", "treatment",
             "difference [95% Newcombe CI]", "discordant: only baseline / only treatment",
             "exact McNemar p", "Holm p"],
            [[f"{c['treatment']} − {c['baseline']}", c["benchmark"], c["n"],
              f"{c['accuracy_a']:.3f}", f"{c['accuracy_b']:.3f}",
              f"{c['difference']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]",
              f"{c['only_a']} / {c['only_b']}", f"{c['p_value']:.3g}", f"{c['p_holm']:.3g}"]
             for c in p["comparisons"]]))
        for s in p["beta_sign_tests"]:
            md.append(f"\nSign test over benchmarks, {s['treatment']} − {s['baseline']} > 0: "
                      f"{s['positive']} positive, {s['negative']} negative, {s['zero']} zero "
                      f"(a zero has no sign and is left out); one-sided p = "
                      f"{_f(s['p_value'], 3, 'g')} over the non-zero cells (paper: 12 of 12 "
                      "cells positive, p = 2^-12).")
        crn = p["common_random_numbers"]
        if crn:
            for statement in p["common_random_numbers_notes"]:
                md += ["", statement]
            md.append("")
            md.append(_md_table(
                ["treatment − baseline", "benchmark", "same keys (seed)", "other settings that differ",
                 "identical final completions"],
                [[f"{c['treatment']} − {c['baseline']}", c["benchmark"],
                  f"{'yes' if c['same_keys'] else '**no**'} ({c['seed']})",
                  ", ".join(c["other_settings_differ"]) or "none",
                  f"{c['identical_completions']} of {c['problems']}"] for c in crn]))
        if "paired" in figures:
            md += ["", f"![paired differences]({figures['paired']})"]
    else:
        md.append("No pair of methods ran on common problems.")

    md += ["", "## Predictive validity of D(x) (the predictive-validity pool)", ""]
    pv = tables["predictive_validity"]
    if pv:
        md.append(_md_table(
            ["benchmark", "pool", "candidates (problems)", "candidate accuracy",
             "problem-demeaned AUC [95% CI]", "AUC [95% CI]", "Spearman rho", "mean gap",
             "pairwise acc. (pairs)", "accuracy by D quartile"],
            [[b, s["sampling"], f"{s['n']} ({s['n_problems']})", _f(s["accuracy"]),
              f"**{format_interval(s, 'demeaned_auc')}**", format_interval(s, "auc"),
              _f(s["spearman_rho"]), _f(s["gap"], 4),
              f"{_f(s['pairwise']['accuracy'])} ({s['pairwise']['pairs']})",
              " / ".join(f"{_f(x['accuracy'], 2)}" for x in s["buckets"])]
             for b, s in pv.items()]))
        boot = next(iter(pv.values()))["cluster_bootstrap"]
        md += ["", "Headline: the problem-demeaned AUC (D minus the mean D of its problem, then "
                   "the AUC over all candidates: candidates ranked against their own problem). "
                   "Intervals: percentile cluster bootstrap over problems (each resampled with "
                   f"all of its candidates; {boot['resamples']:,} resamples, seed {boot['seed']}). "
                   "Footnote: the candidate-level Mann-Whitney test of the gap treats the "
                   "candidates of one problem as independent, so its p-value is too small: "
                   + "; ".join(f"{b} p = {_f(s['mann_whitney_p'], 3, 'g')}" for b, s in pv.items())
                   + "."]
        for b in pv:
            if f"predictive_validity_{b}" in figures:
                md += ["", f"![predictive validity {b}]({figures[f'predictive_validity_{b}']})"]
    else:
        md.append("Not run.")
    v = paper.PREDICTIVE_VALIDITY
    md += ["", f"Paper ({v['model']} / MATH500, {v['candidates']} candidates): AUC {v['auc']}, "
               f"Spearman {v['spearman_rho']}, pairwise {v['pairwise']}, {v['gap']}; {v['buckets']}."]

    md += ["", "## L_sub ablation (on the pool)", ""]
    ls = tables["lsub"]
    if ls:
        for b, t in ls.items():
            ref = t["reference"]
            md += [f"**{b}**: {t['n_candidates']} candidates of {t['n_problems']} problems; DEGS "
                   f"rerank = argmax {t['weights']['alpha']:g}·log p + {t['weights']['beta']:g}·D. "
                   f"Reference on this pool: Best-of-N (log p) {_f(ref['best_of_n'])}, oracle "
                   f"{_f(ref['oracle'])}, mean candidate {_f(ref['mean_candidate'])}.", ""]
            md.append(_md_table(
                ["L_sub", "K", "probe cost K/L", "demeaned AUC", "AUC", "Spearman", "pairwise",
                 "DEGS rerank acc.", "depth-only acc.", "mean D"],
                [["{" + ",".join(map(str, r["lsub"])) + "}", r["K"], f"{r['probe_cost_per_token']:.3f}",
                  _f(r["demeaned_auc"]), _f(r["auc"]), _f(r["spearman_rho"]), _f(r["pairwise_accuracy"]),
                  _f(r["degs_rerank_accuracy"]), _f(r["depth_only_accuracy"]), _f(r["mean_D"], 4)]
                 for r in t["rows"]]))
            c = t["recorded_vs_rescored_D"]
            if c:
                md.append(f"\nD(x) of the default set re-computed teacher-forced vs recorded during "
                          f"generation: mean |difference| {c['mean_abs_difference']:.2e}, max "
                          f"{c['max_abs_difference']:.2e} (collapse depths flip where an entropy "
                          "sits within rounding of tau).")
            md.append("")
    else:
        md.append("Not run.")
    md += ["The paper's table (Qwen2.5-Math-7B MATH500 / GPQA, DeepSeek-Math-7B DeepMind500; "
           "accuracy of DEGS with each L_sub, overhead = measured wall-clock):", ""]
    md.append(_md_table(["L_sub", "K", "overhead", "MATH500", "GPQA", "DeepMind500"],
                        [[r["lsub"] if r["lsub"] == "all" else "{" + ",".join(map(str, r["lsub"])) + "}",
                          r["K"], f"{r['overhead']:.2f}×", r["math500"], r["gpqa_diamond"],
                          r["deepmind500"]] for r in paper.LSUB_TABLE]))

    md += ["", "## Layer-entropy trajectories (Figure 1 style)", ""]
    tr = tables["trajectories"]
    if tr:
        for b, t in tr.items():
            md.append(f"**{b}** (tau = {t['tau']:g}): " + "; ".join(
                f"{name}: {g['candidates']} candidates, {g['tokens']} tokens, mean collapse layer "
                + _collapse_text(t, g) for name, g in t["groups"].items()))
            if f"trajectory_{b}" in figures:
                md += ["", f"![trajectory {b}]({figures[f'trajectory_{b}']})", ""]
    else:
        md.append("Not run.")

    md += ["", "## Compute accounting", "", tables["compute"]["note"] + ".", ""]
    rows = tables["compute"]["rows"]
    if rows:
        md.append(_md_table(
            ["benchmark", "method", "n", "completion tok", "EOS", "answer read", "generated tok",
             "forward tok",
             "probe charge", "fwd-eq", "× greedy", "acceptance pooled (per-problem mean)",
             "decode s", "grade s",
             "s / 1k gen. tok"],
            [[r["benchmark"], r["method"], r["n"], _f(r["completion_tokens"], 1),
              _f(r["ended_with_eos"], 2), _f(r["answer_extracted"], 2),
              _f(r["generated_tokens"], 0), _f(r["forward_tokens"], 0),
              _f(r["probe_charge"], 0), _f(r["forward_equivalents"], 0),
              _f(r["forward_equivalents_vs_greedy"], 1),
              _f(r["acceptance_pooled"], 3) + ("" if r["mean_acceptance"] is None
                                               else f" ({_f(r['mean_acceptance'], 3)})"),
              _f(r["decode_s_per_problem"], 2), _f(r["grade_s_per_problem"], 2),
              _f(r["decode_s_per_1k_generated_tokens"], 3)] for r in rows]))
    for o in tables["compute"]["probe_overhead"]:
        md.append(f"\nProbe overhead {o['treatment']} over {o['baseline']} on {o['benchmark']}: "
                  f"{_pct(o['wall_clock_overhead_per_generated_token'])} decoding time per generated "
                  f"token, {_pct(o['forward_equivalents_per_generated_token'])} forward-equivalents "
                  "per generated token.")
    w = paper.WALL_CLOCK_S
    md += ["", f"Paper ({w['model']} / MATH500, {w['device']}), seconds per problem: "
               + ", ".join(f"{paper.METHOD_LABELS[m]} {s}" for m, s in w["seconds"].items())
               + f"; probe overhead +{100 * paper.PROBE_OVERHEAD['degs_mcmc_vs_power_mcmc']:.1f}% "
                 f"(DEGS-MCMC), +{100 * paper.PROBE_OVERHEAD['degs_rerank_vs_best_of_n']:.1f}% "
                 "(DEGS reranking); acceptance "
               + ", ".join(f"{k} {100 * v:.0f}%" for k, v in paper.ACCEPTANCE.items()) + "."]

    md += ["", "## The paper's claims at this scale", ""]
    md.append(_md_table(["claim", "paper", "measured here", "verdict"],
                        [[c["claim"], c["paper"], c["measured"], c["verdict"]]
                         for c in tables["claims"]]))
    md.append("")
    return "\n".join(md)


# --------------------------------------------------------------------------- export


def export_study(study_dir, dest) -> dict[str, Any]:
    """A compact copy of a study for committing, and its report.

    Keeps study.json, every run.json / summary.json, the per-problem records (chosen
    completions as stored: GPQA only as hashes) with each kept candidate's scores and
    verdict but without its tokens, and the layer-pass files; then writes the report
    into ``dest``. The copy renders the same tables (they never read tokens).
    """
    src, dest = Path(study_dir), Path(dest)
    load_study(src)  # refuse a directory that is not a study
    if dest.exists() and any(dest.iterdir()):
        if not (dest / STUDY_FILE).exists():
            raise ValueError(f"{dest} exists and is not an exported study; refusing to overwrite it")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / STUDY_FILE, dest / STUDY_FILE)
    for run_dir in sorted(list((src / "runs").glob("*/*")) + list((src / "pool").glob("*"))):
        if not (run_dir / "run.json").exists():
            continue
        target = dest / run_dir.relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in ("run.json", "summary.json", LAYERS_META, LAYERS_FILE):
            if (run_dir / name).exists():
                shutil.copy2(run_dir / name, target / name)
        with open(target / "results.jsonl", "w", encoding="utf-8") as f:
            for r in read_records(run_dir):
                if "candidates" in r:
                    r = {**r, "candidates": [{k: v for k, v in c.items()
                                              if k not in ("tokens", "tokens_packed")}
                                             for c in r["candidates"]]}
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return write_report(dest)
