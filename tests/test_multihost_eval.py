"""Multi-process `degs eval` and `degs reproduce`: two CPU processes on loopback, as one
jax.distributed job.

Every run is a real `python -m degs_jax.cli` process (jax.distributed cannot be joined
twice, nor after JAX has started, in the pytest process), on a 4-layer random model
with SmolLM2's tokenizer, which compiles in seconds. The runs share a persistent XLA
compilation cache, which the single-process reference run fills first.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from degs_jax import cli
from degs_jax.eval.results import ResultStore, accuracy, merge_shards
from degs_jax.models import loading
from xla_flags import one_host_device

pytestmark = pytest.mark.slow

# deepmind500 problems 0, 1, 3, 4 share a prompt-length bucket, problem 2 has its own.
# A problem is decoded in different batches by one and by two processes (and on resume):
# --batch-invariant makes its numbers independent of the batch, so records compare
# bitwise (without it, log_p and the entropies differ in the last bits on some CPUs).
EVAL = ["eval", "--benchmark", "deepmind500", "--method", "temperature", "--temperature", "1.0",
        "--seed", "7", "--max-new-tokens", "16", "--dtype", "float32", "--no-progress",
        "--batch-invariant"]
FIELDS = ("id", "index", "completion", "correct", "extracted", "n_tokens", "log_p", "D",
          "final_entropy", "generated_tokens")
TIMEOUT_S = 300  # per command: a hung barrier fails the test instead of hanging it


@dataclasses.dataclass(frozen=True)
class Setup:
    env: dict  # for the subprocesses
    model: Path | str  # --model: a model directory, or a built-in name


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A model directory (SmolLM2's tokenizer, so real prompts and chat template, on 4
    random layers) and the environment of the CLI processes."""
    import jax
    import numpy as np
    from safetensors.numpy import save_file

    from degs_jax.models import init_params
    from degs_jax.models.checkpoint import params_to_hf
    from degs_jax.models.loading import load

    smollm2 = load("smollm2-135m", progress=False)
    cfg = dataclasses.replace(smollm2.cfg, hidden_size=32, intermediate_size=64, num_layers=4,
                              num_heads=4, num_kv_heads=2, head_dim=8)
    params = init_params(cfg, jax.random.key(0), np.float32)
    model = tmp_path_factory.mktemp("tiny")
    save_file({k: np.asarray(v) for k, v in params_to_hf(params, cfg).items()},
              str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps(cfg.to_hf()))
    smollm2.tokenizer.save_pretrained(model)

    # gRPC honours proxy variables, which would send the loopback coordinator's traffic
    # to a proxy; XLA_FLAGS fakes several host devices (one per process is meant).
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(XLA_FLAGS=one_host_device(os.environ.get("XLA_FLAGS", "")), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONUNBUFFERED="1")
    return Setup(env, model)


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """A single-process run of the first 5 problems (fills the compilation cache)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    _run_one(setup, out, "--limit", 5)
    assert [r["index"] for r in _records(out)] == [0, 1, 2, 3, 4]
    return out


def _degs(setup, out, *extra, base=EVAL, launcher=None):
    """The command line; ``launcher``: Python code run in place of ``-m degs_jax.cli``."""
    start = ["-m", "degs_jax.cli"] if launcher is None else ["-c", launcher]
    return [sys.executable, *start, *base, "--model", str(setup.model), "--out", str(out),
            *map(str, extra)]


def _run_one(setup, out, *extra, base=EVAL, launcher=None):
    done = subprocess.run(_degs(setup, out, *extra, base=base, launcher=launcher), env=setup.env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(setup, out, extra=((), ()), base=EVAL, launcher=None):
    """Processes 0 and 1 of one job (``extra``: each one's additional arguments); returns
    [(returncode, stdout, stderr)] by process id."""
    port = _free_port()
    logs = [(out.parent / f"{out.name}.p{k}.out", out.parent / f"{out.name}.p{k}.err")
            for k in range(2)]
    procs = []
    try:
        for k in range(2):
            argv = _degs(setup, out, *extra[k], "--coordinator", f"127.0.0.1:{port}",
                         "--num-processes", 2, "--process-id", k, base=base, launcher=launcher)
            with open(logs[k][0], "w") as stdout, open(logs[k][1], "w") as stderr:
                procs.append(subprocess.Popen(argv, env=setup.env, stdout=stdout, stderr=stderr))
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, logs[k][0].read_text(), logs[k][1].read_text())
            for k, proc in enumerate(procs)]


def _records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "results.jsonl").read_text().splitlines()]


def _assert_same(records, reference):
    """Same problems with the same outputs (timings aside)."""
    for field in FIELDS:
        assert [r[field] for r in records] == [r[field] for r in reference], field


def _assert_ok(results):
    for k, (rc, _, err) in enumerate(results):
        assert rc == 0, f"process {k}:\n{err[-3000:]}"


def test_two_processes_match_one_and_resume(setup, reference, tmp_path):
    multi = tmp_path / "multi"
    ref = _records(reference)

    # A fresh run split over two processes (3 problems: an odd count).
    results = _run_two(setup, multi, (["--limit", 3], ["--limit", 3]))
    _assert_ok(results)
    _assert_same(_records(multi), ref[:3])
    assert sorted(p.name for p in multi.iterdir()) == ["results.jsonl", "run.json", "summary.json"]
    summary = json.loads((multi / "summary.json").read_text())
    assert summary["n_problems"] == 3
    assert summary["accuracy"]["correct"] == accuracy(ref[:3]).correct
    assert "accuracy" in results[0][1] and results[1][1] == ""  # only process 0's table
    run = json.loads((multi / "run.json").read_text())
    (invocation,) = run["invocations"]
    assert invocation["process_count"] == 2 and len(invocation["processes"]) == 2
    assert run["config"] == json.loads((reference / "run.json").read_text())["config"]
    first_run = (multi / "results.jsonl").read_bytes()

    # Interrupted earlier: a process's shard with problem 4 was never merged (its record
    # is marked to show that it is kept, not decoded again). Resuming with --limit 5
    # merges it first (results.jsonl is append-only), then decodes only problem 3.
    (multi / "results.process-1-of-2.jsonl").write_text(json.dumps(dict(ref[4], decode_s=-1.0))
                                                        + "\n")
    results = _run_two(setup, multi, (["--limit", 5], ["--limit", 5]))
    _assert_ok(results)
    records = _records(multi)
    assert [r["index"] for r in records] == [0, 1, 2, 4, 3]
    _assert_same(sorted(records, key=lambda r: r["index"]), ref)
    assert (multi / "results.jsonl").read_bytes().startswith(first_run)
    assert records[3]["decode_s"] == -1.0 and records[4]["decode_s"] > 0
    assert not list(multi.glob("results.process-*"))
    assert json.loads((multi / "summary.json").read_text())["accuracy"] == \
        json.loads((reference / "summary.json").read_text())["accuracy"]
    assert len(json.loads((multi / "run.json").read_text())["invocations"]) == 2


def test_one_process_merges_leftover_shards(setup, reference, tmp_path):
    # The reference run's records, spread over shards as if a two-process run had been
    # interrupted before its merge (with problem 0 merged already, and its shard's copy
    # left behind): a one-process rerun merges them, in problem order, and decodes nothing.
    out = tmp_path / "run"
    out.mkdir()
    ref = _records(reference)
    (out / "run.json").write_bytes((reference / "run.json").read_bytes())
    (out / "results.jsonl").write_text(json.dumps(ref[0]) + "\n")
    shards = {0: [ref[3], ref[1]], 1: [ref[0], ref[4], ref[2]]}
    for k, records in shards.items():
        (out / f"results.process-{k}-of-2.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    _run_one(setup, out, "--limit", 5)
    assert _records(out) == ref
    assert not list(out.glob("results.process-*"))


@pytest.mark.parametrize("case", ["different seed", "missing data on process 1"])
def test_a_failure_stops_every_process(case, setup, tmp_path):
    # Process 0 refuses a configuration that differs between processes; a failure in
    # process 1 (before the first barrier) stops process 0 instead of leaving it waiting.
    out = tmp_path / "run"
    extra = (["--seed", 8] if case == "different seed"
             else ["--data-dir", tmp_path / "missing"])
    (rc0, _, err0), (rc1, _, err1) = _run_two(setup, out, (["--limit", 2], ["--limit", 2, *extra]))
    assert rc0 == rc1 == 2, (err0[-2000:], err1[-2000:])
    if case == "different seed":
        assert ("process 1 was started with a different configuration than process 0 "
                "(seed: process 0 has 7, process 1 has 8)") in err0
        assert "process 0 of 2 failed: ValueError: process 1 was started" in err1
    else:
        assert "missing/deepmind500.jsonl" in err1
        assert "process 1 of 2 failed: FileNotFoundError" in err0
    assert not out.exists()  # refused before anything was written


def test_merge_shards_skips_stored_ids_and_orders_by_index(tmp_path):
    with ResultStore(tmp_path / "results.jsonl") as store:
        store.append({"id": "b", "index": 1})
        (tmp_path / "s0.jsonl").write_text('{"id": "d", "index": 3}\n{"id": "b", "index": 1}\n')
        # a torn last line (a crash mid-write) is cut off, as when resuming a store
        (tmp_path / "s1.jsonl").write_text('{"id": "c", "index": 2}\n{"id": "a", "index": 0}\n{"id')
        (tmp_path / "s2.jsonl").write_text('{"id": "a", "index": 0}\n')
        shards = [tmp_path / f"s{k}.jsonl" for k in range(3)]
        assert merge_shards(store, shards) == 3
        assert [r["id"] for r in store.records] == ["b", "a", "c", "d"]
        assert not any(s.exists() for s in shards)
        with ResultStore(tmp_path / "busy.jsonl"):  # still being written by another process
            with pytest.raises(RuntimeError, match="being written by another run"):
                merge_shards(store, [tmp_path / "busy.jsonl"])


@pytest.mark.parametrize("argv, message", [
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"], "missing --process-id"),
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "h:1"],
     "--process-id 2 is out of range 0..1"),
    (["--num-processes", "0", "--process-id", "0", "--coordinator", "h:1"],
     "--num-processes must be positive"),
    (["--num-processes", "2", "--process-id", "0", "--coordinator", "h"], "must be HOST:PORT"),
])
def test_bad_distributed_options(argv, message, tmp_path, capsys):
    rc = cli.main([*EVAL, "--out", str(tmp_path / "x"), *argv])
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_batch_invariant_runs_do_not_depend_on_processes_or_batch_size(setup, tmp_path):
    """Issue 16: with `--batch-invariant`, in bfloat16 and through the MH chain, the
    records of one process decoding 4 problems per batch equal bitwise those of two
    processes decoding 1 per batch (other batches, other neighbours, other buffers)."""
    chain = ["eval", "--benchmark", "deepmind500", "--method", "degs_mcmc", "--block-len", 4, "--num-blocks", 2,
             "--mh-steps", 2, "--seed", 7, "--dtype", "bfloat16", "--batch-invariant", "--limit", 4, "--no-progress"]
    chain = [str(a) for a in chain]
    one = tmp_path / "one"
    _run_one(setup, one, "--batch-size", 4, base=chain)
    two = tmp_path / "two"
    _assert_ok(_run_two(setup, two, (["--batch-size", 1], ["--batch-size", 1]), base=chain))
    # (records are in the order the problems finished, which a refilled run's chunk sizes,
    # chosen from wall-clock time, may change: compared by problem)
    records = _records(two)
    reference = sorted(_records(one), key=lambda r: r["index"])
    assert [r["index"] for r in reference] == [0, 1, 2, 3]
    # generated_tokens is the batch's work shared out per problem (a cost, not a result)
    for field in [f for f in FIELDS if f != "generated_tokens"] + ["acceptance"]:
        assert [r[field] for r in sorted(records, key=lambda r: r["index"])] == [r[field] for r in reference], field
    assert json.loads((one / "run.json").read_text())["config"]["model"]["batch_invariant"] is True


def test_two_processes_on_a_fresh_cache_convert_the_builtin_model_once(setup, tmp_path):
    """The README's launch command on a fresh machine: no converted weights yet, so one
    process converts the built-in GGUF under the cache's file lock while the other waits
    for it. Until the backend was started in `_join_job`, the converting process's first
    JAX array waited for the waiting process's device topology: a deadlock, ended by
    jax's 2-minute topology timeout with process 0 failing (found on 2 x H200)."""
    fresh = Setup(dict(setup.env, DEGS_JAX_CACHE=str(tmp_path / "fresh")), "smollm2-135m")
    base = ["eval", "--benchmark", "gsm8k", "--method", "greedy", "--max-new-tokens", "2",
            "--limit", "2", "--batch-size", "1", "--no-progress"]
    _assert_ok(_run_two(fresh, tmp_path / "run", base=base))
    assert [r["index"] for r in _records(tmp_path / "run")] == [0, 1]
    converted = tmp_path / "fresh" / f"gguf-v{loading.GGUF_CACHE_VERSION}"
    assert len(list(converted.glob("*/model.safetensors"))) == 1


# A study of greedy decoding and a pool (2 candidates each), on 2 problems, one per batch
# (both prompts in one length bucket: one compilation per decoder), with its layer pass
# one problem per group: two processes take both batches (or groups) in one step, one
# process streams a job's problems through its slot in one refilled call (the layer pass:
# one group per step). Both decode the same batches, so their records are equal without
# --batch-invariant. STUDY_CLI is `degs` with a layer pass of one problem per group and
# two candidates per lens call (on the CPU a call at the default row budget takes ~10 s).
STUDY = ["reproduce", "--benchmarks", "deepmind500", "--methods", "greedy", "--limit", "2",
         "--pool-benchmarks", "deepmind500", "--hp", "max_new_tokens=8", "--hp", "pool.n=2",
         "--batch-size", "1", "--seed", "7", "--dtype", "float32", "--no-progress"]
STUDY_CLI = ("import degs_jax.reproduce.study as study; study.LAYER_PASS_PROBLEMS = 1; "
             "study.LENS_ROW_BUDGET = 2 * 5 * study.LENGTH_BUCKET; "
             "from degs_jax.cli import entry_point; entry_point()")


def _layer_records(study):
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (study / "pool/deepmind500/layers.jsonl").read_text().splitlines()]


