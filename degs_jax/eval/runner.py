"""`degs eval`: run a decoder over a benchmark, grade, and record everything (docs/design.md §5).

A run directory holds

- ``run.json``: the configuration (model, benchmark, method, every resolved
  hyperparameter, seed, key derivation, template hash, whether candidates are kept),
  plus one entry per invocation (time, argv, limit, batch size, package versions);
- ``results.jsonl``: one record per finished problem, appended through
  :class:`~degs_jax.eval.results.ResultStore` (flushed and fsynced) as soon as the problem
  is done;
- ``summary.json``: accuracy with a 95% Wilson interval, per-problem means and the
  method's own statistics of its answers (``extras``: numbers averaged, other values
  counted; :func:`extras_summary`), rewritten after every batch_size finished problems
  and at the end of every invocation.

Scheduling (``refill``, the default; recorded in each invocation): the problems stream
through ``batch_size`` slots, and a slot whose problem is done takes the next waiting one
at once (``decoders.decode_stream``), so a batch costs the mean problem rather than the
slowest; each record is written when its problem finishes (in the order they finish)
and its ``decode_s`` is the wall-clock since the previous problem finished. Without it
(``--no-refill``) the problems run in fixed batches and ``decode_s`` is the batch's time
over its size. Each problem keeps its own key either way, so with ``--batch-invariant``
the records are the same (timings aside); otherwise they agree up to the rounding of
different batch compositions.

Resuming: rerunning the same command skips the problems already in ``results.jsonl``;
a directory whose ``run.json`` has a different configuration is refused, and so is one
whose stored files a resume cannot use (:func:`check_run_directory`: the store's rules
in :mod:`degs_jax.eval.results`). With refill, a problem that was in flight goes on from
its last snapshot (an MCMC chain from its last completed block, not its first token):
``checkpoints/`` holds one per in-flight problem (:mod:`degs_jax.eval.checkpoints`), and
the invocation records which problems it resumed and from which block (``resumed``);
with ``--batch-invariant`` the resumed records equal those of a run never stopped.

HumanEval: the completions are model-written programs, graded in the sandbox
(:mod:`degs_jax.eval.sandbox`); where it cannot create namespaces the run is refused
before anything runs unless ``allow_unsandboxed``, and the isolation is recorded in the
invocation (``humaneval_isolation``), in every record (``isolation``) and in the summary
(``isolation``: the levels its records were graded under); a resume under another
isolation than the run's is refused.

Several processes (a ``jax.distributed`` job, ``jax.process_count() > 1``; the run
directory on a filesystem all of them see): process 0 checks that every process was
given the same configuration and problems, creates or updates ``run.json`` and works
out what is left to do; then each process claims batches of that, one at a time from a
shared counter (so a process that draws short problems takes more of them), and appends
its records to its own shard ``results.process-K-of-N.jsonl``; once all are done,
process 0 merges the shards into ``results.jsonl`` in problem order, deletes them and
writes ``summary.json`` (only then: there is no running summary). A failure in any
process stops all of them at their next batch. Leftover shards of an interrupted run
count as done and are merged first by the next invocation, with any number of
processes. Records are the same as a single process writes. The barriers, shared values and failure
propagation are in :mod:`degs_jax.eval.processes`.

Randomness: problem ``i`` (its index in the benchmark file, independent of ``--limit``)
is decoded with the key ``fold_in(key(seed), i)`` (passed to ``decode`` as its per-prompt
``keys``), so its tokens do not depend on which problems ran before it, on restarts or
on batching.

Per problem: id, index, correct, extracted answer, grading detail (HumanEval: and its
isolation), completion (GPQA: only its hash and
length, see :func:`~degs_jax.eval.results.transcript_fields`), completion tokens, log p,
D(x), final-layer entropy, MCMC acceptance rates and MH decisions decided by beta·ΔD (per
block and in total: `decoders.Candidate.depth_decisions`) and every MH decision whole
(`mh_decisions`: `degs_jax.mcmc.MHDecisions`), generated tokens, forward tokens,
probed token-layers, forward-equivalents (probing charged K/L of a forward per probed
token) and wall-clock (decoding, including compilation on a new shape, plus grading);
for power_smc / degs_smc / scalable_power also the decoder's `diagnostics` (log Z-hat,
ESS per check, resamplings, copied rows; rollouts).
With ``keep_candidates`` every candidate (Best-of-N pool, MCMC chain or SMC particle,
with its weight) is graded and stored with its tokens, log p, D(x), final-layer entropy
and verdict, for `degs analyze`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from degs_jax.batching import choose_batch_size, describe_batch_choice, peak_memory
from degs_jax.decoders import decode, decode_stream
from degs_jax.eval import sandbox
from degs_jax.eval.benchmarks import Problem, canonical_name, load_benchmark
from degs_jax.eval.checkpoints import CheckpointStore
from degs_jax.eval.graders import RULES_VERSION, Grader, pass_at_k
from degs_jax.eval.processes import (ProcessGroup, barrier, failures_published, process_group,
                                     raise_if_peer_failed, share, shared)
from degs_jax.eval.prompts import benchmark_stop, problem_prompt_ids, template_hash, uses_chat_template
from degs_jax.eval.results import (
    EVAL_RECORD_FIELDS,
    ResultStore,
    merge_shards,
    pack_tokens,
    package_versions,
    read_records,
    read_run_file,
    summarize,
    transcript_fields,
    write_json,
    write_summary,
)
from degs_jax.methods import as_method, method_from_record, method_origin, method_record
from degs_jax.method import Method
from degs_jax.model_api import params_dtype
from degs_jax.models import with_tuned_lens
from degs_jax.stops import cut_at_stop, token_bytes
from degs_jax.text import ended_by

RUN_FILE = "run.json"
RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
KEY_DERIVATION = "fold_in(key(seed), problem_index)"
GPQA = "gpqa_diamond"

SHARD_PATTERN = "results.process-*-of-*.jsonl"
# A run rewrites its summary.json at most this often while records come in (and at the end
# of each batch), so a killed run's summary lacks at most the records of its last this
# many seconds. The progress line's accuracy and tokens per step follow every record.
SUMMARY_SECONDS = 30.0

__all__ = ["run_eval", "run_config", "problem_key", "run_summary", "extras_summary", "format_summary",
           "shard_file", "check_run_directory", "recorded_dtype",
           "RUN_FILE", "RESULTS_FILE", "SUMMARY_FILE", "SHARD_PATTERN"]


def shard_file(process: int, count: int) -> str:
    """File name of process ``process``'s records in a run of ``count`` processes."""
    return f"results.process-{process}-of-{count}.jsonl"


