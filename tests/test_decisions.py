"""MH decision records (`mcmc.MHDecisions`) and what `degs_jax.decisions` reads off them.

- The flip curve's formulas on a hand-made table (expected flips over u, realized flips
  with the recorded u, departing chains, null moves).
- The prediction the records make, checked against runs: from a DEGS-MCMC run at a small
  beta, the chains that a run at a large beta (same keys) turns into other chains are
  exactly those with a realized flip at the large beta, each departing at the predicted
  decision; and a run's own decided decisions are the realized flips of its records.
  (Records equal a step redone by hand: tests/test_decoders.py.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.decisions import (DecisionTable, decision_anatomy, decision_table, departures, flip_curve,
                                format_anatomy)
from degs_jax.decoders import decode
from degs_jax.models import TransformerLM, init_params
from tiny_models import tiny_config

TAU = 3.3  # in the bulk of the tiny model's lens entropies: d_t varies (test_decoders.py)
HYPERPARAMETERS = dict(block_len=3, num_blocks=3, mh_steps=3, n_chains=4, tau=TAU)
PROMPTS = [[3, 14, 15], [35, 89, 79, 32, 38, 46, 26], [60, 2, 71, 8]]


def table(**columns) -> DecisionTable:
    n = len(columns["log_ratio_power"])
    defaults = dict(chain=np.zeros(n, int), problem=np.zeros(n, int), block=np.zeros(n, int),
                    step=np.arange(n), null_move=np.zeros(n, bool), accepted=np.zeros(n, bool),
                    depth_decided=np.zeros(n, bool), cut=np.zeros(n, int), current_suffix=np.ones(n, int),
                    proposal_suffix=np.ones(n, int))
    return DecisionTable(**{**defaults, **{k: np.asarray(v) for k, v in columns.items()}})


def test_flip_curve_by_hand():
    """Three decisions of one chain and one of another:
    r_0 = -1, ΔD = +0.1: accept probability e^-1 -> e^(-1 + 0.1·beta) (1 from beta = 10);
    r_0 = 2, ΔD = -0.1: 1 -> e^(2 - 0.1·beta) below 1 from beta = 20;
    a null move (r_0 = 0, ΔD = 0): never flips;
    r_0 = -3, ΔD = 0 on chain 1: never flips."""
    t = table(chain=[0, 0, 0, 1], block=[0, 0, 1, 0], step=[0, 1, 0, 0],
              log_ratio_power=[-1.0, 2.0, 0.0, -3.0], depth_delta=[0.1, -0.1, 0.0, 0.0],
              log_u=[np.log(0.5), np.log(0.5), np.log(0.9), np.log(0.01)],
              null_move=[False, False, True, False])
    by_beta = {row["beta"]: row for row in flip_curve(t, [0.0, 5.0, 10.0, 30.0])}
    assert by_beta[0.0]["expected_flips"] == 0.0 and by_beta[0.0]["realized_flips"] == 0
    p5 = np.exp(-0.5) - np.exp(-1.0)
    assert by_beta[5.0]["expected_flips"] == pytest.approx(p5)
    p30 = (1 - np.exp(-1.0)) + (1 - np.exp(-1.0))  # first: to 1; second: 1 -> e^(2 - 3)
    assert by_beta[30.0]["expected_flips"] == pytest.approx(p30)
    assert by_beta[30.0]["expected_flips_non_null"] == pytest.approx(p30)
    # realized with u = 0.5: the first flips once e^(-1 + 0.1 beta) > 0.5 (beta > 3.07);
    # the second once e^(2 - 0.1 beta) < 0.5 (beta > 26.9)
    assert [by_beta[b]["realized_flips"] for b in (5.0, 10.0, 30.0)] == [1, 1, 2]
    assert by_beta[5.0]["first_flips"] == {"0": [0, 0]}
    assert by_beta[30.0]["realized_departing_chains"] == 1
    # chain 0 departs with probability 1 - (1 - p1)(1 - p2); chain 1 never
    assert by_beta[30.0]["expected_departing_chains"] == pytest.approx(1 - np.exp(-1.0) ** 2)
    anatomy = decision_anatomy(t, beta=5.0, betas=[5.0, 30.0])
    assert anatomy["null_moves"] == 1 and anatomy["decisions"] == 4 and anatomy["chains"] == 2
    assert anatomy["realized_flips_at_run_beta"] == 1
    assert anatomy["beta_half_chains_depart"] is None  # chain 0 departs with p < 1, chain 1 never
    assert "expected flips" in format_anatomy(anatomy)


def test_power_chain_records_have_no_depth_difference():
    t = table(log_ratio_power=[0.5], depth_delta=[np.nan], log_u=[-1.0])
    with pytest.raises(ValueError, match="did not probe"):
        flip_curve(t)
    assert "flip_curve" not in decision_anatomy(t)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("Qwen2ForCausalLM")  # vocab 97, 3 layers, EOS = 96
    return cfg, init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)


def records(result) -> list[dict]:
    """`degs eval`-like records of a decode result: one per prompt with its chains as
    candidates (through JSON, as a run directory holds them)."""
    return json.loads(json.dumps([
        {"index": i, "candidates": [{"mh_decisions": c.mh_decisions, "tokens": c.tokens} for c in out.candidates]}
        for i, out in enumerate(result.outputs)]))


def write_run(directory, beta, records) -> str:
    """A `degs eval`-like run directory holding `records` (as `degs analyze` reads it)."""
    directory.mkdir()
    config = {"method": "degs_mcmc", "benchmark": "math500", "seed": 7, "model": {"name": "tiny"},
              "key_derivation": "fold_in(key(seed), problem_index)",
              "hyperparameters": dict(HYPERPARAMETERS, beta=beta)}
    (directory / "run.json").write_text(json.dumps({"config": config, "invocations": []}))
    lines = [json.dumps({"id": f"p{r['index']}", "correct": False, **r}) for r in records]
    (directory / "results.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory)


def test_records_predict_which_chains_a_larger_beta_changes(model, tmp_path):
    cfg, params = model
    lm = TransformerLM(cfg)
    keys = jax.random.split(jax.random.key(7), len(PROMPTS))

    def run(beta):
        return records(decode(lm, params, PROMPTS, "degs_mcmc", keys=keys, eos_ids=cfg.eos_token_ids,
                              beta=beta, **HYPERPARAMETERS))

    small, large = 0.01, 40.0
    base, other = run(small), run(large)
    chains = [c for r in base for c in r["candidates"]]
    chains_large = [c for r in other for c in r["candidates"]]
    base_table, large_table = decision_table(base), decision_table(other)
    assert not base_table.depth_decided.any(), "beta = 0.01 decided a decision: not the power chain"
    # each run's decided decisions are the realized flips of its own records, chain by chain
    for t, beta in ((base_table, small), (large_table, large)):
        row = flip_curve(t, [beta])[0]
        assert row["realized_flips"] == int(t.depth_decided.sum())
    predicted = flip_curve(base_table, [large])[0]["first_flips"]
    assert 0 < len(predicted) < len(chains), "every or no chain departs: the prediction is vacuous"
    check = departures(base_table, large_table, large)
    assert check["all_as_predicted"] and check["departed"] == predicted and not check["mismatches"]
    with pytest.raises(ValueError, match="not the power chains"):
        departures(large_table, base_table, small)
    for chain, (a, b) in enumerate(zip(chains, chains_large)):
        first = predicted.get(str(chain))
        a_steps, b_steps = (decision_table([{"index": 0, "mh_decisions": c["mh_decisions"]}]) for c in (a, b))
        if first is None:  # the same chain: every decision and the tokens
            assert a["tokens"] == b["tokens"], f"chain {chain} changed without a predicted flip"
            np.testing.assert_array_equal(a_steps.accepted, b_steps.accepted)
            np.testing.assert_array_equal(a_steps.log_u, b_steps.log_u)
            continue
        # the same decisions up to the predicted flip, where the large beta decides first
        before = (a_steps.block < first[0]) | ((a_steps.block == first[0]) & (a_steps.step < first[1]))
        n = int(before.sum())
        np.testing.assert_array_equal(a_steps.accepted[:n], b_steps.accepted[:n])
        np.testing.assert_array_equal(a_steps.log_ratio_power[:n], b_steps.log_ratio_power[:n])
        assert not b_steps.depth_decided[:n].any() and b_steps.depth_decided[n], \
            f"chain {chain}: the large beta did not depart at the predicted decision {first}"
        assert a_steps.accepted[n] != b_steps.accepted[n]

    # the same check from run directories, through `degs analyze --departures-from`
    from degs_jax.cli import main
    small_dir, large_dir = write_run(tmp_path / "small", small, base), write_run(tmp_path / "large", large, other)
    assert main(["analyze", large_dir, "--departures-from", small_dir]) == 0
    written = json.loads((tmp_path / "large" / "departures.json").read_text())
    assert written["all_as_predicted"] and written["departed"] == predicted
    assert (tmp_path / "large" / "decisions.png").stat().st_size > 0
    anatomy = json.loads((tmp_path / "large" / "decisions.json").read_text())["decisions"]
    assert anatomy["depth_decided"] == int(large_table.depth_decided.sum()) == anatomy["realized_flips_at_run_beta"]


def test_departures_refuse_a_run_that_is_not_a_degs_mcmc_chain(tmp_path):
    """`analyze_departures` reads the method each run.json records (its class, not its
    name: a method of DegsMCMC's class is one): a power MCMC base is refused."""
    from degs_jax.analysis import analyze_departures

    run_dir, base_dir = write_run(tmp_path / "run", 5.0, []), write_run(tmp_path / "base", 0.0, [])
    config = json.loads((tmp_path / "base" / "run.json").read_text())
    config["config"]["method"] = "power_mcmc"
    (tmp_path / "base" / "run.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the base is a power_mcmc run; both must be DEGS-MCMC runs"):
        analyze_departures(run_dir, base_dir, quiet=True)
