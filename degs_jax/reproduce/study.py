"""`degs reproduce`: the paper's study for one model, resumable, into one directory.

What runs (docs/design.md §5; the paper's Table 1, predictive-validity section, L_sub table,
compute accounting and Figure 1):

- **Table 1**: each decoder on each benchmark is a ``degs eval`` run
  (:func:`~degs_jax.eval.runner.run_eval`) in ``runs/<benchmark>/<method>/``. Best-of-N
  keeps and grades its whole pool; Best-of-N-Entropy, DEGS reranking and depth-only
  reranking are *selections from that same pool*: the three decoders draw identical
  pools for the same seed and pool hyperparameters (same per-problem keys, same
  sampler) and differ only in the argmax, so they cost no generation of their own
  (``tests/test_reproduce.py`` checks the selections against the decoders).
  What the study knows of a row it reads off the method class (:func:`study_rows`: its
  ``StudyRow``, ``degs_jax.method``): its label and place, the method it is selected
  from and by which rule, its comparisons and beta pair; no name is special here.
- **Predictive-validity pool** (``pool/<benchmark>/``): best_of_n with N = 16, T = 0.8,
  top-p 0.9, every candidate graded (the paper's higher-entropy regime for this
  analysis).
- **Layer pass** (``pool/<benchmark>/layers.jsonl``): one teacher-forced forward per
  pool candidate with the lens at every layer 0..L. Per candidate it stores the mean
  entropy of each layer over its scored tokens (Figure 1, correct vs incorrect) and
  D(x) under every probe set of the L_sub ablation (collapse depths are read off the
  same entropies, so one pass serves every set).
- The **report** (``report.md``, ``tables/*.json``, ``figures/*.png``;
  :mod:`degs_jax.reproduce.report`) is computed from these files alone, without the model.

Resuming: every piece is stored per problem as soon as it is done (``run_eval``'s
append-only stores; the layer pass likewise), so rerunning the command after an
interruption continues where it stopped, and an invocation may ask for more problems,
other methods or benchmarks than the one before. The configuration of each run is
checked by ``run_eval`` (a different model or hyperparameters are refused).

Order and time budget: work goes in *rounds* of ``round_size`` problems per benchmark
(default: everything in one round). In each round every job (benchmarks in the given
order; per benchmark the decoders in the given order, then the pool, then its layer
pass) finishes its share before the next round starts, so a run that stops early leaves
paired results for every method on the same problems. Each batch is ``batch_size``
consecutive problems (``problems [k·b, (k+1)·b)``), the same partition in every
invocation, so a resumed run decodes the same batches as an uninterrupted one. A job
given no batch size takes ``DEFAULT_BATCH_SIZE`` problems, or fewer where the memory
estimate of ``--batch-size auto`` (``degs_jax.batching``) says that many do not fit
(the partition then follows the smaller size; a resumed run on the same device cuts the
same batches). With a
``time_budget`` a batch starts only if its estimated time fits in what is left (the
estimate: seconds per problem measured on this job, else on a job of the same benchmark
and worst case, else on the same method elsewhere (`_job_rate_keys`), times the batch's
problems; work never measured starts while 15% of the budget is left);
the study then stops cleanly and the report says what ran.

Randomness is ``run_eval``'s: problem ``i`` uses ``fold_in(key(seed), i)``, whatever
the batch, round or invocation.

Several processes (a ``jax.distributed`` job, one process per GPU or host; the study
directory on a filesystem all of them see) run one study together: every process calls
:func:`run_study` with the same request (process 0 checks that, before anything is
written). Process 0 alone reads what is done, applies the time budget and keeps
``study.json``; it hands each step to all as one ``run_eval`` call of up to N batches,
the same batches as a single process decodes, one per process (``run_eval``'s own
multi-process protocol). With N processes a step therefore lasts about as long as one
batch, and the time budget counts a batch's time as one process measures it. The layer
pass is shared the same way: each step gives every process a group of pool problems, and
process 0 stores what they computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import jax
import numpy as np

from degs_jax.batching import AUTO, BatchDoesNotFitError, describe_batch_choice
from degs_jax.eval import Grader, results, runner, sandbox
from degs_jax.eval.benchmarks import canonical_name, load_benchmark
from degs_jax.eval.checkpoints import CheckpointStore
from degs_jax.eval.processes import (ProcessGroup, failures_published, from_process_0,
                                     gathered_on_process_0, process_group)
from degs_jax.eval.prompts import problem_prompt_ids, uses_chat_template
from degs_jax.eval.results import EVAL_RECORD_FIELDS, ResultStore, candidate_tokens, package_versions, write_json
from degs_jax.methods import (METHODS, hyperparameters_for, method_classes, method_from_record,
                              resolve_hyperparameters)
from degs_jax.lens import collapse_depth, default_lsub, sequence_depth
from degs_jax.method import Method, StudyRow, registered_methods, study_row, study_variants_of
from degs_jax.reproduce.paper import CANDIDATE_SAMPLING
from degs_jax.sampling import BestOfN, DegsRerank
from degs_jax.scoring import completion_layer_entropies

STUDY_FILE = "study.json"
LAYERS_FILE = "layers.jsonl"
LAYERS_META = "layers.json"

POOL_METHOD = BestOfN.method  # the decoder of the predictive-validity pool
POOL_RERANK = DegsRerank.method  # the selection the L_sub ablation scores on that pool
POOL_SCOPE = "pool"  # name of the predictive-validity pool in --hp / --batch-size
# The predictive-validity pool of the paper (N, T, top-p).
POOL_SETTINGS = dict(CANDIDATE_SAMPLING)
# The paper decodes HumanEval at T = 0.5 (alpha = 1/T = 2) "to retain the diversity
# program synthesis requires"; every other benchmark at the defaults (alpha 4, T 0.25).
# The low-temperature row's T = 0.5 is its own fact (`StudyRow.benchmark_settings`).
HUMANEVAL_ALPHA = 2.0
DEFAULT_BATCH_SIZE = 16
# Layer pass: lens rows (layers x positions) per forward, bounding the [rows, 8192] fp32
# blocks of the streamed lens to 1 GiB; sequence lengths are padded to a multiple of
# LENGTH_BUCKET (one compilation per bucket).
LENS_ROW_BUDGET = 1 << 15
LENGTH_BUCKET = 256
LAYER_PASS_PROBLEMS = 8  # pool problems per stored layer-pass step
# A batch of a kind never measured starts only while this fraction of the time budget is
# left (its first batch includes compiling; 15% of an 8-minute budget is 72 s).
UNMEASURED_RESERVE = 0.15


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    """A row of the study: its name, the method it is (a variant's: the method that
    states it) and what the method says of it (``StudyRow``)."""

    name: str
    method: str
    facts: StudyRow

    @property
    def label(self) -> str:
        return self.facts.label or self.name


def _rows_of(classes: Mapping[str, type[Method]]) -> dict[str, Row]:
    """The rows the method classes state, those with a Table 1 position first (in its
    order), then the others in the classes' order. TypeError for a variant named as a
    method or another row, or not selected from a method's kept candidates (a variant
    has no run of its own)."""
    rows: dict[str, Row] = {}
    for name, cls in classes.items():
        rows[name] = Row(name, name, study_row(cls))
        for variant, facts in study_variants_of(cls).items():
            if variant in classes or variant in rows:
                raise TypeError(f"{cls.__module__}.{cls.__qualname__}: the study row {variant!r} is "
                                "named as a method or another row; choose another name")
            if not facts.selected_from:
                raise TypeError(f"{cls.__module__}.{cls.__qualname__}: the study row {variant!r} is a "
                                "variant, so it must be selected from a method's kept candidates "
                                "(StudyRow(selected_from=..., select=...))")
            rows[variant] = Row(variant, name, facts)
    placed = sorted((r for r in rows.values() if r.facts.position is not None),
                    key=lambda r: r.facts.position)
    return {r.name: r for r in placed + [r for r in rows.values() if r.facts.position is None]}


def study_rows() -> dict[str, Row]:
    """Every row the study can produce, by name: Table 1's (the library's methods and
    their variants, in the order of their positions), then the methods installed
    packages or scripts add (``degs_jax.methods.method_classes``), by their
    positions where they state one, else after them."""
    return _rows_of(method_classes())


# Table 1's rows, in order: the rows of the default study. Those of the library, not
# read off the whole registry: a method an installed package adds joins a study only
# where --methods names it.
TABLE1_ORDER = tuple(name for name, row in _rows_of({m: registered_methods()[m] for m in METHODS}).items()
                     if row.facts.position is not None)


def study_row_of(name: str) -> Row:
    """The row ``name`` (ValueError naming the rows for another)."""
    rows = study_rows()
    if name not in rows:
        raise ValueError(f"unknown method {name!r}; the study has {', '.join(rows)}")
    return rows[name]


def row_label(name: str) -> str:
    """A row's label in the report's tables (the paper's, for the library's); a name that
    is no row (a method not installed here): the name."""
    row = study_rows().get(name)
    return name if row is None else row.label


def row_decoder(name: str) -> str:
    """The method whose run gives the row: the one it is selected from, else its own."""
    row = study_row_of(name)
    return row.facts.selected_from or row.method


def available_methods() -> tuple[str, ...]:
    """Every row the study can produce (:func:`study_rows`): Table 1's (the paper's
    decoders and the pool selections), then the methods installed packages add."""
    return tuple(study_rows())


def method_defaults(method: str) -> dict[str, Any]:
    """The decoder's resolved default hyperparameters (the paper's, docs/design.md §4)."""
    return dict(resolve_hyperparameters(method, {}))


# --------------------------------------------------------------------------- request


@dataclass(frozen=True)
class StudyRequest:
    """What one invocation asks for.

    benchmarks: benchmark -> problem limit (None: all), in priority order.
    methods: rows of Table 1 to produce, in priority order (decoders or pool selections).
    pool_benchmarks: benchmark -> limit for the predictive-validity pool (empty: none).
    overrides: scope -> {hyperparameter: value}; scope ``"*"`` applies to every decoder
      that takes the name (``beta`` is never applied to a beta = 0 baseline), a method
      name to that decoder, ``"pool"`` to the predictive-validity pool.
    batch_sizes: scope -> problems per decode call (``"*"``: the default).
    round_size: problems per benchmark per round (None: one round).
    lsub_sets: the probe sets of the L_sub ablation (None: the paper's, mapped to the
      model's depth by :func:`paper_lsub_sets`).
    layer_pass: run the layer pass on the pool (trajectories and the L_sub ablation).
    chat: prompts through the tokenizer's chat template (False: every prompt as raw text).
    raw_benchmarks: benchmarks whose prompts go as raw text whatever ``chat`` says (the
      paper's HumanEval is a completion of the signature and docstring), so that one study
      holds every benchmark in its own format (:meth:`chat_for`).
    """

    benchmarks: Mapping[str, Optional[int]]
    methods: tuple[str, ...]
    pool_benchmarks: Mapping[str, Optional[int]] = field(default_factory=dict)
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    batch_sizes: Mapping[str, int] = field(default_factory=dict)
    seed: int = 0
    round_size: Optional[int] = None
    lsub_sets: Optional[tuple[tuple[int, ...], ...]] = None
    layer_pass: bool = True
    chat: bool = True
    raw_benchmarks: tuple[str, ...] = ()

    def __post_init__(self):
        raw = tuple(canonical_name(b) for b in self.raw_benchmarks)
        object.__setattr__(self, "raw_benchmarks", raw)
        benchmarks = {canonical_name(b): n for b, n in self.benchmarks.items()}
        pool = {canonical_name(b): n for b, n in self.pool_benchmarks.items()}
        for b, n in list(benchmarks.items()) + list(pool.items()):
            if n is not None and (not isinstance(n, int) or n < 0):
                raise ValueError(f"the limit of {b} must be a non-negative integer, got {n!r}")
        object.__setattr__(self, "benchmarks", benchmarks)
        object.__setattr__(self, "pool_benchmarks", pool)
        outside = [b for b in raw if b not in benchmarks and b not in pool]
        if outside:  # else it would be ignored without a word
            raise ValueError(f"--raw-prompts {', '.join(outside)}: not a benchmark of this study "
                             f"({', '.join([*benchmarks, *pool]) or 'none'})")
        rows = available_methods()
        unknown = [m for m in self.methods if m not in rows]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; the study has "
                             f"{', '.join(rows)}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods repeated in {', '.join(self.methods)}")
        for scope, size in self.batch_sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"batch size of {scope} must be a positive integer, got {size!r}")
        if self.round_size is not None and self.round_size < 1:
            raise ValueError(f"round_size must be positive, got {self.round_size}")
        scopes = set(rows) | {"*", POOL_SCOPE}
        for scope in set(self.overrides) | set(self.batch_sizes):
            if scope not in scopes:
                raise ValueError(f"unknown scope {scope!r} in --hp/--batch-size: use a method "
                                 f"({', '.join(rows)}), 'pool' or no prefix")
        decoders = {study_row_of(m).method for m in self.methods}
        decoders |= {row_decoder(m) for m in self.methods}  # the selections' sources
        if self.pool_benchmarks:
            decoders.add(POOL_METHOD)
        for name in self.overrides.get("*", {}):  # else it would be ignored without a word
            if not any(name in method_defaults(d) for d in decoders):
                raise ValueError(f"--hp {name}: no decoder of this study takes a hyperparameter "
                                 f"of that name ({', '.join(sorted(decoders)) or 'none'})")
        for method in self.methods:  # fail on bad names before any model is loaded
            for benchmark in self.benchmarks or {"math500": None}:
                job_hyperparameters(method, benchmark, self.overrides)
        for benchmark in self.pool_benchmarks:
            pool_hyperparameters(benchmark, self.overrides)

    def chat_for(self, benchmark: str) -> bool:
        """Whether ``benchmark``'s prompts go through the chat template."""
        return self.chat and canonical_name(benchmark) not in self.raw_benchmarks

    def batch_size(self, scope: str) -> int:
        return self.batch_sizes.get(scope, self.batch_sizes.get("*", DEFAULT_BATCH_SIZE))

    def gives_batch_size(self, scope: str) -> bool:
        """Whether the request sets ``scope``'s batch size (itself or through "*")."""
        return scope in self.batch_sizes or "*" in self.batch_sizes

    def as_json(self) -> dict[str, Any]:
        return {"benchmarks": dict(self.benchmarks), "methods": list(self.methods),
                "pool_benchmarks": dict(self.pool_benchmarks),
                "overrides": {k: dict(v) for k, v in self.overrides.items()},
                "batch_sizes": dict(self.batch_sizes), "seed": self.seed,
                "round_size": self.round_size,
                "lsub_sets": None if self.lsub_sets is None else [list(s) for s in self.lsub_sets],
                "layer_pass": self.layer_pass, "chat": self.chat,
                "raw_benchmarks": list(self.raw_benchmarks)}


def _scoped(overrides: Mapping[str, Mapping[str, Any]], method: str, defaults: Mapping,
            scope: Optional[str] = None) -> dict[str, Any]:
    hp = {}
    for name, value in overrides.get("*", {}).items():
        if name in defaults and not (name == "beta" and defaults["beta"] == 0):
            hp[name] = value
    hp.update(overrides.get(scope or method, {}))
    return hp


def _value_text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else repr(value)


def job_hyperparameters(method: str, benchmark: str,
                        overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The hyperparameter overrides of the row ``method`` on ``benchmark`` (its defaults
    are the paper's): the paper's settings of the benchmark (HumanEval: alpha 2 for every
    method that has one, and the row's own ``benchmark_settings``), then the request's
    ``*`` and per-row overrides, then what a variant fixes. For a pool selection: the
    selection's weights (its ``StudyRow.weights``: ``alpha``, ``beta`` of degs_rerank,
    ``alpha = 0`` for depth-only), after checking that it selects from the pool its
    source draws. Errors name the bad hyperparameter."""
    row = study_row_of(method)
    decoder = row.method
    defaults = method_defaults(decoder)
    hp: dict[str, Any] = {}
    if canonical_name(benchmark) == "humaneval" and "alpha" in defaults:
        hp["alpha"] = HUMANEVAL_ALPHA
    hp.update({name: value for on, name, value in row.facts.benchmark_settings
               if canonical_name(on) == canonical_name(benchmark)})
    hp.update(_scoped(overrides, decoder, defaults, scope=method))
    for name, value in row.facts.fixed:
        if name in overrides.get(method, {}):
            raise ValueError(f"{method} is {name} = {_value_text(value)} by definition; set {decoder}'s "
                             f"{name} instead")
        hp[name] = value
    resolved = resolve_hyperparameters(decoder, hp)  # ValueError on bad names or values
    source = row.facts.selected_from
    if source:
        pool = {**method_defaults(source), **job_hyperparameters(source, benchmark, overrides)}
        shared = sorted(k for k in pool if k in resolved and pool[k] != resolved[k])
        if shared:
            raise ValueError(f"{method} selects from {source}'s pool, so its {', '.join(shared)} "
                             f"must equal {source}'s; set them for {source} (or without a prefix)")
        return selection_weights(method, resolved)
    return hp


def selection_weights(method: str, hyperparameters: Mapping[str, Any]) -> dict[str, float]:
    """What the pool selection ``method`` ranks by: its hyperparameters that its row names
    (``StudyRow.weights``; DEGS reranking and depth-only ``alpha``, ``beta``: argmax
    alpha·log p + beta·D; Best-of-N-Entropy none: argmin final-layer entropy)."""
    return {name: float(hyperparameters[name]) for name in study_row_of(method).facts.weights}


def pool_hyperparameters(benchmark: str, overrides: Mapping[str, Mapping[str, Any]]) -> dict:
    """The predictive-validity pool's best_of_n overrides: N = 16, T = 0.8, top-p 0.9,
    the request's ``*`` overrides and ``pool.`` overrides."""
    defaults = method_defaults(POOL_METHOD)
    hp = {**POOL_SETTINGS, **_scoped(overrides, POOL_METHOD, defaults, scope=POOL_SCOPE)}
    resolve_hyperparameters(POOL_METHOD, hp)
    return hp


# --------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class Job:
    """One ``run_eval`` run of the study: a decoder on a benchmark, or the pool."""

    kind: str  # "decoder" or "pool"
    benchmark: str
    method: str  # the decoder that runs
    hyperparameters: Mapping[str, Any]  # its overrides of the defaults (study.json's record)
    limit: Optional[int]
    batch_size: int
    keep_candidates: bool
    directory: str  # relative to the study directory
    # The method value that runs (built once, here; what `run_eval` and the estimates use).
    decoder: Method = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "decoder", hyperparameters_for(self.method, **self.hyperparameters))

    @property
    def scope(self) -> str:
        """Its name in --batch-size and --hp: the pool's, else the decoder's."""
        return POOL_SCOPE if self.kind == "pool" else self.method

    @property
    def label(self) -> str:
        return f"{self.benchmark} {'pool' if self.kind == 'pool' else self.method}"


def run_directory(benchmark: str, method: str) -> str:
    return f"runs/{benchmark}/{method}"


def pool_directory(benchmark: str) -> str:
    return f"pool/{benchmark}"


def plan_jobs(request: StudyRequest) -> list[Job]:
    """The ``run_eval`` runs of ``request``, in priority order (module docstring)."""
    jobs = []
    decoders = []
    for m in request.methods:
        d = row_decoder(m)
        if d not in decoders:
            decoders.append(d)
    sources = {row.facts.selected_from for row in study_rows().values()}  # their candidates are kept
    for benchmark, limit in request.benchmarks.items():
        for method in decoders:
            jobs.append(Job("decoder", benchmark, method,
                            job_hyperparameters(method, benchmark, request.overrides), limit,
                            request.batch_size(method), method in sources,
                            run_directory(benchmark, method)))
        if benchmark in request.pool_benchmarks:
            jobs.append(_pool_job(request, benchmark))
    for benchmark in request.pool_benchmarks:
        if benchmark not in request.benchmarks:
            jobs.append(_pool_job(request, benchmark))
    return jobs


def _pool_job(request: StudyRequest, benchmark: str) -> Job:
    return Job("pool", benchmark, POOL_METHOD, pool_hyperparameters(benchmark, request.overrides),
               request.pool_benchmarks[benchmark], request.batch_size(POOL_SCOPE), True,
               pool_directory(benchmark))


def paper_lsub_sets(num_layers: int) -> tuple[tuple[int, ...], ...]:
    """The probe sets of the paper's L_sub table, for a model of ``num_layers`` blocks.

    For 28 layers they are the paper's own: all layers, the default grid
    {4,...,28} and its deepest 6, 5 and 4 layers, windows of four grid layers sliding
    toward the input ({12..24}, {8..20}, {4..16}), {1,4,8,12} and {1,2,3,4}. For
    another depth the same roles on that model's default grid (``lens.default_lsub``).
    """
    grid = default_lsub(num_layers)
    sets = [tuple(range(1, num_layers + 1)), grid, grid[1:], grid[2:], grid[3:], grid[2:6],
            grid[1:5], grid[0:4], tuple(sorted({1, *grid[0:3]})),
            tuple(range(1, min(4, num_layers) + 1))]
    unique = []
    for s in sets:
        if s and s not in unique:
            unique.append(s)
    return tuple(unique)


# --------------------------------------------------------------------------- study file


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_study_file(path: Path) -> dict:
    """``study.json``: ValueError naming the file if it is not one `degs reproduce` wrote
    (not JSON, no ``model`` with its ``name`` and ``num_layers``, no ``invocations`` list)."""
    study = results.read_json(path)
    model = study.get("model")
    if not (isinstance(model, dict) and isinstance(model.get("name"), str)
            and type(model.get("num_layers")) is int):
        raise ValueError(f"{path} has no 'model' with a 'name' and 'num_layers'; repair or "
                         "delete it")
    if not (isinstance(study.get("invocations"), list)
            and all(isinstance(i, dict) for i in study["invocations"])):
        raise ValueError(f"{path}: 'invocations' must be a list of JSON objects; repair or "
                         "delete it")
    return study


def open_study(out: Path, model_name: str, num_layers: int, request: StudyRequest,
               argv: Optional[Sequence[str]]) -> dict:
    """Create or extend ``study.json``; refuse a study of another model."""
    path = out / STUDY_FILE
    if path.exists():
        study = read_study_file(path)
        if study["model"]["name"] != model_name:
            raise ValueError(f"{out} holds a study of model {study['model']['name']!r}, not "
                             f"{model_name!r}; use another --out directory")
    else:
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} exists and is not a `degs reproduce` directory "
                             f"(no {STUDY_FILE}); use an empty or new --out directory")
        study = {"model": {"name": model_name, "num_layers": num_layers}, "invocations": []}
    study["invocations"].append({
        "started": _now(), "argv": list(argv) if argv is not None else None,
        "request": request.as_json(), "device": str(jax.local_devices()[0]),
        "versions": package_versions(), "status": "running", "steps": []})
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, study)
    return study