def _shards(out: Path) -> list[Path]:
    return sorted(out.glob(SHARD_PATTERN))


def problem_key(seed: int, index: int):
    """The PRNG key of problem ``index``: ``fold_in(key(seed), index)``."""
    return jax.random.fold_in(jax.random.key(seed), index)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # e.g. a dtype


def run_config(model, benchmark: str, method: Method, seed: int, chat: bool,
               keep_candidates: bool, tuned_lens=None) -> dict[str, Any]:
    """The configuration that determines a run's results (what resuming must match).

    The method is recorded by ``method_record`` with ``lsub`` made explicit for the
    model's depth, so spelling a default out or leaving it implicit gives the same
    configuration, and where its class came from (``method_origin``: module and
    distribution; a resume compares the class it finds today, and a run whose method is
    not installed names the package). A
    tuned lens is recorded by its layers and weights' sha256 (the logit lens, the
    default, adds nothing, so earlier runs keep their configuration); so is
    `--batch-invariant` (other numerics, hence other records).
    """
    bench = canonical_name(benchmark)
    method = dataclasses.replace(method, lsub=method.lens_config(model.lm.num_layers).lsub)
    dtype = str(np.dtype(params_dtype(model.params)))
    lens = {}
    if tuned_lens is not None:
        lens = {"lens": {"kind": "tuned", "layers": list(tuned_lens.layers),
                         "sha256": tuned_lens.fingerprint()}}
    return _jsonable({
        "benchmark": bench,
        **method_record(method),
        "method_origin": method_origin(type(method)),
        "seed": int(seed),
        "key_derivation": KEY_DERIVATION,
        "model": {"name": model.name, "architecture": model.architecture,
                  "num_layers": model.lm.num_layers, "dtype": dtype,
                  **({"batch_invariant": True} if model.lm.batch_invariant else {})},
        "chat": bool(chat and uses_chat_template(model.tokenizer)),
        "keep_candidates": bool(keep_candidates),
        "template_sha256": template_hash(bench),
        **lens,
    })


