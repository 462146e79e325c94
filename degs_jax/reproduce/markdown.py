"""report.md from the report's tables: one section per table, the paper's numbers beside.

:func:`render_markdown` joins the sections in the report's order: what ran, the
deviations from the paper, Table 1, the paired comparisons, predictive validity, the
L_sub ablation, the layer-entropy trajectories, compute accounting and the paper's
claims. Each section is a list of lines built from its table alone (and the figure
paths, relative to the report); the text is a function of the tables, so equal tables
render byte-identical reports.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

from degs_jax.analysis import format_interval
from degs_jax.reproduce import paper
from degs_jax.reproduce.study import row_label


def format_number(x, digits: int = 3, kind: str = "f") -> str:
    """``x`` with ``digits`` in format ``kind`` (``f`` or ``g``); ``n/a`` for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}{kind}}"


def format_percent_change(x) -> str:
    """A relative change (0.088) as a signed percent (``+8.8%``); ``n/a`` for None."""
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _cell(c: Optional[Mapping]) -> str:
    if not c or not c["n"]:
        return "not run"
    return f"{c['accuracy']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}] ({c['correct']}/{c['n']})"


def _collapse_text(trajectory: Mapping, group: Mapping) -> str:
    """A group's mean collapse layer, naming the grid it is on: D(x)'s probe grid (a token
    collapses at a grid layer or at L), then all layers where the layer pass has them."""
    grid = trajectory["probe_grid"]
    text = (f"{format_number(group['mean_collapse_layer'], 2)} of {trajectory['num_layers']} on the "
            "probe grid {" + ",".join(map(str, grid)) + "}" if grid is not None
            else f"n/a of {trajectory['num_layers']} (the pool's probe grid was not scored)")
    if group.get("mean_collapse_layer_all_layers") is not None:
        text += f", {format_number(group['mean_collapse_layer_all_layers'], 2)} on all layers"
    return text


def render_markdown(tables: Mapping[str, Any], figures: Mapping[str, str]) -> str:
    """report.md from the tables (figure paths relative to the report)."""
    md = (_status_section(tables["status"])
          + _deviations_section(tables["deviations"])
          + _table1_section(tables["table1"], figures)
          + _paired_section(tables["paired"], figures)
          + _validity_section(tables["predictive_validity"], figures)
          + _lsub_section(tables["lsub"])
          + _trajectory_section(tables["trajectories"], figures)
          + _compute_section(tables["compute"])
          + _decisions_section(tables["decisions"])
          + _claims_section(tables["claims"]))
    return "\n".join(md)


def _status_section(status: Mapping[str, Any]) -> list[str]:
    """The title, the invocations, re-gradings and partial results, and what ran."""
    model = status["model"]["name"]
    md = [f"# Reproduction study: {model}", ""]
    last = status["invocations"][-1]
    md += [f"Model `{model}` ({status['model']['num_layers']} layers). "
           f"{len(status['invocations'])} invocation(s); the last on {last['device']}, started "
           f"{last['started']}, status: **{last['status']}**."]
    for r in status["regrades"]:
        changed = (f"{r['changed']} stored verdicts changed (chosen completions and kept "
                   "candidates; study.json lists them)" if r["changed"]
                   else "no stored verdict changed")
        md += ["", f"Verdicts re-graded on {r['when']} with grading rules version "
                   f"{r['rules_version']} (`degs reproduce --regrade`): {changed}"
                   + (f"; {r['timeouts_kept']} timed out and were kept" if r["timeouts_kept"]
                      else "") + "."]
    if not status["complete"]:
        md += ["", "**Partial results**: not every job reached its target (see *What ran*); "
                   "every number below is over the problems that finished, and paired "
                   "comparisons use the problems both methods finished."
                   + (" Under refill a problem is stored when its chain ends, so the problems "
                      "a partial job finished lean towards the shorter chains: they are not a "
                      "random sample of the benchmark." if any(i.get("refill") for i in status["invocations"])
                      else "")]
    md += ["", "## What ran", ""]
    md.append(_md_table(
        ["job", "target", "done"],
        [[r["directory"], r["target"],
          f"{r['done']}" + (f" (layer pass {r['layer_pass_done']})" if "layer_pass_done" in r else "")]
         for r in status["jobs"]]))
    skipped = last.get("skipped") or []
    if skipped:
        md.append("\nLeft for a later invocation (time budget): " + "; ".join(skipped))
    return md


