"""Benchmark loaders, GPQA shuffling and secrecy, prompt templates.

GPQA assertions compare booleans or counts, never the texts themselves, so a
failing test cannot print a question or option into the test log.
"""

import csv
import hashlib
import io
import json
import logging
import pickle
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

from degs_jax.eval import benchmarks as bm
from degs_jax.eval.benchmarks import (
    BENCHMARKS,
    ChecksumError,
    default_data_dir,
    gpqa_permutation,
    gsm8k_gold,
    load_benchmark,
)
from degs_jax.eval.graders import Grader
from degs_jax.eval.prompts import (
    build_prompt,
    extract_code,
    humaneval_solution,
    template_hash,
    truncate_completion,
)
from degs_jax.eval.results import ResultStore, summarize, transcript_fields, write_summary

EXPECTED_ROWS = {"math500": 500, "deepmind500": 500, "gsm8k": 1319, "humaneval": 164,
                 "gpqa_diamond": 198}


@pytest.fixture(scope="module")
def gpqa():
    return load_benchmark("gpqa")


def _gpqa_rows():
    """The decrypted CSV rows, in memory (test-side reference)."""
    with zipfile.ZipFile(default_data_dir() / "gpqa_dataset.zip") as archive:
        data = archive.read(bm.GPQA_DIAMOND_MEMBER, pwd=bm.GPQA_PASSWORD)
    return list(csv.DictReader(io.StringIO(data.decode("utf-8"))))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_loaders_rows_and_fields(name):
    problems = load_benchmark(name)
    assert len(problems) == EXPECTED_ROWS[name]
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.benchmark == name and p.question and p.answer for p in problems)
    assert pickle.loads(pickle.dumps(problems[0])) == problems[0]  # for worker processes


def test_specific_fields():
    math500 = load_benchmark("math500")
    assert math500[0].id == "test/precalculus/807.json"
    assert math500[0].answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert math500[0].metadata["level"] in range(1, 6)
    assert load_benchmark("deepmind500")[0].answer == "3"
    he = load_benchmark("humaneval")
    assert he[0].id == "HumanEval/0" and he[0].metadata["entry_point"] == "has_close_elements"
    gsm = load_benchmark("gsm8k")
    assert all("," not in p.answer and p.answer.lstrip("-").replace(".", "").isdigit()
               for p in gsm)


def test_gsm8k_gold():
    assert gsm8k_gold("So 2 + 3 = <<2+3=5>>5\n#### 1,234") == "1234"
    with pytest.raises(ValueError):
        gsm8k_gold("no final answer")


def test_checksum_mismatch_is_an_error_with_opt_out(tmp_path):
    copy = tmp_path / "math500.jsonl"
    shutil.copy(default_data_dir() / "math500.jsonl", copy)
    with copy.open("a") as f:
        f.write("\n")
    with pytest.raises(ChecksumError, match="verify_checksum=False"):
        load_benchmark("math500", copy)
    assert len(load_benchmark("math500", copy, verify_checksum=False)) == 500


def test_data_dir_resolution(tmp_path, monkeypatch):
    """The files installed with the package are the default; $DEGS_JAX_DATA overrides them;
    a file missing from the chosen directory is an error naming it and the override."""
    monkeypatch.delenv(bm.DATA_ENV_VAR, raising=False)
    assert default_data_dir() == bm.packaged_data_dir()
    shutil.copy(bm.packaged_data_dir() / "deepmind500.jsonl", tmp_path)
    monkeypatch.setenv(bm.DATA_ENV_VAR, str(tmp_path))
    assert default_data_dir() == tmp_path
    assert len(load_benchmark("deepmind500")) == 500
    with pytest.raises(FileNotFoundError, match=r"math500\.jsonl not found.*DEGS_JAX_DATA"):
        load_benchmark("math500")