def _config_differences(old: Mapping, new: Mapping, prefix: str = "",
                        labels: tuple[str, str] = ("stored", "requested")) -> list[str]:
    diffs = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, "<missing>"), new.get(k, "<missing>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            diffs += _config_differences(a, b, f"{prefix}{k}.", labels)
        elif a != b:
            diffs.append(f"{prefix}{k}: {labels[0]} {a!r}, {labels[1]} {b!r}")
    return diffs


def check_run_directory(out: Path, humaneval_isolation: Optional[str] = None) -> None:
    """Read what a resume into ``out`` would use (``run.json``, the results and any shards
    of an interrupted multi-process run), e.g. before loading a model: ValueError naming
    the file and line that it could not use (the store's rules:
    :mod:`degs_jax.eval.results`), or saying that the run was graded under another
    isolation than ``humaneval_isolation``. Nothing is written."""
    if (out / RUN_FILE).exists():
        run = read_run_file(out / RUN_FILE)
        _stored_config(out / RUN_FILE, run)
        _check_isolation(out, run, {"humaneval_isolation": humaneval_isolation})
    for path in [out / RESULTS_FILE, *_shards(out)]:
        if path.is_file():
            read_records(path, fields=EVAL_RECORD_FIELDS)


def recorded_dtype(out: Path) -> Optional[str]:
    """The parameter dtype the run in ``out`` was made with (``run.json``'s
    ``config.model.dtype``, as `degs eval` and `degs train-grpo` write it), or None where
    there is no run yet. A resumed run keeps it (``--dtype auto``): its configuration,
    hence its records, depend on it."""
    if not (out / RUN_FILE).is_file():
        return None
    model = read_run_file(out / RUN_FILE)["config"].get("model")
    dtype = model.get("dtype") if isinstance(model, Mapping) else None
    return dtype if isinstance(dtype, str) else None


def _stored_config(path: Path, run: Mapping[str, Any]) -> dict[str, Any]:
    """The configuration of a stored run, its method as the method value it records gives
    it today (``method_from_record``: what an older version recorded still compares
    equal); ValueError naming the file for a record that gives none (and the package a
    method that is not installed came from)."""
    config = run["config"]
    return {**config, **method_record(method_from_record(config, path))}


# Recorded in the configuration, not compared on resuming: where the method's class came
# from (a resume runs the class registered under the method's name today, and records
# where that came from; runs from before it was recorded resume too).
NOT_COMPARED = ("method_origin",)


def _prepare_run_dir(out: Path, config: dict, invocation: dict) -> dict:
    """Create or check ``run.json``; refuse a different configuration."""
    run_file = out / RUN_FILE
    if run_file.exists():
        run = read_run_file(run_file)
        stored = _stored_config(run_file, run)
        diffs = _config_differences(*({k: v for k, v in c.items() if k not in NOT_COMPARED}
                                      for c in (stored, config)))
        if diffs:
            raise ValueError(
                f"{out} holds a run with a different configuration; refusing to resume into it "
                f"({'; '.join(diffs)}). Use another --out directory, or repeat the original "
                "command to resume.")
        run["config"] = config  # equal to the stored one but for NOT_COMPARED, which is today's
        _check_isolation(out, run, invocation)
        old_versions = (run.get("invocations") or [{}])[0].get("versions")
        if old_versions and old_versions != invocation["versions"]:
            changed = sorted(k for k in set(old_versions) | set(invocation["versions"])
                             if old_versions.get(k) != invocation["versions"].get(k))
            print(f"warning: resuming {out} with different package versions ({', '.join(changed)}); "
                  "see run.json", file=sys.stderr)
        run["invocations"].append(invocation)
    else:
        if (out / RESULTS_FILE).stat().st_size or _shards(out):  # (the caller's store created it)
            raise ValueError(f"{out} has results but no {RUN_FILE}; refusing to mix runs")
        run = {"config": config, "invocations": [invocation]}
    out.mkdir(parents=True, exist_ok=True)
    write_json(run_file, run)
    return run


def _check_isolation(out: Path, run: Mapping[str, Any], invocation: Mapping[str, Any]) -> None:
    """A HumanEval run's records share one isolation: ValueError (one line) for a resume
    under another one than the stored invocations graded under."""
    level = invocation.get("humaneval_isolation")
    stored = sorted({i["humaneval_isolation"] for i in run.get("invocations", [])
                     if i.get("humaneval_isolation")})
    if level and stored and stored != [level]:
        raise ValueError(
            f"{out} was graded under isolation {', '.join(stored)} and this invocation would "
            f"grade under {level}; refusing to mix them in one run (resume where the same "
            "isolation is available, or use another --out directory)")


def _mean_or_none(values: Optional[Sequence[float]]) -> Optional[float]:
    return float(np.mean(values)) if values else None


@failures_published
def run_eval(model, out_dir, *, benchmark: str, method: str | Method,
             hyperparameters: Optional[Mapping[str, Any]] = None, seed: int = 0,
             limit: Optional[int] = None, indices: Optional[Sequence[int]] = None,
             batch_size: int | str = "auto", keep_candidates: bool = False, chat: bool = True,
             progress: bool = True, data_dir=None, grader: Optional[Grader] = None,
             argv: Optional[Sequence[str]] = None, print_table: bool = True,
             tuned_lens=None, allow_unsandboxed: bool = False, refill: bool = True) -> dict[str, Any]:
    """Evaluate ``method`` on ``benchmark`` with a loaded model, resumably, into ``out_dir``.

    model: a :class:`~degs_jax.model_api.LanguageModel` (any ``CausalLM`` with its
      parameters and tokenizer), or what ``degs_jax.models.load`` returns.
    method: a method value (``degs_jax.method.Method``, e.g. ``DegsMCMC(mh_steps=4)``), or
      a method name with ``hyperparameters``, overrides of its defaults (as ``decode``).
    limit: the first ``limit`` problems; indices: explicit problem indices instead.
    batch_size: problems per ``decode`` call, or "auto" (the default): as many as fit in
      the device's free memory with the method's buffer (``degs_jax.batching``; the
      choice and its terms are recorded in run.json). Results do not depend on it (each
      problem draws from its own key).
    keep_candidates: grade and store every candidate. chat: use the chat template when
      the tokenizer has one. grader: reuse a :class:`Grader` (else one is made and closed).
    tuned_lens: probe through a tuned lens (`degs_jax.train.tuned_lens`) instead of the
      logit lens (recorded in the configuration).
    refill: stream the problems through ``batch_size`` slots, refilling each as its problem
      finishes (module docstring); False: fixed batches. Recorded in the invocation. A
      multi-process run claims fixed batches (this does not apply).
    allow_unsandboxed: HumanEval only, where bubblewrap cannot create namespaces: grade
      under the sandbox's weaker fallback instead of refusing
      (:class:`~degs_jax.eval.sandbox.IsolationUnavailableError`, raised before anything
      runs). The isolation is recorded in the invocation (``humaneval_isolation``) and in
      every record (``isolation``). A given ``grader`` brings its own setting.
    In a ``jax.distributed`` job every process calls this with the same arguments and
    they share the problems (module docstring); only process 0 shows a progress bar and
    prints the table. Raises :class:`PeerProcessError` when another process failed; a
    failure ends the job (the failing process's error is published to the others).
    Returns the summary (also written to ``summary.json``).
    """
    group = process_group()
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    out = Path(out_dir)
    bench = canonical_name(benchmark)
    if grader is not None:
        allow_unsandboxed = grader.allow_unsandboxed
    # Before anything runs: refused where programs cannot be isolated (and not allowed).
    code_isolation = sandbox.isolation(allow_unsandboxed) if bench == "humaneval" else None
    method = as_method(method, hyperparameters or {})
    chat = bool(chat and uses_chat_template(model.tokenizer))
    method = dataclasses.replace(method, stop=benchmark_stop(bench, chat, method.stop))
    config = run_config(model, bench, method, seed, chat, keep_candidates, tuned_lens)
    # Every hyperparameter as the kernels read it (an installed method's own checks too),
    # before anything is written: a refused run leaves the directory as it was.
    method.kernel_config(model.lm.num_layers, tuple(int(e) for e in model.eos_ids))
    all_problems = load_benchmark(bench, data_dir=data_dir)
    if indices is not None:
        bad = [i for i in indices if not 0 <= i < len(all_problems)]
        if bad:
            raise ValueError(f"problem indices {bad} out of range 0..{len(all_problems) - 1}")
        selected = [(int(i), all_problems[i]) for i in indices]
    else:
        selected = list(enumerate(all_problems[:limit] if limit is not None else all_problems))
    # What a stored record may be: one of the benchmark's problems, at its index.
    problems = {p.id: i for i, p in enumerate(all_problems)}
    batch_choice = choose_problem_batch(model, batch_size, method, [p for _, p in selected], chat)
    batch_size = batch_choice["batch_size"]
    if batch_choice["requested"] == "auto" and (group is None or group.index == 0):
        print(f"{bench} {method.method}: {describe_batch_choice(batch_choice)}", file=sys.stderr)
    invocation = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv) if argv is not None else None,
        "limit": limit, "indices": list(indices) if indices is not None else None,
        "batch_size": batch_size, "batch_choice": batch_choice, "refill": bool(refill and group is None),
        "model_source": None if model.source is None else str(model.source),
        "versions": package_versions(config["method_origin"]["distribution"]),
        "grading_rules": RULES_VERSION,
        "device": str(jax.local_devices()[0]), "process_count": jax.process_count(),
        **({"humaneval_isolation": code_isolation} if code_isolation else {}),
    }
    own_grader = grader is None
    grader = Grader(allow_unsandboxed=allow_unsandboxed) if own_grader else grader
    decode_batch = functools.partial(
        _decode_batch, model, seed=seed, method=method, eos=model.eos_ids, grader=grader, chat=chat,
        keep_candidates=keep_candidates, tuned_lens=tuned_lens)
    bar_label = f"{bench} {method.method}"
    try:
        if group is None:
            summary = _run_single(out, config, invocation, selected, problems, decode_batch,
                                  batch_size, progress, bar_label, refill)
        else:
            summary = _run_group(group, out, config, invocation, selected, problems,
                                 decode_batch, batch_size, progress, bar_label)
    finally:
        if own_grader:
            grader.close()
    if print_table and (group is None or group.index == 0):
        print(format_summary(summary))
    return summary