def _deviations_section(deviations: Sequence[Mapping[str, Any]]) -> list[str]:
    md = ["", "## Deviations from the paper", "",
          "Every setting this study could change, from its recorded configuration "
          "(`study.json`, each run's `run.json`) against the paper's; deviations first.", ""]
    rows = sorted(deviations, key=lambda r: not r["deviates"])
    md.append(_md_table(
        ["setting", "paper", "this study", "deviates", "measured effect"],
        [[r["setting"], r["paper"], r["used"], "**yes**" if r["deviates"] else "no",
          r["effect"] or ""] for r in rows]))
    return md


def _table1_section(table1: Mapping[str, Any], figures: Mapping[str, str]) -> list[str]:
    """Table 1 with intervals, its figure, and the paper's Table 1."""
    md = ["", "## Table 1: accuracy", "",
          "Accuracy [95% Wilson interval] (correct/n). Best-of-N-Entropy, DEGS reranking and "
          "depth-only are selections from the Best-of-N run's candidates (same pool)."]
    md.append("")
    benchmarks = table1["benchmarks"]
    md.append(_md_table(["method"] + [paper.BENCHMARK_LABELS.get(b, b) for b in benchmarks],
                        [[r["label"]] + [_cell(r["cells"].get(b)) for b in benchmarks]
                         for r in table1["rows"]]))
    if "table1" in figures:
        md += ["", f"![Table 1]({figures['table1']})"]
    md += ["", "The paper's Table 1 (7B models; no GSM8K column) for reference:", ""]
    bs = ("math500", "deepmind500", "humaneval", "gpqa_diamond")
    rows = []
    for model_name, table in paper.TABLE1.items():
        for m, cells in table.items():
            rows.append([model_name, row_label(m)] + [f"{cells[b]:.3f}" for b in bs])
    md.append(_md_table(["model", "method"] + [paper.BENCHMARK_LABELS[b] for b in bs], rows))
    return md


def _paired_section(paired: Mapping[str, Any], figures: Mapping[str, str]) -> list[str]:
    """The paired comparisons, the beta pairs' sign tests and common random numbers, and
    the figure."""
    md = ["", "## Paired comparisons", "", paired["note"] + ".", ""]
    if not paired["comparisons"]:
        md.append("No pair of methods ran on common problems.")
        return md
    md.append(f"**{paired['comparisons_made']} comparisons** in this table.")
    md.append("")
    md.append(_md_table(
        ["treatment − baseline", "benchmark", "n", "baseline", "treatment",
         "difference [95% Newcombe CI]", "discordant: only baseline / only treatment",
         "exact McNemar p", "Holm p"],
        [[f"{c['treatment']} − {c['baseline']}", c["benchmark"], c["n"],
          f"{c['accuracy_a']:.3f}", f"{c['accuracy_b']:.3f}",
          f"{c['difference']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]",
          f"{c['only_a']} / {c['only_b']}", f"{c['p_value']:.3g}", f"{c['p_holm']:.3g}"]
         for c in paired["comparisons"]]))
    if paired.get("pooled"):
        md += ["", "Pooled over benchmarks: every common problem of each benchmark is one pair, so a "
               "benchmark weighs by its problems; these restate the rows above and are not in Holm's family.",
               "", _md_table(
                   ["treatment − baseline", "benchmarks", "n", "baseline", "treatment",
                    "difference [95% Newcombe CI]", "discordant: only baseline / only treatment",
                    "exact McNemar p"],
                   [[f"{c['treatment']} − {c['baseline']}", ", ".join(c["benchmarks"]), c["n"],
                     f"{c['accuracy_a']:.3f}", f"{c['accuracy_b']:.3f}",
                     f"{c['difference']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]",
                     f"{c['only_a']} / {c['only_b']}", f"{c['p_value']:.3g}"] for c in paired["pooled"]])]
    for s in paired["beta_sign_tests"]:
        md.append(f"\nSign test over benchmarks, {s['treatment']} − {s['baseline']} > 0: "
                  f"{s['positive']} positive, {s['negative']} negative, {s['zero']} zero "
                  f"(a zero has no sign and is left out); one-sided p = "
                  f"{format_number(s['p_value'], 3, 'g')} over the non-zero cells (paper: 12 of 12 "
                  "cells positive, p = 2^-12).")
    md += _crn_lines(paired)
    if "paired" in figures:
        md += ["", f"![paired differences]({figures['paired']})"]
    return md


