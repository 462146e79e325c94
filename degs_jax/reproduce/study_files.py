"""A study directory's stored files, read for the report (no model, no benchmark data).

:func:`load_study` reads a `degs reproduce` directory (:mod:`degs_jax.reproduce.study`),
or a compact copy of one, into a :class:`Study`: study.json, every decoder run (its
run.json, the method value it records and its per-problem records) and every
predictive-validity pool with its layer pass. :func:`status_table` says what ran from
them: per job its target and finished problems, per invocation the device, time and why
it stopped, and the re-gradings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from degs_jax.eval.benchmarks import BENCHMARKS
from degs_jax.eval.results import read_run_file
from degs_jax.methods import BestOfN, method_from_record
from degs_jax.reproduce.study import (
    LAYERS_FILE,
    LAYERS_META,
    STUDY_FILE,
    read_jsonl,
    read_records,
    read_study_file,
    study_rows,
)


@dataclass
class Study:
    """The files of a study directory: study.json (`meta`), the runs and the pools."""

    directory: Path
    meta: dict  # study.json
    runs: dict[tuple[str, str], dict] = field(default_factory=dict)  # (benchmark, method)
    pools: dict[str, dict] = field(default_factory=dict)  # benchmark

    @property
    def num_layers(self) -> int:
        return int(self.meta["model"]["num_layers"])

    @property
    def benchmarks(self) -> list[str]:
        """The benchmarks with a decoder run, in :data:`BENCHMARKS` order."""
        present = {b for b, _ in self.runs}
        return [b for b in BENCHMARKS if b in present]

    def latest(self, key: str) -> dict:
        """``key`` (a per-directory or per-benchmark mapping) merged over the invocations,
        later ones winning."""
        merged: dict = {}
        for inv in self.meta["invocations"]:
            merged.update(inv.get(key, {}))
        return merged


def _run(directory: Path) -> Optional[dict]:
    """A run's run.json (`run`), the method value it records (`decoder`) and its records."""
    if not (directory / "run.json").exists():
        return None
    run = read_run_file(directory / "run.json")
    return {"run": run, "decoder": method_from_record(run["config"], directory / "run.json"),
            "records": sorted(read_records(directory), key=lambda r: r["index"])}


def load_study(directory) -> Study:
    """Read a `degs reproduce` directory (or an exported copy)."""
    directory = Path(directory)
    if not (directory / STUDY_FILE).exists():
        raise FileNotFoundError(f"{directory} is not a `degs reproduce` directory (no {STUDY_FILE})")
    study = Study(directory, read_study_file(directory / STUDY_FILE))
    for run_dir in sorted((directory / "runs").glob("*/*")):
        data = _run(run_dir)
        if data is not None:
            study.runs[(run_dir.parent.name, run_dir.name)] = data
    for pool_dir in sorted((directory / "pool").glob("*")):
        data = _run(pool_dir)
        if data is None:
            continue
        if (pool_dir / LAYERS_META).exists():
            data["layers_meta"] = json.loads((pool_dir / LAYERS_META).read_text())
            data["layers"] = {r["id"]: r for r in read_jsonl(pool_dir / LAYERS_FILE)}
        study.pools[pool_dir.name] = data
    return study


def ordered_methods(methods) -> list[str]:
    """``methods`` without repeats, the rows with a Table 1 position first in its order
    (``StudyRow.position``), then the others sorted."""
    methods = list(dict.fromkeys(methods))
    placed = [m for m, row in study_rows().items() if m in methods and row.facts.position is not None]
    return placed + sorted(m for m in methods if m not in placed)


def pool_sampling(pool: BestOfN) -> str:
    """A Best-of-N pool's sampling settings."""
    return f"N = {pool.n}, T = {pool.temperature:g}, top-p {pool.top_p:g}"


def status_table(study: Study) -> dict:
    """What ran: per job its target and finished problems (and the layer pass's), per
    invocation when, where and how it ended, the selection weights that deviate, the
    re-gradings, and whether every job reached its target."""
    jobs = study.latest("jobs")
    rows = []
    for directory, job in sorted(jobs.items()):
        if job["kind"] == "pool":
            data = study.pools.get(job["benchmark"])
        else:
            data = study.runs.get((job["benchmark"], job["method"]))
        done = len(data["records"]) if data else 0
        row = {"directory": directory, "kind": job["kind"], "benchmark": job["benchmark"],
               "method": job["method"], "target": job["target"], "done": done,
               "deviations": job["deviations"]}
        if job["kind"] == "pool" and data is not None:
            row["layer_pass_done"] = len(data.get("layers", {}))
        rows.append(row)
    invocations = [{k: inv.get(k) for k in ("started", "finished", "status", "device", "seconds",
                                            "argv", "skipped", "refill")}
                   for inv in study.meta["invocations"]]
    complete = all(r["done"] >= r["target"] and r.get("layer_pass_done", r["done"]) >= r["done"]
                   for r in rows)
    selection_deviations = {b: s["deviations"] for b, s in study.latest("selections").items()
                            if s.get("deviations")}
    regrades = [{"when": r["when"], "rules_version": r["rules_version"],
                 "changed": len(r["changed"]), "timeouts_kept": len(r["timeouts_kept"])}
                for r in study.meta.get("regrades", [])]
    return {"model": study.meta["model"], "complete": complete, "jobs": rows,
            "selection_deviations": selection_deviations, "invocations": invocations,
            "regrades": regrades}