def choose_problem_batch(model, requested: int | str, method: Method, problems: Sequence[Problem],
                         chat: bool) -> dict[str, Any]:
    """``degs_jax.batching.choose_batch_size`` for these problems (their longest prompt)."""
    if requested != "auto":
        return choose_batch_size(requested, None, None, 0, len(problems), None)
    longest = max((len(problem_prompt_ids(p, model.tokenizer, chat)) for p in problems), default=1)
    return choose_batch_size("auto", model.lm, method, longest, len(problems),
                             method.cache_dtype or params_dtype(model.params))


def _record_peak_memory(out: Path, run: dict) -> None:
    """Store the device's peak memory in this invocation's entry of run.json."""
    run["invocations"][-1]["peak_memory"] = peak_memory()
    write_json(out / RUN_FILE, run)


def _decode_batch(model, batch: Sequence[tuple[int, Problem]], *, seed: int, method: Method,
                  eos, grader: Grader, chat: bool,
                  keep_candidates: bool, tuned_lens=None, slots: Optional[int] = None,
                  checkpoints: Optional[CheckpointStore] = None):
    """Decode ``(index, problem)`` pairs with the problems' own keys and yield each
    problem's graded record: in order, as one batch (slots None), or through ``slots``
    refilled slots as each problem finishes (``decode_stream``; its ``decode_s`` is the
    wall-clock since the previous one finished). checkpoints (with slots): the problems'
    snapshots are stored there as they are renewed, and a problem with one goes on from
    it (``degs_jax.eval.checkpoints``)."""
    prompts = [problem_prompt_ids(p, model.tokenizer, chat) for _, p in batch]
    keys = jax.numpy.stack([problem_key(seed, i) for i, _ in batch])
    t0 = time.perf_counter()
    lm, params = with_tuned_lens(model.lm, model.params, tuned_lens)
    vocabulary = token_bytes(model.tokenizer) if method.stop else None
    if slots is not None:
        resume, on_checkpoint = {}, None
        if checkpoints is not None:
            resume = {position: snapshot for position, (_, problem) in enumerate(batch)
                      if (snapshot := checkpoints.load(problem.id)) is not None}
            on_checkpoint = lambda position, snapshot: checkpoints.save(batch[position][1].id, snapshot)
        for position, output in decode_stream(lm, params, prompts, method, keys=keys, eos_ids=eos, slots=slots,
                                              token_bytes=vocabulary, resume=resume, on_checkpoint=on_checkpoint):
            index, problem = batch[position]
            decode_s = time.perf_counter() - t0
            yield _record(model, problem, index, output, None, 1, decode_s, model.lm.num_layers, grader, chat,
                          keep_candidates, method.stop)
            t0 = time.perf_counter()  # grading is timed in the record, not charged to the next problem
        return
    result = decode(lm, params, prompts, method, keys=keys, eos_ids=eos, token_bytes=vocabulary)
    decode_s = time.perf_counter() - t0
    for (index, problem), output in zip(batch, result.outputs):
        yield _record(model, problem, index, output, result, len(batch), decode_s,
                      model.lm.num_layers, grader, chat, keep_candidates, method.stop)