def test_a_study_in_two_processes_matches_one(setup, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _run_one(setup, one, "--no-report", base=STUDY, launcher=STUDY_CLI)
    results = _run_two(setup, two, base=STUDY, launcher=STUDY_CLI)
    _assert_ok(results)
    for job in ("runs/deepmind500/greedy", "pool/deepmind500"):
        records = _records(two / job)
        assert [r["index"] for r in records] == [0, 1]
        _assert_same(records, _records(one / job))
        assert not list((two / job).glob("results.process-*"))
    assert [r["candidates"] for r in _records(two / "pool/deepmind500")] == \
        [r["candidates"] for r in _records(one / "pool/deepmind500")]
    layers = _layer_records(two)
    assert [r["index"] for r in layers] == [0, 1] and layers == _layer_records(one)
    assert [len(r["candidates"]) for r in layers] == [2, 2]
    (invocation,) = json.loads((two / "study.json").read_text())["invocations"]
    assert invocation["status"] == "finished" and invocation["process_count"] == 2
    assert [(s["job"], s["problems"]) for s in invocation["steps"]] == [
        ("runs/deepmind500/greedy", [0, 1]), ("pool/deepmind500", [0, 1]),
        ("pool/deepmind500/layers", [0, 1])]
    single = json.loads((one / "study.json").read_text())["invocations"][0]["steps"]
    # one process: each decoder job streams both problems through its one slot in one
    # refilled call; the layer pass takes a group per step
    assert [s["problems"] for s in single] == [[0, 1], [0, 1], [0], [1]]
    (rc0, out0, err0), (rc1, out1, err1) = results
    assert "report: " in out0 and (two / "report.md").exists()  # process 0 writes it
    assert "study finished" in err0 and out1 == "" and "study finished" not in err1


def test_a_study_refuses_processes_started_differently(setup, tmp_path):
    out = tmp_path / "study"
    (rc0, _, err0), (rc1, _, err1) = _run_two(setup, out, ([], ["--hp", "pool.temperature=0.5"]),
                                              base=STUDY)
    assert rc0 == rc1 == 2, (err0[-2000:], err1[-2000:])
    assert "process 1 was started with another study than process 0 (overrides: " in err0
    assert "process 0 of 2 failed: ValueError: process 1 was started with another study" in err1
    assert not out.exists()  # refused before anything was written


def test_a_study_in_several_processes_refuses_single_process_modes(tmp_path, capsys):
    rc = cli.main(["reproduce", "--out", str(tmp_path / "x"), "--plan", "--coordinator", "h:1",
                   "--num-processes", "2", "--process-id", "0"])
    assert rc == 2 and "--plan runs in one process" in capsys.readouterr().err
