"""Benchmark loaders: MATH500, DeepMind500, GSM8K, HumanEval, GPQA Diamond.

Every loader returns a list of :class:`Problem` in file order. The files ship inside the
package (``degs_jax/data``: sources, licences and checksums in its ``README.md``) and are
checked against the sha256 values below before use, wherever they are read from.

GPQA is distributed as a password-protected zip and its authors ask that the
questions never appear in plain text online. The zip is decrypted in memory
only; nothing here writes question or option text anywhere, and the text fields
of :class:`Problem` are left out of its ``repr`` so that logging a problem does
not leak them.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib.resources
import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

BENCHMARKS = ("math500", "deepmind500", "gsm8k", "humaneval", "gpqa_diamond")
MATH_BENCHMARKS = frozenset({"math500", "deepmind500", "gsm8k"})
_ALIASES = {"math": "math500", "deepmind": "deepmind500", "gpqa": "gpqa_diamond",
            "gsm8k_test": "gsm8k"}

DATA_ENV_VAR = "DEGS_JAX_DATA"

FILES = {
    "math500": "math500.jsonl",
    "deepmind500": "deepmind500.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "humaneval": "humaneval.jsonl.gz",
    "gpqa_diamond": "gpqa_dataset.zip",
}

# sha256 of each file as stored on disk (the table of degs_jax/data/README.md).
SHA256 = {
    "math500.jsonl": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
    "deepmind500.jsonl": "001c294aac90fd70920df791d1a63634c1a5032e54a708ffa137dec40888e63b",
    "gsm8k_test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "humaneval.jsonl.gz": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    "gpqa_dataset.zip": "461ae7329f15a3e35f8184d2dac24b990f34fdf12f366ca4062d8e6638cd08dc",
}

GPQA_PASSWORD = b"deserted-untie-orchid"  # published in the idavidrein/gpqa README
GPQA_DIAMOND_MEMBER = "dataset/gpqa_diamond.csv"
GPQA_DIAMOND_SHA256 = "41d1213cd7a4998605a26c2798500652572007161b3a92817ba46b35befcd305"
# Changing this reshuffles every GPQA question (and changes results): don't.
GPQA_SHUFFLE_SEED = 0
LETTERS = ("A", "B", "C", "D")

# datasets-hub equivalents for source="hub" (DeepMind500 is a local sample only).
HUB_DATASETS = {
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "humaneval": ("openai/openai_humaneval", None, "test"),
    "gpqa_diamond": ("Idavidrein/gpqa", "gpqa_diamond", "train"),
}


class ChecksumError(ValueError):
    """A benchmark file does not match the sha256 in the data README."""


@dataclass(frozen=True)
class Problem:
    """One benchmark problem, uniform across benchmarks.

    Attributes:
        id: stable identifier (MATH ``unique_id``, ``gsm8k/<row>``,
            ``deepmind500/<row>``, HumanEval ``task_id``, GPQA ``Record ID``).
        benchmark: one of :data:`BENCHMARKS`.
        question: the text the prompt template shows (HumanEval: the function
            signature and docstring to complete).
        answer: the gold answer (math: answer string; GPQA: letter after
            shuffling; HumanEval: the canonical solution body).
        choices: GPQA options in presented order (A, B, C, D); empty otherwise.
        metadata: benchmark-specific fields (HumanEval ``entry_point`` and
            ``test``; GPQA ``permutation``; MATH ``subject`` and ``level``...).
    """

    id: str
    benchmark: str
    question: str = field(repr=False)
    answer: str = field(repr=False)
    choices: tuple[str, ...] = field(default=(), repr=False)
    metadata: Mapping[str, Any] = field(default_factory=dict, repr=False, hash=False)


def packaged_data_dir() -> Path:
    """The benchmark files installed with the package (``degs_jax/data``)."""
    return Path(str(importlib.resources.files("degs_jax") / "data"))


def default_data_dir() -> Path:
    """``$DEGS_JAX_DATA`` if set, else the files installed with the package."""
    env = os.environ.get(DATA_ENV_VAR)
    return Path(env) if env else packaged_data_dir()


def canonical_name(name: str) -> str:
    """Resolve aliases (``gpqa`` -> ``gpqa_diamond``...); error on unknown names."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {BENCHMARKS}")
    return key


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def check_sha256(data: bytes, expected: str, what: str, verify: bool = True) -> None:
    """Raise :class:`ChecksumError` if ``verify`` and sha256(``data``) != ``expected``."""
    if not verify:
        return
    actual = sha256_bytes(data)
    if actual != expected:
        raise ChecksumError(
            f"{what}: sha256 {actual} is not that of the published file ({expected}); "
            "the file is damaged or another version (in Python, verify_checksum=False "
            "loads it anyway; results will not be comparable)")