def _run_single(out: Path, config: dict, invocation: dict, selected, problems, decode_batch,
                batch_size: int, progress: bool, bar_label: str, refill: bool) -> dict[str, Any]:
    """The one-process run: everything goes straight into ``results.jsonl``, a record as
    soon as its problem is done. ``problems``: id -> index of the benchmark's problems
    (what a stored record may be)."""
    # The store's lock first: a second run into this directory stops before touching run.json.
    with ResultStore(out / RESULTS_FILE, fields=EVAL_RECORD_FIELDS, problems=problems) as store:
        run = _prepare_run_dir(out, config, invocation)
        merge_shards(store, _shards(out))  # an interrupted multi-process run's records
        todo = [(i, p) for i, p in selected if not store.is_done(p.id)]
        checkpoints = CheckpointStore(out)
        checkpoints.discard(p.id for _, p in selected if store.is_done(p.id))
        if refill:  # the chains a killed run left mid-way, and the blocks they go on from
            run["invocations"][-1]["resumed"] = {p.id: int(snapshot["block"].min()) for _, p in todo
                                                 if (snapshot := checkpoints.load(p.id)) is not None}
            write_json(out / RUN_FILE, run)
        summarised = time.monotonic()
        bar = tqdm(total=len(selected), initial=len(selected) - len(todo), unit="problem",
                   desc=bar_label, disable=not progress, file=sys.stderr)
        # refill: one stream of every problem left through batch_size slots
        batches = ([todo] if todo else []) if refill else [todo[start:start + batch_size] for start in range(0, len(todo), batch_size)]
        for batch in batches:
            for finished, record in enumerate(decode_batch(batch, slots=batch_size if refill else None,
                                                           checkpoints=checkpoints if refill else None), start=1):
                store.append(record)
                checkpoints.remove(record["id"])
                bar.update(1)
                bar.set_postfix(acc=f"{np.mean([r['correct'] for r in store.records]):.3f}",
                                **tokens_per_step_postfix(store.records))
                if finished == len(batch) or time.monotonic() - summarised >= SUMMARY_SECONDS:
                    write_summary(out, run_summary(store.records, run))
                    summarised = time.monotonic()
        bar.close()
        records = list(store.records)
        _record_peak_memory(out, run)
    summary = run_summary(records, run)
    write_summary(out, summary)
    return summary


def _check_agreement(announced: Sequence[Mapping[str, Any]]) -> None:
    """Every process must run the same configuration, problems and batches as process 0."""
    first = announced[0]
    for k, other in enumerate(announced[1:], start=1):
        diffs = _config_differences(first["config"], other["config"],
                                    labels=("process 0 has", f"process {k} has"))
        if diffs:
            raise ValueError(f"process {k} was started with a different configuration than "
                             f"process 0 ({'; '.join(diffs)}); give every process the same "
                             "command")
        if other["selection"] != first["selection"]:
            raise ValueError(f"process {k} selects other problems than process 0 "
                             f"({other['n_selected']} vs {first['n_selected']}); give every "
                             "process the same --limit and the same benchmark data")
        if other["batch_size"] != first["batch_size"]:
            raise ValueError(f"process {k} has batch size {other['batch_size']}, process 0 "
                             f"{first['batch_size']}; give every process the same command "
                             "(--batch-size auto sizes each process's device: pass an integer)")


