"""The report's analyses of the predictive-validity pool and its layer pass.

- :func:`predictive_validity_table`: per pool benchmark, :func:`degs_jax.analysis.predictive_validity`
  of D(x) (headline: the problem-demeaned AUC; intervals from the problem-level cluster
  bootstrap; accuracy in :data:`N_BUCKETS` D(x) buckets);
- :func:`lsub_table`: the L_sub ablation, every probe set of the layer pass scored on the
  pool (AUC, pairwise accuracy, DEGS-rerank and depth-only accuracy, probe cost K/L);
- :func:`trajectory_table`: mean lens entropy per layer of correct and incorrect pool
  candidates, with each group's mean collapse layer.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from degs_jax.analysis import pool_from_records, predictive_validity
from degs_jax.reproduce.study_files import Study, pool_sampling
from degs_jax.stats import rerank_accuracy

N_BUCKETS = 4


def _pool_items(pool: Mapping[str, Any]) -> list[tuple[dict, dict]]:
    """(pool record, its layer record) for the problems the layer pass has done."""
    layers = pool.get("layers", {})
    return [(r, layers[r["id"]]) for r in pool["records"] if r["id"] in layers]


def predictive_validity_table(study: Study) -> dict:
    """Per pool benchmark: its sampling and the predictive validity of the recorded D(x)."""
    out = {}
    for b, pool in study.pools.items():
        if pool["records"]:
            out[b] = {"sampling": pool_sampling(pool["decoder"]),
                      **predictive_validity(pool_from_records(pool["records"]),
                                            n_buckets=N_BUCKETS)}
    return out


def _default_set(pool: Mapping[str, Any]) -> Optional[int]:
    """Index among the layer pass's probe sets of the pool decoder's own L_sub (the grid its
    D(x) was recorded on), or None where the layer pass did not score it."""
    lsub = pool["decoder"].lsub
    sets = pool["layers_meta"]["lsub_sets"]
    return sets.index(list(lsub)) if lsub is not None and list(lsub) in sets else None


def lsub_table(study: Study) -> dict:
    """Per pool benchmark with a layer pass: each probe set's statistics and reranking
    accuracies, the pool's reference accuracies, and how far the default set's D(x)
    re-computed teacher-forced is from the D(x) recorded during generation."""
    weights = {b: sel["pool_rerank"] for b, sel in study.latest("selections").items()}
    out = {}
    for b, pool in study.pools.items():
        items = _pool_items(pool)
        if not items:
            continue
        base = pool_from_records([r for r, _ in items])
        groups = base.groups()
        w = weights.get(b, {"alpha": 4.0, "beta": 5.0})
        L = pool["layers_meta"]["num_layers"]
        rows = []
        for k, lsub in enumerate(pool["layers_meta"]["lsub_sets"]):
            d = np.array([c["D"][k] for _, lay in items for c in lay["candidates"]])
            s = predictive_validity(base, scores=d, n_buckets=N_BUCKETS, n_resamples=0)
            rows.append({
                "lsub": lsub, "K": len(lsub), "probe_cost_per_token": len(lsub) / L,
                "demeaned_auc": s["demeaned_auc"], "auc": s["auc"],
                "spearman_rho": s["spearman_rho"], "gap": s["gap"],
                "pairwise_accuracy": s["pairwise"]["accuracy"],
                "degs_rerank_accuracy": rerank_accuracy(base.groups(d), w["alpha"], w["beta"]),
                "depth_only_accuracy": rerank_accuracy(base.groups(d), 0.0, 1.0),
                "mean_D": float(d.mean())})
        consistency = None
        k = _default_set(pool)
        if k is not None:
            rescored = np.array([c["D"][k] for _, lay in items for c in lay["candidates"]])
            delta = np.abs(rescored - base.D)
            consistency = {"lsub": pool["layers_meta"]["lsub_sets"][k],
                           "mean_abs_difference": float(delta.mean()),
                           "max_abs_difference": float(delta.max())}
        seconds = [lay["seconds"] for _, lay in items]
        out[b] = {
            "weights": w, "n_problems": len(items), "n_candidates": int(len(base.D)),
            "reference": {"best_of_n": rerank_accuracy(groups, 1.0, 0.0),
                          "oracle": float(np.mean([bool(np.any(g["correct"])) for g in groups])),
                          "mean_candidate": float(base.correct.mean())},
            "rows": rows,
            "recorded_vs_rescored_D": consistency,
            "layer_pass_s_per_candidate": float(sum(seconds) / len(base.D)) if len(base.D) else None,
        }
    return out


def trajectory_table(study: Study) -> dict:
    """Per pool benchmark, for correct and incorrect candidates: the token-weighted mean lens
    entropy at every layer and the mean collapse layer, both on the probe grid that D(x)
    uses (the pool's L_sub: a token's collapse layer is a grid layer, or L) and on all L
    layers where the layer pass scored the all-layers set (the collapse layer itself)."""
    out = {}
    for b, pool in study.pools.items():
        items = _pool_items(pool)
        if not items:
            continue
        sets = pool["layers_meta"]["lsub_sets"]
        L = pool["layers_meta"]["num_layers"]
        k = _default_set(pool)
        k_all = sets.index(list(range(1, L + 1))) if list(range(1, L + 1)) in sets else None
        groups = {}
        for name, want in (("correct", True), ("incorrect", False)):
            ent, n_tok, depth = [], [], []
            for r, lay in items:
                for c, s in zip(r["candidates"], lay["candidates"]):
                    if bool(c["correct"]) == want and s["n_scored"] > 0:
                        ent.append(s["entropy"])
                        n_tok.append(s["n_scored"])
                        depth.append([s["D"][j] if j is not None else math.nan for j in (k, k_all)])
            if not ent:
                continue
            ent, n_tok, depth = np.array(ent, float), np.array(n_tok, float), np.array(depth)
            # token-weighted: every scored token of the group counts once
            layer = [float((depth[:, j] * L * n_tok).sum() / n_tok.sum()) if index is not None
                     else None for j, index in enumerate((k, k_all))]
            groups[name] = {
                "candidates": int(len(n_tok)), "tokens": int(n_tok.sum()),
                "mean_entropy": list(map(float, (ent * n_tok[:, None]).sum(0) / n_tok.sum())),
                "mean_collapse_layer": layer[0], "mean_collapse_layer_all_layers": layer[1]}
        out[b] = {"layers": pool["layers_meta"]["layers"], "tau": pool["layers_meta"]["tau"],
                  "num_layers": L, "probe_grid": sets[k] if k is not None else None,
                  "groups": groups}
    return out