def _readme_table() -> dict[str, tuple[int, str]]:
    """file -> (bytes, sha256) from the table of degs_jax/data/README.md."""
    rows = {}
    for line in (bm.packaged_data_dir() / "README.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] and (bm.packaged_data_dir() / cells[0]).is_file():
            rows[cells[0]] = (int(cells[2].replace(",", "")), cells[3])
    return rows


def test_the_packaged_files_are_the_documented_ones():
    """Every benchmark file (and GSM8K train) ships with the package, byte for byte the file
    its README names: size and sha256 as in the README's table and in the loaders' table;
    each has a licence file."""
    from degs_jax.train.data import GSM8K_TRAIN_FILE, GSM8K_TRAIN_SHA256

    table = _readme_table()
    expected = dict(bm.SHA256, **{GSM8K_TRAIN_FILE: GSM8K_TRAIN_SHA256})
    assert set(table) == set(expected) == set(bm.FILES.values()) | {GSM8K_TRAIN_FILE}
    for name, (size, sha) in table.items():
        data = (bm.packaged_data_dir() / name).read_bytes()
        assert len(data) == size and bm.sha256_bytes(data) == sha == expected[name], name
    licences = bm.packaged_data_dir() / "LICENSES"
    assert len([f for f in licences.iterdir() if f.stat().st_size > 200]) >= 4


def test_unknown_benchmark_and_hub_without_copy():
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("mmlu")
    with pytest.raises(ValueError, match="no hub copy"):
        load_benchmark("deepmind500", source="hub")


def test_gpqa_answer_follows_permutation(gpqa):
    rows = {r["Record ID"]: r for r in _gpqa_rows()}
    for p in gpqa:
        row = rows[p.id]
        perm = p.metadata["permutation"]
        assert sorted(perm) == [0, 1, 2, 3]
        assert perm == gpqa_permutation(p.id)
        gold_index = "ABCD".index(p.answer)
        incorrect = {row[f"Incorrect Answer {i}"].strip() for i in (1, 2, 3)}
        # Booleans only: a failing assert must not print GPQA text.
        gold_ok = p.choices[gold_index] == row["Correct Answer"].strip()
        others_ok = set(p.choices) - {p.choices[gold_index]} <= incorrect
        assert gold_ok and others_ok, p.id
    # The shuffle actually moves the correct answer around.
    assert {p.answer for p in gpqa} == set("ABCD")


def test_gpqa_permutation_stable_across_processes(gpqa):
    ids = [p.id for p in gpqa]
    here = [list(gpqa_permutation(i)) for i in ids]
    code = ("import json, sys\nfrom degs_jax.eval.benchmarks import gpqa_permutation\n"
            "ids = json.load(sys.stdin)\n"
            "print(json.dumps([list(gpqa_permutation(i)) for i in ids]))")
    # A different hash seed would expose any dependence on hash().
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(ids), text=True,
                         capture_output=True, check=True, env={"PYTHONHASHSEED": "123"})
    assert json.loads(out.stdout) == here
    # Pinned values: changing the derivation would silently change every result.
    digest = hashlib.sha256(json.dumps(here).encode()).hexdigest()
    assert gpqa_permutation("rec06pnAkLOr2t2mp") == PINNED_FIRST_PERMUTATION
    assert digest == PINNED_ALL_PERMUTATIONS_SHA256


PINNED_FIRST_PERMUTATION = (1, 2, 3, 0)
PINNED_ALL_PERMUTATIONS_SHA256 = "7e33bfbcdb25b39827e0ea0faa31c224ba90ae1f50552bb78b61424824850eb3"


def test_gpqa_text_never_written(gpqa, tmp_path, monkeypatch, caplog):
    """Grade and store GPQA results; no question or option text reaches disk or logs."""
    # Any temporary file created by library code lands under tmp_path too.
    sys_tmp = tmp_path / "sys_tmp"
    sys_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(sys_tmp))
    caplog.set_level(logging.DEBUG)
    run_dir = tmp_path / "run"
    with Grader() as grader, ResultStore(run_dir / "results.jsonl") as store:
        for p in gpqa:
            # Worst case: a transcript that quotes the question and every option.
            completion = (build_prompt(p) + "\n" + "\n".join(p.choices)
                          + f"\nSo the answer is \\boxed{{{p.answer}}}")
            verdict = grader.grade(p, completion)
            assert verdict.correct
            store.append({"id": p.id, "correct": verdict.correct,
                          "extracted": verdict.extracted, "problem": repr(p),
                          **transcript_fields(p, completion)})
        write_summary(run_dir, summarize(store.records))
    secrets = [p.question for p in gpqa] + [c for p in gpqa for c in p.choices]
    # Very short options ("2", "Yes") occur in any text; long ones identify a question.
    secrets = [s for s in secrets if len(s) >= 12]
    n_secrets = len(secrets)
    assert n_secrets > 600
    written = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert {f.name for f in written} >= {"results.jsonl", "summary.json"}
    for f in written:
        text = f.read_text("utf-8", errors="replace")
        n_leaked = sum(s in text for s in secrets)
        assert n_leaked == 0, f"{f} contains GPQA text"
    n_logged = sum(s in caplog.text for s in secrets)
    assert n_logged == 0