def _check_shared_dir(out: Path, group: ProcessGroup, invocation: Mapping[str, Any]) -> None:
    """Process 0 has just written ``run.json``: a process that does not see it there
    would write a shard that process 0 never merges."""
    try:
        seen = json.loads((out / RUN_FILE).read_text())["invocations"][-1]
    except (OSError, ValueError, KeyError, IndexError):
        seen = None
    if seen != invocation:
        raise ValueError(f"process {group.index} (host {socket.gethostname()}) does not see the "
                         f"{RUN_FILE} that process 0 has just written in {out}: the run directory "
                         "must be on a filesystem shared by all processes")


def _run_group(group: ProcessGroup, out: Path, config: dict, invocation: dict, selected,
               problems, decode_batch, batch_size: int, progress: bool,
               bar_label: str) -> dict[str, Any]:
    """One process's part of a multi-process run (module docstring)."""
    ids = json.dumps([[i, p.id] for i, p in selected])
    share(group, f"announced/{group.index}", {
        "config": config, "selection": hashlib.sha256(ids.encode()).hexdigest(),
        "n_selected": len(selected), "batch_size": batch_size,
        "host": socket.gethostname(), "device": invocation["device"]})
    barrier(group, "announced")
    with contextlib.ExitStack() as stack:
        if group.index == 0:
            announced = [shared(group, f"announced/{k}") for k in range(group.count)]
            _check_agreement(announced)
            invocation["processes"] = [{"host": a["host"], "device": a["device"]}
                                       for a in announced]
            # Held until the end, as by a single process: a second job in this directory
            # fails here, before touching run.json.
            store = stack.enter_context(ResultStore(out / RESULTS_FILE, fields=EVAL_RECORD_FIELDS,
                                                    problems=problems))
            run = _prepare_run_dir(out, config, invocation)
            merge_shards(store, _shards(out))  # an interrupted run's records count as done
            todo = [pos for pos, (_, p) in enumerate(selected) if not store.is_done(p.id)]
            share(group, "plan", {"todo": todo, "invocation": run["invocations"][-1]})
        barrier(group, "planned")
        plan = shared(group, "plan")
        if group.index != 0:
            _check_shared_dir(out, group, plan["invocation"])
        todo = [selected[pos] for pos in plan["todo"]]

        bar = tqdm(total=len(selected), initial=len(selected) - len(todo), unit="problem",
                   desc=f"{bar_label} ({group.count} processes)", file=sys.stderr,
                   disable=not (progress and group.index == 0))
        shown = 0
        with ResultStore(out / shard_file(group.index, group.count),
                         fields=EVAL_RECORD_FIELDS, problems=problems) as shard:
            while True:
                raise_if_peer_failed(group)
                # Batches are claimed from a shared counter, in problem order, and are the
                # ones a single process would decode.
                claimed = group.client.key_value_increment(f"{group.prefix}/next_batch", 1) - 1
                batch = todo[claimed * batch_size:(claimed + 1) * batch_size]
                if not batch:
                    break
                for record in decode_batch(batch):
                    shard.append(record)
                finished = group.client.key_value_increment(f"{group.prefix}/finished",
                                                            len(batch))
                bar.update(finished - shown)  # every process's problems, as of now
                shown = finished
        bar.close()
        barrier(group, "decoded")

        if group.index == 0:
            merge_shards(store, _shards(out))
            missing = [p.id for _, p in selected if not store.is_done(p.id)]
            if missing:
                raise RuntimeError(f"{len(missing)} problems have no result after merging the "
                                   f"shards of {out} (first: {missing[0]})")
            summary = run_summary(store.records, run)
            write_summary(out, summary)
            _record_peak_memory(out, run)  # process 0's device
    barrier(group, "merged")
    if group.index != 0:
        summary = json.loads((out / SUMMARY_FILE).read_text())
    return summary


def _candidate_record(model, problem: Problem, cand, verdict, chosen: bool, end) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    if problem.benchmark == GPQA:
        rec["tokens_packed"] = pack_tokens(cand.tokens)
    else:
        rec["tokens"] = list(map(int, cand.tokens))
    rec.update({
        "n_tokens": len(cand.tokens), "ended": cand.ended, "ended_by": end, "log_p": cand.log_p,
        "D": cand.depth, "final_entropy": cand.final_entropy, "acceptance": cand.acceptance,
        "depth_decisions": cand.depth_decisions, "mh_decisions": cand.mh_decisions,
        "correct": verdict.correct, "extracted": verdict.extracted, "chosen": chosen,
    })
    if cand.weight is not None:  # SMC particle
        rec["weight"] = cand.weight
    if cand.extras is not None:  # the method's own statistics
        rec["extras"] = cand.extras
    return rec


