"""Accuracy tables of the report: Table 1 and the paired comparisons.

- :func:`table1`: accuracy with a 95% Wilson interval per row and benchmark;
- :func:`paired_table`: paired comparisons (:data:`PAIRS`) on the problems both rows
  answered: accuracy difference with Newcombe's 95% paired score interval, the exact
  McNemar test and its Holm adjustment over the table's comparisons; the sign test over
  benchmarks of beta = 5 vs beta = 0; the common random numbers of each beta pair, with
  how many final completions are identical (:func:`common_random_numbers`).

The statistics are :mod:`degs_jax.stats`'s. The reranking rows Best-of-N-Entropy, DEGS
reranking and depth-only are selected here from the Best-of-N run's kept candidates
with the decoders' own rules (first candidate on ties, :func:`select_candidate`): argmin
of the mean final-layer entropy; argmax of ``alpha·log p + beta·D`` (depth-only:
alpha = 0), with the weights the study recorded.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Mapping, Sequence

import numpy as np

from degs_jax.reproduce import paper
from degs_jax.reproduce.study import SELECTED_FROM_POOL
from degs_jax.reproduce.study_files import Study, ordered_methods
from degs_jax.stats import compare_paired, holm, sign_test, wilson_interval

# (treatment, baseline, question): paired comparisons reported when both rows exist.
PAIRS = (
    ("degs_mcmc", "power_mcmc", "depth term in MCMC (beta = 5 vs beta = 0)"),
    ("degs_smc", "power_smc", "depth term in SMC (beta = 5 vs beta = 0)"),
    ("degs_rerank", "best_of_n", "depth term in reranking"),
    ("best_of_n_entropy", "best_of_n", "final-layer entropy vs likelihood reranking"),
    ("degs_rerank", "depth_only", "likelihood term in reranking"),
    ("degs_mcmc", "degs_rerank", "compounding over the chain vs one selection"),
    ("power_mcmc", "greedy", "power sampling vs greedy"),
    ("degs_mcmc", "greedy", "DEGS-MCMC vs greedy"),
)
# The beta = 5 vs beta = 0 pairs: a sign test over benchmarks, common random numbers.
BETA_PAIRS = (("degs_mcmc", "power_mcmc"), ("degs_smc", "power_smc"))


def select_candidate(method: str, candidates: Sequence[Mapping[str, Any]],
                     weights: Mapping[str, float]) -> int:
    """Index of the candidate a pool selection picks (first on ties, as the decoders)."""
    if method == "best_of_n_entropy":
        return int(np.argmin([c["final_entropy"] for c in candidates]))
    if any(c.get("D") is None for c in candidates):
        raise ValueError(f"{method} needs D(x) of every candidate; the Best-of-N pool was not probed")
    scores = [weights["alpha"] * c["log_p"] + weights["beta"] * c["D"] for c in candidates]
    return int(np.argmax(scores))


def verdicts(study: Study) -> dict[tuple[str, str], dict[int, bool]]:
    """Per (benchmark, row): problem index -> correct, for decoder runs and the pool
    selections the study recorded."""
    out: dict[tuple[str, str], dict[int, bool]] = {}
    for (b, m), data in study.runs.items():
        out[(b, m)] = {r["index"]: bool(r["correct"]) for r in data["records"]}
    selections = study.latest("selections")
    for b, sel in selections.items():
        pool = study.runs.get((b, "best_of_n"))
        if pool is None:
            continue
        for method, weights in sel["rows"].items():
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
    for m in ordered_methods(m for _, m in verdict):
        cells = {b: _accuracy_cell(verdict[(b, m)]) for b in benchmarks if (b, m) in verdict}
        source = ("selected from the best_of_n run's candidates" if m in SELECTED_FROM_POOL
                  else "decoder run")
        rows.append({"method": m, "label": paper.METHOD_LABELS.get(m, m), "source": source,
                     "cells": cells})
    return {"benchmarks": benchmarks, "rows": rows}


def paired_table(study: Study, verdict) -> dict:
    """Every pair of :data:`PAIRS` on every benchmark where both rows answered common
    problems: Newcombe's interval, the exact McNemar p and its Holm adjustment over
    the comparisons of the table; the sign test over benchmarks of each beta pair; the
    common random numbers of each beta pair."""
    comparisons = []
    for treat, base, question in PAIRS:
        for b in study.benchmarks:
            if (b, treat) not in verdict or (b, base) not in verdict:
                continue
            common = sorted(set(verdict[(b, treat)]) & set(verdict[(b, base)]))
            if not common:
                continue
            c = compare_paired([verdict[(b, base)][i] for i in common],
                               [verdict[(b, treat)][i] for i in common])
            comparisons.append({"treatment": treat, "baseline": base, "question": question,
                                "benchmark": b, **asdict(c)})
    for c, adjusted in zip(comparisons, holm([c["p_value"] for c in comparisons])):
        c["p_holm"] = adjusted
    # Holm's family: the comparisons with a p-value (stats.holm leaves NaN ones out)
    family = sum(not math.isnan(c["p_value"]) for c in comparisons)
    beta = []
    for treat, base in BETA_PAIRS:
        diffs = {c["benchmark"]: c["difference"] for c in comparisons
                 if c["treatment"] == treat and c["baseline"] == base}
        if diffs:
            beta.append({"treatment": treat, "baseline": base, "differences": diffs,
                         **sign_test(list(diffs.values()), alternative="greater")})
    m = len(comparisons)
    crn = common_random_numbers(study)
    return {"comparisons": comparisons, "comparisons_made": m, "holm_family": family,
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
    for treat, base in BETA_PAIRS:
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
    """The statement of each kind of beta pair present in ``crn``, in BETA_PAIRS order."""
    present = {(c["treatment"], c["baseline"]) for c in crn}
    return [CRN_STATEMENTS[pair] for pair in BETA_PAIRS if pair in present]


# What the common random numbers of a beta pair imply, per pair of BETA_PAIRS.
CRN_STATEMENTS = {
    ("degs_mcmc", "power_mcmc"): (
        "Common random numbers (MCMC): the two chains of a beta pair draw problem i with the "
        "same key, fold_in(key(seed), i), and within a chain the same counter-based streams "
        "for the extensions, cut indices, regenerations and accept uniforms (docs/design.md "
        "§4); they differ only by the beta·ΔD term of the acceptance ratio. Until that term "
        "flips an accept decision the two chains hold the same tokens (up to floating-point "
        "differences between the two compiled programs); after it, they sample different "
        "continuations. The paired difference therefore has a smaller variance than with "
        "independent keys, and a discordant problem is one the depth term changed (with the "
        "sampling that followed), not one where the keys differed."),
    ("degs_smc", "power_smc"): (
        "Common random numbers (SMC): the two runs of a beta pair draw problem i with the same "
        "key, fold_in(key(seed), i), and the same counter-based streams for each particle's "
        "tokens (per particle and position), the systematic uniform of each resampling check "
        "and the final draw of the returned particle (degs_jax/smc.py); they differ only by "
        "the beta·D terms of the particles' incremental weights. Until those terms change "
        "whether a check resamples or which ancestors it copies, the two runs hold the same "
        "particles; the final draw reads the final weights, which the depth term also "
        "changes, so a problem can return another particle of the same set. A discordant "
        "problem is therefore one the depth term changed through the weights, not one where "
        "the keys differed."),
}
