"""Resumable result store and summary statistics."""

import json
import math
import re

import pytest

from degs_jax.eval.benchmarks import Problem
from degs_jax.eval.results import (
    EVAL_RECORD_FIELDS,
    ResultStore,
    numeric_means,
    package_versions,
    read_records,
    summarize,
    transcript_fields,
    write_summary,
)
from degs_jax.stats import accuracy, wilson_interval


def test_append_resume_and_skip(tmp_path):
    path = tmp_path / "run" / "results.jsonl"
    with ResultStore(path) as store:
        assert store.done_ids == frozenset()
        store.append({"id": "a", "correct": True})
        store.append({"id": "b", "correct": False})
    with ResultStore(path) as store:
        assert store.done_ids == {"a", "b"}
        todo = [i for i in ["a", "b", "c"] if not store.is_done(i)]
        assert todo == ["c"]
        store.append({"id": "c", "correct": True})
        assert [r["id"] for r in store.records] == ["a", "b", "c"]
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


def test_duplicate_ids_are_refused(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultStore(path) as store:
        store.append({"id": "a", "correct": True})
        with pytest.raises(ValueError, match="duplicate"):
            store.append({"id": "a", "correct": False})
    with ResultStore(path) as store:
        with pytest.raises(ValueError, match="duplicate"):
            store.append({"id": "a", "correct": False})
    assert len(path.read_text().splitlines()) == 1
    # A file that already holds a duplicate (e.g. concatenated by hand) is an error.
    path.write_text('{"id": "x"}\n{"id": "x"}\n')
    with pytest.raises(ValueError, match="duplicate id"):
        ResultStore(path)


@pytest.mark.parametrize("torn", [b'{"id": "c", "corr', b'{"id": "c"}', b"\x00\x00\x00"])
def test_torn_last_line_is_truncated(tmp_path, torn):
    path = tmp_path / "results.jsonl"
    with ResultStore(path) as store:
        store.append({"id": "a", "correct": True})
        store.append({"id": "b", "correct": False})
    intact = path.read_bytes()
    path.write_bytes(intact + torn)  # a crash in the middle of writing "c"
    with ResultStore(path) as store:
        assert store.done_ids == {"a", "b"}
        assert path.read_bytes() == intact
        store.append({"id": "c", "correct": True})
    with ResultStore(path) as store:
        assert [r["id"] for r in store.records] == ["a", "b", "c"]


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="line 2"):
        ResultStore(path)


@pytest.mark.parametrize("line, message", [
    ('{"id": ["a"], "index": 1, "correct": true}', "'id' must be a string or an integer, got [\"a\"]"),
    ('{"id": true, "index": 1, "correct": true}', "'id' must be a string or an integer, got true"),
    ('{"id": "b", "index": 1}', "line 2 has no 'correct'"),
    ('{"id": "b", "index": 1, "correct": "yes"}', "'correct' must be bool, got \"yes\""),
    ('{"id": "b", "index": true, "correct": false}', "'index' must be int, got true"),
    ('["b"]', "line 2 is not a result record (no 'id')"),
])
def test_records_that_break_the_rules_are_named_not_guessed(tmp_path, line, message):
    """Every reader (the store on resume, read_records for analysis and studies) refuses
    a file with a complete line that is not a valid record, naming the file and line;
    the file is left as it was."""
    path = tmp_path / "results.jsonl"
    content = '{"id": "a", "index": 0, "correct": true}\n' + line + "\n"
    path.write_text(content)
    for read in (lambda: ResultStore(path, fields=EVAL_RECORD_FIELDS),
                 lambda: read_records(path, fields=EVAL_RECORD_FIELDS)):
        with pytest.raises(ValueError) as error:
            read()
        assert str(error.value).startswith(f"{path}: line 2") and message in str(error.value)
    assert path.read_text() == content


def test_second_writer_is_refused(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultStore(path):
        with pytest.raises(RuntimeError, match="another run"):
            ResultStore(path)


def test_wilson_interval_known_values():
    # 8/10 at 95%: (0.4902, 0.9433), e.g. statsmodels proportion_confint(method="wilson").
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.490162, abs=1e-6)
    assert high == pytest.approx(0.943318, abs=1e-6)
    # Boundaries stay inside [0, 1] and are not degenerate.
    assert wilson_interval(0, 20)[0] == 0.0 and 0 < wilson_interval(0, 20)[1] < 0.2
    assert wilson_interval(20, 20)[1] == 1.0
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


def test_wilson_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    ci = stats.binomtest(37, 120).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson_interval(37, 120) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_summary(tmp_path):
    records = [
        {"id": "a", "correct": True, "logp": -1.0, "tokens": 10, "d": None, "method": "degs"},
        {"id": "b", "correct": False, "logp": -3.0, "tokens": 20, "d": 0.5, "method": "degs"},
        {"id": "c", "correct": True, "logp": -2.0, "tokens": 30, "d": 0.7, "method": "degs"},
    ]
    acc = accuracy(records)
    assert (acc.n, acc.correct) == (3, 2) and acc.accuracy == pytest.approx(2 / 3)
    assert (acc.ci_low, acc.ci_high) == pytest.approx(wilson_interval(2, 3))
    assert numeric_means(records) == pytest.approx({"logp": -2.0, "tokens": 20.0, "d": 0.6})
    summary = summarize(records, template_sha256="x" * 64)
    path = write_summary(tmp_path, summary)
    loaded = json.loads(path.read_text())
    assert path.name == "summary.json"
    assert loaded["accuracy"]["correct"] == 2 and loaded["template_sha256"] == "x" * 64
    assert loaded["means"]["tokens"] == 20.0


