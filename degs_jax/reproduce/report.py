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

This module composes the pieces, each its own module of :mod:`degs_jax.reproduce`:
``study_files`` (reading the directory; ``status``), ``accuracy`` (``table1``,
``paired``; the reranking rows Best-of-N-Entropy, DEGS reranking and depth-only are
selected there from the Best-of-N run's kept candidates with the decoders' own rules),
``pool_tables`` (``predictive_validity``, ``lsub``, ``trajectories``),
``compute_accounting`` (``compute``), ``deviations``, ``claims``, ``figures`` and
``markdown`` (report.md from the tables).

Everything except timings (:data:`TIMING_FIELDS`) is a function of the stored records, so
an interrupted and resumed study gives the same tables as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from degs_jax.eval.checkpoints import CHECKPOINT_DIR
from degs_jax.eval.results import write_json
from degs_jax.reproduce.accuracy import paired_table, table1, verdicts
from degs_jax.reproduce.claims import claims_table
from degs_jax.reproduce.compute_accounting import compute_table
from degs_jax.reproduce.decision_anatomy import decisions_table
from degs_jax.reproduce.deviations import deviations_table
from degs_jax.reproduce.figures import write_figures
from degs_jax.reproduce.markdown import render_markdown
from degs_jax.reproduce.pool_tables import lsub_table, predictive_validity_table, trajectory_table
from degs_jax.reproduce.study import LAYERS_FILE, LAYERS_META, STUDY_FILE, read_records
from degs_jax.reproduce.study_files import Study, load_study, status_table

# The tables' fields that are timings (the only ones an interrupted study may change).
TIMING_FIELDS = ("decode_s_per_problem", "grade_s_per_problem", "wall_clock_s_per_problem",
                 "decode_s_per_1k_generated_tokens", "layer_pass_s_per_candidate",
                 "wall_clock_overhead_per_generated_token")


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
            "trajectories": trajectory_table(study), "compute": compute, "decisions": decisions_table(study),
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


def export_study(study_dir, dest) -> dict[str, Any]:
    """A compact copy of a study for committing, and its report.

    Keeps study.json, every run.json / summary.json, the per-problem records (chosen
    completions as stored: GPQA only as hashes) with each kept candidate's scores and
    verdict but without its tokens, the layer-pass files, and the checkpoints of chains
    still in flight (`degs_jax.eval.checkpoints`: a study exported mid-run continues from
    the copy, `degs reproduce --out DEST`); then writes the report into ``dest``. The
    copy renders the same tables (they never read tokens).
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
        if (run_dir / CHECKPOINT_DIR).is_dir() and any((run_dir / CHECKPOINT_DIR).iterdir()):
            shutil.copytree(run_dir / CHECKPOINT_DIR, target / CHECKPOINT_DIR)
        with open(target / "results.jsonl", "w", encoding="utf-8") as f:
            for r in read_records(run_dir):
                if "candidates" in r:
                    r = {**r, "candidates": [{k: v for k, v in c.items()
                                              if k not in ("tokens", "tokens_packed")}
                                             for c in r["candidates"]]}
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return write_report(dest)