def _completion_text(model, cand, stop: Optional[Sequence[str]]) -> tuple[str, Optional[int | str]]:
    """What a completion says (its tokens decoded, cut where its first stop string begins)
    and what ended it (`degs_jax.text.ended_by`: an end token's id or a stop string)."""
    decoded = model.tokenizer.decode(cand.tokens, skip_special_tokens=True)
    return cut_at_stop(decoded, stop), ended_by(cand.tokens, cand.ended, model.eos_ids, stop, decoded)


def _record(model, problem: Problem, index: int, output, result, batch_len: int,
            decode_s: float, num_layers: int, grader: Grader, chat: bool,
            keep_candidates: bool, stop: Optional[Sequence[str]]) -> dict[str, Any]:
    """One problem's graded record (`result`: its batch's `DecodeResult`, or None for a
    refilled problem, whose `output.counters` are its own); `stop`: the run's stop strings,
    where the graded text is cut."""
    chosen = output.chosen
    t0 = time.perf_counter()
    candidates = []
    verdict = None
    if keep_candidates:
        for cand in output.candidates:
            text, end = _completion_text(model, cand, stop)
            v = grader.grade(problem, text, chat=chat)
            if cand is chosen:
                verdict, chosen_text, chosen_end = v, text, end
            candidates.append(_candidate_record(model, problem, cand, v, cand is chosen, end))
    if verdict is None:
        chosen_text, chosen_end = _completion_text(model, chosen, stop)
        verdict = grader.grade(problem, chosen_text, chat=chat)
    grade_s = time.perf_counter() - t0

    counters = getattr(output, "counters", None)
    share = 1
    if counters is None:
        counters, share = result.counters, batch_len
    counters = {k: v / share for k, v in counters.items()}
    fwd_eq = counters["forward_tokens"] + counters["probed_token_layers"] / num_layers
    record: dict[str, Any] = {
        "id": problem.id, "index": index,
        "correct": bool(verdict.correct), "extracted": verdict.extracted,
        "grade_detail": verdict.detail if problem.benchmark != GPQA else verdict.detail[:40],
        **({"isolation": verdict.isolation} if verdict.isolation else {}),
        **transcript_fields(problem, chosen_text),
        "n_tokens": len(chosen.tokens), "ended": chosen.ended, "ended_by": chosen_end,
        "log_p": chosen.log_p, "D": chosen.depth, "final_entropy": chosen.final_entropy,
        "acceptance": chosen.acceptance, "mean_acceptance": _mean_or_none(chosen.acceptance),
        "depth_decisions": chosen.depth_decisions,
        "depth_decisions_total": None if chosen.depth_decisions is None else sum(chosen.depth_decisions),
        "mh_decisions": chosen.mh_decisions,
        "generated_tokens": counters["generated_tokens"],
        "forward_tokens": counters["forward_tokens"],
        "probed_token_layers": counters["probed_token_layers"],
        "decode_steps": counters.get("decode_steps"),  # (a method of its own may not count them)
        "forward_equivalents": fwd_eq,
        "decode_s": decode_s / batch_len, "grade_s": grade_s,
        "wall_clock_s": decode_s / batch_len + grade_s,
    }
    if chosen.extras is not None:  # the method's own statistics of the chosen candidate
        record["extras"] = chosen.extras
    if share > 1:
        record["batch_share"] = share  # counters are the batch's totals / share
    if getattr(output, "advance_seconds", None) is not None:  # refill: the stream's fastest advance
        record["advance_s"] = output.advance_seconds
    if output.diagnostics is not None:  # SMC: log Z-hat, ESS, resamplings; SPS: rollouts
        record["diagnostics"] = output.diagnostics
    if keep_candidates:
        record["candidates"] = candidates
        record["n_candidates"] = len(candidates)
        record["n_candidates_correct"] = sum(c["correct"] for c in candidates)
    return record


def run_summary(records: Sequence[Mapping[str, Any]], run: Mapping[str, Any]) -> dict[str, Any]:
    """``summary.json`` of a run's records and its ``run.json`` content: accuracy with its
    interval, means, the last invocation's versions, and the kept candidates' accuracy and
    pass@k."""
    cfg = run["config"]
    summary = summarize(records, template_sha256=cfg["template_sha256"],
                        versions=run["invocations"][-1]["versions"], config=cfg,
                        n_problems=len(records))
    summary["means"].pop("index", None)
    summary["means"].pop("ended_by", None)  # token ids, not quantities
    per_step = tokens_per_decode_step(records)
    if per_step is not None:
        summary["tokens_per_decode_step"] = per_step
    extras = extras_summary(records)
    if extras:  # the method's own statistics
        summary["extras"] = extras
    levels = sorted({r["isolation"] for r in records if r.get("isolation")})
    if levels:  # HumanEval: what the programs were graded under
        summary["isolation"] = levels
    if records and all("candidates" in r for r in records):
        n = [len(r["candidates"]) for r in records]
        c = [sum(x["correct"] for x in r["candidates"]) for r in records]
        k_max = min(n)
        summary["candidates"] = {
            "n_candidates": int(sum(n)),
            "candidate_accuracy": float(sum(c) / sum(n)) if sum(n) else math.nan,
            "pass_at_k": {str(k): float(np.mean([pass_at_k(ni, ci, k) for ni, ci in zip(n, c)]))
                          for k in sorted({1, k_max}) if k_max >= 1},
        }
    return summary