def _eval_record(i, **fields):
    """A `degs eval` record of the fields `format_summary` reads (a non-MCMC method's)."""
    return {"id": str(i), "index": i, "correct": i % 2 == 0, "n_tokens": 10 + i, "ended_by": 2,
            "log_p": -1.0 - i, "D": 0.5, "mean_acceptance": None, "depth_decisions_total": None,
            "generated_tokens": 10 + i, "forward_equivalents": 12.0, "wall_clock_s": 0.1, **fields}


def test_eval_summary_averages_numeric_extras_counts_others_and_shows_only_rows_that_apply(tmp_path):
    """`degs eval`'s summary (issue 54): a method's own statistics of its answers (each
    record's "extras") are averaged where every value is a number and counted otherwise,
    in summary.json and the printed table; the MCMC rows (acceptance, beta·ΔD decisions)
    and D(x) are shown only where the records have them."""
    from degs_jax.eval.runner import extras_summary, format_summary, run_summary

    run = {"config": {"template_sha256": "x" * 64, "model": {"name": "m"}, "benchmark": "gsm8k",
                      "method": "my_rule", "seed": 0}, "invocations": [{"versions": {}}]}
    records = [_eval_record(i, extras={"score": [1.0, 2, 4.5][i], "verdict": ["cut", "kept", "kept"][i],
                                       "flag": [True, False, True][i], **({"late": 7} if i == 2 else {})})
               for i in range(3)]
    summary = run_summary(records, run)
    assert summary["extras"] == {"score": {"mean": 2.5, "n": 3}, "verdict": {"counts": {"kept": 2, "cut": 1}},
                                 "flag": {"counts": {"true": 2, "false": 1}}, "late": {"mean": 7.0, "n": 1}}
    assert list(summary["extras"]["verdict"]["counts"]) == ["kept", "cut"]  # most frequent first
    assert json.loads(write_summary(tmp_path, summary).read_text())["extras"] == summary["extras"]
    table = format_summary(summary)
    for row in ("mean score  2.5", "verdict  kept (2), cut (1)", "flag  true (2), false (1)", "mean late  7",
                "mean D(x)  0.5000"):
        assert re.search(rf"^  {re.escape(row.split('  ')[0])} +{re.escape(row.split('  ')[1])}$", table, re.M), row
    assert "n/a" not in table and "acceptance" not in table and "beta·ΔD" not in table

    mcmc = [_eval_record(i, mean_acceptance=0.25 * i, depth_decisions_total=i, D=None) for i in range(3)]
    table = format_summary(run_summary(mcmc, run))
    assert re.search(r"^  acceptance rate +0\.250$", table, re.M)
    assert re.search(r"^  MH decisions decided by beta·ΔD +1\.00 / problem$", table, re.M)
    assert "D(x)" not in table and "extras" not in run_summary(mcmc, run)  # not probed; no extras
    assert extras_summary([_eval_record(0, extras={"x": None})]) == {}


def test_package_versions():
    versions = package_versions()
    assert set(versions) >= {"jax", "jaxlib", "transformers", "numpy", "degs-jax", "python"}
    assert versions["degs-jax"] == "0.1.0" and versions["numpy"]


def test_transcript_fields_hide_gpqa_completions():
    gpqa = Problem(id="rec1", benchmark="gpqa_diamond", question="q", answer="A")
    stored = transcript_fields(gpqa, "a long transcript")
    assert "completion" not in stored and stored["completion_chars"] == 17
    math_problem = Problem(id="m", benchmark="math500", question="q", answer="1")
    assert transcript_fields(math_problem, "text") == {"completion": "text"}


def test_every_file_is_strict_json(tmp_path):
    """Issue 58: NaN and inf (Python's json writes and reads them, strict parsers refuse
    them) are written as null in records and summaries, and a stored NaN is refused by
    name and line; a summary of no problems is valid JSON."""
    from degs_jax.eval.results import read_json, summarize, write_summary

    strict = lambda text: json.loads(text, parse_constant=lambda c: pytest.fail(c))  # noqa: E731
    with ResultStore(tmp_path / "r.jsonl") as store:
        store.append({"id": "a", "log_p": float("nan"), "D": [1.0, float("-inf")],
                      "diagnostics": {"log_evidence": float("inf")}})
    line = (tmp_path / "r.jsonl").read_text()
    assert strict(line) == {"id": "a", "log_p": None, "D": [1.0, None],
                            "diagnostics": {"log_evidence": None}}
    write_summary(tmp_path, summarize([]))
    summary = strict((tmp_path / "summary.json").read_text())
    assert summary["accuracy"]["n"] == 0 and summary["accuracy"]["accuracy"] is None
    assert read_json(tmp_path / "summary.json") == summary
    (tmp_path / "nan.jsonl").write_text('{"id": "a"}\n{"id": "b", "x": NaN}\n')
    with pytest.raises(ValueError, match=r"nan.jsonl: line 2 is not valid JSON \(NaN is not JSON\)"):
        read_records(tmp_path / "nan.jsonl")
    (tmp_path / "inf.jsonl").write_text('{"id": "a", "x": -Infinity}\n')
    with pytest.raises(ValueError, match=r"line 1 is not valid JSON \(-Infinity is not JSON\)"):
        ResultStore(tmp_path / "inf.jsonl")


def test_a_record_of_no_problem_of_the_run_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "p/0", "index": 0}\n{"id": "p/9", "index": 9}\n')
    problems = {"p/0": 0, "p/1": 1}
    with pytest.raises(ValueError, match=r'r.jsonl: line 2: "p/9" \(index 9\) is no problem'):
        read_records(path, problems=problems)
    with pytest.raises(ValueError, match="line 2"):
        ResultStore(path, problems=problems)
    assert len(read_records(path)) == 2  # without the run's problems: read as before
