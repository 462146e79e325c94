"""The method value at the run record: `method_record` (value -> run.json's dict) and
`method_from_record` (dict -> value) are inverses for every method, and every run.json
committed under docs/ (written by every earlier version) still reads back to a method."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from degs_jax.eval.results import read_run_file
from degs_jax.methods import (METHODS, DegsMCMC, ScalablePower, as_method, hyperparameters_for,
                              method_from_record, method_record)

DOCS = Path(__file__).resolve().parents[1] / "docs"
DOCS_RUNS = sorted(p for p in DOCS.rglob("run.json") if "method" in json.loads(p.read_text())["config"])


@pytest.mark.parametrize("method", METHODS)
def test_record_round_trip(method):
    for value in (hyperparameters_for(method), hyperparameters_for(method, lsub=(2, 3), tau=0.5),
                  hyperparameters_for(method, cache_dtype=jnp.bfloat16)):
        record = json.loads(json.dumps(method_record(value)))  # what run.json holds
        assert record["method"] == method
        assert method_from_record(record) == value


# Hyperparameters added after some committed runs were recorded (issue 55).
NEWER_FIELDS = {"draft_tokens", "draft_lookup"}


def test_docs_run_records_read_back():
    """Every `degs eval` run.json under docs/ gives its method, with every recorded
    hyperparameter but the retired ones at their value."""
    assert len(DOCS_RUNS) >= 50  # the reproduction and training studies' runs
    for path in DOCS_RUNS:
        config = json.loads(path.read_text())["config"]
        method = method_from_record(config, path)
        recorded = {k: v for k, v in config["hyperparameters"].items() if k != "lens_chunk"}
        record = method_record(method)
        # A field added after the run was recorded reads back at its default (draft_tokens: 0).
        newer = {k: v for k, v in record["hyperparameters"].items() if k not in recorded}
        assert newer == {k: v for k, v in method_record(type(method)())["hyperparameters"].items() if k in newer}, path
        assert set(newer) <= NEWER_FIELDS, (path, set(newer))
        record["hyperparameters"] = {k: v for k, v in record["hyperparameters"].items() if k in recorded}
        assert record == {"method": config["method"], "hyperparameters": recorded}, path
        assert method_from_record(read_run_file(path)["config"], path) == method, path


def test_bad_records_name_the_file():
    cases = [({"method": "nucleus", "hyperparameters": {}}, "unknown method 'nucleus'"),
             ({"method": "greedy", "hyperparameters": {"mh_steps": 3}}, "greedy does not take mh_steps"),
             ({"method": "degs_mcmc", "hyperparameters": {"tau": 0}}, "tau"),
             ({"method": "degs_mcmc", "hyperparameters": {"lens_chunk": 64}}, "does not take lens_chunk"),
             ({"hyperparameters": {}}, "needs a method name"),
             ({"method": "greedy", "hyperparameters": [1]}, "needs a method name")]
    for record, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            method_from_record(record, "runs/x/run.json")
        assert str(info.value).startswith("runs/x/run.json: ")


def test_as_method_takes_a_value_or_a_name():
    value = DegsMCMC(mh_steps=4)
    assert as_method(value) is value
    assert as_method("degs_mcmc", {"mh_steps": 4}) == value
    assert as_method("scalable_power") == ScalablePower()
    with pytest.raises(ValueError, match="either in the DegsMCMC or as overrides"):
        as_method(value, {"mh_steps": 3})


def test_a_run_recorded_before_a_field_was_retired_resumes(tmp_path):
    """Resuming compares the stored configuration through its method value: a run.json
    that records lens_chunk (retired) is the same configuration; another value is not."""
    from degs_jax.eval import runner

    method = hyperparameters_for("greedy", max_new_tokens=8, lsub=(1, 2))
    config = {"benchmark": "gsm8k", **method_record(method), "seed": 0}
    old = json.loads(json.dumps(config))
    old["hyperparameters"]["lens_chunk"] = None
    (tmp_path / "run.json").write_text(json.dumps({"config": old, "invocations": [{"versions": {}}]}))
    run = runner._prepare_run_dir(tmp_path, config, {"versions": {}})
    assert run["config"] == config and len(run["invocations"]) == 2
    changed = {**config, **method_record(hyperparameters_for("greedy", max_new_tokens=9, lsub=(1, 2)))}
    with pytest.raises(ValueError, match="hyperparameters.max_new_tokens: stored 8, requested 9"):
        runner._prepare_run_dir(tmp_path, changed, {"versions": {}})


def test_degs_eval_builds_the_method_value_once_and_passes_it_down(monkeypatch, tmp_path):
    from degs_jax import cli
    from degs_jax.eval import runner

    seen = {}
    monkeypatch.setattr(cli, "_load", lambda args: object())
    monkeypatch.setattr(runner, "run_eval", lambda model, out, **kwargs: seen.update(kwargs))
    assert cli.main(["eval", "--benchmark", "gsm8k", "--method", "degs_mcmc", "--mh-steps", "3",
                     "--out", str(tmp_path / "run")]) == 0
    assert seen["method"] == DegsMCMC(mh_steps=3) and "hyperparameters" not in seen
