"""Hostile command lines: stored files damaged, options out of range, a model-written
program that cannot be isolated. Each case ends in one `degs: error: ...` line naming the
file or the flag, exit status 2, no traceback, and nothing written, changed or lost;
where the check can come before the model loads, it does (the loader is replaced by one
that records its calls and returns a tiny random model with a byte tokenizer)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax import cli
from degs_jax.eval import sandbox
from degs_jax.models import LoadedModel
from degs_jax.models.config import ModelConfig
from degs_jax.models.params import param_shapes
from degs_jax.examples.byte_tokenizer import byte_tokenizer

# 2 blocks over 257 byte tokens; a context long enough for a HumanEval prompt in bytes.
TINY_CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=257, hidden_size=32,
                       intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=2048, qkv_bias=False, tie_word_embeddings=False,
                       eos_token_ids=(256,))


@pytest.fixture(scope="module")
def tiny_model():
    rng = np.random.default_rng(0)  # numpy draws: no program to compile per tensor
    params = jax.tree.map(
        lambda shape: jnp.asarray((len(shape) == 1) + 0.1 * rng.standard_normal(shape), jnp.float32),
        param_shapes(TINY_CFG), is_leaf=lambda x: isinstance(x, tuple))
    return LoadedModel(cfg=TINY_CFG, params=params, tokenizer=byte_tokenizer(), source="random",
                       name="tiny-bytes")


@pytest.fixture
def degs(request, monkeypatch, capsys):
    """Run `degs ...` in-process; returns (exit status, stdout, stderr, models loaded)."""
    loads = []

    def load(source, dtype="bfloat16", **kwargs):
        loads.append(source)
        return request.getfixturevalue("tiny_model")  # made only where a case gets this far

    monkeypatch.setattr("degs_jax.models.loading.load", load)

    def run(*argv):
        capsys.readouterr()
        loads.clear()
        rc = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err, list(loads)

    return run


def _run_dir(path, config=None, invocations=None, records=()):
    path.mkdir()
    # a valid run record (its method too: `degs eval` reads it before the results), so that
    # what a directory breaks is what its test names
    run = {"config": {"model": {"name": "tiny-bytes", "dtype": "float32"}, "benchmark": "gsm8k",
                      "method": "greedy", "hyperparameters": {}}
           if config is None else config, "invocations": [] if invocations is None else invocations}
    (path / "run.json").write_text(json.dumps(run))
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _files(tmp):
    """What the table's command lines point at."""
    from safetensors.numpy import save_file

    (tmp / "a_file").write_text("x")
    (tmp / "a_dir").mkdir()
    good = {"id": "gsm8k/0", "index": 0, "correct": True, "D": None}
    _run_dir(tmp / "config_list", config=[], records=[good])
    _run_dir(tmp / "invocations_str", invocations="2024-01-01")
    _run_dir(tmp / "id_list", records=[good, {**good, "id": ["gsm8k/1"], "index": 1}])
    _run_dir(tmp / "no_correct", records=[{"id": "gsm8k/0", "index": 0}])
    _run_dir(tmp / "no_method", config={"model": {"name": "tiny-bytes", "dtype": "float32"},
                                        "benchmark": "gsm8k"}, records=[good])
    _run_dir(tmp / "good_run", records=[good])
    _run_dir(tmp / "foreign_problem", records=[good, {**good, "id": "gsm8k/9999", "index": 9999}])
    _run_dir(tmp / "wrong_index", records=[{**good, "index": 5}])
    (tmp / "nan_record").mkdir()
    (tmp / "nan_record" / "results.jsonl").write_text(
        json.dumps(good) + "\n" + json.dumps({**good, "id": "gsm8k/1", "index": 1, "log_p": math.nan}) + "\n")
    (tmp / "garbage.safetensors").write_bytes(os.urandom(256))
    save_file({"x": np.zeros(3, np.float32)}, str(tmp / "foreign.safetensors"))
    (tmp / "no_answer.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    (tmp / "no_final.jsonl").write_text(json.dumps({"question": "q", "answer": "4"}) + "\n")
    (tmp / "torn_rows.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 4"})
                                         + "\n{\"question\": \n" + "{}\n")
    for name, text in (("study_torn", '{"model": '), ("study_no_model", '{"invocations": []}')):
        (tmp / name).mkdir()
        (tmp / name / "study.json").write_text(text)
    (tmp / "lone_surrogate.jsonl").write_text('{"prompt": "ab\\ud800c"}\n')
    _run_dir(tmp / "graded_in_process", config={"benchmark": "humaneval", "method": "greedy",
                                                "hyperparameters": {}},
             invocations=[{"humaneval_isolation": "process"}])
    study = tmp / "study_corrupt" / "runs" / "gsm8k" / "greedy"
    study.parent.mkdir(parents=True)
    _run_dir(study, records=[good])
    with open(study / "results.jsonl", "a") as f:
        f.write('{"id": "gsm8k/1", "index": 1, "correct": tr\n{"id": "gsm8k/2", "index": 2, "correct": true}\n')
    return tmp


