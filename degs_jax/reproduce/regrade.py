"""Re-grading stored records with the current grader (`degs reproduce --regrade`).

A math verdict is a function of the problem and the answer the completion boxes last
(:mod:`degs_jax.eval.graders`), and every record keeps that answer: the chosen completion
(``completion``, whose last boxed span is re-extracted and must equal the stored
``extracted``) and each kept candidate (``extracted``; an exported study keeps candidates
without their tokens, but with their answer). So a study, or its committed export, can be
graded again without the model whenever the grading rules change, and the report rendered
from the new verdicts.

What is re-graded: every run and predictive-validity pool of MATH500, DeepMind500 and
GSM8K, chosen completions and kept candidates. HumanEval is left alone (its verdicts come
from running the program in the sandbox, not from an answer string), and so is GPQA (its
completions are stored only as hashes; its letter grading has not changed).

In place: ``results.jsonl`` is rewritten (atomically: a temporary file, then a rename)
with the new ``correct``/``grade_detail`` of each record, ``correct`` of each candidate
and ``n_candidates_correct``; ``summary.json`` is recomputed; ``run.json`` and
``study.json`` get a ``regrades`` entry (when, the rules version, package versions, and
in study.json every verdict that changed). A grading that times out keeps the stored
verdict and is listed apart (a timeout is no evidence that an answer is wrong).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from degs_jax.eval import Grader, graders
from degs_jax.eval.benchmarks import MATH_BENCHMARKS, load_benchmark
from degs_jax.eval.results import package_versions, read_run_file, write_json
from degs_jax.eval.runner import RESULTS_FILE, RUN_FILE, SUMMARY_FILE, run_summary
from degs_jax.reproduce.study import STUDY_FILE, read_records


@dataclass(frozen=True)
class VerdictChange:
    """One stored verdict that the current grader decides otherwise (or could not decide in
    time: ``timeout``, the stored verdict kept)."""

    directory: str  # the run, relative to the study (``runs/deepmind500/greedy``, ``pool/math500``)
    problem_id: str
    candidate: Optional[int]  # None: the chosen completion; else the kept candidate's position
    old: bool
    new: bool
    answer: Optional[str]
    timeout: bool = False

    def describe(self) -> str:
        what = "chosen" if self.candidate is None else f"candidate {self.candidate}"
        verdict = ("timed out, kept " + _word(self.old) if self.timeout
                   else f"{_word(self.old)} -> {_word(self.new)}")
        return f"{self.directory} {self.problem_id} {what}: {verdict}  (answer {self.answer!r})"


def _word(correct: bool) -> str:
    return "right" if correct else "wrong"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def regrade_run(run_dir, grader: Grader, *, name: Optional[str] = None,
                data_dir=None) -> Optional[list[VerdictChange]]:
    """Re-grade one ``run_eval`` directory in place (module docstring); the changed verdicts
    (timeouts included, marked), or None for a benchmark that is not re-graded. ``name``:
    how the changes name the directory (default its path)."""
    run_dir = Path(run_dir)
    run = read_run_file(run_dir / RUN_FILE)
    benchmark = run["config"]["benchmark"]
    if benchmark not in MATH_BENCHMARKS:
        return None
    name = name or str(run_dir)
    problems = {p.id: p for p in load_benchmark(benchmark, data_dir=data_dir)}
    records = read_records(run_dir)
    changes: list[VerdictChange] = []

    def grade(problem, answer: Optional[str], old: bool, candidate: Optional[int]) -> tuple[bool, str]:
        result = grader.math.grade_answer(answer, problem.answer, benchmark, problem.question)
        if result.detail == "timeout":
            changes.append(VerdictChange(name, problem.id, candidate, old, old, answer, True))
            return old, "timeout (stored verdict kept)"
        if result.correct != old:
            changes.append(VerdictChange(name, problem.id, candidate, old, result.correct, answer))
        return result.correct, result.detail

    for record in records:
        problem = problems.get(record["id"])
        if problem is None:
            raise ValueError(f"{run_dir / RESULTS_FILE}: problem {record['id']!r} is not in "
                             f"{benchmark}; was it run on other data?")
        answer = record.get("extracted")
        if "completion" in record and graders.last_boxed(record["completion"]) != answer:
            raise ValueError(f"{run_dir / RESULTS_FILE}: the stored answer of {record['id']!r} "
                             "is not the last boxed span of its completion; refusing to re-grade")
        record["correct"], record["grade_detail"] = grade(problem, answer, bool(record["correct"]),
                                                          None)
        for k, cand in enumerate(record.get("candidates") or []):
            cand["correct"], _ = grade(problem, cand.get("extracted"), bool(cand["correct"]), k)
        if "candidates" in record:
            record["n_candidates_correct"] = sum(bool(c["correct"]) for c in record["candidates"])

    _write_records(run_dir / RESULTS_FILE, records)
    write_json(run_dir / SUMMARY_FILE, run_summary(records, run))
    run.setdefault("regrades", []).append({
        "when": _now(), "rules_version": graders.RULES_VERSION, "versions": package_versions(),
        "changed": sum(not c.timeout for c in changes),
        "timeouts_kept": sum(c.timeout for c in changes)})
    write_json(run_dir / RUN_FILE, run)
    return changes


def _write_records(path: Path, records) -> None:
    """The records as the result store writes them, replacing ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def regrade_study(study_dir, *, grader: Optional[Grader] = None, data_dir=None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Re-grade every math run and pool of a `degs reproduce` directory (or its export) in
    place, ``log`` each changed verdict, and record the re-grading in study.json. Returns
    that record: ``changed`` (every change, as dicts of :class:`VerdictChange`), the
    directories re-graded and those left alone. The report is not rewritten here. A
    single `degs eval` directory (a run.json, no study.json) is re-graded alone (its
    run.json records it; there is no study.json)."""
    study_dir = Path(study_dir)
    single = not (study_dir / STUDY_FILE).exists() and (study_dir / RUN_FILE).exists()
    if not single and not (study_dir / STUDY_FILE).exists():
        raise FileNotFoundError(f"{study_dir} is neither a `degs reproduce` directory (no "
                                f"{STUDY_FILE}) nor a `degs eval` one (no {RUN_FILE})")
    own = grader is None
    grader = grader or Grader()
    regraded, skipped, changes = [], [], []
    runs = ([study_dir] if single else
            sorted(list(study_dir.glob("runs/*/*")) + list(study_dir.glob("pool/*"))))
    try:
        for run_dir in runs:
            if not (run_dir / RUN_FILE).exists():
                continue
            name = str(run_dir.relative_to(study_dir)) if not single else run_dir.name
            found = regrade_run(run_dir, grader, name=name, data_dir=data_dir)
            if found is None:
                skipped.append(name)
                continue
            regraded.append(name)
            changes += found
    finally:
        if own:
            grader.close()
    for change in changes:
        log(change.describe())
    entry = {"when": _now(), "rules_version": graders.RULES_VERSION,
             "versions": package_versions(), "regraded": regraded, "not_regraded": skipped,
             "changed": [asdict(c) for c in changes if not c.timeout],
             "timeouts_kept": [asdict(c) for c in changes if c.timeout]}
    if not single:
        study = json.loads((study_dir / STUDY_FILE).read_text())
        study.setdefault("regrades", []).append(entry)
        write_json(study_dir / STUDY_FILE, study)
    log(f"re-graded {len(regraded)} runs ({', '.join(regraded) or 'none'}); "
        f"{len(entry['changed'])} verdicts changed, {len(entry['timeouts_kept'])} timed out "
        f"(stored verdict kept); not re-graded: {', '.join(skipped) or 'none'}")
    return entry