def test_template_hash():
    hashes = {b: template_hash(b) for b in BENCHMARKS}
    assert hashes["math500"] == hashes["gsm8k"] == hashes["deepmind500"]
    assert len({hashes["math500"], hashes["gpqa_diamond"], hashes["humaneval"]}) == 3
    assert template_hash("gpqa") == hashes["gpqa_diamond"]
    assert all(len(h) == 64 for h in hashes.values())


class FakeChatTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "<user>" + messages[0]["content"] + "</user><assistant>"


class FakeBaseTokenizer:
    chat_template = None


def test_build_prompt_chat_and_raw(gpqa):
    problem = load_benchmark("math500")[0]
    raw = build_prompt(problem, FakeBaseTokenizer())
    assert raw == build_prompt(problem, None)
    assert raw.startswith(problem.question) and raw.endswith(r"within \boxed{}.")
    chat = build_prompt(problem, FakeChatTokenizer())
    assert chat == "<user>" + raw + "</user><assistant>"
    he = load_benchmark("humaneval")[0]
    assert build_prompt(he, None) == he.question
    assert he.question in build_prompt(he, FakeChatTokenizer())
    g = gpqa[0]
    text = build_prompt(g)
    positions = [text.find(f"\n{letter}) {choice}") for letter, choice in zip("ABCD", g.choices)]
    assert -1 not in positions and positions == sorted(positions)
    starts_with_question = text.find(g.question) > 0
    assert starts_with_question


def test_problem_repr_hides_text(gpqa):
    shown = repr(gpqa[0])
    hidden = gpqa[0].question not in shown and all(c not in shown for c in gpqa[0].choices)
    assert hidden and shown == f"Problem(id={gpqa[0].id!r}, benchmark='gpqa_diamond')"


def test_extract_code_variants():
    reply = "Sure!\n```python\ndef f(x):\n    return x\n```\nDone."
    assert extract_code(reply, "f") == "def f(x):\n    return x\n"
    two = "```\nprint(1)\n```\n```python\ndef g():\n    pass\n```"
    assert extract_code(two, "g").startswith("def g")
    assert extract_code(two, None) == "def g():\n    pass\n"
    assert extract_code("def f(): return 1", "f") == "def f(): return 1"
    assert extract_code("```python\ndef f():\n    return 1", "f").startswith("def f")  # unclosed


def test_humaneval_solution_assembly():
    he = load_benchmark("humaneval")[2]  # truncate_number
    body = he.answer
    assert humaneval_solution(he, body, chat=False) == he.question + body
    assert truncate_completion("    return 1\n\ndef extra():\n    pass") == "    return 1\n"
    rewritten = f"```python\ndef {he.metadata['entry_point']}(number: float) -> float:\n" \
                "    return number % 1.0\n```"
    solution = humaneval_solution(he, rewritten, chat=True)
    assert solution.startswith(he.question) and solution.rstrip().endswith("return number % 1.0")
    unindented = humaneval_solution(he, "```python\nreturn number % 1.0\n```", chat=True)
    assert unindented == he.question + "    return number % 1.0\n"


@pytest.mark.parametrize("command", ["eval", "reproduce"])
def test_a_tampered_data_file_is_refused_in_one_line(command, tmp_path, capsys):
    """One flipped byte in a benchmark file: `degs eval` / `degs reproduce` stop before
    loading a model, with one `degs: error:` line naming the file, and write no results."""
    from degs_jax import cli

    data = tmp_path / "data"
    shutil.copytree(bm.packaged_data_dir(), data)
    target = data / "gsm8k_test.jsonl"
    raw = bytearray(target.read_bytes())
    raw[100] ^= 0x01
    target.write_bytes(bytes(raw))
    out = tmp_path / "run"
    argv = (["eval", "--benchmark", "gsm8k", "--limit", "2"] if command == "eval"
            else ["reproduce", "--benchmarks", "gsm8k", "--limit", "2"])
    rc = cli.main([*argv, "--out", str(out), "--data-dir", str(data), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("degs: error: "), err
    assert str(target) in lines[0] and "sha256" in lines[0] and "Traceback" not in err
    assert not (out / "results.jsonl").exists()