def recorded_dtype(out: Path) -> Optional[str]:
    """The parameter dtype of the study's runs so far (their ``run.json``), or None before
    its first run; ValueError if its runs were made in different dtypes."""
    found = {dtype for run_dir in [*sorted(out.glob("runs/*/*")), *sorted(out.glob("pool/*"))]
             if (dtype := runner.recorded_dtype(run_dir)) is not None}
    if len(found) > 1:
        raise ValueError(f"{out} holds runs made in different dtypes ({', '.join(sorted(found))}); "
                         "give --dtype")
    return next(iter(found), None)


def _save_study(out: Path, study: dict) -> None:
    write_json(out / STUDY_FILE, study)


def read_jsonl(path: Path, fields: Mapping[str, type] = {}) -> list[dict]:
    """The records of a JSONL store (empty when it does not exist yet), by the store's
    rules (:mod:`degs_jax.eval.results`): a torn last line is ignored (the next
    ``ResultStore`` opening drops it and the problem runs again), corruption is an error
    naming the file and line."""
    return results.read_records(path, fields=fields) if path.exists() else []


def read_records(run_dir: Path) -> list[dict]:
    """The records of a ``run_eval`` directory (empty when it has none yet)."""
    return read_jsonl(Path(run_dir) / "results.jsonl", EVAL_RECORD_FIELDS)