def _crn_lines(paired: Mapping[str, Any]) -> list[str]:
    """What the common random numbers of the beta pairs imply, and their table."""
    crn = paired["common_random_numbers"]
    if not crn:
        return []
    md = []
    for statement in paired["common_random_numbers_notes"]:
        md += ["", statement]
    md.append("")
    md.append(_md_table(
        ["treatment − baseline", "benchmark", "same keys (seed)", "other settings that differ",
         "identical final completions"],
        [[f"{c['treatment']} − {c['baseline']}", c["benchmark"],
          f"{'yes' if c['same_keys'] else '**no**'} ({c['seed']})",
          ", ".join(c["other_settings_differ"]) or "none",
          f"{c['identical_completions']} of {c['problems']}"] for c in crn]))
    return md


def _validity_section(validity: Mapping[str, Any], figures: Mapping[str, str]) -> list[str]:
    """Predictive validity per pool, the bootstrap and its footnote, the figures, the paper's."""
    md = ["", "## Predictive validity of D(x) (the predictive-validity pool)", ""]
    if validity:
        md.append(_md_table(
            ["benchmark", "pool", "candidates (problems)", "candidate accuracy",
             "problem-demeaned AUC [95% CI]", "AUC [95% CI]", "Spearman rho", "mean gap",
             "pairwise acc. (pairs)", "accuracy by D quartile"],
            [[b, s["sampling"], f"{s['n']} ({s['n_problems']})", format_number(s["accuracy"]),
              f"**{format_interval(s, 'demeaned_auc')}**", format_interval(s, "auc"),
              format_number(s["spearman_rho"]), format_number(s["gap"], 4),
              f"{format_number(s['pairwise']['accuracy'])} ({s['pairwise']['pairs']})",
              " / ".join(f"{format_number(x['accuracy'], 2)}" for x in s["buckets"])]
             for b, s in validity.items()]))
        boot = next(iter(validity.values()))["cluster_bootstrap"]
        md += ["", "Headline: the problem-demeaned AUC (D minus the mean D of its problem, then "
                   "the AUC over all candidates: candidates ranked against their own problem). "
                   "Intervals: percentile cluster bootstrap over problems (each resampled with "
                   f"all of its candidates; {boot['resamples']:,} resamples, seed {boot['seed']}). "
                   "Footnote: the candidate-level Mann-Whitney test of the gap treats the "
                   "candidates of one problem as independent, so its p-value is too small: "
                   + "; ".join(f"{b} p = {format_number(s['mann_whitney_p'], 3, 'g')}"
                               for b, s in validity.items())
                   + "."]
        for b in validity:
            if f"predictive_validity_{b}" in figures:
                md += ["", f"![predictive validity {b}]({figures[f'predictive_validity_{b}']})"]
    else:
        md.append("Not run.")
    v = paper.PREDICTIVE_VALIDITY
    md += ["", f"Paper ({v['model']} / MATH500, {v['candidates']} candidates): AUC {v['auc']}, "
               f"Spearman {v['spearman_rho']}, pairwise {v['pairwise']}, {v['gap']}; {v['buckets']}."]
    return md


