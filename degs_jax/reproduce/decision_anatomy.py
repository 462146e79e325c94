"""The report's anatomy of the MH decisions, per MCMC run whose records carry them
(`mh_decisions`, `degs_jax.decisions`): how many decisions, how many were accepted or null
moves, how many the depth term decided at the run's beta (the power-MCMC decision from the
same u would have gone the other way) and in how many chains, the typical sizes of
|log r_0| and |beta·ΔD| of the non-null decisions, and the beta at which the records
expect half the chains to depart from the chain they visited — the study's prediction
for the moving-beta run, stated before it is made. Runs without decision records (made
before they were recorded) have no row.
"""

from __future__ import annotations

from typing import Any

from degs_jax.decisions import decision_anatomy, decision_table, first_decided, has_decision_records
from degs_jax.reproduce.study_files import Study, ordered_methods


def decisions_table(study: Study) -> dict[str, Any]:
    """One row per (benchmark, method) run with decision records, in the report's order."""
    rows = []
    for (benchmark, method), data in sorted(study.runs.items(), key=lambda kv: (
            kv[0][0], ordered_methods([m for _, m in study.runs]).index(kv[0][1]))):
        records = data["records"]
        if not records or not has_decision_records(records):
            continue
        table = decision_table(records)
        probed = bool(getattr(data["decoder"], "probed", False))
        beta = float(data["decoder"].beta) if probed else None
        anatomy = decision_anatomy(table, beta)
        rows.append({
            "benchmark": benchmark, "method": method, "beta": beta, "problems": anatomy["problems"],
            "decisions": anatomy["decisions"], "accepted": anatomy["acceptance_pooled"],
            "null_moves": anatomy["null_move_fraction"], "depth_decided": anatomy["depth_decided"],
            "chains_depth_decided": len(first_decided(table)) if probed else None,
            "median_abs_log_ratio_power": anatomy["abs_log_ratio_power_non_null"]["median"],
            "median_abs_beta_depth_delta": (anatomy["abs_beta_depth_delta_non_null"]["median"]
                                            if probed else None),
            "near_zero_fraction": anatomy["near_zero_fraction_non_null"],
            "near_zero_nats": anatomy["near_zero_nats"],
            "beta_half_chains_depart": anatomy.get("beta_half_chains_depart"),
        })
    return {"rows": rows}