NO_NAMESPACES = "no namespaces"  # marks the cases run with the namespace probe failing

# (argv, a distinctive part of the message, whether the model may load first)
CLI_TABLE = [
    # stored files a resume or an analysis reads
    (["eval", "--benchmark", "gsm8k", "--out", "{tmp}/config_list"],
     "config_list/run.json: 'config' must be a JSON object, got []", False),
    (["eval", "--benchmark", "gsm8k", "--out", "{tmp}/invocations_str"],
     "invocations_str/run.json: 'invocations' must be a list of JSON objects", False),
    (["eval", "--benchmark", "gsm8k", "--out", "{tmp}/id_list"],
     "id_list/results.jsonl: line 2: 'id' must be a string or an integer, got [\"gsm8k/1\"]", False),
    (["eval", "--benchmark", "gsm8k", "--out", "{tmp}/no_correct"],
     "no_correct/results.jsonl: line 1 has no 'correct'", False),
    (["eval", "--benchmark", "gsm8k", "--out", "{tmp}/no_method"],
     "no_method/run.json: a run record needs a method name and its hyperparameters", False),
    (["analyze", "{tmp}/config_list"], "config_list/run.json: 'config' must be a JSON object", False),
    (["analyze", "{tmp}/invocations_str"], "'invocations' must be a list", False),
    (["analyze", "{tmp}/id_list"], "id_list/results.jsonl: line 2: 'id' must be", False),
    (["analyze", "{tmp}/no_correct"], "no_correct/results.jsonl: line 1 has no 'correct'", False),
    (["reproduce", "--out", "{tmp}/study_corrupt", "--plan", "--benchmarks", "gsm8k", "--methods",
      "greedy", "--pool-benchmarks", "none", "--limit", "3"],
     "greedy/results.jsonl: line 2 is not valid JSON", False),
    # a record that is not strict JSON, or of no problem of the run (issue 58)
    (["eval", "--benchmark", "gsm8k", "--out", "{tmp}/nan_record"],
     "nan_record/results.jsonl: line 2 is not valid JSON (NaN is not JSON)", False),
    (["eval", "--benchmark", "gsm8k", "--method", "greedy", "--out", "{tmp}/foreign_problem"],
     "foreign_problem/results.jsonl: line 2: \"gsm8k/9999\" (index 9999) is no problem of this "
     "run's benchmark", True),
    (["eval", "--benchmark", "gsm8k", "--method", "greedy", "--out", "{tmp}/wrong_index"],
     "wrong_index/results.jsonl: line 1: \"gsm8k/0\" (index 5) is no problem of this run's "
     "benchmark", True),
    # values refused before --out is touched (issue 58: they were refused after run.json)
    (["eval", "--benchmark", "gsm8k", "--method", "temperature", "--temperature", "-1", "--out",
      "{tmp}/new_run"], "temperature must be >= 0 and at most 3.402823e+38 (float32), got -1.0",
     False),
    (["eval", "--benchmark", "gsm8k", "--method", "greedy", "--stop", "ab\udcff", "--out",
      "{tmp}/new_run"], "the stop string 'ab\\udcff' is not valid UTF-8 text (a lone surrogate at "
     "character 2)", False),
    (["eval", "--benchmark", "gsm8k", "--method", "greedy", "--lsub", "1,99", "--out",
      "{tmp}/new_run"], "L_sub", True),
    # a file that is no tuned lens
    (["eval", "--benchmark", "gsm8k", "--out", "{tmp}/r", "--lens", "tuned", "--tuned-lens",
      "{tmp}/garbage.safetensors"], "garbage.safetensors is not a safetensors file", False),
    (["eval", "--benchmark", "gsm8k", "--out", "{tmp}/r", "--lens", "tuned", "--tuned-lens",
      "{tmp}/foreign.safetensors"],
     "foreign.safetensors is not a tuned-lens file (its tensors are x;", False),
    (["analyze", "{tmp}/good_run", "--lens", "tuned", "--tuned-lens", "{tmp}/foreign.safetensors"],
     "foreign.safetensors is not a tuned-lens file", False),
    (["sample", "x", "--lens", "tuned", "--tuned-lens", "{tmp}/garbage.safetensors"],
     "garbage.safetensors is not a safetensors file", False),
    # train-lens
    (["train-lens", "--layers", "1,99", "--out", "{tmp}/lens.safetensors"],
     "--layers: tuned-lens layers must be distinct increasing indices in 0..2, got (1, 99)", True),
    (["train-lens", "--layers", "0,1", "--corpus", "{tmp}/no_answer.jsonl"],
     "no_answer.jsonl:1: each row needs a string 'question' and a string 'answer'", False),
    (["train-lens", "--corpus", "{tmp}/torn_rows.jsonl"], "torn_rows.jsonl:2: not valid JSON", False),
    (["train-lens", "--corpus", "{tmp}/missing.jsonl"], "missing.jsonl", False),
    (["train-lens", "--out", "{tmp}/a_dir"], "--out {tmp}/a_dir is a directory; give a file path", False),
    (["train-lens", "--out", "{tmp}/a_file/lens.safetensors"], "is under {tmp}/a_file, which is a file",
     False),
    (["train-lens", "--out", "{tmp}/read_only/lens.safetensors"],
     "--out {tmp}/read_only/lens.safetensors: cannot write in {tmp}/read_only", False),
    # train-grpo
    (["train-grpo", "--out", "{tmp}/g", "--steps", "0"], "--steps must be at least 1, got 0", False),
    (["train-grpo", "--out", "{tmp}/g", "--steps", "2", "--keep-checkpoints", "0"],
     "--keep-checkpoints must be at least 1, got 0", False),
    (["train-grpo", "--out", "{tmp}/g", "--steps", "2", "--checkpoint-every", "0"],
     "--checkpoint-every must be at least 1", False),
    (["train-grpo", "--out", "{tmp}/g", "--steps", "2", "--data", "{tmp}/no_answer.jsonl"],
     "no_answer.jsonl:1: each row needs a string 'question'", False),
    (["train-grpo", "--out", "{tmp}/g", "--steps", "2", "--data", "{tmp}/no_final.jsonl"],
     "no_final.jsonl:1: the 'answer' has no '#### <final answer>' line", False),
    (["train-grpo", "--out", "{tmp}/a_file", "--steps", "2"], "--out {tmp}/a_file is a file", False),
    # reproduce
    (["reproduce", "--out", "{tmp}/s", "--hp", "max_new_tokns=8"],
     "--hp max_new_tokns: no decoder of this study takes a hyperparameter of that name", False),
    (["reproduce", "--out", "{tmp}/s", "--methods", "greedy", "--hp", "n=4", "--pool-benchmarks",
      "none"], "--hp n: no decoder of this study takes", False),
    (["reproduce", "--out", "{tmp}/a_file"], "--out {tmp}/a_file is a file; give a directory", False),
    (["reproduce", "--out", "{tmp}/s", "--seed", str(2**64)], "--seed must be an integer from 0 to",
     False),
    (["reproduce", "--out", "{tmp}/study_torn"], "study_torn/study.json is not valid JSON", False),
    (["reproduce", "--out", "{tmp}/study_torn", "--report-only"],
     "study_torn/study.json is not valid JSON", False),
    (["reproduce", "--out", "{tmp}/study_no_model"],
     "study_no_model/study.json has no 'model' with a 'name' and 'num_layers'", False),
    (["reproduce", "--out", "{tmp}/study_no_model", "--report-only"],
     "study_no_model/study.json has no 'model'", False),
    # inputs that gave tracebacks
    (["sample", "--input", "{tmp}/lone_surrogate.jsonl"],
     "lone_surrogate.jsonl:1: 'prompt' is not valid text (a lone surrogate \\ud800 at character 2)",
     False),
    (["train-grpo", "--out", "{tmp}/g", "--steps", "2", "--seed", str(10**30)],
     "--seed must be an integer from 0 to", False),
    (["train-lens", "--seed", "-1"], "--seed must be an integer from 0 to", False),
    # a HumanEval run graded without namespaces is not resumed with them (nor the reverse)
    (["eval", "--benchmark", "humaneval", "--out", "{tmp}/graded_in_process"],
     "graded_in_process was graded under isolation process and this invocation would grade "
     "under namespaces; refusing to mix them", False),
    # model-written code where no namespaces can be made
    ([NO_NAMESPACES, "eval", "--benchmark", "humaneval", "--out", "{tmp}/h"],
     "model-written HumanEval programs cannot be isolated here", False),
    ([NO_NAMESPACES, "reproduce", "--out", "{tmp}/s", "--benchmarks", "gsm8k,humaneval", "--methods",
      "greedy", "--pool-benchmarks", "none"], "--unsafe-unsandboxed-grading", False),
]


