"""Accuracy tables of the report: Table 1 and the paired comparisons.

- :func:`table1`: accuracy with a 95% Wilson interval per row and benchmark;
- :func:`paired_table`: paired comparisons (:func:`paired_comparisons`, the ones the rows
  state) on the problems both rows answered: accuracy difference with Newcombe's 95%
  paired score interval, the exact McNemar test and its Holm adjustment over the table's
  comparisons; each comparison pooled over the benchmarks it was made on
  (:func:`pooled_comparisons`); the sign test over benchmarks of beta = 5 vs beta = 0; the common random
  numbers of each beta pair (:func:`beta_pairs`), with how many final completions are
  identical (:func:`common_random_numbers`).

The statistics are :mod:`degs_jax.stats`'s. The rows selected from another method's kept
candidates (Best-of-N-Entropy, DEGS reranking and depth-only, from the Best-of-N run's)
are selected here with their rows' rules (``StudyRow.select``, the decoders' own, first
candidate on ties, :func:`select_candidate`): argmin of the mean final-layer entropy;
argmax of ``alpha·log p + beta·D`` (depth-only: alpha = 0), with the weights the study
recorded.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Mapping, Sequence

from degs_jax.reproduce.study import study_row_of, study_rows
from degs_jax.reproduce.study_files import Study, ordered_methods
from degs_jax.stats import compare_paired, holm, sign_test, wilson_interval


def paired_comparisons() -> list[tuple[str, str, str]]:
    """(treatment, baseline, question) of every comparison a row states
    (``StudyRow.comparisons``), in the order of their ranks (ties: the rows' order, then
    as stated); the report makes those whose two rows ran."""
    stated = [(c.rank, treatment, c.baseline, c.question) for treatment, row in study_rows().items()
              for c in row.facts.comparisons]
    return [(t, b, q) for _, t, b, q in sorted(stated, key=lambda c: c[0])]


def beta_pairs() -> list[tuple[str, str]]:
    """(treatment, its depth baseline) of every row with one (``StudyRow.depth_baseline``:
    beta = 5 vs beta = 0 with the same keys), in the rows' order: a sign test over
    benchmarks, the common random numbers, the probe overhead."""
    return [(name, row.facts.depth_baseline) for name, row in study_rows().items()
            if row.facts.depth_baseline]


def select_candidate(method: str, candidates: Sequence[Mapping[str, Any]],
                     weights: Mapping[str, float]) -> int:
    """Index of the candidate the pool selection ``method`` picks: its row's rule
    (``StudyRow.select``, first on ties, as the decoders) with the recorded weights."""
    select = study_row_of(method).facts.select
    if select is None:
        raise ValueError(f"{method} is not selected from a pool (its study row has no select rule)")
    try:
        return select(candidates, weights)
    except ValueError as e:
        raise ValueError(f"{method}: {e}") from None


def verdicts(study: Study) -> dict[tuple[str, str], dict[int, bool]]:
    """Per (benchmark, row): problem index -> correct, for decoder runs and the pool
    selections the study recorded."""
    out: dict[tuple[str, str], dict[int, bool]] = {}
    for (b, m), data in study.runs.items():
        out[(b, m)] = {r["index"]: bool(r["correct"]) for r in data["records"]}
    selections = study.latest("selections")
    for b, sel in selections.items():
        for method, weights in sel["rows"].items():
            pool = study.runs.get((b, study_row_of(method).facts.selected_from))
            if pool is None:
                continue
            out[(b, method)] = {
                r["index"]: bool(r["candidates"][select_candidate(method, r["candidates"],
                                                                  weights)]["correct"])
                for r in pool["records"] if r.get("candidates")}
    return out


def _accuracy_cell(v: Mapping[int, bool]) -> dict[str, Any]:
    n, k = len(v), int(sum(v.values()))
    low, high = wilson_interval(k, n)
    return {"n": n, "correct": k, "accuracy": k / n if n else math.nan, "ci_low": low,
            "ci_high": high}


def table1(study: Study, verdict: Mapping[tuple[str, str], Mapping[int, bool]]) -> dict:
    benchmarks = study.benchmarks
    rows = []
    known = study_rows()
    for m in ordered_methods(m for _, m in verdict):
        cells = {b: _accuracy_cell(verdict[(b, m)]) for b in benchmarks if (b, m) in verdict}
        selected_from = known[m].facts.selected_from if m in known else ""
        source = f"selected from the {selected_from} run's candidates" if selected_from else "decoder run"
        rows.append({"method": m, "label": known[m].label if m in known else m, "source": source,
                     "cells": cells})
    return {"benchmarks": benchmarks, "rows": rows}


def _common_pairs(verdict, benchmark: str, treatment: str, baseline: str) -> list[tuple[bool, bool]]:
    """(baseline correct, treatment correct) on each problem of ``benchmark`` both answered."""
    base, treat = verdict[(benchmark, baseline)], verdict[(benchmark, treatment)]
    return [(base[i], treat[i]) for i in sorted(set(base) & set(treat))]


def pooled_comparisons(verdict, comparisons: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Each comparison made on two or more benchmarks, pooled over them: every common
    problem of every benchmark is one pair (so a benchmark weighs by its problems), with
    Newcombe's interval and the exact McNemar p of the pooled pairs. They restate the
    per-benchmark rows and are not in Holm's family."""
    pooled = []
    for treat, base, question in paired_comparisons():
        benchmarks = [c["benchmark"] for c in comparisons if (c["treatment"], c["baseline"]) == (treat, base)]
        if len(benchmarks) < 2:
            continue
        pairs = [pair for b in benchmarks for pair in _common_pairs(verdict, b, treat, base)]
        c = compare_paired([a for a, _ in pairs], [t for _, t in pairs])
        pooled.append({"treatment": treat, "baseline": base, "question": question,
                       "benchmarks": benchmarks, **asdict(c)})
    return pooled