def extras_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The method's own statistics of the chosen candidates (each record's "extras": what
    its `RunDetails.candidate_fields` named), by name in the order first seen: one whose
    every value is a number (not a bool) is averaged, `{"mean": m, "n": records with it}`;
    any other is counted, `{"counts": {value: records}}`, most frequent first (the value
    as JSON text where it is not a string). None values are left out."""
    values: dict[str, list[Any]] = {}
    for record in records:
        for name, value in (record.get("extras") or {}).items():
            if value is not None:
                values.setdefault(name, []).append(value)
    summary = {}
    for name, seen in values.items():
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in seen):
            summary[name] = {"mean": float(np.mean(seen)), "n": len(seen)}
        else:
            keys = [v if isinstance(v, str) else json.dumps(v, sort_keys=True) for v in seen]
            counts = collections.Counter(keys)
            summary[name] = {"counts": dict(counts.most_common())}
    return summary


# The summary table's rows that only some methods have (a quantity no record has is not
# shown: MCMC's acceptance and beta·ΔD decisions, D(x) where nothing was probed).
_METHOD_ROWS = (("acceptance rate", "mean_acceptance", ".3f", ""),
                ("MH decisions decided by beta·ΔD", "depth_decisions_total", ".2f", " / problem"))
# Distinct values of a counted extra shown in the table (summary.json has them all).
SHOWN_COUNTS = 5


def tokens_per_decode_step(records: Sequence[Mapping[str, Any]]) -> Optional[float]:
    """Generated tokens per decode step over the records that count decode steps (None if
    none does: runs stored before the counter). A drafted proposal verifies several guessed
    tokens in one forward (`generation.drafted_decode_step`); undrafted runs are just under
    1 (a proposal that reaches its limit takes one more step, for its last token's lens
    statistics)."""
    counted = [r for r in records if r.get("decode_steps") is not None]
    steps = sum(r["decode_steps"] for r in counted)
    return sum(r["generated_tokens"] for r in counted) / steps if steps else None


def tokens_per_step_postfix(records: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The progress line's `tokens_per_decode_step` (nothing where the records have none)."""
    value = tokens_per_decode_step(records)
    return {} if value is None else {"tok/step": f"{value:.2f}"}


def format_summary(summary: Mapping[str, Any]) -> str:
    """The printed table of a run's summary."""
    cfg = summary["config"]
    acc = summary["accuracy"]
    means = summary["means"]

    def m(name: str, fmt: str, unit: str = "") -> str:
        v = means.get(name)
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{fmt}}{unit}"

    if acc["n"]:
        acc_s = (f"{acc['accuracy']:.3f}  95% CI [{acc['ci_low']:.3f}, {acc['ci_high']:.3f}]  "
                 f"({acc['correct']}/{acc['n']})")
    else:
        acc_s = "n/a (no problems)"
    rows = [
        ("accuracy", acc_s),
        ("completion tokens", m("n_tokens", ".1f", " / problem")),
        *((label, m(name, fmt, unit)) for label, name, fmt, unit in _METHOD_ROWS if name in means),
        ("generated tokens", m("generated_tokens", ".1f", " / problem")),
        *((("generated tokens per decode step", f"{summary['tokens_per_decode_step']:.2f}"),)
          if "tokens_per_decode_step" in summary else ()),
        ("forward-equivalents", m("forward_equivalents", ".1f", " / problem")),
        ("wall-clock", m("wall_clock_s", ".2f", " s / problem")),
        ("mean log p(x)", m("log_p", ".2f")),
        *((("mean D(x)", m("D", ".4f")),) if "D" in means else ()),
    ]
    for name, stat in summary.get("extras", {}).items():  # the method's own statistics
        if "mean" in stat:
            rows.append((f"mean {name}", f"{stat['mean']:.4g}"))
        else:
            shown = list(stat["counts"].items())[:SHOWN_COUNTS]
            more = len(stat["counts"]) - len(shown)
            rows.append((name, ", ".join(f"{value} ({count})" for value, count in shown)
                         + (f", {more} more values" if more else "")))
    if "candidates" in summary:
        c = summary["candidates"]
        rows.append(("candidates", f"{c['n_candidates']} graded, accuracy "
                                   f"{c['candidate_accuracy']:.3f}, " + ", ".join(
                                       f"pass@{k} {v:.3f}" for k, v in c["pass_at_k"].items())))
    head = (f"degs eval: {cfg['model']['name']} | {cfg['benchmark']} | {cfg['method']} | "
            f"seed {cfg['seed']} | {summary['n_problems']} problems")
    width = max(len(r[0]) for r in rows)
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows] +
                     ["  (wall-clock includes compilation of each new prompt-length bucket)"])