def _lsub_section(lsub: Mapping[str, Any]) -> list[str]:
    """The L_sub ablation per pool, then the paper's table."""
    md = ["", "## L_sub ablation (on the pool)", ""]
    if lsub:
        for b, table in lsub.items():
            md += _lsub_pool_lines(b, table)
    else:
        md.append("Not run.")
    md += ["The paper's table (Qwen2.5-Math-7B MATH500 / GPQA, DeepSeek-Math-7B DeepMind500; "
           "accuracy of DEGS with each L_sub, overhead = measured wall-clock):", ""]
    md.append(_md_table(["L_sub", "K", "overhead", "MATH500", "GPQA", "DeepMind500"],
                        [[r["lsub"] if r["lsub"] == "all" else "{" + ",".join(map(str, r["lsub"])) + "}",
                          r["K"], f"{r['overhead']:.2f}×", r["math500"], r["gpqa_diamond"],
                          r["deepmind500"]] for r in paper.LSUB_TABLE]))
    return md


def _lsub_pool_lines(benchmark: str, table: Mapping[str, Any]) -> list[str]:
    """One pool's L_sub ablation: its reference accuracies, a row per probe set, and the
    recorded D(x) against the re-computed one."""
    ref = table["reference"]
    md = [f"**{benchmark}**: {table['n_candidates']} candidates of {table['n_problems']} problems; "
          f"DEGS rerank = argmax {table['weights']['alpha']:g}·log p + {table['weights']['beta']:g}·D. "
          f"Reference on this pool: Best-of-N (log p) {format_number(ref['best_of_n'])}, oracle "
          f"{format_number(ref['oracle'])}, mean candidate {format_number(ref['mean_candidate'])}.", ""]
    md.append(_md_table(
        ["L_sub", "K", "probe cost K/L", "demeaned AUC", "AUC", "Spearman", "pairwise",
         "DEGS rerank acc.", "depth-only acc.", "mean D"],
        [["{" + ",".join(map(str, r["lsub"])) + "}", r["K"], f"{r['probe_cost_per_token']:.3f}",
          format_number(r["demeaned_auc"]), format_number(r["auc"]), format_number(r["spearman_rho"]),
          format_number(r["pairwise_accuracy"]), format_number(r["degs_rerank_accuracy"]),
          format_number(r["depth_only_accuracy"]), format_number(r["mean_D"], 4)]
         for r in table["rows"]]))
    c = table["recorded_vs_rescored_D"]
    if c:
        md.append(f"\nD(x) of the default set re-computed teacher-forced vs recorded during "
                  f"generation: mean |difference| {c['mean_abs_difference']:.2e}, max "
                  f"{c['max_abs_difference']:.2e} (collapse depths flip where an entropy "
                  "sits within rounding of tau).")
    md.append("")
    return md


def _trajectory_section(trajectories: Mapping[str, Any], figures: Mapping[str, str]) -> list[str]:
    md = ["", "## Layer-entropy trajectories (Figure 1 style)", ""]
    if not trajectories:
        md.append("Not run.")
        return md
    for b, t in trajectories.items():
        md.append(f"**{b}** (tau = {t['tau']:g}): " + "; ".join(
            f"{name}: {g['candidates']} candidates, {g['tokens']} tokens, mean collapse layer "
            + _collapse_text(t, g) for name, g in t["groups"].items()))
        if f"trajectory_{b}" in figures:
            md += ["", f"![trajectory {b}]({figures[f'trajectory_{b}']})", ""]
    return md