# Non-finite numbers for real-valued options: argparse's usage, then one error line naming
# the flag.
NON_FINITE = [
    ["sample", "x", "--alpha=inf"], ["sample", "x", "--beta=-inf"],
    ["sample", "x", "--temperature=nan"], ["eval", "--benchmark", "gsm8k", "--out", "r", "--alpha=NaN"],
    ["analyze", "r", "--beta=1e999"], ["probe", "--input", "x", "--tau=inf"],
    ["train-grpo", "--out", "g", "--steps", "1", "--learning-rate=nan"],
    ["train-lens", "--momentum=Infinity"],
]


# Past float32 (the compiled programs' hyperparameter dtype, where they would be inf).
PAST_FLOAT32 = [["eval", "--benchmark", "gsm8k", "--out", "r", "--alpha=4e38"],
                ["sample", "x", "--beta=-1e308"], ["sample", "x", "--temperature=3.5e38"]]


@pytest.mark.parametrize("argv", PAST_FLOAT32, ids=[" ".join(a) for a in PAST_FLOAT32])
def test_numbers_past_float32_are_refused(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flag, value = argv[-1].split("=")
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert err.endswith(f"degs {argv[0]}: error: argument {flag}: must be at most 3.402823e+38 in "
                        f"magnitude (float32), got {value!r}\n"), err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", NON_FINITE, ids=[" ".join(a) for a in NON_FINITE])
def test_non_finite_numbers_are_refused(argv, capsys):
    flag, value = argv[-1].split("=")
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert errors == [f"degs {argv[0]}: error: argument {flag}: must be a finite number, "
                      f"got {value!r}"] and err.endswith(errors[0] + "\n"), err


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can create files in, root included (chattr +i where the
    process is root: permission bits do not bind root)."""
    path = tmp_path / "read_only"
    path.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("running as root on a file system without chattr +i")
    else:
        path.chmod(0o555)
    yield path
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    path.chmod(0o755)


def _tree(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else None,
                   p.read_bytes() if p.is_file() else None) for p in root.rglob("*"))


@pytest.mark.parametrize("argv, message, may_load", CLI_TABLE,
                         ids=[" ".join(a).replace("{tmp}/", "") for a, _, _ in CLI_TABLE])
def test_bad_input_ends_in_one_error_line(degs, tmp_path, read_only_dir, monkeypatch, argv,
                                          message, may_load):
    if argv[0] == NO_NAMESPACES:
        monkeypatch.setattr(sandbox, "_probe", lambda: (None, "forced by the test"))
        argv = argv[1:]
    tmp = _files(tmp_path)
    before = _tree(tmp)
    rc, out, err, loads = degs(*[a.replace("{tmp}", str(tmp)) for a in argv])
    lines = [line for line in err.splitlines() if line.startswith("degs")]
    assert rc == 2 and len(lines) == 1 and err.endswith(lines[0] + "\n"), err
    assert lines[0].startswith("degs: error: ") and message.replace("{tmp}", str(tmp)) in lines[0], err
    assert "Traceback" not in err and out == ""
    assert _tree(tmp) == before  # nothing written, changed or lost
    assert may_load or loads == [], loads


def test_a_torn_last_line_does_not_stop_a_study(degs, tmp_path):
    """`degs reproduce` reads its runs by the store's rules: a torn last line (a killed
    write) is the problem still to do, not an error (the run's store drops it on reopening)."""
    run = tmp_path / "study" / "runs" / "gsm8k" / "greedy"
    run.parent.mkdir(parents=True)
    _run_dir(run, records=[{"id": "gsm8k/0", "index": 0, "correct": True, "wall_clock_s": 2.0}])
    with open(run / "results.jsonl", "a") as f:
        f.write('{"id": "gsm8k/1", "index": 1, "corr')
    rc, out, err, loads = degs("reproduce", "--out", tmp_path / "study", "--plan", "--benchmarks",
                               "gsm8k", "--methods", "greedy", "--pool-benchmarks", "none",
                               "--limit", "3")
    assert rc == 0 and loads == [], err
    row = next(line for line in out.splitlines() if line.startswith("gsm8k greedy"))
    assert row.split()[2:5] == ["3", "1", "16"], row  # target 3, 1 done, batch 16
    assert "4 s" in row  # 2 s per problem measured, 2 problems left


def test_runs_without_humaneval_do_not_need_namespaces(tmp_path, monkeypatch, capsys):
    """Where no namespaces can be made, a run without HumanEval goes on to load its model."""
    monkeypatch.setattr(sandbox, "_probe", lambda: (None, "forced by the test"))

    def load(source, dtype="bfloat16", **kwargs):
        raise ValueError("the model would load here")

    monkeypatch.setattr("degs_jax.models.loading.load", load)
    for argv in (["eval", "--benchmark", "gsm8k", "--out", tmp_path / "run"],
                 ["reproduce", "--out", tmp_path / "study", "--benchmarks", "gsm8k,math500",
                  "--pool-benchmarks", "gsm8k", "--methods", "greedy"]):
        assert cli.main([str(a) for a in argv]) == 2
        assert capsys.readouterr().err == "degs: error: the model would load here\n"


def test_unsandboxed_grading_opt_in_labels_every_result(degs, tmp_path, monkeypatch):
    """With the opt-in where no namespaces can be made: the run happens, a warning is the
    first and the last line, and the isolation is in run.json, summary.json and every record;
    resuming the run where namespaces work is refused."""
    probe = sandbox._probe
    monkeypatch.setattr(sandbox, "_probe", lambda: (None, "forced by the test"))
    out = tmp_path / "run"
    rc, stdout, err, loads = degs("eval", "--benchmark", "humaneval", "--method", "greedy",
                                  "--limit", "2", "--max-new-tokens", "4", "--batch-size", "2",
                                  "--no-progress", "--out", out, sandbox.UNSAFE_FLAG)
    assert rc == 0 and len(loads) == 1, err
    lines = err.strip().splitlines()
    assert lines[0] == lines[-1] == sandbox.unsandboxed_warning(), err
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 and {r["isolation"] for r in records} == {"process"}
    assert all(r["grade_detail"].startswith("failed: ") for r in records)  # a random model
    run = json.loads((out / "run.json").read_text())
    assert run["invocations"][-1]["humaneval_isolation"] == "process"
    assert json.loads((out / "summary.json").read_text())["isolation"] == ["process"]
    # the same command where namespaces work: refused in one line, nothing changed
    monkeypatch.setattr(sandbox, "_probe", probe)
    assert sandbox.isolation() == sandbox.NAMESPACES
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, stdout, err, loads = degs("eval", "--benchmark", "humaneval", "--method", "greedy",
                                  "--limit", "3", "--max-new-tokens", "4", "--batch-size", "2",
                                  "--no-progress", "--out", out)
    assert rc == 2 and loads == [] and err.count("\n") == 1, err
    assert err.startswith(f"degs: error: {out} was graded under isolation process"), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("argv, message", [
    (["eval", "--benchmark", "gsm8k", "--out", "RUN"],
     "degs: interrupted; finished problems are saved in RUN: rerun the same command to resume"),
    (["reproduce", "--out", "RUN"],
     "degs: interrupted; finished batches are saved in RUN: rerun the same command to resume"),
    (["reproduce", "--out", "RUN", "--plan"], "degs: interrupted"),
    (["train-grpo", "--out", "RUN", "--steps", "4"],
     "degs: interrupted; the checkpoints written so far are in RUN: rerun the same command to "
     "resume from the newest"),
    (["train-lens"], "degs: interrupted"),
])
def test_ctrl_c_says_how_to_resume(argv, message):
    assert cli.interrupted_message(cli.build_parser().parse_args(argv)) == message


@pytest.mark.parametrize("mode", ["namespaces", "process"])
def test_hostile_humaneval_programs_cost_one_failed_verdict_each(degs, tmp_path, monkeypatch,
                                                                 mode):
    """Issue 58, through `degs eval`: the programs that stopped evaluations for good (a
    forged isolation report with terminal escapes, calls on the grading process's limits,
    priority and affinity, a scratch tree too deep to remove recursively; the in-process
    guards removed) are failed verdicts with a printable reason, the run finishes with
    exit status 0, valid files and no escape printed, and a resume grades the next problem."""
    from test_sandbox_hostile import (DEEP_SCRATCH, FORGED_UNISOLATED, REACH_OTHERS,
                                      REACH_OTHERS_RESULT, kernel_layers_only)
    from degs_jax.eval.benchmarks import load_benchmark

    flags = []
    if mode == "process":
        monkeypatch.setattr(sandbox, "_probe", lambda: (None, "forced by the test"))
        flags = [sandbox.UNSAFE_FLAG]
    kernel_layers_only(monkeypatch)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    problems = load_benchmark("humaneval")
    completions = ["    pass\nexec(" + repr(source) + ")\n"
                   for source in (FORGED_UNISOLATED, REACH_OTHERS, DEEP_SCRATCH)]
    completions.append(problems[3].answer)  # the resume's problem: its reference solution
    given = iter(completions)
    monkeypatch.setattr("degs_jax.eval.runner._completion_text", lambda *a: (next(given), None))
    out = tmp_path / "run"
    command = ["eval", "--benchmark", "humaneval", "--method", "greedy", "--max-new-tokens", "1",
               "--batch-size", "3", "--no-progress", "--out", out, *flags]
    rc, stdout, err, _ = degs(*command, "--limit", "3")
    assert rc == 0, err
    assert "\x1b" not in stdout + err and "\x07" not in stdout + err
    records = {r["completion"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    details = [records[c]["grade_detail"] for c in completions[:3]]
    assert details[0].startswith("failed: the sandbox's kernel layers were not applied: "
                                 "\\x1b]0;owned\\x07\\x1b[2J"), details
    assert details[1] == REACH_OTHERS_RESULT and details[2] == "failed: AssertionError: ", details
    assert not any(r["correct"] for r in records.values())
    rc, stdout, err, _ = degs(*command, "--limit", "4")
    assert rc == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"]["n"] == 4 and summary["accuracy"]["correct"] == 1, summary
    assert os.listdir(tmp_path / "tmp") == []  # every scratch directory removed


def test_error_lines_print_no_control_character():
    """A message carrying text from a file or a program (terminal escapes, a bell, a lone
    surrogate) is printed with those characters escaped."""
    assert cli.one_line(ValueError("bad \x1b]0;owned\x07\x1b[2J\ud800 ΔD\nnext")) == \
        "bad \\x1b]0;owned\\x07\\x1b[2J\\ud800 ΔD next"


def test_a_methods_own_check_refuses_before_the_run_directory_is_touched(degs, tmp_path,
                                                                         monkeypatch):
    """Issue 58: a method's own checks of its kernel settings (an installed package's
    too) run before `degs eval` writes anything: one error line, no run directory."""
    import degs_jax.method
    from degs_jax.sampling import Greedy

    monkeypatch.setattr(degs_jax.method, "_REGISTERED", dict(degs_jax.method._REGISTERED))

    @dataclasses.dataclass(frozen=True)
    class PickyGreedy(Greedy):
        method: ClassVar[str] = "picky_greedy"

        def kernel_config(self, num_layers, eos_ids, stop=None):
            raise ValueError(f"picky_greedy refuses a model of {num_layers} layers")

    out = tmp_path / "run"
    rc, stdout, err, loads = degs("eval", "--benchmark", "gsm8k", "--method", "picky_greedy",
                                  "--limit", "1", "--out", out)
    assert rc == 2 and err.endswith("degs: error: picky_greedy refuses a model of 2 layers\n"), err
    assert loads and not out.exists() and os.listdir(tmp_path) == []


KILLED_EVAL_SCRIPT = r'''
import sys
import numpy as np, jax, jax.numpy as jnp
from degs_jax import cli
from degs_jax.eval import sandbox
from degs_jax.models import LoadedModel
from degs_jax.models.params import param_shapes
from degs_jax.examples.byte_tokenizer import byte_tokenizer
from test_cli_hostile import TINY_CFG
from test_sandbox_hostile import KILLED_GRADER_PROGRAM
sandbox._probe = lambda: (None, "forced by the test")
call = "    _in_process_guards(scratch, setup[\"guard\"])\n"
sandbox._CANDIDATE = sandbox._CANDIDATE.replace(call, "")
rng = np.random.default_rng(0)
params = jax.tree.map(lambda shape: jnp.asarray((len(shape) == 1) + 0.1 * rng.standard_normal(shape),
                                                jnp.float32),
                      param_shapes(TINY_CFG), is_leaf=lambda x: isinstance(x, tuple))
model = LoadedModel(cfg=TINY_CFG, params=params, tokenizer=byte_tokenizer(), source="random",
                    name="tiny-bytes")
import degs_jax.models.loading
degs_jax.models.loading.load = lambda *a, **k: model
import degs_jax.eval.runner
degs_jax.eval.runner._completion_text = lambda *a: ("    pass\nexec(" + repr(KILLED_GRADER_PROGRAM) + ")\n", None)
sys.exit(cli.main(["eval", "--benchmark", "humaneval", "--method", "greedy", "--limit", "1",
                   "--max-new-tokens", "1", "--batch-size", "1", "--no-progress", "--out", sys.argv[1],
                   sandbox.UNSAFE_FLAG]))
'''


def test_a_program_that_clears_its_parent_death_signal_dies_with_a_killed_degs_eval(tmp_path):
    """Issue 58, through `degs eval` under the fallback (in-process guards removed): a
    program that clears its parent-death signal and sleeps dies with `degs eval` killed by
    SIGKILL; the scratch left is removed by the next fallback check in that TMPDIR."""
    import signal
    import sys
    import time

    from test_sandbox_hostile import sandbox_processes, wait_until

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(scratch),
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_EVAL_SCRIPT, str(tmp_path / "run")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: len(sandbox_processes(proc.pid)) == 2, 120)  # candidate, checker
        time.sleep(1.0)  # the program has cleared its parent-death signal and sleeps
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: sandbox_processes(proc.pid) == [], 5), sandbox_processes(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert len(os.listdir(scratch)) == 2
    sandbox._remove_stale_scratch(str(scratch))
    assert os.listdir(scratch) == []