# --------------------------------------------------------------------------- budget


class Budget:
    """Wall-clock budget of one invocation, counted from its start."""

    def __init__(self, seconds: Optional[float], start: Optional[float] = None):
        if seconds is not None and seconds <= 0:
            raise ValueError(f"time budget must be positive, got {seconds}")
        self.seconds = seconds
        self.start = time.monotonic() if start is None else start

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def fits(self, estimate: Optional[float]) -> bool:
        """Whether work estimated at ``estimate`` seconds may start. Work never measured
        (None) starts while at least UNMEASURED_RESERVE of the budget is left."""
        if self.seconds is None:
            return True
        left = self.seconds - self.elapsed()
        return left >= UNMEASURED_RESERVE * self.seconds if estimate is None else estimate <= left


class _Rates:
    """Measured seconds per unit of work, per job and per method, for estimates."""

    def __init__(self):
        self.by_key: dict[str, list[float]] = {}

    def add(self, keys: Sequence[str], seconds: float, units: int) -> None:
        for k in keys:
            total = self.by_key.setdefault(k, [0.0, 0.0])
            total[0] += seconds
            total[1] += units

    def per_unit(self, keys: Sequence[str]) -> Optional[float]:
        for k in keys:  # the most specific measurement first
            if k in self.by_key and self.by_key[k][1]:
                return self.by_key[k][0] / self.by_key[k][1]
        return None