def _compute_section(compute: Mapping[str, Any]) -> list[str]:
    """Compute accounting per run, the probe overhead, and the paper's numbers."""
    md = ["", "## Compute accounting", "", compute["note"] + ".", ""]
    rows = compute["rows"]
    if rows:
        md.append(_md_table(
            ["benchmark", "method", "n", "completion tok", "EOS", "answer read", "generated tok",
             "forward tok", "probe charge", "fwd-eq", "× greedy",
             "acceptance pooled (per-problem mean)", "decode s", "grade s", "s / 1k gen. tok"],
            [[r["benchmark"], r["method"], r["n"], format_number(r["completion_tokens"], 1),
              format_number(r["ended_with_eos"], 2), format_number(r["answer_extracted"], 2),
              format_number(r["generated_tokens"], 0), format_number(r["forward_tokens"], 0),
              format_number(r["probe_charge"], 0), format_number(r["forward_equivalents"], 0),
              format_number(r["forward_equivalents_vs_greedy"], 1),
              format_number(r["acceptance_pooled"], 3) + (
                  "" if r["mean_acceptance"] is None
                  else f" ({format_number(r['mean_acceptance'], 3)})"),
              format_number(r["decode_s_per_problem"], 2), format_number(r["grade_s_per_problem"], 2),
              format_number(r["decode_s_per_1k_generated_tokens"], 3)] for r in rows]))
    for o in compute["probe_overhead"]:
        md.append(f"\nProbe overhead {o['treatment']} over {o['baseline']} on {o['benchmark']}: "
                  f"{format_percent_change(o['wall_clock_overhead_per_generated_token'])} decoding "
                  "time per generated token, "
                  f"{format_percent_change(o['forward_equivalents_per_generated_token'])} "
                  "forward-equivalents per generated token.")
    w = paper.WALL_CLOCK_S
    md += ["", f"Paper ({w['model']} / MATH500, {w['device']}), seconds per problem: "
               + ", ".join(f"{row_label(m)} {s}" for m, s in w["seconds"].items())
               + f"; probe overhead +{100 * paper.PROBE_OVERHEAD['degs_mcmc_vs_power_mcmc']:.1f}% "
                 f"(DEGS-MCMC), +{100 * paper.PROBE_OVERHEAD['degs_rerank_vs_best_of_n']:.1f}% "
                 "(DEGS reranking); acceptance "
               + ", ".join(f"{k} {100 * v:.0f}%" for k, v in paper.ACCEPTANCE.items()) + "."]
    return md


def _decisions_section(decisions: Mapping[str, Any]) -> list[str]:
    """The MH decisions of every run that recorded them (none: no section)."""
    rows = decisions["rows"]
    if not rows:
        return []
    near = rows[0]["near_zero_nats"]
    md = ["", "## Where the depth term acts: the MH decisions", "",
          "Every recorded MH decision of each MCMC run: accepted and null-move fractions; "
          "decided by β·ΔD (log u between power sampling's log r_0 and log r_0 + β·ΔD: the "
          "power-MCMC decision from the same u goes the other way, and the chain departs from "
          "the power chain of its keys there); medians over the non-null decisions of "
          f"|log r_0| and |β·ΔD|, and the fraction with |log r_0| < {near:g} nats; the β at "
          "which the records expect half the chains to depart from the chain they visited "
          "(first order, on `degs_jax.decisions.BETA_GRID`: the prediction for a run at "
          "another β; `degs analyze` gives the whole curve).", ""]
    md.append(_md_table(
        ["benchmark", "method", "β", "problems", "decisions", "accepted", "null moves",
         "decided by β·ΔD (chains)", "median \\|log r_0\\|", "median \\|β·ΔD\\|",
         f"\\|log r_0\\| < {near:g}",
         "β: half the chains depart"],
        [[r["benchmark"], r["method"], format_number(r["beta"], 3, "g"), r["problems"], f"{r['decisions']:,}",
          format_number(r["accepted"], 3), format_number(r["null_moves"], 3),
          "n/a" if r["chains_depth_decided"] is None else f"{r['depth_decided']} ({r['chains_depth_decided']})",
          format_number(r["median_abs_log_ratio_power"], 3, "g"),
          format_number(r["median_abs_beta_depth_delta"], 3, "g"), format_number(r["near_zero_fraction"], 3),
          format_number(r["beta_half_chains_depart"], 3, "g")] for r in rows]))
    return md


def _claims_section(claims: Sequence[Mapping[str, Any]]) -> list[str]:
    md = ["", "## The paper's claims at this scale", ""]
    md.append(_md_table(["claim", "paper", "measured here", "verdict"],
                        [[c["claim"], c["paper"], c["measured"], c["verdict"]] for c in claims]))
    md.append("")
    return md
