"""`degs eval` / `degs analyze` end to end on the built-in SmolLM2-135M (CPU).

The model is loaded once per session and the CLI runs in-process with that model
(`degs_jax.cli._load` patched), except the SIGKILL resumability test, which needs real
processes; those share the session's converted-weights cache ($DEGS_JAX_CACHE) and a
persistent XLA compilation cache, so only the first of them compiles.

Compilation is most of these tests' time, and every prompt width is a program of its own:
the greedy runs pad their prompts to one width (`shared_prompt_width`), so the five
benchmarks, the batch-size test and the damaged-files test share two compiled decodes
(three slots, one slot) instead of compiling one per benchmark and test.
"""

import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from degs_jax import cli
from degs_jax.eval import Grader, load_benchmark
from degs_jax.eval.results import unpack_tokens
from xla_flags import users_flags

pytestmark = pytest.mark.slow

BENCHMARKS = ("math500", "deepmind500", "gsm8k", "humaneval", "gpqa")
TINY = ["--max-new-tokens", "16", "--no-progress"]
# The five benchmarks' first three prompts are 68 to 209 tokens (chat template, SmolLM2's
# tokenizer): padded to 224, every greedy run of the module decodes with the same shapes.
SHARED_PROMPT_WIDTH = 224


@pytest.fixture(scope="session")
def model():
    from degs_jax.models.loading import load

    return load("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def grader():
    with Grader() as g:
        yield g


@pytest.fixture
def degs(model, grader, monkeypatch, capsys):
    """Run `degs ...` in-process with the session's model and grader; returns (rc, out, err)."""
    import degs_jax.eval.runner as runner

    monkeypatch.setattr(cli, "_load", lambda args: model)
    real = runner.run_eval
    monkeypatch.setattr(runner, "run_eval", lambda *a, **k: real(*a, grader=grader, **k))

    def run(*argv):
        capsys.readouterr()
        rc = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture
def shared_prompt_width(monkeypatch):
    """Prompts padded to a multiple of SHARED_PROMPT_WIDTH (pad_prompts' bucket, 16, raised):
    the decode runs as for a run whose longest prompt is that long, with one compiled
    program for every greedy test of the module."""
    from degs_jax import decoders, generation

    monkeypatch.setattr(decoders, "pad_prompts",
                        functools.partial(generation.pad_prompts, multiple=SHARED_PROMPT_WIDTH))


def run_stops(run_dir) -> list:
    """The stop strings a run recorded (none: [])."""
    return json.loads((Path(run_dir) / "run.json").read_text())["config"]["hyperparameters"].get("stop") or []


def _records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_greedy_on_each_benchmark(benchmark, degs, model, tmp_path, shared_prompt_width):
    out = tmp_path / benchmark
    extra = ["--keep-candidates"] if benchmark == "gpqa" else []
    rc, stdout, err = degs("eval", "--benchmark", benchmark, "--method", "greedy", "--limit", 3,
                           "--batch-size", 3, "--out", out, *TINY, *extra)
    assert rc == 0, err
    problems = load_benchmark(benchmark, limit=3)
    records = sorted(_records(out), key=lambda r: r["index"])  # written as each problem finishes
    assert [r["id"] for r in records] == [p.id for p in problems]
    assert [r["index"] for r in records] == [0, 1, 2]
    for r in records:
        assert isinstance(r["correct"], bool)
        assert 1 <= r["n_tokens"] <= 16
        # what ended it: an end token's id or a stop string (HumanEval's Codex stops), none at the budget
        stops = run_stops(out)
        assert (r["ended_by"] in model.eos_ids or r["ended_by"] in stops) if r["ended"] else r["ended_by"] is None
        assert 0.0 <= r["D"] <= 1.0 and r["log_p"] <= 0.0
        assert r["generated_tokens"] > 0 and r["forward_equivalents"] > r["forward_tokens"] > 0
        assert r["wall_clock_s"] > 0 and r["acceptance"] is None
        if benchmark == "gpqa":
            assert "completion" not in r and len(r["completion_sha256"]) == 64
            assert r["extracted"] in (None, "A", "B", "C", "D")
            (cand,) = r["candidates"]
            assert "tokens" not in cand and len(unpack_tokens(cand["tokens_packed"])) == r["n_tokens"]
        else:
            assert isinstance(r["completion"], str) and r["completion"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"]["n"] == 3 and summary["n_problems"] == 3
    assert "ended_by" not in summary["means"]  # token ids are not averaged
    assert summary["means"]["forward_equivalents"] > 0
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["method"] == "greedy" and run["config"]["seed"] == 0
    assert run["invocations"][0]["refill"] is True  # the default schedule
    assert run["config"]["hyperparameters"]["max_new_tokens"] == 16
    assert run["config"]["hyperparameters"]["lsub"] == [4, 9, 14, 18, 22, 26, 30]
    assert len(run["config"]["template_sha256"]) == 64
    assert run["invocations"][0]["versions"]["jax"]
    for field in ("accuracy", "95% CI", "completion tokens", "generated tokens", "forward-equivalents",
                  "wall-clock", "mean D(x)"):
        assert field in stdout
    assert "acceptance rate" not in stdout and "n/a" not in stdout  # MCMC's rows: not greedy's
    if benchmark == "gpqa":
        _assert_no_gpqa_text(problems, out, stdout + err)


def _assert_no_gpqa_text(problems, out, console):
    needles = []
    for p in problems:
        needles += [p.question[:50], p.question[-50:]]
        needles += [c for c in p.choices if len(c) >= 8]
    written = {f: f.read_text(errors="replace") for f in out.rglob("*") if f.is_file()}
    assert set(f.name for f in written) >= {"run.json", "results.jsonl", "summary.json"}
    for text in list(written.values()) + [console]:
        for needle in needles:
            assert needle not in text


def test_best_of_n_keeps_and_grades_candidates_then_analyze(degs, tmp_path):
    out = tmp_path / "pool"
    # deepmind500 problems 0 and 1 share a prompt-length bucket: one compilation
    rc, stdout, err = degs("eval", "--benchmark", "deepmind500", "--method", "best_of_n", "--n", 2,
                           "--limit", 2, "--keep-candidates", "--out", out, *TINY)
    assert rc == 0, err
    records = sorted(_records(out), key=lambda r: r["index"])
    assert [r["id"] for r in records] == [f"deepmind500/{i}" for i in range(2)]
    for r in records:
        cands = r["candidates"]
        assert len(cands) == 2 == r["n_candidates"]
        assert all(isinstance(c["correct"], bool) and len(c["tokens"]) == c["n_tokens"] for c in cands)
        (chosen,) = [c for c in cands if c["chosen"]]
        assert chosen["log_p"] == max(c["log_p"] for c in cands) == r["log_p"]
        assert chosen["correct"] == r["correct"] and chosen["D"] == r["D"]
        assert r["generated_tokens"] == sum(c["n_tokens"] for c in cands)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["candidates"]["n_candidates"] == 4
    assert set(summary["candidates"]["pass_at_k"]) == {"1", "2"}
    assert "pass@2" in stdout

    rc, stdout, err = degs("analyze", out)
    assert rc == 0, err
    assert "AUC" in stdout and "accuracy by D(x) bucket" in stdout
    assert (out / "analysis.png").read_bytes()[:4] == b"\x89PNG"
    stats = json.loads((out / "analysis.json").read_text())["predictive_validity"]
    assert stats["n"] == 4 and stats["n_problems"] == 2

    rc, stdout, err = degs("analyze", out, "--lsub-sweep", "4,9,14;default")
    assert rc == 0, err
    sweep = json.loads((out / "lsub_sweep.json").read_text())
    assert [row["lsub"] for row in sweep["rows"]] == [[4, 9, 14], [4, 9, 14, 18, 22, 26, 30]]
    for row in sweep["rows"]:
        assert 0.0 <= row["degs_rerank_accuracy"] <= 1.0
        assert row["probe_forward_equivalents_per_token"] == pytest.approx(row["K"] / 30)
    assert "DEGS rerank" in stdout
    # Re-scoring with the default probe set reproduces the D(x) recorded during
    # generation (teacher-forced vs incremental: summation order only).
    generated = [c["D"] for r in records for c in r["candidates"]]
    rescored_mean = sweep["rows"][1]["mean_D"]
    assert rescored_mean == pytest.approx(sum(generated) / len(generated), abs=0.02)


@pytest.mark.parametrize("method,extra", [
    ("degs_smc", ["--n-particles", 3, "--resample-every", 4, "--ess-threshold", 1.0, "--keep-candidates"]),
    ("scalable_power", ["--block-len", 8, "--candidate-pool", 3, "--candidates-kept", 2, "--rollouts", 2,
                        "--rollout-horizon", 4]),
])
def test_smc_and_sps_record_their_diagnostics(method, extra, degs, tmp_path):
    out = tmp_path / method
    rc, stdout, err = degs("eval", "--benchmark", "math500", "--method", method, "--limit", 2, "--batch-size", 2,
                           "--out", out, *TINY, *extra)
    assert rc == 0, err
    for r in _records(out):
        assert 1 <= r["n_tokens"] <= 16 and r["forward_equivalents"] > 0
        d = r["diagnostics"]
        if method == "degs_smc":
            assert d["resamples"] >= 1 and len(d["ess"]) >= 1 and d["log_evidence"] <= 0.0
            weights = [c["weight"] for c in r["candidates"]]
            assert len(weights) == 3 and abs(sum(weights) - 1.0) < 1e-5
            assert sum(c["chosen"] for c in r["candidates"]) == 1
        else:
            assert d["rollouts"] > 0


def test_refuses_a_different_configuration(degs, tmp_path):
    out = tmp_path / "run"
    args = ["eval", "--benchmark", "gsm8k", "--method", "temperature", "--limit", 0, "--out", out,
            *TINY]
    rc, _, err = degs(*args)
    assert rc == 0, err
    # strict JSON (issue 58: the accuracy of no problems was written as NaN)
    summary = json.loads((out / "summary.json").read_text(), parse_constant=pytest.fail)
    assert summary["n_problems"] == 0 and summary["accuracy"]["accuracy"] is None
    rc, _, err = degs(*args)  # same configuration: resumes (nothing to do)
    assert rc == 0, err
    assert len(json.loads((out / "run.json").read_text())["invocations"]) == 2
    # spelling out a default is the same configuration
    rc, _, err = degs(*args, "--temperature", "0.25")
    assert rc == 0, err
    for changed in (["--seed", "1"], ["--temperature", "0.5"], ["--max-new-tokens", "17"]):
        rc, _, err = degs(*args, *changed)  # argparse: the last value wins
        assert rc == 2
        assert "different configuration" in err
    rc, _, err = degs("eval", "--benchmark", "math500", "--method", "temperature", "--limit", 0,
                      "--out", out, *TINY)
    assert rc == 2 and "benchmark: stored 'gsm8k', requested 'math500'" in err
    rc, _, err = degs("eval", "--benchmark", "gsm8k", "--method", "greedy", "--n", 2, "--out",
                      tmp_path / "x", *TINY)
    assert rc == 2 and "does not take n" in err


# --------------------------------------------------------------------------- SIGKILL


def _eval_cmd(out):
    # Three deepmind500 problems through 2 refilled slots (the default schedule), DEGS-MCMC
    # chains of 3 blocks of 6 tokens: a record is written as each problem finishes and its
    # slot takes problem 2, and a chain's snapshot after each block is in checkpoints/, so a
    # kill right after the first result line with a snapshot present lands with problems in
    # flight, one of them past its first block (compilations are cached on disk for the
    # later processes). Batch-invariant: a problem's record does not depend on which
    # problems shared its batch, nor on whether its chain was stopped and resumed.
    return [sys.executable, "-m", "degs_jax.cli", "eval", "--benchmark", "deepmind500", "--limit", "3",
            "--method", "degs_mcmc", "--block-len", "6", "--num-blocks", "3", "--mh-steps", "1", "--seed", "7",
            "--out", str(out), "--batch-size", "2", "--batch-invariant", "--model", "smollm2-135m", "--no-progress"]


def _count_lines(path):
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def process_env(tmp_path, **more):
    """The environment of a `degs` process a test starts: on the CPU, with a persistent
    compilation cache in `tmp_path` that the test's later processes share."""
    return dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONUNBUFFERED="1", **more)


def kill_after_first_record(cmd, env, out, log_path, also=lambda: True, **popen):
    """Run `cmd` (a `degs eval` into `out`) and SIGKILL it as soon as its first record is
    in out/results.jsonl (and `also()` holds); assert that it was killed that way (else
    show its log)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, **popen)
        deadline = time.monotonic() + 400
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if _count_lines(out / "results.jsonl") >= 1 and also():
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.05)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == -signal.SIGKILL, Path(log_path).read_text()[-3000:]


def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    """Killed with a record written and a chain mid-way (a snapshot in checkpoints/): the
    rerun skips the finished problem, goes on with the stopped chain from its last
    completed block (run.json says which and from where), and every record equals an
    uninterrupted run's, decision records included; no snapshot is left."""
    # Compiled as a user's processes are (tests/xla_flags.py): these three decode real
    # weights batch-invariantly, which the unoptimized code runs slowly enough to cost more
    # than the faster compilation saves (the test took 84 s instead of 103 s, measured).
    env = process_env(tmp_path, XLA_FLAGS=users_flags(os.environ.get("XLA_FLAGS", "")))
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    snapshots = killed / "checkpoints"
    kill_after_first_record(_eval_cmd(killed), env, killed, tmp_path / "killed.log",
                            also=lambda: any(snapshots.glob("*.npz")))
    results = killed / "results.jsonl"
    assert 1 <= _count_lines(results) < 3  # killed mid-run, with a result written
    written = {r["id"] for r in _records(killed)}
    stopped = {urllib.parse.unquote(path.stem) for path in snapshots.glob("*.npz")} - written
    assert stopped, "no chain was stopped mid-way"

    for out in (killed, reference):  # resume the killed run; then an uninterrupted one
        done = subprocess.run(_eval_cmd(out), env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "accuracy" in done.stdout

    # records are written as problems finish: compare them by problem
    resumed = sorted(_records(killed), key=lambda r: r["index"])
    uninterrupted = sorted(_records(reference), key=lambda r: r["index"])
    ids = [r["id"] for r in resumed]
    assert len(ids) == len(set(ids)) == 3  # nothing lost, nothing repeated
    assert written <= set(ids)
    assert ids == [r["id"] for r in uninterrupted]
    for field in ("completion", "correct", "extracted", "n_tokens", "log_p", "D", "generated_tokens",
                  "forward_tokens", "probed_token_layers", "acceptance", "mh_decisions"):
        assert [r.get(field) for r in resumed] == [r.get(field) for r in uninterrupted], field
    invocations = json.loads((killed / "run.json").read_text())["invocations"]
    assert len(invocations) == 2 and all(i["refill"] for i in invocations)
    assert set(invocations[1]["resumed"]) == stopped and min(invocations[1]["resumed"].values()) >= 1
    assert not any(snapshots.glob("*")), "a finished run left snapshots behind"
    assert json.loads((killed / "summary.json").read_text())["accuracy"] == \
        json.loads((reference / "summary.json").read_text())["accuracy"]


# --------------------------------------------------------------------------- errors


def test_second_run_into_a_directory_in_use_is_one_line_and_leaves_run_json_alone(degs, tmp_path):
    from degs_jax.eval.results import ResultStore

    out = tmp_path / "run"
    args = ["eval", "--benchmark", "gsm8k", "--method", "greedy", "--limit", 0, "--out", out, *TINY]
    rc, _, err = degs(*args)
    assert rc == 0, err
    before = (out / "run.json").read_bytes()
    with ResultStore(out / "results.jsonl"):  # another run holds the directory
        rc, _, err = degs(*args)
    assert rc == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("degs")]
    assert line.startswith("degs: error: ") and "being written by another run" in line
    assert (out / "run.json").read_bytes() == before  # no phantom invocation


def test_damaged_run_files_are_named(degs, tmp_path, shared_prompt_width):
    out = tmp_path / "run"
    args = ["eval", "--benchmark", "deepmind500", "--method", "greedy", "--limit", 1, "--out", out,
            *TINY]
    rc, _, err = degs(*args)
    assert rc == 0, err
    results = out / "results.jsonl"
    good = results.read_bytes()
    # A torn last line (an interrupted write): the store and `degs analyze` both accept it.
    results.write_bytes(good + b'{"id": "deepmind500/1", "corr')
    rc, stdout, err = degs("analyze", out)
    assert rc == 0, err
    assert json.loads((out / "analysis.json").read_text())["predictive_validity"]["n"] == 1
    rc, _, err = degs(*args)
    assert rc == 0, err
    assert results.read_bytes() == good  # the store cut the torn line off
    # A bad line before the last one is corruption: named with its file and line.
    results.write_bytes(b"{oops\n" + good)
    for argv in (args, ("analyze", out)):
        rc, _, err = degs(*argv)
        assert rc == 2 and f"degs: error: {results}: line 1 is not valid JSON" in err, err
    results.write_bytes(good)
    (out / "run.json").write_text('{"config": ')
    for argv in (args, ("analyze", out)):
        rc, _, err = degs(*argv)
        assert rc == 2 and f"degs: error: {out / 'run.json'} is not valid JSON" in err, err
        assert "Traceback" not in err


def test_batch_size_auto_is_recorded_and_an_integer_overrides_it(degs, tmp_path, shared_prompt_width):
    """--batch-size auto (the default) sizes the batch from free memory and records the
    choice and the peak memory in run.json; an explicit size overrides it."""
    runs = {}
    for name, extra in (("auto", []), ("one", ["--batch-size", 1])):
        out = tmp_path / name
        # greedy on gsm8k: the compiled decodes of test_greedy_on_each_benchmark
        rc, _, err = degs("eval", "--benchmark", "gsm8k", "--method", "greedy", "--limit", 3,
                          "--out", out, *TINY, *extra)
        assert rc == 0, err
        runs[name] = (json.loads((out / "run.json").read_text())["invocations"][-1], _records(out))
    auto, one = runs["auto"][0], runs["one"][0]
    choice = auto["batch_choice"]
    assert choice["requested"] == "auto" and auto["batch_size"] == choice["batch_size"]
    assert 1 <= choice["batch_size"] <= 3 and choice["largest"] == 3
    assert choice["bytes_per_row"] > 0 and choice["free_bytes"] > 0 and choice["memory_source"]
    assert one["batch_choice"] == {"batch_size": 1, "requested": 1} and one["batch_size"] == 1
    for inv in (auto, one):
        assert set(inv["peak_memory"]) == {"peak_bytes", "note"}
        if inv["device"].startswith("TFRT_CPU") or "cpu" in inv["device"].lower():
            assert inv["peak_memory"]["peak_bytes"] is None
    assert choice["batch_size"] > 1  # a CPU host has room for 3 tiny rows
    # Same problems; the completions themselves are compared in fp32 by
    # test_cli's many-prompt test: in bf16 a batch padded to another prompt length runs
    # other kernels, and rounding differences flip a sample after a few tokens.
    assert sorted(r["id"] for r in runs["auto"][1]) == sorted(r["id"] for r in runs["one"][1])
    rc, _, err = degs("eval", "--benchmark", "gsm8k", "--out", tmp_path / "bad", "--batch-size", "0")
    assert rc == 2 and "degs: error: --batch-size takes a positive integer or 'auto'" in err


def test_the_progress_line_follows_every_record(degs, tmp_path, shared_prompt_width, monkeypatch):
    """The progress line's accuracy and tokens per step are set after every finished problem
    (a refilled run of 256 slots set them once per 256 problems: an H200 run of MATH500
    showed its first 256 problems' numbers until its end)."""
    import degs_jax.eval.runner as runner

    shown = []

    class Bar:
        def __init__(self, *args, initial=0, **kwargs):
            self.n = initial

        def update(self, count):
            self.n += count

        def set_postfix(self, **values):
            shown.append((self.n, values))

        def close(self):
            pass

    monkeypatch.setattr(runner, "tqdm", Bar)
    rc, _, err = degs("eval", "--benchmark", "math500", "--method", "greedy", "--limit", 3, "--batch-size", 3,
                      "--out", tmp_path / "run", *TINY)
    assert rc == 0, err
    assert [n for n, _ in shown] == [1, 2, 3] and all(set(values) == {"acc", "tok/step"} for _, values in shown)