def paired_table(study: Study, verdict) -> dict:
    """Every pair of :func:`paired_comparisons` on every benchmark where both rows
    answered common problems: Newcombe's interval, the exact McNemar p and its Holm
    adjustment over the comparisons of the table; the sign test over benchmarks of each
    beta pair; the common random numbers of each beta pair."""
    comparisons = []
    for treat, base, question in paired_comparisons():
        for b in study.benchmarks:
            if (b, treat) not in verdict or (b, base) not in verdict:
                continue
            pairs = _common_pairs(verdict, b, treat, base)
            if not pairs:
                continue
            c = compare_paired([a for a, _ in pairs], [t for _, t in pairs])
            comparisons.append({"treatment": treat, "baseline": base, "question": question,
                                "benchmark": b, **asdict(c)})
    for c, adjusted in zip(comparisons, holm([c["p_value"] for c in comparisons])):
        c["p_holm"] = adjusted
    # Holm's family: the comparisons with a p-value (stats.holm leaves NaN ones out)
    family = sum(not math.isnan(c["p_value"]) for c in comparisons)
    beta = []
    for treat, base in beta_pairs():
        diffs = {c["benchmark"]: c["difference"] for c in comparisons
                 if c["treatment"] == treat and c["baseline"] == base}
        if diffs:
            beta.append({"treatment": treat, "baseline": base, "differences": diffs,
                         **sign_test(list(diffs.values()), alternative="greater")})
    m = len(comparisons)
    crn = common_random_numbers(study)
    return {"comparisons": comparisons, "comparisons_made": m, "holm_family": family,
            "pooled": pooled_comparisons(verdict, comparisons),
            "beta_sign_tests": beta, "common_random_numbers": crn,
            "common_random_numbers_notes": _crn_statements(crn),
            "note": "difference = accuracy(treatment) − accuracy(baseline) on the problems both "
                    "answered; interval: 95% Newcombe (1998) paired score interval (method 10: "
                    "Wilson limits of each accuracy with the continuity-adjusted correlation of "
                    "the pairs; it keeps its width with few discordant pairs); p: exact McNemar "
                    "(two-sided binomial on the discordant pairs); Holm p: adjusted over "
                    + _holm_family(family, m) + " (one family: family-wise error 5% at Holm "
                    "p < 0.05)"}


def _holm_family(family: int, rows: int) -> str:
    """Holm's family, as the report states it: ``family`` comparisons with a p-value of the
    table's ``rows``."""
    text = f"all {family} comparison{'s' if family != 1 else ''} of this table"
    if family != rows:
        text = (f"the {family} comparison{'s' if family != 1 else ''} of this table that "
                f"have a p-value ({rows - family} without one left out)")
    return text


# Hyperparameters that do not change a chain's random draws: the depth weight and the
# lens that reads D(x) (the depth term's own settings).
_DEPTH_TERM = ("beta", "lsub", "tau")


def common_random_numbers(study: Study) -> list[dict]:
    """Per beta pair of decoder runs on one benchmark: whether both drew with the same keys
    and settings but the depth term (common random numbers), and on how many common
    problems their final completions are identical."""
    out = []
    for treat, base in beta_pairs():
        for b in study.benchmarks:
            runs = [study.runs.get((b, m)) for m in (treat, base)]
            if None in runs:
                continue
            (ct, cb) = (r["run"]["config"] for r in runs)
            keys = [(c.get("seed"), c.get("key_derivation")) for c in (ct, cb)]
            hp_t, hp_b = ct["hyperparameters"], cb["hyperparameters"]
            differ = sorted(k for k in set(hp_t) | set(hp_b)
                            if k not in _DEPTH_TERM and hp_t.get(k) != hp_b.get(k))
            text = [{r["index"]: r.get("completion", r.get("completion_sha256"))
                     for r in data["records"]} for data in runs]
            common = set(text[0]) & set(text[1])
            out.append({
                "benchmark": b, "treatment": treat, "baseline": base,
                "same_keys": keys[0] == keys[1] and keys[0][0] is not None,
                "seed": keys[0][0], "key_derivation": keys[0][1],
                "other_settings_differ": differ,
                "problems": len(common),
                "identical_completions": sum(text[0][i] == text[1][i] for i in common)})
    return out


def _crn_statements(crn: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the common random numbers of each beta pair present in ``crn`` imply (the
    treatment row's ``StudyRow.common_random_numbers``), in :func:`beta_pairs` order."""
    present = {(c["treatment"], c["baseline"]) for c in crn}
    return [statement for pair in beta_pairs() if pair in present
            and (statement := study_row_of(pair[0]).facts.common_random_numbers)]