def load_benchmark(
    name: str,
    path: str | os.PathLike | None = None,
    *,
    data_dir: str | os.PathLike | None = None,
    verify_checksum: bool = True,
    source: str = "local",
    limit: int | None = None,
) -> list[Problem]:
    """Load a benchmark as a list of :class:`Problem`.

    Args:
        name: one of :data:`BENCHMARKS` (aliases ``gpqa``, ``math``, ``deepmind``).
        path: the data file itself (any location); default
            ``<data_dir>/<FILES[name]>``.
        data_dir: directory holding the files; default :func:`default_data_dir`.
        verify_checksum: compare the file's sha256 with the data README and
            raise :class:`ChecksumError` on mismatch. The expected hash is that
            of the published file whatever ``path`` is, so a modified copy needs
            ``verify_checksum=False``.
        source: ``"local"`` or ``"hub"``. ``"hub"`` downloads the same benchmark
            with the ``datasets`` package (imported lazily, not a dependency:
            ``pip install datasets``; GPQA is gated on the hub and needs a
            logged-in token). Hub rows go through the same converters, so the
            problems, ids and GPQA permutations are the same.
        limit: keep only the first ``limit`` problems.
    """
    key = canonical_name(name)
    if source == "hub":
        problems = _load_from_hub(key)
    elif source == "local":
        if path is None:
            base = Path(data_dir) if data_dir is not None else default_data_dir()
            path = base / FILES[key]
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"benchmark file {path} not found (the data directory is --data-dir / "
                f"data_dir=..., else ${DATA_ENV_VAR}, else the package's own "
                f"{packaged_data_dir()})")
        data = path.read_bytes()
        check_sha256(data, SHA256[FILES[key]], str(path), verify_checksum)
        problems = _LOCAL_LOADERS[key](data, verify_checksum)
    else:
        raise ValueError(f"source must be 'local' or 'hub', not {source!r}")
    return problems if limit is None else problems[:limit]


def gsm8k_gold(solution: str) -> str:
    """The final answer of a GSM8K solution: text after ``####``, commas removed."""
    if "####" not in solution:
        raise ValueError("GSM8K solution without a '####' final-answer line")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def gpqa_permutation(record_id: str, seed: int = GPQA_SHUFFLE_SEED) -> tuple[int, ...]:
    """The stored shuffle of one GPQA question's options.

    ``perm[i]`` is the index, in ``(correct, incorrect 1, incorrect 2,
    incorrect 3)``, of the option shown at position ``i`` (letter ``"ABCD"[i]``).
    It depends only on sha256 of ``seed`` and the record id, so it is the same
    in every process, Python version and platform (no ``random``, no ``hash``).
    """
    def key(i: int) -> bytes:
        return hashlib.sha256(f"gpqa-shuffle:{seed}:{record_id}:{i}".encode()).digest()
    return tuple(sorted(range(4), key=key))


def _jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def _math500(rows: Iterable[Mapping]) -> list[Problem]:
    return [
        Problem(id=r["unique_id"], benchmark="math500", question=r["problem"],
                answer=r["answer"],
                metadata={"subject": r["subject"], "level": r["level"]})
        for r in rows
    ]


def _deepmind500(rows: Iterable[Mapping]) -> list[Problem]:
    return [
        Problem(id=f"deepmind500/{i}", benchmark="deepmind500", question=r["question"],
                answer=r["answer"], metadata={"module": r["module"]})
        for i, r in enumerate(rows)
    ]


def _gsm8k(rows: Iterable[Mapping]) -> list[Problem]:
    return [
        Problem(id=f"gsm8k/{i}", benchmark="gsm8k", question=r["question"],
                answer=gsm8k_gold(r["answer"]))
        for i, r in enumerate(rows)
    ]


def _humaneval(rows: Iterable[Mapping]) -> list[Problem]:
    return [
        Problem(id=r["task_id"], benchmark="humaneval", question=r["prompt"],
                answer=r["canonical_solution"],
                metadata={"entry_point": r["entry_point"], "test": r["test"]})
        for r in rows
    ]


def _gpqa(rows: Iterable[Mapping]) -> list[Problem]:
    problems = []
    for r in rows:
        record_id = r["Record ID"]
        original = tuple(r[c].strip() for c in ("Correct Answer", "Incorrect Answer 1",
                                                "Incorrect Answer 2", "Incorrect Answer 3"))
        perm = gpqa_permutation(record_id)
        problems.append(Problem(
            id=record_id, benchmark="gpqa_diamond", question=r["Question"].strip(),
            answer=LETTERS[perm.index(0)],
            choices=tuple(original[j] for j in perm),
            metadata={
                "permutation": perm,
                "subdomain": r["Subdomain"],
                "domain": r["High-level domain"],
            },
        ))
    return problems


def _local_jsonl(convert: Callable[[list[dict]], list[Problem]]):
    return lambda data, verify: convert(_jsonl(data))


def _local_humaneval(data: bytes, verify: bool) -> list[Problem]:
    return _humaneval(_jsonl(gzip.decompress(data)))


def _local_gpqa(data: bytes, verify: bool) -> list[Problem]:
    # Decrypted bytes live only in this frame: never written to disk.
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        csv_bytes = archive.read(GPQA_DIAMOND_MEMBER, pwd=GPQA_PASSWORD)
    check_sha256(csv_bytes, GPQA_DIAMOND_SHA256, GPQA_DIAMOND_MEMBER, verify)
    return _gpqa(csv.DictReader(io.StringIO(csv_bytes.decode("utf-8"))))


_LOCAL_LOADERS = {
    "math500": _local_jsonl(_math500),
    "deepmind500": _local_jsonl(_deepmind500),
    "gsm8k": _local_jsonl(_gsm8k),
    "humaneval": _local_humaneval,
    "gpqa_diamond": _local_gpqa,
}

_HUB_CONVERTERS = {
    "math500": _math500,
    "gsm8k": _gsm8k,
    "humaneval": _humaneval,
    "gpqa_diamond": _gpqa,
}


def _load_from_hub(key: str) -> list[Problem]:
    """Download ``key`` with ``datasets`` (optional dependency, imported lazily)."""
    if key not in HUB_DATASETS:
        raise ValueError(f"{key} has no hub copy; it is a fixed local sample (see the data README)")
    try:
        import datasets  # an optional dependency (the `hub` extra), needed here only
    except ImportError as err:
        raise ImportError("source='hub' needs the 'datasets' package: pip install datasets") from err
    repo, config, split = HUB_DATASETS[key]
    return _HUB_CONVERTERS[key](datasets.load_dataset(repo, config, split=split))
