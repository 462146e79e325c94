"""The report's compute accounting, per benchmark and method, from the stored records.

Per problem means of completion, generated and forward tokens, the probe charge (K/L of
a forward per probed token), forward-equivalents and their ratio to greedy's (the row
whose ``StudyRow.compute_unit`` says so), decoding and grading seconds, seconds per 1k
generated tokens and the MH acceptance (pooled over every step, and the mean of the
per-problem rates); and the probe overhead of each beta pair (DEGS over power sampling)
per generated token.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from degs_jax.method import Method
from degs_jax.reproduce.accuracy import beta_pairs
from degs_jax.reproduce.study import study_rows
from degs_jax.reproduce.study_files import Study, ordered_methods


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def pooled_acceptance(records, method: Method) -> dict[str, Any]:
    """MH acceptance pooled over every step of every chain (accepted proposals / MH steps),
    beside ``mean_acceptance`` (the mean over problems of each chain's mean over its
    blocks, which weights a short chain's blocks more). A record's ``acceptance`` holds
    each block's accepted fraction of its ``mh_steps`` steps."""
    steps = getattr(method, "mh_steps", None)
    blocks = [a for r in records for a in (r.get("acceptance") or [])]
    if not steps or not blocks:
        return {"acceptance_pooled": None, "mh_steps_total": None}
    accepted = sum(round(a * steps) for a in blocks)
    return {"acceptance_pooled": accepted / (steps * len(blocks)),
            "mh_steps_total": steps * len(blocks)}


def compute_table(study: Study) -> dict:
    """Per (benchmark, method) decoder run the per-problem means (module docstring), the
    probe overhead of each beta pair, and a note on how the columns are counted."""
    L = study.num_layers
    rows = []
    for (b, m), data in sorted(study.runs.items(), key=lambda kv: (
            kv[0][0], ordered_methods([x for _, x in study.runs]).index(kv[0][1]))):
        recs = data["records"]
        if not recs:
            continue
        gen = sum(r["generated_tokens"] for r in recs)
        rows.append({
            "benchmark": b, "method": m, "n": len(recs),
            "completion_tokens": _mean(r["n_tokens"] for r in recs),
            "ended_with_eos": _mean(float(r["ended"]) for r in recs),
            # a final answer could be read (boxed span / letter); HumanEval has none to read
            "answer_extracted": (None if b == "humaneval" else
                                 _mean(float(r.get("extracted") is not None) for r in recs)),
            "generated_tokens": _mean(r["generated_tokens"] for r in recs),
            "forward_tokens": _mean(r["forward_tokens"] for r in recs),
            "probe_charge": _mean(r["probed_token_layers"] / L for r in recs),
            "forward_equivalents": _mean(r["forward_equivalents"] for r in recs),
            "mean_acceptance": _mean(r.get("mean_acceptance") for r in recs),
            **pooled_acceptance(recs, data["decoder"]),
            "decode_s_per_problem": _mean(r["decode_s"] for r in recs),
            "grade_s_per_problem": _mean(r["grade_s"] for r in recs),
            "wall_clock_s_per_problem": _mean(r["wall_clock_s"] for r in recs),
            "decode_s_per_1k_generated_tokens": (1000 * sum(r["decode_s"] for r in recs) / gen
                                                 if gen else None),
        })
    units = {name for name, row in study_rows().items() if row.facts.compute_unit}
    unit = {r["benchmark"]: r["forward_equivalents"] for r in rows if r["method"] in units}
    for r in rows:
        g = unit.get(r["benchmark"])
        r["forward_equivalents_vs_greedy"] = r["forward_equivalents"] / g if g else None
    return {"rows": rows, "probe_overhead": _probe_overhead(rows),
            "note": "per problem means; a batch's decoding time is shared equally by its problems "
                    "and includes compiling each new batch shape; forward-equivalents charge "
                    f"probing K/L of a forward per probed token (L = {L}); acceptance: accepted "
                    "proposals / MH steps pooled over every chain, in parentheses the mean of "
                    "the per-problem acceptance rates"}


def _probe_overhead(rows) -> list[dict]:
    """Per beta pair and benchmark where both ran: the treatment's relative increase over
    the baseline in forward-equivalents and in decoding time, both per generated token."""
    overhead = []
    by = {(r["benchmark"], r["method"]): r for r in rows}
    for treat, base in beta_pairs():
        for b in sorted({r["benchmark"] for r in rows}):
            if (b, treat) in by and (b, base) in by:
                t, s = by[(b, treat)], by[(b, base)]
                per_tok = [x["decode_s_per_1k_generated_tokens"] for x in (t, s)]
                overhead.append({
                    "benchmark": b, "treatment": treat, "baseline": base,
                    "forward_equivalents_per_generated_token": (
                        (t["forward_equivalents"] / t["generated_tokens"])
                        / (s["forward_equivalents"] / s["generated_tokens"]) - 1),
                    "wall_clock_overhead_per_generated_token": (
                        per_tok[0] / per_tok[1] - 1 if all(per_tok) else None)})
    return overhead