def _job_rate_keys(job: Job) -> tuple[str, ...]:
    """Where a job's cost per problem is looked up, the most specific first: the job itself,
    then any job of the same benchmark, batch size and worst-case shape (e.g. power MCMC
    from DEGS-MCMC's records: the chains have the same schedule and the same worst case, and
    a problem's cost follows its benchmark's completion lengths), then its method on other
    benchmarks (HumanEval's power-MCMC chains of a few hundred tokens priced MATH500's at a
    quarter of their DEGS-MCMC cost), so that a job never measured does not start a batch
    the budget cannot hold."""
    own, method = _job_and_method_keys(job)
    worst = job.decoder.worst_case_cost()
    if worst is None:
        return own, method
    return own, f"shape:{job.kind}:{job.benchmark}:{job.batch_size}:{worst[0]}:{worst[1]}", method


def _job_and_method_keys(job: Job) -> tuple[str, str]:
    """The job's own key and its method's (the first two of `_job_rate_keys`): where a
    measurement of this very decoder is looked up (the pace of an advance: `plan_table`)."""
    return f"job:{job.directory}", f"method:{job.kind}:{job.method}"


# --------------------------------------------------------------------------- running


def _batches(job: Job, start: int, stop: int) -> Iterator[list[int]]:
    """Problem indices in [start, stop), cut at multiples of the job's batch size."""
    b = job.batch_size
    first = (start // b) * b
    for s in range(first, stop, b):
        chunk = list(range(max(s, start), min(s + b, stop)))
        if chunk:
            yield chunk


def _next_call(job: Job, chunks: Iterator[list[int]], width: int, out: Path, rates: _Rates,
               budget: Budget, skipped: list[str], refill: bool = False) -> list[list[int]]:
    """The batches of the next ``run_eval`` call of ``job``: the next ones from ``chunks``
    (each without its finished problems) whose estimated time fits the budget, up to
    ``width`` (one per process; the estimate of a batch is the time one process takes).
    A batch cut short (by a round's end or by finished problems) ends the call, so that
    ``run_eval``, cutting the call's problems into batches of the largest one's size,
    decodes exactly these batches. refill (one process): the call streams its problems
    through ``batch_size`` slots, so it takes every batch whose cumulative estimate fits:
    without a time budget every batch (a slot freed by a finished chain takes the next
    problem at once, never waiting for the batch's slowest), under a budget one batch
    while the job's cost was never measured. Batches the budget does not admit go to
    ``skipped``; [] when ``chunks`` has no more."""
    call: list[list[int]] = []
    for chunk in chunks:
        done = {r["index"] for r in read_records(out / job.directory)}
        todo = [i for i in chunk if i not in done]
        if not todo:
            continue
        rate = rates.per_unit(_job_rate_keys(job))
        planned = sum(map(len, call)) if refill else 0  # refill: the call's problems run one after another
        if not budget.fits(None if rate is None else rate * (planned + len(todo))):
            skipped.append(f"{job.label} problems {todo[0]}-{todo[-1]}")
            continue
        call.append(todo)
        if refill and (rate is not None or budget.seconds is None):
            continue
        if len(call) == width or len(todo) < job.batch_size:
            break
    return call


def check_prompt_formats(out: Path, request: StudyRequest) -> None:
    """ValueError, before anything runs, where a benchmark of the request already has runs
    in ``out`` made in the other prompt format (chat template or raw text: ``--raw-prompts``,
    ``--no-chat``), so that a resume that forgets the flag neither stops at that job's turn
    nor adds a method in another format beside the benchmark's runs."""
    stored = [(f.parent.parent.name, f) for f in sorted(out.glob("runs/*/*/run.json"))]
    stored += [(f.parent.name, f) for f in sorted(out.glob("pool/*/run.json"))]
    for benchmark, run_file in stored:
        if benchmark not in {*request.benchmarks, *request.pool_benchmarks}:
            continue
        chat = results.read_run_file(run_file)["config"].get("chat")
        if chat is not None and bool(chat) != request.chat_for(benchmark):
            fix = (f"leave {benchmark} out of --raw-prompts, without --no-chat" if chat
                   else f"add --raw-prompts {benchmark}")
            raise ValueError(f"{run_file.parent} has {benchmark}'s prompts "
                             f"{'through the chat template' if chat else 'as raw text'}; this invocation "
                             f"would give them the other format: {fix}")


def _fit_to_memory(model, job: Job, request: StudyRequest, problems: Sequence, log) -> Job:
    """``job`` with a batch that fits the device: where the request gives no size for it
    (the study's default, ``DEFAULT_BATCH_SIZE`` problems), at most what ``--batch-size
    auto`` would choose for these problems from the free memory, so that the study never
    runs out of memory at a size it chose itself (Scalable Power Sampling holds up to 105
    caches of the whole buffer per problem: 16 problems of a 1.5B model need 163 GiB). A
    size the request gives is kept: the user chose it; where the estimate fits fewer, a
    warning says so before anything is compiled (the run may still fit: the estimate
    leaves 1 - DEFAULT_MEMORY_FRACTION of the free memory unused). A problem that fits
    nowhere is refused here (``BatchDoesNotFitError``), before anything is compiled."""
    if not problems:
        return job
    given = request.gives_batch_size(job.scope)
    try:
        choice = runner.choose_problem_batch(model, AUTO, job.decoder, problems, request.chat_for(job.benchmark))
    except BatchDoesNotFitError as error:
        if given:  # the user's size is kept
            log(f"{job.label}: warning: batch size {job.batch_size} kept as given, but {error}")
            return job
        raise
    if choice["limited_by"] != "memory" or choice["batch_size"] >= job.batch_size:
        return job
    if given:
        log(f"{job.label}: warning: batch size {job.batch_size} kept as given, but the memory "
            f"estimate fits fewer: {describe_batch_choice(choice)}; a larger batch may run out "
            "of memory (leave --batch-size to the study to fit it)")
        return job
    log(f"{job.label}: {choice['batch_size']} problems per batch instead of the default "
        f"{job.batch_size} ({describe_batch_choice(choice)})")
    return dataclasses.replace(job, batch_size=choice["batch_size"])


def _check_same_request(group: ProcessGroup, request: StudyRequest) -> None:
    """Process 0 checks that every process of the job runs its study (else their calls
    would differ), before anything is written; the others learn of a refusal at the next
    barrier (PeerProcessError)."""
    requests = gathered_on_process_0(group, "requests", json.loads(json.dumps(request.as_json())))
    if requests is None:
        return
    first = requests[0]
    for k, other in enumerate(requests[1:], start=1):
        differ = [f"{name}: process 0 has {first[name]!r}, process {k} has {other.get(name)!r}"
                  for name in first if other.get(name) != first[name]]
        if differ:
            raise ValueError(f"process {k} was started with another study than process 0 "
                             f"({'; '.join(differ)}); give every process the same command")


@failures_published
def run_study(model, out_dir, request: StudyRequest, *, time_budget: Optional[float] = None,
              progress: bool = True, data_dir=None, argv: Optional[Sequence[str]] = None,
              grader=None, budget: Optional[Budget] = None, log=None,
              allow_unsandboxed: bool = False, refill: bool = True) -> Optional[dict]:
    """Run (or continue) the study of ``request`` with a loaded model into ``out_dir``.

    ``allow_unsandboxed``: grade HumanEval under the sandbox's weaker fallback where there
    are no namespaces (see ``run_eval``; a given ``grader`` brings its own setting).
    ``refill``: one process streams each call's problems through the job's batch size of
    slots (``run_eval``'s refill; recorded in the invocation); a multi-process job
    decodes fixed batches.
    Returns ``study.json``'s content after this invocation. The report is not written
    here (see :func:`degs_jax.reproduce.report.write_report`).

    In a ``jax.distributed`` job every process calls this with the same request (the
    module docstring); process 0 returns ``study.json``'s content, the others None.
    """

    out = Path(out_dir)
    group = process_group()
    lead = group is None or group.index == 0
    if grader is not None:
        allow_unsandboxed = grader.allow_unsandboxed
    if "humaneval" in {**request.benchmarks, **request.pool_benchmarks}:
        sandbox.isolation(allow_unsandboxed)  # refused before anything is written
    if group is not None:
        _check_same_request(group, request)
    budget = budget or Budget(time_budget)
    log = log or (lambda message: print(f"[{budget.elapsed():7.1f} s] {message}",
                                        file=sys.stderr, flush=True))
    lsub_sets = request.lsub_sets or paper_lsub_sets(model.lm.num_layers)
    jobs = plan_jobs(request)
    problems = {b: load_benchmark(b, data_dir=data_dir)
                for b in {j.benchmark for j in jobs}}
    targets = {j.directory: len(problems[j.benchmark]) if j.limit is None
               else min(j.limit, len(problems[j.benchmark])) for j in jobs}
    check_prompt_formats(out, request)
    rates = _Rates()
    skipped: list[str] = []
    if lead:  # process 0 alone cuts batches (_next_call)
        jobs = [_fit_to_memory(model, job, request, problems[job.benchmark][:targets[job.directory]],
                               log) for job in jobs]
        study = open_study(out, model.name, model.lm.num_layers, request, argv)
        invocation = study["invocations"][-1]
        invocation["model"] = {"source": model.source,
                               "chat_template": uses_chat_template(model.tokenizer)}
        if group is not None:
            invocation["process_count"] = group.count
        invocation["refill"] = refill
        invocation.update(describe(request, jobs, targets))
        _save_study(out, study)
        for job in jobs:  # what earlier invocations measured
            recs = read_records(out / job.directory)
            if recs:
                rates.add(_job_rate_keys(job), sum(r["wall_clock_s"] for r in recs), len(recs))
    width = 1 if group is None else group.count  # batches per run_eval call
    refill = refill and group is None
    calls = itertools.count()  # the decisions process 0 shares
    own_grader = grader is None
    grader = grader or Grader(allow_unsandboxed=allow_unsandboxed)
    try:
        rounds = max(targets.values(), default=0)
        size = request.round_size or max(rounds, 1)
        for start in range(0, rounds, size):
            for job in jobs:
                stop = min(start + size, targets[job.directory])
                chunks = _batches(job, start, stop)
                while True:
                    call = _next_call(job, chunks, width, out, rates, budget, skipped, refill) if lead else None
                    call = from_process_0(group, f"call/{next(calls)}", call)
                    if not call:
                        break
                    todo = [i for chunk in call for i in chunk]
                    t0 = time.monotonic()
                    runner.run_eval(model, out / job.directory, benchmark=job.benchmark,
                             method=job.decoder, seed=request.seed, indices=todo,
                             batch_size=job.batch_size if refill else max(map(len, call)),
                             keep_candidates=job.keep_candidates,
                             chat=request.chat_for(job.benchmark), progress=progress, data_dir=data_dir,
                             grader=grader, argv=argv, print_table=False, refill=refill)
                    seconds = time.monotonic() - t0
                    if not lead:
                        continue
                    # fixed batches ran side by side (one per process): one process's seconds per
                    # problem; refill: the call's problems ran one stream
                    rates.add(_job_rate_keys(job), seconds * (1 if refill else len(call)), len(todo))
                    invocation["steps"].append({"job": job.directory, "problems": todo,
                                                "seconds": round(seconds, 3)})
                    _save_study(out, study)
                    log(f"{job.label}: problems {todo[0]}-{todo[-1]} ({len(todo)}) in {seconds:.1f} s")
                if job.kind == "pool" and request.layer_pass:
                    _layer_pass(model, out / job.directory, problems[job.benchmark], lsub_sets,
                                budget, rates, invocation if lead else None, skipped, log, group,
                                calls)
                    if lead:
                        _save_study(out, study)
        status = "stopped by the time budget" if skipped else "finished"
    except BaseException as error:
        status = ("interrupted" if isinstance(error, KeyboardInterrupt)
                  else f"failed: {type(error).__name__}: {error}")
        raise
    finally:
        if own_grader:
            grader.close()
        if lead:
            invocation["status"] = status
            invocation["finished"] = _now()
            invocation["seconds"] = round(budget.elapsed(), 1)
            invocation["skipped"] = skipped
            _save_study(out, study)
    if not lead:
        return None
    log(f"study {status} after {budget.elapsed():.1f} s" +
        (f"; {len(skipped)} batches left for a later invocation" if skipped else ""))
    return study


def describe(request: StudyRequest, jobs: Sequence[Job], targets: Mapping[str, int]) -> dict:
    """What an invocation records for the report (which then needs neither the model nor
    the benchmark files): per job its target and hyperparameters where they differ from
    the paper's; the selection weights of the reranking rows and of the pool's."""
    described = {}
    for job in jobs:
        decoder_defaults = method_defaults(job.method)
        paper = ({**decoder_defaults, **POOL_SETTINGS} if job.kind == "pool" else
                 {**decoder_defaults, **job_hyperparameters(job.method, job.benchmark, {})})
        used = job.decoder.to_dict()
        described[job.directory] = {
            "kind": job.kind, "benchmark": job.benchmark, "method": job.method,
            "target": targets[job.directory], "batch_size": job.batch_size,
            "deviations": {k: {"paper": paper[k], "used": used[k]}
                           for k in sorted(used) if paper.get(k) != used[k]}}
    selections: dict[str, dict] = {}
    for benchmark in dict(request.benchmarks) | dict(request.pool_benchmarks):
        rows = {m: job_hyperparameters(m, benchmark, request.overrides)
                for m in request.methods if study_row_of(m).facts.selected_from}
        paper = {m: job_hyperparameters(m, benchmark, {}) for m in rows}
        selections[benchmark] = {"rows": rows,
                                 "pool_rerank": rerank_weights(benchmark, request.overrides),
                                 "deviations": {m: {"paper": paper[m], "used": rows[m]}
                                                for m in paper if paper[m] != rows[m]}}
    return {"jobs": described, "selections": selections}


def rerank_weights(benchmark: str, overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """DEGS reranking's (alpha, beta) on ``benchmark`` (``POOL_RERANK``'s weights): the
    paper's (HumanEval alpha 2) with the request's overrides of those two (used on the
    predictive-validity pool)."""
    defaults = method_defaults(POOL_RERANK)
    weights = study_row_of(POOL_RERANK).facts.weights
    hp = {"alpha": HUMANEVAL_ALPHA} if canonical_name(benchmark) == "humaneval" else {}
    hp.update({k: v for k, v in _scoped(overrides, POOL_RERANK, defaults).items() if k in weights})
    return selection_weights(POOL_RERANK, {**defaults, **hp})


# --------------------------------------------------------------------------- layer pass


def _set_label(lsub: Sequence[int]) -> str:
    return ",".join(map(str, lsub))


def _layer_pass(model, pool_dir: Path, problems, lsub_sets, budget: Budget, rates: _Rates,
                invocation: Optional[dict], skipped: list, log, group: Optional[ProcessGroup],
                steps: Iterator[int]) -> None:
    """Layer statistics of every graded pool problem not yet in ``layers.jsonl``.

    Every process of a job calls this (``invocation`` is process 0's; ``steps`` numbers
    the decisions process 0 shares, the same sequence on every process). Process 0
    decides each step, up to one group of LAYER_PASS_PROBLEMS problems per process, within
    the time budget; each process computes its group and sends the statistics to process
    0 (the coordination service's key-value store: a few KB per problem), which stores
    them in order."""
    records = read_records(pool_dir)  # the same on every process: merged at the last step
    if not records:
        return
    lead = group is None or group.index == 0
    width = 1 if group is None else group.count
    run = results.read_run_file(pool_dir / "run.json")
    tau = float(method_from_record(run["config"], pool_dir / "run.json").tau)
    meta = {"layers": list(range(model.lm.num_layers + 1)), "tau": tau,
            "lsub_sets": [list(s) for s in lsub_sets], "model": model.name,
            "num_layers": model.lm.num_layers, "chat": run["config"]["chat"]}
    meta_path = pool_dir / LAYERS_META
    if lead and meta_path.exists():
        stored = json.loads(meta_path.read_text())
        if stored != meta:
            raise ValueError(f"{meta_path} was computed with other settings ("
                             + "; ".join(f"{k}: {stored.get(k)!r} vs {v!r}" for k, v in meta.items()
                                         if stored.get(k) != v)
                             + f"); delete it and {LAYERS_FILE} to recompute")
    by_id = {p.id: p for p in problems}
    keys = (f"layers:{pool_dir}", "layers")
    with ResultStore(pool_dir / LAYERS_FILE) if lead else contextlib.nullcontext() as store:
        todo = [k for k, r in enumerate(records) if not store.is_done(r["id"])] if lead else []
        if lead and not meta_path.exists():
            write_json(meta_path, meta)
        groups = iter(range(0, len(todo), LAYER_PASS_PROBLEMS))
        while True:
            step = None
            if lead:  # up to `width` groups (record positions) that fit the budget
                step = []
                for start in groups:
                    group_todo = todo[start:start + LAYER_PASS_PROBLEMS]
                    n_cand = sum(len(records[k]["candidates"]) for k in group_todo)
                    rate = rates.per_unit(keys)
                    if not budget.fits(None if rate is None else rate * n_cand):
                        skipped.append(f"{pool_dir.name} layer pass ({len(todo) - start} problems)")
                        groups = iter(())
                        break
                    step.append(group_todo)
                    if len(step) == width:
                        break
            name = f"layers/{next(steps)}"
            step = from_process_0(group, name, step)
            if not step:
                return
            t0 = time.monotonic()
            index = 0 if group is None else group.index
            mine = step[index] if index < len(step) else []  # this process's group
            stats = pool_layer_statistics(model, [(by_id[records[k]["id"]], records[k]) for k in mine],
                                          chat=meta["chat"], lsub_sets=lsub_sets, tau=tau)
            every = gathered_on_process_0(group, f"{name}/statistics", stats)
            seconds = time.monotonic() - t0
            if not lead:
                continue
            n_cand = 0
            for positions, group_stats in zip(step, every):
                for k, s in zip(positions, group_stats):
                    store.append({"id": records[k]["id"], "index": records[k]["index"],
                                  "seconds": seconds / len(positions), "candidates": s})
                    n_cand += len(s)
            rates.add(keys, seconds * len(step), n_cand)  # the groups ran side by side
            done = [records[k]["index"] for positions in step for k in positions]
            invocation["steps"].append({"job": f"{pool_dir.parent.name}/{pool_dir.name}/layers",
                                        "problems": done, "seconds": round(seconds, 3)})
            log(f"{pool_dir.name} layer pass: {len(done)} problems ({n_cand} candidates) "
                f"in {seconds:.1f} s")


def pool_layer_statistics(model, items, *, chat: bool, lsub_sets, tau: float) -> list[list[dict]]:
    """:func:`sequence_layer_statistics` of every candidate of each ``(problem, record)``
    (prompt as the pool's run built it), grouped per record."""
    sequences, owners = [], []
    for ri, (problem, record) in enumerate(items):
        prompt = problem_prompt_ids(problem, model.tokenizer, chat)
        for cand in record["candidates"]:
            sequences.append((prompt, candidate_tokens(cand), bool(cand["ended"])))
            owners.append(ri)
    stats = sequence_layer_statistics(model.lm, model.params, sequences, lsub_sets=lsub_sets,
                                      tau=tau)
    out: list[list[dict]] = [[] for _ in items]
    for ri, s in zip(owners, stats):
        out[ri].append(s)
    return out


def padded_length(n: int, bucket: int) -> int:
    """`n` rounded up to a multiple of `bucket`, or below `bucket` to a power of two: a
    few compiled shapes, and short lengths (the usual completion in a test, a short
    prompt) padded by at most half."""
    if n >= bucket:
        return -(-n // bucket) * bucket
    return min(bucket, 1 << max(0, n - 1).bit_length())


def sequence_layer_statistics(lm, params, sequences, *, lsub_sets, tau: float,
                              row_budget: Optional[int] = None,
                              bucket: int = LENGTH_BUCKET) -> list[dict]:
    """Per ``(prompt ids, completion ids, ended)``: the mean lens entropy at every layer
    0..L over the completion's scored tokens and D(x) under each probe set of
    ``lsub_sets`` with threshold ``tau``, for the ``CausalLM`` ``lm`` with ``params``.

    Sequences of similar lengths run together (as many per call as fit in ``row_budget``
    lens rows at their padded length, default LENS_ROW_BUDGET) through
    :func:`degs_jax.scoring.completion_layer_entropies`: the prompts without the lens,
    then the scored tokens with it, each right-padded to ``padded_length`` (bounding
    recompiles). Scored tokens are the completion's, its final EOS excluded when
    ``ended``, each read at its own position (docs/design.md §3) — the tokens and
    positions :func:`degs_jax.scoring.score_sequences` and generation score. Returns
    ``{"n_scored", "entropy": [L+1] (None if nothing is scored), "D": [one per set]}``
    per sequence, in order.
    """
    row_budget = LENS_ROW_BUDGET if row_budget is None else row_budget
    L = lm.num_layers
    layers = tuple(range(L + 1))
    seqs = sorted(((i, np.asarray(list(p) + list(c), np.int32), len(p), len(c) - int(ended))
                   for i, (p, c, ended) in enumerate(sequences)), key=lambda s: s[1].size)
    out: list[Optional[dict]] = [None] * len(seqs)
    k = 0
    while k < len(seqs):
        width = min(-(-seqs[k][1].size // bucket) * bucket, lm.max_context)
        rows = max(1, row_budget // (len(layers) * width))
        group = [s for s in seqs[k:k + rows] if s[1].size <= width]  # a prefix: sorted
        k += len(group)
        # fixed rows per width (fewer compilations); the scored tokens only: a final EOS
        # has no entropy read, and nothing comes after it
        prompts = np.zeros((rows, padded_length(max(first for _, _, first, _ in group), bucket)), np.int32)
        scored = np.zeros((rows, padded_length(max(1, max(n for _, _, _, n in group)), bucket)), np.int32)
        prompt_lengths, scored_lengths = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for r, (_, toks, first, n) in enumerate(group):
            prompts[r, :first], scored[r, :n] = toks[:first], toks[first:first + n]
            prompt_lengths[r], scored_lengths[r] = first, n
        mask = np.arange(scored.shape[1])[None] < scored_lengths[:, None]
        # [L+1, rows, scored.shape[1]]: each scored token's entropies at its own position
        entropy = np.asarray(completion_layer_entropies(lm, params, prompts, prompt_lengths, scored,
                                                        scored_lengths, layers))
        depths = [np.asarray(sequence_depth(collapse_depth(entropy[list(s)], s, L, tau), mask, L))
                  for s in lsub_sets]
        for r, (i, _, _, n) in enumerate(group):
            mean = entropy[:, r, mask[r]].astype(np.float64).mean(axis=1) if n else None
            out[i] = {"n_scored": int(n),
                      "entropy": None if mean is None else [round(float(x), 5) for x in mean],
                      "D": [round(float(d[r]), 6) for d in depths]}
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------- plan


def fixed_batch_utilisation(records: Sequence[Mapping[str, Any]], method: Method) -> Optional[float]:
    """The fraction of row-steps that did useful work in the fixed batches these records
    were decoded in (those with a ``batch_share``: consecutive problems by index, that many
    per batch), modelled from their answers' lengths: Σ_i steps(n_i) / Σ_batches size ·
    max_i steps(n_i), steps = ``method.sequential_steps`` (a batch lasts as long as its
    slowest prompt). With refill a slot takes the next problem at once, so its seconds per
    problem are about the fixed batches' times this fraction (the drain at the end of a
    run aside). None: no record of a fixed batch of more than one problem."""
    fixed = sorted((r for r in records if r.get("batch_share", 1) > 1), key=lambda r: r["index"])
    useful = held = 0.0
    at = 0
    while at < len(fixed):
        batch = fixed[at:at + int(fixed[at]["batch_share"])]
        steps = [method.sequential_steps(int(r["n_tokens"])) for r in batch]
        useful += sum(steps)
        held += len(batch) * max(steps)
        at += len(batch)
    return useful / held if held else None


def plan_table(out_dir, request: StudyRequest, data_dir=None) -> list[dict]:
    """Per job: target and finished problems, the worst-case generated tokens per problem
    and the measured seconds per problem (this job, else one of the same benchmark and
    worst case, else the same method elsewhere in the study: `_job_rate_keys`) with the
    estimate for what is left; where the job's records come from fixed batches, also the
    estimate with refill (`fixed_batch_utilisation`); and where refilled records measured
    the pace of an advance (``advance_s``: the stream's fastest seconds per `advance`, this
    job's or its method's elsewhere) and the method knows its worst case
    (`Method.worst_case_advances`), the refill estimate is at least the slowest prompt
    alone (``slowest_prompt_s``): a refilled job lasts as long as its longest chain
    whatever its slots; where every problem left has a checkpoint, the most any of their
    chains still needs (`_slowest_advances_left`). No model is loaded."""
    out = Path(out_dir)
    jobs = plan_jobs(request)
    sizes = {b: len(load_benchmark(b, data_dir=data_dir)) for b in {j.benchmark for j in jobs}}
    records = {job.directory: read_records(out / job.directory) for job in jobs}
    rates = _Rates()
    paces: dict[str, float] = {}  # the fastest measured seconds per advance, per job and per method
    for job in jobs:
        recs = records[job.directory]
        if recs:
            rates.add(_job_rate_keys(job), sum(r["wall_clock_s"] for r in recs), len(recs))
        measured = [r["advance_s"] for r in recs if r.get("advance_s") is not None]
        for key in _job_and_method_keys(job) if measured else ():
            paces[key] = min(paces.get(key, min(measured)), min(measured))
    rows = []
    for job in jobs:
        target = sizes[job.benchmark] if job.limit is None else min(job.limit, sizes[job.benchmark])
        done = len({r["index"] for r in records[job.directory] if r["index"] < target})
        rate = rates.per_unit(_job_rate_keys(job))
        worst = job.decoder.worst_case_cost()
        utilisation = fixed_batch_utilisation(records[job.directory], job.decoder)
        estimate = None if rate is None else rate * (target - done)
        refill_estimate = estimate if estimate is None or utilisation is None else estimate * utilisation
        pace = next((paces[k] for k in _job_and_method_keys(job) if k in paces), None)
        advances = _slowest_advances_left(out / job.directory, job.decoder, records[job.directory], target - done)
        slowest = None if pace is None or advances is None or done >= target else pace * advances
        if slowest is not None and refill_estimate is not None:
            refill_estimate = max(refill_estimate, slowest)
        rows.append({"job": job.label, "directory": job.directory, "target": target, "done": done,
                     "batch_size": job.batch_size,
                     "worst_case_tokens_per_problem": worst and worst[0],
                     "worst_case_steps_per_batch": worst and worst[1],
                     "seconds_per_problem": rate,
                     "estimate_s": estimate,
                     "fixed_batch_utilisation": utilisation,
                     "advance_s": pace,
                     "slowest_prompt_s": slowest,
                     "refill_estimate_s": refill_estimate})
        if job.kind == "pool" and request.layer_pass:
            stored = read_jsonl(out / job.directory / LAYERS_FILE)
            rate = (sum(r["seconds"] for r in stored) / len(stored)) if stored else None
            rows.append({"job": f"{job.benchmark} layer pass", "directory": job.directory,
                         "target": target, "done": len(stored), "batch_size": LAYER_PASS_PROBLEMS,
                         "worst_case_tokens_per_problem": None, "worst_case_steps_per_batch": None,
                         "seconds_per_problem": rate,
                         "estimate_s": None if rate is None else rate * (target - len(stored))})
    return rows


def _slowest_advances_left(run_dir: Path, decoder: Method, records: Sequence[Mapping], left: int) -> Optional[int]:
    """The worst-case advances of the job's slowest prompt still to run: a whole prompt's
    (`Method.worst_case_advances`) while a problem left has no checkpoint, else the most
    that one of the checkpointed chains still needs from its snapshot (its blocks done)."""
    whole = decoder.worst_case_advances()
    if whole is None or left <= 0:
        return whole
    store = CheckpointStore(run_dir)
    stored = {r["id"] for r in records}
    in_flight = [i for i in store.problem_ids() if i not in stored]
    if len(in_flight) < left:
        return whole
    return max(decoder.worst_case_advances(store.load(i)) for i in in_flight)


def format_plan(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (f"{'job':<28} {'target':>6} {'done':>5} {'batch':>5} {'worst tok/problem':>17} "
            f"{'worst steps/batch':>17} {'s/problem':>9} {'estimate left':>13}")
    lines = [head]
    total, unknown, refill_total = 0.0, 0, 0.0
    for r in rows:
        rate = "?" if r["seconds_per_problem"] is None else f"{r['seconds_per_problem']:.2f}"
        left = r["target"] - r["done"]
        if r["estimate_s"] is None and left:
            est, unknown = "?", unknown + 1
        else:
            est = f"{r['estimate_s'] or 0.0:.0f} s"
            total += r["estimate_s"] or 0.0
            refill = r.get("refill_estimate_s", r["estimate_s"])
            refill_total += refill or 0.0
            if refill is not None and refill == r.get("slowest_prompt_s"):
                est += f" (refill {refill:.0f} s: its slowest prompt alone)"
            elif r.get("fixed_batch_utilisation") is not None:
                est += f" (refill {refill:.0f} s: fixed batches {100 * r['fixed_batch_utilisation']:.0f}% used)"
        wt, ws = r["worst_case_tokens_per_problem"], r["worst_case_steps_per_batch"]
        lines.append(f"{r['job']:<28} {r['target']:>6} {r['done']:>5} {r['batch_size']:>5} "
                     f"{'?' if wt is None else f'{wt:,}':>17} {'?' if ws is None else f'{ws:,}':>17} "
                     f"{rate:>9} {est:>13}")
    lines.append(f"measured estimate of what is left: {total:.0f} s"
                 + (f" + {unknown} job(s) never measured (run a first batch: the estimate then "
                    "uses its seconds per problem)" if unknown else ""))
    if refill_total != total:
        lines.append(f"with refill (the default schedule): {refill_total:.0f} s; where the records come from "
                     "fixed batches, their seconds times the fraction of the batches' row-steps that did "
                     "useful work, modelled from the answers' lengths; and no less than the job's slowest "
                     "prompt alone: its worst-case advances (MCMC: a chain's decode steps) times the "
                     "fastest seconds per advance the refilled records measured")
    lines.append("(worst case: no completion ends before its budget. Seconds per problem from "
                 "stored records: decoding, including the compilation of each new batch shape, "
                 "plus grading; for the layer pass its forward passes)")
    return "\n".join(lines)
