"""`degs reproduce`: request parsing, the report's tables against hand-computed values on a
synthetic study directory (no model), and the study end to end on the embedded model
(CPU), interrupted and resumed."""

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest

from degs_jax import stats
from degs_jax.eval import graders
from degs_jax.cli import reproduction as command
from degs_jax.reproduce import accuracy, claims, paper, report, study, study_files
from degs_jax.methods import DegsMCMC, hyperparameters_for
from degs_jax.method import study_row
from degs_jax.reproduce.study import StudyRequest, job_hyperparameters


# --------------------------------------------------------------------------- request


def test_parse_values_and_overrides():
    assert command.parse_value("768") == 768 and command.parse_value("0.5") == 0.5
    assert command.parse_value("true") is True and command.parse_value("none") is None
    assert command.parse_value("4,8,12") == (4, 8, 12)
    with pytest.raises(ValueError, match="cannot read"):
        command.parse_value("abc")
    assert command.parse_overrides(["max_new_tokens=768", "degs_mcmc.beta=2", "pool.n=8"]) == {
        "*": {"max_new_tokens": 768}, "degs_mcmc": {"beta": 2}, "pool": {"n": 8}}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        command.parse_overrides(["beta"])
    assert command._scoped_ints(["64", "best_of_n=8"], "--batch-size") == {"*": 64, "best_of_n": 8}


def test_paper_settings_per_benchmark_and_overrides():
    # HumanEval: alpha 2 for every decoder that has one, the low temperature at 0.5
    assert job_hyperparameters("degs_mcmc", "humaneval", {}) == {"alpha": 2.0}
    assert job_hyperparameters("temperature", "humaneval", {}) == {"temperature": 0.5}
    assert job_hyperparameters("degs_mcmc", "math500", {}) == {}
    over = {"*": {"max_new_tokens": 768, "num_blocks": 4, "beta": 2.0}}
    assert job_hyperparameters("greedy", "gsm8k", over) == {"max_new_tokens": 768}
    assert job_hyperparameters("degs_mcmc", "gsm8k", over) == {"num_blocks": 4, "beta": 2.0}
    # a global beta never turns the beta = 0 baseline into something else
    assert job_hyperparameters("power_mcmc", "gsm8k", over) == {"num_blocks": 4}
    # the reranking rows are selections: their weights only
    assert job_hyperparameters("degs_rerank", "humaneval", {}) == {"alpha": 2.0, "beta": 5.0}
    assert job_hyperparameters("depth_only", "gsm8k", {}) == {"alpha": 0.0, "beta": 5.0}
    assert job_hyperparameters("best_of_n_entropy", "gsm8k", {}) == {}
    with pytest.raises(ValueError, match="must equal best_of_n's"):
        job_hyperparameters("degs_rerank", "gsm8k", {"degs_rerank": {"n": 4}})
    with pytest.raises(ValueError, match="alpha = 0 by definition"):
        job_hyperparameters("depth_only", "gsm8k", {"depth_only": {"alpha": 1.0}})
    with pytest.raises(ValueError, match="does not take"):
        job_hyperparameters("greedy", "gsm8k", {"greedy": {"num_blocks": 2}})
    assert study.pool_hyperparameters("gsm8k", over) == {"n": 16, "temperature": 0.8,
                                                        "top_p": 0.9, "max_new_tokens": 768}


def test_request_validation_and_jobs():
    with pytest.raises(ValueError, match="unknown method"):
        StudyRequest(benchmarks={"gsm8k": 2}, methods=("greedy", "beam_search"))
    with pytest.raises(ValueError, match="limit of gsm8k"):
        StudyRequest(benchmarks={"gsm8k": -1}, methods=("greedy",))
    with pytest.raises(ValueError, match="unknown scope"):
        StudyRequest(benchmarks={"gsm8k": 2}, methods=("greedy",), overrides={"grredy": {"n": 2}})
    with pytest.raises(ValueError, match="unknown benchmark"):
        StudyRequest(benchmarks={"gsm8": 2}, methods=("greedy",))
    r = StudyRequest(benchmarks={"gpqa": 3, "gsm8k": None},
                     methods=("degs_rerank", "greedy", "best_of_n_entropy"),
                     pool_benchmarks={"gsm8k": 5}, batch_sizes={"*": 4, "pool": 2})
    jobs = study.plan_jobs(r)
    assert [(j.kind, j.benchmark, j.method, j.limit, j.batch_size, j.keep_candidates)
            for j in jobs] == [
        ("decoder", "gpqa_diamond", "best_of_n", 3, 4, True),  # the reranking rows' pool, once
        ("decoder", "gpqa_diamond", "greedy", 3, 4, False),
        ("decoder", "gsm8k", "best_of_n", None, 4, True),
        ("decoder", "gsm8k", "greedy", None, 4, False),
        ("pool", "gsm8k", "best_of_n", 5, 2, True)]
    assert jobs[-1].hyperparameters == {"n": 16, "temperature": 0.8, "top_p": 0.9}
    assert jobs[-1].directory == "pool/gsm8k" and jobs[0].directory == "runs/gpqa_diamond/best_of_n"


def test_available_methods_follow_table1_order():
    from degs_jax.methods import METHODS

    rows = study.available_methods()
    assert set(rows) == set(METHODS) | {"depth_only"}
    order = [m for m in study.TABLE1_ORDER if m in rows]
    assert list(rows[:len(order)]) == order


def test_paper_lsub_sets():
    # for 28 layers exactly the ten sets of the paper's table
    assert study.paper_lsub_sets(28) == (
        tuple(range(1, 29)), (4, 8, 12, 16, 20, 24, 28), (8, 12, 16, 20, 24, 28),
        (12, 16, 20, 24, 28), (16, 20, 24, 28), (12, 16, 20, 24), (8, 12, 16, 20),
        (4, 8, 12, 16), (1, 4, 8, 12), (1, 2, 3, 4))
    from degs_jax.reproduce import paper
    assert [list(s) for s in study.paper_lsub_sets(28)[1:]] == [r["lsub"] for r in paper.LSUB_TABLE[1:]]
    sets24 = study.paper_lsub_sets(24)  # Qwen2.5-0.5B: grid 3,7,10,14,17,21,24
    assert sets24[1] == (3, 7, 10, 14, 17, 21, 24) and sets24[4] == (14, 17, 21, 24)
    assert sets24[-2] == (1, 3, 7, 10) and len(set(sets24)) == 10


def test_worst_case_cost_by_hand():
    # 4 blocks of 192, 10 MH steps: 4*192 + 10*192*(1+2+3+4)/2 = 768 + 9600
    assert hyperparameters_for("degs_mcmc", num_blocks=4).worst_case_cost() == (10368, 10368)
    # paper default: 16 blocks: 3072 + 10*192*136/2 = 133,632
    assert hyperparameters_for("power_mcmc").worst_case_cost() == (133632, 133632)
    assert hyperparameters_for("best_of_n", max_new_tokens=768).worst_case_cost() == (16 * 768, 768)
    assert hyperparameters_for("greedy").worst_case_cost() == (3072, 3072)
    assert hyperparameters_for("degs_smc", max_new_tokens=512).worst_case_cost() == (16 * 512, 512)


def test_a_job_never_measured_is_estimated_from_one_of_the_same_shape():
    """DEGS-MCMC's first batch is estimated from power MCMC's (same benchmark, batch and
    worst case; before the method's records on other benchmarks), so a budget that cannot
    hold another batch does not start it (on the GPU a 400 s DEGS batch started with 128 s
    of a 540 s budget left, before this)."""
    def job(method, benchmark="math500", batch=64, **hp):
        return study.Job(kind="decoder", benchmark=benchmark, method=method, hyperparameters=hp,
                         limit=None, batch_size=batch, keep_candidates=False,
                         directory=study.run_directory(benchmark, method))

    rates = study._Rates()
    rates.add(study._job_rate_keys(job("power_mcmc")), 390.0, 64)
    assert rates.per_unit(study._job_rate_keys(job("degs_mcmc"))) == pytest.approx(390.0 / 64)
    for other in (job("degs_mcmc", benchmark="gsm8k"), job("degs_mcmc", batch=32),
                  job("degs_mcmc", num_blocks=4), job("greedy")):
        assert rates.per_unit(study._job_rate_keys(other)) is None
    rates.add(study._job_rate_keys(job("degs_mcmc")), 400.0, 64)  # its own measurement wins
    assert rates.per_unit(study._job_rate_keys(job("degs_mcmc"))) == pytest.approx(400.0 / 64)
    # the same benchmark's chains price a job before its method's chains on another benchmark
    # (the 1.5B study: HumanEval's short power-MCMC chains priced MATH500's at 0.66 s a problem)
    rates = study._Rates()
    rates.add(study._job_rate_keys(job("power_mcmc", benchmark="humaneval")), 66.0, 100)
    rates.add(study._job_rate_keys(job("degs_mcmc")), 239.0, 100)
    assert rates.per_unit(study._job_rate_keys(job("power_mcmc"))) == pytest.approx(2.39)
    assert rates.per_unit(study._job_rate_keys(job("power_mcmc", benchmark="gsm8k"))) == pytest.approx(0.66)


def test_a_refill_call_takes_every_batch_the_budget_holds(tmp_path):
    """With refill a `run_eval` call streams its problems through the batch's slots, so it
    takes every batch whose cumulative estimate fits: without a budget all of them (the
    slots of a finished chain take the next problem at once), under one a single batch
    while the job was never measured."""
    job = study.Job(kind="decoder", benchmark="math500", method="greedy", hyperparameters={}, limit=None,
                    batch_size=2, keep_candidates=False, directory=study.run_directory("math500", "greedy"))
    rates, skipped = study._Rates(), []

    def call(budget):
        return study._next_call(job, study._batches(job, 0, 5), 1, tmp_path, rates, budget, skipped, refill=True)

    assert call(study.Budget(None)) == [[0, 1], [2, 3], [4]]  # no budget: the whole job streams
    assert call(study.Budget(1000.0)) == [[0, 1]]  # a budget, never measured: one batch
    rates.add(study._job_rate_keys(job), 10.0, 1)
    assert call(study.Budget(None)) == [[0, 1], [2, 3], [4]]
    assert call(study.Budget(45.0)) == [[0, 1], [2, 3]] and skipped == ["math500 greedy problems 4-4"]


def test_budget():
    import time

    b = study.Budget(10.0, start=time.monotonic() - 8.0)  # 2 s left
    assert b.fits(1.5) and not b.fits(2.5)
    assert b.fits(None) == (2.0 >= study.UNMEASURED_RESERVE * 10)  # unmeasured work: a reserve
    assert not study.Budget(10.0, start=time.monotonic() - 9.0).fits(None)
    assert study.Budget(10.0, start=time.monotonic() - 5.0).fits(None)
    b = study.Budget(10.0, start=time.monotonic() - 11.0)
    assert not b.fits(None) and not b.fits(0.0)
    assert study.Budget(None).fits(1e9)
    with pytest.raises(ValueError):
        study.Budget(0)


def test_batches_are_a_fixed_partition():
    job = study.Job("decoder", "gsm8k", "greedy", {}, 10, 4, False, "runs/gsm8k/greedy")
    assert list(study._batches(job, 0, 10)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # a round that starts inside a batch keeps the same cut points
    assert list(study._batches(job, 6, 10)) == [[6, 7], [8, 9]]


def test_layer_statistics_match_score_sequences_and_trajectories():
    """The layer pass's D(x) per probe set equals teacher-forced scoring's
    (`scoring.score_sequences`), its per-layer means equal `lens.entropy_trajectory`'s, on
    a tiny random model: same tokens, same positions, EOS excluded, however the sequences
    are batched and padded."""
    import jax
    import jax.numpy as jnp

    from degs_jax.lens import LensConfig
    from degs_jax.models import TransformerLM
    from degs_jax.models import init_params
    from degs_jax.scoring import entropy_trajectory, score_sequences
    from tiny_models import tiny_config

    cfg = tiny_config("Qwen2ForCausalLM")  # vocab 97, 3 layers, EOS 96
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(9):
        prompt = rng.integers(0, 96, size=int(rng.integers(2, 12))).tolist()
        completion = rng.integers(0, 96, size=int(rng.integers(1, 25))).tolist()
        if i % 2 == 0:
            completion.append(96)
        seqs.append((prompt, completion, i % 2 == 0))
    seqs.append(([5, 6], [96], True))  # nothing to score
    sets, tau = [(1, 2, 3), (2, 3), (3,)], 3.3  # tau in the bulk of this model's entropies
    # a small row budget: 3 rows of 16 positions, 1 of 32 (several calls, padded rows)
    stats = study.sequence_layer_statistics(TransformerLM(cfg), params, seqs, lsub_sets=sets, tau=tau,
                                            row_budget=4 * 16 * 3, bucket=16)
    assert [s["n_scored"] for s in stats] == [len(c) - e for _, c, e in seqs]
    for k, lsub in enumerate(sets):
        ref = score_sequences(TransformerLM(cfg), params, [p for p, _, _ in seqs], [c for _, c, _ in seqs],
                              LensConfig(lsub=lsub, tau=tau), eos_ids=(96,))
        # D is stored rounded to 6 decimals
        assert [s["D"][k] for s in stats] == pytest.approx([r["depth"] for r in ref], abs=1e-6)
    assert len({s["D"][0] for s in stats}) > 3  # the depths vary: the comparison has teeth
    traj = entropy_trajectory(TransformerLM(cfg), params, [(p + c, [False] * len(p) + [True] * (len(c) - e) + [False] * e)
                                            for p, c, e in seqs], bucket=16)
    for s, row in zip(stats, traj.per_sequence):
        if s["n_scored"]:  # stored rounded to 5 decimals
            assert s["entropy"] == pytest.approx(row.tolist(), abs=2e-5)
        else:
            assert s["entropy"] is None


# --------------------------------------------------------------------------- report (synthetic)

L = 4


def _record(index, correct, **extra):
    base = {"id": f"gsm8k/{index}", "index": index, "correct": correct, "n_tokens": 10,
            "ended": True, "generated_tokens": 10, "forward_tokens": 10, "probed_token_layers": 0,
            "forward_equivalents": 10.0, "decode_s": 1.0, "grade_s": 0.1, "wall_clock_s": 1.1,
            "mean_acceptance": None, "D": None, "log_p": -1.0, "final_entropy": 1.0}
    base.update(extra)
    return base


def _cand(correct, log_p, D, fent):
    return {"correct": correct, "log_p": log_p, "D": D, "final_entropy": fent, "n_tokens": 5,
            "ended": True, "tokens": [1, 2, 3, 4, 5]}


def _write_run(directory: Path, method, records, hp=None):
    directory.mkdir(parents=True)
    config = {"benchmark": "gsm8k", "method": method, "hyperparameters": hp or {}, "chat": True,
              "model": {"name": "toy", "num_layers": L, "architecture": "ToyForCausalLM",
                        "dtype": "float32"},
              "seed": 0, "key_derivation": "fold_in(key(seed), problem_index)"}
    (directory / "run.json").write_text(json.dumps({"config": config, "invocations": []}))
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# best_of_n pools of three candidates for four problems; for each selection rule the
# chosen candidate (by hand):
#   problem 0: log p -1, -2, -3; D .5, .9, .1; H 1, .5, .5 -> BoN 0, entropy 1 (first of the
#              tie .5/.5), DEGS (4 log p + 5 D = 2.5, 0.5, -11.5) 0, depth-only 1
#   problem 1: log p -2, -1, -1.1; D .2, .2, .8; H .3, .9, .1 -> BoN 1, entropy 2,
#              DEGS (-7, -3, -0.4) 2, depth-only 2
#   problem 2: every score tied -> every rule picks candidate 0
#   problem 3: log p -1, -1.5, -4; D .1, .4, .9; H 2, 1, 3 -> BoN 0, entropy 1,
#              DEGS (-3.5, -4, -11.5) 0, depth-only 2
POOLS = [
    [_cand(True, -1, .5, 1), _cand(False, -2, .9, .5), _cand(True, -3, .1, .5)],
    [_cand(False, -2, .2, .3), _cand(False, -1, .2, .9), _cand(True, -1.1, .8, .1)],
    [_cand(False, -1, .5, 1), _cand(True, -1, .5, 1), _cand(True, -1, .5, 1)],
    [_cand(False, -1, .1, 2), _cand(True, -1.5, .4, 1), _cand(True, -4, .9, 3)],
]
BON_CHOSEN = [0, 1, 0, 0]
EXPECTED = {  # problem -> verdict of the selected candidate
    "best_of_n": [True, False, False, False],
    "best_of_n_entropy": [False, True, False, True],
    "degs_rerank": [True, True, False, False],
    "depth_only": [False, True, False, True],
}
POWER = [True, False, False, True, False, True]
DEGS = [True, True, False, True, True, False]
# final completions of the two chains: the same on problems 0, 2 and 3
POWER_TEXT = ["a", "b", "c", "d", "e", "f"]
DEGS_TEXT = ["a", "B", "c", "d", "E", "F"]
# DEGS-MCMC's accepted fraction of its 10 MH steps per block: problem 0 ran three blocks
# (9 of 10 accepted in each), the others one (6 of 10). Mean of the per-problem means
# (0.9 + 5 x 0.6) / 6 = 0.65; pooled over the 80 MH steps (27 + 5 x 6) / 80 = 0.7125.
DEGS_ACCEPTANCE = [[0.9, 0.9, 0.9]] + [[0.6]] * 5
# pool of 2 problems x 2 candidates with layer statistics (L = 4, layers 0..4):
# sets {1,2,3,4} (default) and {3,4}
POOL_CANDS = [[_cand(True, -1, .5, 1), _cand(False, -1.2, .25, 1)],
              [_cand(False, -3, .75, 1), _cand(True, -2, 1.0, 1)]]
LAYERS = [[{"n_scored": 2, "entropy": [5, 4, 3, 2, 1], "D": [.5, .75]},
           {"n_scored": 6, "entropy": [6, 5, 4, 3, 2], "D": [.25, .75]}],
          [{"n_scored": 4, "entropy": [4, 4, 4, 4, 4], "D": [.75, .75]},
           {"n_scored": 2, "entropy": [2, 2, 2, 2, 0], "D": [1.0, 0.5]}]]


@pytest.fixture
def synthetic_study(tmp_path):
    root = tmp_path / "study"
    _write_run(root / "runs/gsm8k/best_of_n",
               "best_of_n", [_record(i, pool[BON_CHOSEN[i]]["correct"], candidates=pool)
                             for i, pool in enumerate(POOLS)])
    _write_run(root / "runs/gsm8k/power_mcmc", "power_mcmc",
               [_record(i, c, generated_tokens=100, forward_tokens=100, forward_equivalents=100.0,
                        decode_s=2.0, mean_acceptance=0.5, completion=POWER_TEXT[i])
                for i, c in enumerate(POWER)], hp={"beta": 0.0})
    _write_run(root / "runs/gsm8k/degs_mcmc", "degs_mcmc",
               [_record(i, c, generated_tokens=120, forward_tokens=120, probed_token_layers=240,
                        forward_equivalents=180.0, decode_s=2.7, acceptance=DEGS_ACCEPTANCE[i],
                        mean_acceptance=float(np.mean(DEGS_ACCEPTANCE[i])),
                        completion=DEGS_TEXT[i], ended=i != 5)
                for i, c in enumerate(DEGS)], hp={"beta": 5.0, "num_blocks": 4, "lsub": [3, 4]})
    _write_run(root / "pool/gsm8k", "best_of_n",
               [_record(i, False, candidates=c) for i, c in enumerate(POOL_CANDS)],
               hp={"lsub": [1, 2, 3, 4], "tau": 0.25, "n": 2})
    (root / "pool/gsm8k/layers.json").write_text(json.dumps(
        {"layers": [0, 1, 2, 3, 4], "tau": 0.25, "lsub_sets": [[1, 2, 3, 4], [3, 4]],
         "model": "toy", "num_layers": L, "chat": True}))
    (root / "pool/gsm8k/layers.jsonl").write_text("".join(
        json.dumps({"id": f"gsm8k/{i}", "index": i, "seconds": 0.5, "candidates": c}) + "\n"
        for i, c in enumerate(LAYERS)))
    jobs = {d: {"kind": k, "benchmark": "gsm8k", "method": m, "target": t, "batch_size": 4,
                "deviations": {}}
            for d, k, m, t in [("runs/gsm8k/best_of_n", "decoder", "best_of_n", 4),
                               ("runs/gsm8k/power_mcmc", "decoder", "power_mcmc", 6),
                               ("runs/gsm8k/degs_mcmc", "decoder", "degs_mcmc", 8),
                               ("pool/gsm8k", "pool", "best_of_n", 2)]}
    jobs["runs/gsm8k/degs_mcmc"]["deviations"] = {"num_blocks": {"paper": 16, "used": 4},
                                                  "mh_steps": {"paper": 10, "used": 2}}
    selections = {"gsm8k": {"rows": {"best_of_n_entropy": {}, "degs_rerank": {"alpha": 4.0, "beta": 5.0},
                                     "depth_only": {"alpha": 0.0, "beta": 5.0}},
                            "pool_rerank": {"alpha": 4.0, "beta": 5.0}, "deviations": {}}}
    (root / "study.json").write_text(json.dumps({
        "model": {"name": "toy", "num_layers": L},
        "invocations": [{"started": "2026-01-01T00:00:00+00:00", "status": "finished",
                         "device": "cpu", "seconds": 1.0, "jobs": jobs,
                         "selections": selections, "skipped": []}]}))
    return root


def test_select_candidate_rules_and_ties():
    for i, pool in enumerate(POOLS):
        assert accuracy.select_candidate("best_of_n_entropy", pool, {}) == [1, 2, 0, 1][i]
        assert accuracy.select_candidate("degs_rerank", pool, {"alpha": 4, "beta": 5}) == [0, 2, 0, 0][i]
        assert accuracy.select_candidate("depth_only", pool, {"alpha": 0, "beta": 5}) == [1, 2, 0, 2][i]
    with pytest.raises(ValueError, match="not probed"):
        accuracy.select_candidate("degs_rerank", [{"log_p": -1, "D": None}], {"alpha": 4, "beta": 5})


def test_report_tables_by_hand(synthetic_study, tmp_path):
    result = report.write_report(synthetic_study, tmp_path / "out")
    rows = {r["method"]: r for r in result["table1"]["rows"]}
    assert result["table1"]["benchmarks"] == ["gsm8k"]
    for method, expected in EXPECTED.items():
        cell = rows[method]["cells"]["gsm8k"]
        assert (cell["n"], cell["correct"]) == (4, sum(expected)), method
    assert rows["degs_mcmc"]["cells"]["gsm8k"]["accuracy"] == pytest.approx(4 / 6)
    # Table 1 order
    assert [r["method"] for r in result["table1"]["rows"]] == [
        "best_of_n", "power_mcmc", "best_of_n_entropy", "degs_rerank", "depth_only", "degs_mcmc"]

    comps = {(c["treatment"], c["baseline"]): c for c in result["paired"]["comparisons"]}
    beta = comps[("degs_mcmc", "power_mcmc")]
    # both right: 0, 3; only power: 5; only degs: 1, 4; neither: 2
    assert (beta["n"], beta["both_correct"], beta["only_a"], beta["only_b"], beta["both_wrong"]) == (6, 2, 1, 2, 1)
    assert beta["difference"] == pytest.approx(1 / 6)
    assert beta["p_value"] == pytest.approx(1.0)  # 2 * P(X <= 1), X ~ Bin(3, 1/2)
    # Newcombe's interval of the table (both 2, only power 1, only DEGS 2, neither 1)
    assert (beta["ci_low"], beta["ci_high"]) == tuple(
        pytest.approx(float(x)) for x in stats.newcombe_paired_interval(2, 1, 2, 1))
    rerank = comps[("degs_rerank", "best_of_n")]  # problem 1 only: +1/4
    assert (rerank["only_a"], rerank["only_b"]) == (0, 1)
    assert rerank["difference"] == pytest.approx(0.25)
    (sign,) = result["paired"]["beta_sign_tests"]
    assert (sign["positive"], sign["negative"]) == (1, 0) and sign["p_value"] == pytest.approx(0.5)
    # five pairs ran (beta, rerank - BoN, entropy - BoN, rerank - depth-only, MCMC - rerank);
    # Holm over the five
    paired = result["paired"]
    assert paired["comparisons_made"] == len(comps) == 5
    assert [c["p_holm"] for c in paired["comparisons"]] == pytest.approx(
        stats.holm([c["p_value"] for c in paired["comparisons"]]))
    assert "5 comparisons" in paired["note"]
    # common random numbers of the beta pair: same seed and key derivation; num_blocks
    # differs (beta and L_sub belong to the depth term); completions equal on 0, 2, 3
    assert paired["common_random_numbers"] == [{
        "benchmark": "gsm8k", "treatment": "degs_mcmc", "baseline": "power_mcmc",
        "same_keys": True, "seed": 0, "key_derivation": "fold_in(key(seed), problem_index)",
        "other_settings_differ": ["num_blocks"], "problems": 6, "identical_completions": 3}]

    # predictive validity of the pool (problem 0: correct .5, incorrect .25; problem 1:
    # incorrect .75, correct 1): AUC 3/4; a resample of problem 0 or 1 twice has AUC 1 (each
    # probability 1/4), of both 3/4 (1/2): interval [3/4, 1]. Demeaned: correct +.125,
    # +.125 vs incorrect −.125, −.125: 1 in every resample.
    pv = result["predictive_validity"]["gsm8k"]
    assert pv["sampling"] == "N = 2, T = 1, top-p 1"
    assert (pv["auc"], pv["auc_ci_low"], pv["auc_ci_high"]) == (0.75, 0.75, 1.0)
    assert (pv["demeaned_auc"], pv["demeaned_auc_ci_low"], pv["demeaned_auc_ci_high"]) == (1.0, 1.0, 1.0)
    assert pv["cluster_bootstrap"]["clusters"] == 2 and pv["cluster_bootstrap"]["resamples"] == 10_000

    # L_sub: candidates' D under the two sets; DEGS rerank with 4 log p + 5 D
    lsub = result["lsub"]["gsm8k"]
    default, deep = lsub["rows"]
    # default set: problem 0 scores (-1.5, -3.55) -> correct; problem 1 (-8.25, -3) -> correct
    assert default["degs_rerank_accuracy"] == 1.0
    # {3,4}: problem 0 D .75/.75 -> 4 log p decides -> correct; problem 1 (-8.25, -5.5) -> correct
    assert deep["degs_rerank_accuracy"] == 1.0
    # depth-only: default (.5 vs .25 -> correct; .75 vs 1 -> correct); {3,4}: problem 0 a tie
    # -> the first (correct), problem 1 .75 vs .5 -> the incorrect one
    assert default["depth_only_accuracy"] == 1.0 and deep["depth_only_accuracy"] == 0.5
    assert default["auc"] == pytest.approx(0.75)  # correct .5, 1.0 vs incorrect .25, .75: 3 of 4
    # {3,4}: correct .75, .5 vs incorrect .75, .75: two ties and two losses of four pairs;
    # within problems a tie (problem 0) and a loss (problem 1)
    assert deep["auc"] == pytest.approx(0.25) and deep["pairwise_accuracy"] == pytest.approx(0.25)
    # Best-of-N on the pool: log p -1 vs -1.2 (correct), -3 vs -2 (correct)
    assert lsub["reference"] == {"best_of_n": 1.0, "oracle": 1.0, "mean_candidate": 0.5}
    assert lsub["recorded_vs_rescored_D"]["max_abs_difference"] == 0.0
    assert default["probe_cost_per_token"] == 1.0 and deep["probe_cost_per_token"] == 0.5

    # trajectories: token-weighted means (correct: 2 and 2 tokens; incorrect: 6 and 4)
    traj = result["trajectories"]["gsm8k"]["groups"]
    assert traj["correct"]["mean_entropy"] == pytest.approx([3.5, 3, 2.5, 2, 0.5])
    assert traj["incorrect"]["mean_entropy"] == pytest.approx([5.2, 4.6, 4, 3.4, 2.8])
    assert traj["correct"]["tokens"] == 4 and traj["incorrect"]["candidates"] == 2
    # mean collapse layer: D * L token-weighted: correct (.5*2 + 1*2)/4 * 4 = 3, incorrect
    # (.25*6 + .75*4)/10 * 4 = 1.8, on the pool's probe grid {1,2,3,4}, which is all layers
    # here
    assert result["trajectories"]["gsm8k"]["probe_grid"] == [1, 2, 3, 4]
    assert traj["correct"]["mean_collapse_layer"] == pytest.approx(3.0)
    assert traj["incorrect"]["mean_collapse_layer"] == pytest.approx(1.8)
    assert traj["incorrect"]["mean_collapse_layer_all_layers"] == pytest.approx(1.8)

    compute = {(r["benchmark"], r["method"]): r for r in result["compute"]["rows"]}
    assert compute[("gsm8k", "degs_mcmc")]["probe_charge"] == pytest.approx(240 / L)
    assert compute[("gsm8k", "degs_mcmc")]["mean_acceptance"] == pytest.approx(0.65)
    assert compute[("gsm8k", "degs_mcmc")]["acceptance_pooled"] == pytest.approx(57 / 80)
    assert compute[("gsm8k", "degs_mcmc")]["mh_steps_total"] == 80
    (over,) = result["compute"]["probe_overhead"]
    assert over["forward_equivalents_per_generated_token"] == pytest.approx(1.5 / 1.0 - 1)
    assert over["wall_clock_overhead_per_generated_token"] == pytest.approx((2.7 / 120) / (2.0 / 100) - 1)

    status = result["status"]
    assert not status["complete"]  # degs_mcmc: 6 of 8
    by_claim = {c["claim"][:10]: c for c in result["claims"]}
    assert by_claim["beta = 5 i"]["verdict"].startswith(
        "positive in every cell, as the paper: 1 positive, 0 negative, 0 zero of 1 cell;")
    assert by_claim["MH accepta"]["measured"] == (
        "gsm8k: 0.713 pooled over 80 MH steps (mean of per-problem means 0.650)")
    assert by_claim["MH accepta"]["verdict"].startswith("1 of 1 benchmarks inside 57-78% (pooled")
    assert by_claim["beta = 5 i"]["verdict"].endswith(
        "significant at 5% after Holm over the 5 comparisons of the paired table: none")
    assert by_claim["D(x) predi"]["verdict"] == ("problem-demeaned AUC interval above 0.5 in 1, "
                                                 "below 0.5 in 0 of 1 pools")

    deviations = {r["setting"]: r for r in result["deviations"]}
    assert deviations["model"]["deviates"] and deviations["model"]["used"] == (
        "`toy`; ToyForCausalLM, 4 layers, float32 weights; prompts through its chat template "
        "(run configuration chat = true)")
    assert "HumanEval prompt" not in deviations  # no HumanEval run
    cap = deviations["completion token cap"]
    assert cap["deviates"] and cap["paper"] == "3072, 3072 (16 blocks of 192)"
    assert cap["used"] == ("3072: best_of_n, pool on gsm8k; 768 (4 blocks of 192): degs_mcmc on "
                           "gsm8k; 3072 (16 blocks of 192): power_mcmc on gsm8k")
    assert cap["effect"].endswith("gsm8k 0–17%")  # one DEGS-MCMC completion of six cut
    bon = deviations["Best-of-N pool (Best-of-N and its selections)"]
    # the paper's Best-of-N: N = 16, top-p 1, temperature not stated (reranking: 0.7 to 1)
    assert bon["paper"] == paper.BEST_OF_N_SAMPLING
    assert not bon["deviates"] and bon["used"] == "N = 16, T = 1, top-p 1: gsm8k"
    # candidates of problems 0 and 1 (the pool's): 3 of 6 correct; the pool's 2 of 4
    assert bon["effect"] == ("mean candidate accuracy on the 2 gsm8k problems both drew: 0.500 at "
                             "N = 16, T = 1, top-p 1 vs 0.500 at N = 2, T = 1, top-p 1 (the "
                             "predictive-validity pool)")
    assert deviations["predictive-validity pool"]["used"] == "N = 2, T = 1, top-p 1: gsm8k"
    assert deviations["predictive-validity pool"]["deviates"]
    assert deviations["predictive-validity pool"]["paper"] == "N = 16, T = 0.8, top-p 0.9"
    # rows of runs that are not in this study
    for setting in ("Scalable Power Sampling candidate temperature", "DeepMind500 grader",
                    "HumanEval completion end"):
        assert setting not in deviations
    assert (deviations["mh_steps"]["paper"], deviations["mh_steps"]["used"]) == (10, "2: degs_mcmc on gsm8k")
    assert "num_blocks" not in deviations  # part of the token cap
    assert deviations["problems per benchmark"]["used"] == "gsm8k 4–6 (not in the paper's Table 1)"
    assert deviations["Table 1 cells"]["used"] == (
        "not run: Base (greedy), Low-temperature, Scalable Power Sampling, Power-SMC; MATH500, "
        "DeepMind500, HumanEval pass@1, GPQA-Diamond")
    assert deviations["L_sub ablation"]["deviates"]

    text = Path(result["report"]).read_text()
    assert "Partial results" in text and "0.667 [" in text
    assert "not a random sample" not in text  # its invocation did not refill
    assert "## Deviations from the paper" in text and "| mh_steps | 10 | 2: degs_mcmc on gsm8k |" in text
    mcmc_statement = study_row(DegsMCMC).common_random_numbers
    assert "**5 comparisons**" in text and mcmc_statement in text
    assert paired["common_random_numbers_notes"] == [mcmc_statement]  # no SMC pair ran
    assert "**1.000 [1.000, 1.000]** | 0.750 [0.750, 1.000]" in text
    for name in ("table1", "paired", "predictive_validity_gsm8k", "trajectory_gsm8k"):
        png = Path(result["figures"][name])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"figures/{png.name}" in text
    for name in ("status", "deviations", "table1", "paired", "predictive_validity", "lsub",
                 "trajectories", "compute", "claims"):
        assert json.loads((tmp_path / "out" / "tables" / f"{name}.json").read_text())


def test_a_users_method_states_its_study_row(synthetic_study, tmp_path, monkeypatch):
    """The study reads what it knows of a row off the method class (`StudyRow`): a user's
    selection from best_of_n's kept candidates, with its own rule, label, Table 1 place and
    comparison, joins the report as the library's rows do; a method that states nothing is
    a row of its own run, labelled by its name, after the paper's rows."""
    import dataclasses
    from typing import ClassVar

    import degs_jax.method
    from degs_jax.methods import BestOfN
    from degs_jax.method import Comparison, StudyRow

    monkeypatch.setattr(degs_jax.method, "_REGISTERED", dict(degs_jax.method._REGISTERED))

    def deepest(candidates, weights):  # the largest D(x), first on ties
        return int(np.argmax([c["D"] for c in candidates]))

    def define(name, **namespace):
        body = {"__module__": "my_script", "__qualname__": name, "method": name,
                "__annotations__": {"method": ClassVar[str], "study": ClassVar[StudyRow]}, **namespace}
        return dataclasses.dataclass(frozen=True)(type(name, (BestOfN,), body))

    define("deepest", study=StudyRow(label="Deepest", position=8.5, selected_from="best_of_n", select=deepest,
                                     comparisons=(Comparison("best_of_n", "depth alone vs likelihood", 0),)))
    define("plain_rule")
    rows = study.available_methods()
    assert rows[:len(study.TABLE1_ORDER) + 1] == (*study.TABLE1_ORDER[:8], "deepest", *study.TABLE1_ORDER[8:])
    assert rows[-1] == "plain_rule" and study.row_label("plain_rule") == "plain_rule"
    assert study.TABLE1_ORDER == tuple(m for m in rows if m not in ("deepest", "plain_rule"))  # the default study
    assert job_hyperparameters("deepest", "gsm8k", {}) == {}  # a selection: its weights (none)
    with pytest.raises(ValueError, match="deepest selects from best_of_n's pool, so its n must equal"):
        job_hyperparameters("deepest", "gsm8k", {"deepest": {"n": 4}})
    (job,) = study.plan_jobs(StudyRequest(benchmarks={"gsm8k": 4}, methods=("deepest",)))
    assert (job.method, job.keep_candidates) == ("best_of_n", True)

    meta = json.loads((synthetic_study / "study.json").read_text())
    meta["invocations"][0]["selections"]["gsm8k"]["rows"]["deepest"] = {}
    (synthetic_study / "study.json").write_text(json.dumps(meta))
    result = report.write_report(synthetic_study, tmp_path / "out")
    table = {r["method"]: r for r in result["table1"]["rows"]}
    assert [r["method"] for r in result["table1"]["rows"]] == [
        "best_of_n", "power_mcmc", "best_of_n_entropy", "degs_rerank", "deepest", "depth_only", "degs_mcmc"]
    # the largest D per problem: 1 (wrong), 2 (right), 0 of a tie (wrong), 2 (right)
    cell = table["deepest"]["cells"]["gsm8k"]
    assert (table["deepest"]["label"], cell["correct"], cell["n"]) == ("Deepest", 2, 4)
    assert table["deepest"]["source"] == "selected from the best_of_n run's candidates"
    first = result["paired"]["comparisons"][0]  # rank 0: before the library's
    assert (first["treatment"], first["baseline"], first["question"]) == (
        "deepest", "best_of_n", "depth alone vs likelihood")
    assert "| Deepest | 0.500 [" in Path(result["report"]).read_text()

    with pytest.raises(TypeError, match="the study row 'greedy' is named as a method"):
        define("renamed", study_variants={"greedy": StudyRow(selected_from="best_of_n", select=deepest)},
               __annotations__={"method": ClassVar[str], "study_variants": ClassVar[dict]})
        study.study_rows()
    with pytest.raises(TypeError, match="needs its rule on the stored candidates"):
        StudyRow(selected_from="best_of_n")


@pytest.mark.parametrize("name", ["smollm2-135m-cpu-smoke", "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-whole"])
def test_a_committed_study_renders_its_committed_report(name, tmp_path):
    """The report is a function of the stored files: a committed study's report.md comes
    back byte for byte (every row, label, comparison, beta pair and claim the method
    classes state; the 1.5B study has both beta pairs, SPS and the pool selections, the
    smoke study greedy's compute unit and the layer pass)."""
    source = Path(__file__).parents[1] / "docs" / "reproduction" / name
    result = report.write_report(source, tmp_path)
    assert Path(result["report"]).read_text() == (source / "report.md").read_text()


def test_the_decision_anatomy_of_the_whole_runs():
    """The report's MH-decision table on the committed DEGS-MCMC chains at 1.5B (every
    benchmark whole: 500 + 500 + 1,319 + 164 + 198 problems), against counts made directly
    from the records' `mh_decisions` here; the power-MCMC runs have rows of their own with
    no depth term; a study whose MCMC records predate decision records has no row and no
    section."""
    source = Path(__file__).parents[1] / "docs" / "reproduction"
    study = report.load_study(source / "qwen2.5-coder-1.5b-whole")
    all_rows = report.build_tables(study)["decisions"]["rows"]
    rows = {r["benchmark"]: r for r in all_rows if r["method"] == "degs_mcmc"}
    power = {r["benchmark"]: r for r in all_rows if r["method"] == "power_mcmc"}
    assert sorted(rows) == sorted(power) == ["deepmind500", "gpqa_diamond", "gsm8k", "humaneval", "math500"]
    assert len(all_rows) == 10 and all(r["beta"] is None and r["chains_depth_decided"] is None for r in power.values())
    for benchmark, row in rows.items():
        decided = accepted = decisions = null = 0
        chains = set()
        for r in study.runs[(benchmark, "degs_mcmc")]["records"]:
            m = r["mh_decisions"]
            for b, block in enumerate(m["accepted"]):
                for s, a in enumerate(block):
                    decisions += 1
                    accepted += bool(a)
                    null += bool(m["null_move"][b][s])
                    if m["depth_decided"][b][s]:
                        decided += 1
                        chains.add(r["index"])
        assert row["beta"] == 5.0
        assert (row["decisions"], row["depth_decided"], row["chains_depth_decided"]) == (decisions, decided, len(chains))
        assert row["accepted"] == pytest.approx(accepted / decisions) and row["null_moves"] == pytest.approx(null / decisions)
    # docs/reproduction.md quotes these: (problems, decisions, decided by beta*dD, chains
    # it decided, the beta the records predict to move half the chains)
    quoted = {"math500": (500, 20250, 7, 7, 200.0), "deepmind500": (500, 17250, 12, 12, 500.0),
              "gsm8k": (1319, 27930, 26, 25, 200.0), "humaneval": (164, 1800, 11, 10, 200.0),
              "gpqa_diamond": (198, 10220, 1, 1, 500.0)}
    assert {b: (r["problems"], r["decisions"], r["depth_decided"], r["chains_depth_decided"],
                r["beta_half_chains_depart"]) for b, r in rows.items()} == quoted
    older = report.load_study(source / "qwen2.5-coder-1.5b")
    assert report.build_tables(older)["decisions"]["rows"] == []
    assert "## Where the depth term acts" not in (source / "qwen2.5-coder-1.5b" / "report.md").read_text()


def test_raw_prompts_give_a_benchmark_its_own_format(embedded_model, tmp_path):
    """`--raw-prompts gsm8k`: GSM8K's prompts go as raw text and MATH500's through the chat
    template in one study (each run records its format, and the deviations table says
    which); a benchmark name is canonicalised, and an unknown one refused."""
    from degs_jax.eval import Grader
    from degs_jax.reproduce import deviations

    request = StudyRequest(benchmarks={"math500": 1, "gsm8k": 1}, methods=("greedy",), pool_benchmarks={},
                           overrides={"*": {"max_new_tokens": 2}}, layer_pass=False, raw_benchmarks=("GSM8K",))
    assert request.raw_benchmarks == ("gsm8k",) and not request.chat_for("gsm8k") and request.chat_for("math500")
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        StudyRequest(benchmarks={"gsm8k": 1}, methods=("greedy",), raw_benchmarks=("gsm9k",))
    with pytest.raises(ValueError, match="--raw-prompts humaneval: not a benchmark of this study"):
        StudyRequest(benchmarks={"gsm8k": 1}, methods=("greedy",), raw_benchmarks=("humaneval",))
    with Grader() as grader:
        study.run_study(embedded_model, tmp_path, request, progress=False, grader=grader, log=lambda m: None)
    chat = {b: json.loads((tmp_path / "runs" / b / "greedy" / "run.json").read_text())["config"]["chat"]
            for b in ("math500", "gsm8k")}
    assert chat == {"math500": True, "gsm8k": False}
    loaded = report.load_study(tmp_path)
    configs = {key: data["run"]["config"] for key, data in deviations._all_runs(loaded).items()}
    (model_row,) = deviations._model_rows(loaded, configs)
    assert model_row["used"].endswith("; raw text for gsm8k")
    # a resume that forgets the flag is refused before anything runs, naming the fix
    forgot = dataclasses.replace(request, raw_benchmarks=())
    with pytest.raises(ValueError, match="gsm8k's prompts as raw text; .* add --raw-prompts gsm8k"):
        study.check_prompt_formats(tmp_path, forgot)
    with pytest.raises(ValueError, match="math500's prompts through the chat template"):
        study.check_prompt_formats(tmp_path, dataclasses.replace(request, raw_benchmarks=("gsm8k", "math500")))
    study.check_prompt_formats(tmp_path, request)  # the same formats: nothing to say


def test_paired_table_holm_over_the_comparisons_made():
    # Only the beta pair ran, on two benchmarks: gsm8k 0 / 8 discordant (exact p = 2 / 2^8),
    # math500 0 / 3 (p = 2 / 2^3). Holm over the two: 2·p_min, then max(that, 1·p_max).
    config = {"seed": 0, "key_derivation": "fold_in(key(seed), problem_index)",
              "hyperparameters": {}}
    records = {"gsm8k": ([False] * 10, [True] * 8 + [False] * 2),
               "math500": ([False] * 5, [True] * 3 + [False] * 2)}
    runs = {(b, m): {"run": {"config": config},
                     "records": [{"index": i, "correct": c, "completion": f"{m}{i}"}
                                 for i, c in enumerate(verdicts)]}
            for b, pair in records.items() for m, verdicts in zip(("power_mcmc", "degs_mcmc"), pair)}
    toy = study_files.Study(Path("toy"), {"model": {"name": "toy", "num_layers": L}, "invocations": []},
                            runs=runs)
    paired = accuracy.paired_table(toy, accuracy.verdicts(toy))
    comps = {c["benchmark"]: c for c in paired["comparisons"]}
    assert paired["comparisons_made"] == 2
    assert comps["gsm8k"]["p_value"] == pytest.approx(2 / 256)
    assert comps["math500"]["p_value"] == pytest.approx(2 / 8)
    assert comps["gsm8k"]["p_holm"] == pytest.approx(2 * 2 / 256)
    assert comps["math500"]["p_holm"] == pytest.approx(2 / 8)
    assert paired["holm_family"] == 2
    # pooled over the two benchmarks: 15 pairs, 0 / 11 discordant, outside Holm's family
    (pooled,) = paired["pooled"]
    assert (pooled["treatment"], pooled["baseline"], pooled["benchmarks"]) == ("degs_mcmc", "power_mcmc",
                                                                              ["math500", "gsm8k"])
    assert (pooled["n"], pooled["only_a"], pooled["only_b"]) == (15, 0, 11)
    assert pooled["difference"] == pytest.approx(11 / 15) and pooled["p_value"] == pytest.approx(2 / 2 ** 11)
    one = study_files.Study(Path("toy"), toy.meta, runs={k: v for k, v in runs.items() if k[0] == "gsm8k"})
    assert accuracy.paired_table(one, accuracy.verdicts(one))["pooled"] == []  # one benchmark: nothing to pool
    assert claims.beta_verdict(paired["comparisons"], paired["holm_family"]).endswith(
        "one-sided sign test over the 2 non-zero cells p = 0.25; significant at 5% after "
        "Holm over the 2 comparisons of the paired table: gsm8k")
    # every completion differs: no identical final completion
    assert [c["identical_completions"] for c in paired["common_random_numbers"]] == [0, 0]


def test_beta_verdict_counts_ties_as_no_direction():
    def cells(*diffs):
        return [{"benchmark": f"b{i}", "difference": d, "p_holm": 1.0} for i, d in enumerate(diffs)]

    # the committed 0.5B study: +0.016, 0, 0 is not "the same direction" as the paper
    verdict = claims.beta_verdict(cells(0.016, 0.0, 0.0), 21)
    assert verdict == ("not positive in every cell: 1 positive, 0 negative, 2 zero of 3 cells; "
                       "one-sided sign test over the 1 non-zero cell p = 0.5; significant at 5% "
                       "after Holm over the 21 comparisons of the paired table: none")
    assert claims.beta_verdict(cells(0.0, 0.0), 2).startswith("no difference in any cell: 0 positive")
    assert "p = n/a" in claims.beta_verdict(cells(0.0, 0.0), 2)
    assert claims.beta_verdict(cells(-0.1, -0.2), 2).startswith("negative in every cell")
    assert claims.beta_verdict(cells(0.1, -0.2, 0.3), 3).startswith(
        "not positive in every cell: 2 positive, 1 negative, 0 zero of 3 cells; one-sided sign "
        "test over the 3 non-zero cells p = 0.5")  # P(X >= 2), X ~ Bin(3, 1/2) = 4/8
    significant = cells(0.1, 0.2)
    significant[1]["p_holm"] = 0.01
    assert claims.beta_verdict(significant, 2).endswith(
        "significant at 5% after Holm over the 2 comparisons of the paired table: b1")


def test_export_drops_tokens_and_renders_the_same_tables(synthetic_study, tmp_path):
    full = report.build_tables(report.load_study(synthetic_study))
    in_flight = synthetic_study / "runs/gsm8k/best_of_n/checkpoints"  # a chain of a killed run
    in_flight.mkdir()
    (in_flight / "test%2F7.npz").write_bytes(b"snapshot")
    exported = report.export_study(synthetic_study, tmp_path / "export")
    for line in (tmp_path / "export/runs/gsm8k/best_of_n/results.jsonl").read_text().splitlines():
        assert all("tokens" not in c for c in json.loads(line)["candidates"])
    # the copy continues where the study stopped: its in-flight chains come along
    assert (tmp_path / "export/runs/gsm8k/best_of_n/checkpoints/test%2F7.npz").read_bytes() == b"snapshot"
    for name in ("deviations", "table1", "paired", "predictive_validity", "lsub", "trajectories",
                 "compute", "claims"):
        assert json.loads(json.dumps(exported[name])) == json.loads(json.dumps(full[name])), name
    with pytest.raises(ValueError, match="not an exported study"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other/file").write_text("x")
        report.export_study(synthetic_study, tmp_path / "other")


# --------------------------------------------------------------------------- regrade

def _boxed(answer):
    return "Step by step ... so the answer is $\\boxed{" + answer + "}$."


def _stored_run(directory: Path, benchmark, method, records):
    """A run as `degs reproduce --export` leaves it (candidates without tokens)."""
    directory.mkdir(parents=True)
    config = {"benchmark": benchmark, "method": method, "hyperparameters": {}, "chat": True,
              "model": {"name": "toy", "num_layers": L, "architecture": "ToyForCausalLM",
                        "dtype": "float32"},
              "seed": 0, "key_derivation": "fold_in(key(seed), problem_index)",
              "template_sha256": "0" * 64}
    invocation = {"started": "2026-01-01T00:00:00+00:00", "versions": {"math-verify": "0.9.0"}}
    (directory / "run.json").write_text(json.dumps({"config": config, "invocations": [invocation]}))
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _answer_record(problem_id, index, answer, correct, **extra):
    return _record(index, correct, id=problem_id, completion=_boxed(answer) if answer else "no box",
                   extracted=answer, grade_detail="ok" if answer else "no boxed answer", **extra)


def _answer_cand(answer, correct, chosen=False):
    return {"correct": correct, "extracted": answer, "chosen": chosen, "log_p": -1.0, "D": 0.5,
            "final_entropy": 1.0, "n_tokens": 5, "ended": True}


@pytest.fixture
def graded_study(tmp_path):
    """Real DeepMind500 problems with answers Qwen2.5-Coder-1.5B wrote (docs/reproduction/
    qwen2.5-coder-1.5b) and the verdicts the grader before the DeepMind500 rules gave them;
    a MATH500 and a HumanEval run beside them."""
    root = tmp_path / "study"
    _stored_run(root / "runs/deepmind500/greedy", "deepmind500", "greedy", [
        _answer_record("deepmind500/0", 0, "3", True),  # "Solve 99*y - 331 = 3*y - 43 for y."
        _answer_record("deepmind500/3", 3, None, False),  # no boxed answer
        _answer_record("deepmind500/45", 45, r"\text{No}", False),  # "Does 1230 divide ...?" False
        _answer_record("deepmind500/51", 51, "-53, 2911, 5, 0.5", True),  # sort decreasing
        _answer_record("deepmind500/60", 60, r"7:01 \text{ PM}", False)])  # 7:01 PM
    _stored_run(root / "runs/deepmind500/best_of_n", "deepmind500", "best_of_n", [
        # "Is 873578389 composite?" (True)
        _answer_record("deepmind500/61", 61, r"\text{Yes}", False, n_candidates=3,
                       n_candidates_correct=0,
                       candidates=[_answer_cand(r"\text{No}", False),
                                   _answer_cand(r"\text{Yes}", False, chosen=True),
                                   _answer_cand("873578389", False)])])
    _stored_run(root / "runs/math500/greedy", "math500", "greedy", [
        _answer_record("test/precalculus/807.json", 0, r"(3, \frac{\pi}{2})", True)])
    _stored_run(root / "runs/humaneval/greedy", "humaneval", "greedy", [
        _record(0, False, id="HumanEval/0", completion="def f(): pass")])
    (root / "study.json").write_text(json.dumps({
        "model": {"name": "toy", "num_layers": L},
        "invocations": [{"started": "2026-01-01T00:00:00+00:00", "status": "finished",
                         "device": "cpu", "seconds": 1.0, "jobs": {}, "selections": {},
                         "skipped": []}]}))
    return root


# (run, problem, candidate, old, new) of every verdict the DeepMind500 rules change
REGRADE_CHANGES = {
    ("runs/deepmind500/best_of_n", "deepmind500/61", None, False, True),
    ("runs/deepmind500/best_of_n", "deepmind500/61", 1, False, True),
    ("runs/deepmind500/greedy", "deepmind500/45", None, False, True),
    ("runs/deepmind500/greedy", "deepmind500/51", None, True, False),
    ("runs/deepmind500/greedy", "deepmind500/60", None, False, True),
}


def test_regrade_changes_stored_verdicts_in_place(graded_study):
    from degs_jax.reproduce.regrade import regrade_study

    humaneval = (graded_study / "runs/humaneval/greedy/results.jsonl").read_bytes()
    before = {r["setting"]: r for r in report.build_tables(report.load_study(graded_study))[
        "deviations"]}["DeepMind500 grader"]
    assert before["used"].endswith("; stored verdicts by grading rules 1 (the current rules are "
                                   f"version {graders.RULES_VERSION}: `degs reproduce --regrade`)")
    assert before["effect"] is None
    lines = []
    entry = regrade_study(graded_study, log=lines.append)
    assert {(c["directory"], c["problem_id"], c["candidate"], c["old"], c["new"])
            for c in entry["changed"]} == REGRADE_CHANGES
    assert entry["timeouts_kept"] == [] and entry["rules_version"] == graders.RULES_VERSION
    assert entry["regraded"] == ["runs/deepmind500/best_of_n", "runs/deepmind500/greedy",
                                 "runs/math500/greedy"]
    assert entry["not_regraded"] == ["runs/humaneval/greedy"]
    assert ("runs/deepmind500/greedy deepmind500/51 chosen: right -> wrong  (answer "
            "'-53, 2911, 5, 0.5')") in lines
    assert "runs/deepmind500/best_of_n deepmind500/61 candidate 1: wrong -> right  (answer " \
           "'\\\\text{Yes}')" in lines
    assert lines[-1].startswith("re-graded 3 runs") and "5 verdicts changed" in lines[-1]

    greedy = study.read_records(graded_study / "runs/deepmind500/greedy")
    assert [r["correct"] for r in greedy] == [True, False, True, False, True]
    assert greedy[1]["grade_detail"] == "no boxed answer"
    summary = json.loads((graded_study / "runs/deepmind500/greedy/summary.json").read_text())
    assert summary["accuracy"]["correct"] == 3 and summary["accuracy"]["n"] == 5
    (bon,) = study.read_records(graded_study / "runs/deepmind500/best_of_n")
    assert bon["correct"] and bon["n_candidates_correct"] == 1
    assert [c["correct"] for c in bon["candidates"]] == [False, True, False]
    run = json.loads((graded_study / "runs/deepmind500/greedy/run.json").read_text())
    assert run["regrades"][-1]["changed"] == 3 and run["regrades"][-1]["rules_version"] == graders.RULES_VERSION
    assert (graded_study / "runs/humaneval/greedy/results.jsonl").read_bytes() == humaneval
    assert not (graded_study / "runs/humaneval/greedy/summary.json").exists()

    tables = report.write_report(graded_study)
    grader = {r["setting"]: r for r in tables["deviations"]}["DeepMind500 grader"]
    assert grader["used"].endswith("degs_jax/eval/deepmind.py)")  # every verdict by rules 2
    assert grader["deviates"] and grader["effect"].startswith(
        "re-grading on 20") and "changed 5 stored DeepMind500 verdicts, of 4 distinct" in grader["effect"]
    assert tables["status"]["regrades"][0]["changed"] == 5
    assert "(`degs reproduce --regrade`): 5 stored verdicts changed" in Path(tables["report"]).read_text()
    cell = {r["method"]: r for r in tables["table1"]["rows"]}["greedy"]["cells"]["deepmind500"]
    assert (cell["correct"], cell["n"]) == (3, 5)

    again = regrade_study(graded_study, log=lines.append)  # nothing left to change
    assert again["changed"] == [] and len(json.loads(
        (graded_study / "study.json").read_text())["regrades"]) == 2


def test_regrade_keeps_a_verdict_that_timed_out(graded_study, monkeypatch):
    from concurrent.futures import TimeoutError as FutureTimeout

    from degs_jax.eval import Grader
    from degs_jax.reproduce.regrade import regrade_study

    def hang(*args):
        raise FutureTimeout

    with Grader() as grader:
        monkeypatch.setattr(grader.math, "call", hang)
        entry = regrade_study(graded_study, grader=grader, log=lambda line: None)
    assert entry["changed"] == []
    # every stored answer timed out (the record without a boxed answer needs no grading)
    assert len(entry["timeouts_kept"]) == 4 + 4 + 1
    greedy = study.read_records(graded_study / "runs/deepmind500/greedy")
    assert [r["correct"] for r in greedy] == [True, False, False, True, False]  # as stored
    assert greedy[2]["grade_detail"] == "timeout (stored verdict kept)"


def test_regrade_refuses_a_record_whose_answer_is_not_its_completion(graded_study):
    from degs_jax.reproduce.regrade import regrade_study

    path = graded_study / "runs/deepmind500/greedy/results.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[2]["extracted"] = r"\text{Yes}"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match="not the last boxed span"):
        regrade_study(graded_study, log=lambda line: None)


def test_regrade_of_one_eval_directory(graded_study, capsys):
    from degs_jax import cli

    run = graded_study / "runs/deepmind500/greedy"
    assert cli.main(["reproduce", "--out", str(run), "--regrade"]) == 0
    out = capsys.readouterr().out
    assert "greedy deepmind500/45 chosen: wrong -> right" in out and "re-graded 1 runs" in out
    assert [r["correct"] for r in study.read_records(run)] == [True, False, True, False, True]
    assert json.loads((run / "run.json").read_text())["regrades"][-1]["changed"] == 3
    assert not (run / "study.json").exists() and not (run / "report.md").exists()
    with pytest.raises(FileNotFoundError, match="neither"):
        from degs_jax.reproduce.regrade import regrade_study

        regrade_study(graded_study / "runs")


def test_regrade_command(graded_study, capsys):
    from degs_jax import cli

    assert cli.main(["reproduce", "--out", str(graded_study), "--regrade", "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "runs/deepmind500/greedy deepmind500/60 chosen: wrong -> right" in out
    assert not (graded_study / "report.md").exists()
    assert cli.main(["reproduce", "--out", str(graded_study), "--regrade"]) == 0
    assert "report: " in capsys.readouterr().out and (graded_study / "report.md").exists()
    assert cli.main(["reproduce", "--out", str(graded_study), "--regrade", "--report-only"]) == 2
    assert "--regrade is a mode of its own; leave out --report-only" in capsys.readouterr().err


# --------------------------------------------------------------------------- end to end (CPU)

# Two benchmarks (the math grader and the sandboxed HumanEval grader), two problems each,
# greedy and DEGS-MCMC with short blocks, a pool of 2 candidates with its layer pass. Every
# compilation happens in the first study; the interrupted and resumed ones reuse them.
# The model is the embedded SmolLM2-135M cut to its first BLOCKS blocks (its own
# embedding, final norm, unembedding, tokenizer and chat template): the forward pass is
# unrolled over layers, and compiling a decoder for all 30 blocks took 23 s of CPU here
# against 9 s for 4 blocks, for no difference to what the test checks. Eight blocks keep
# the paper's ten L_sub sets distinct. The prompts are padded to one width
# (`shared_prompt_width`), so the HumanEval jobs run the programs compiled for GSM8K.
BLOCKS = 8
# The two GSM8K prompts are 115 and 75 tokens, the two HumanEval ones 186 and 179 (chat
# template, SmolLM2's tokenizer): padded to 192, every job of a method has the same shapes.
SHARED_PROMPT_WIDTH = 192
E2E = ["--benchmarks", "gsm8k,humaneval", "--methods", "greedy,degs_mcmc", "--limit", "2",
       "--pool-benchmarks", "gsm8k", "--hp", "max_new_tokens=8", "--hp", "block_len=4",
       "--hp", "num_blocks=2", "--hp", "mh_steps=2", "--hp", "pool.n=2", "--batch-size", "2",
       "--no-progress", "--compilation-cache", "none"]
TIMING = {"decode_s", "grade_s", "wall_clock_s", "seconds", "advance_s"}


@pytest.fixture(scope="module")
def embedded_model():
    import dataclasses

    from degs_jax.models.loading import LoadedModel, load

    full = load("smollm2-135m", progress=False)
    return LoadedModel(cfg=dataclasses.replace(full.cfg, num_layers=BLOCKS),
                       params=dataclasses.replace(full.params, layers=full.params.layers[:BLOCKS]),
                       tokenizer=full.tokenizer, source=full.source,
                       name=f"smollm2-135m-first-{BLOCKS}-blocks")


@pytest.fixture
def shared_prompt_width(monkeypatch):
    """Prompts padded to a multiple of SHARED_PROMPT_WIDTH (pad_prompts' bucket, 16, raised):
    each decode runs as for a run whose longest prompt is that long, with one compiled
    program per method for both benchmarks."""
    from degs_jax import decoders, generation

    monkeypatch.setattr(decoders, "pad_prompts",
                        functools.partial(generation.pad_prompts, multiple=SHARED_PROMPT_WIDTH))


@pytest.fixture
def degs(embedded_model, shared_prompt_width, monkeypatch, capsys):
    """`degs ...` in-process with the module's model (prompts at the shared width)."""
    from degs_jax import cli

    monkeypatch.setattr(cli, "_load", lambda args: embedded_model)

    def run(*argv):
        capsys.readouterr()
        rc = cli.main([str(a) for a in argv])
        return rc, *capsys.readouterr()

    return run


def _without_timing(value):
    if isinstance(value, dict):
        return {k: _without_timing(v) for k, v in value.items()
                if k not in TIMING and k not in report.TIMING_FIELDS}
    if isinstance(value, list):
        return [_without_timing(v) for v in value]
    return value


def _records(root: Path) -> dict[str, list]:
    """Every JSONL file's records without their timings, by problem (a refilled run writes
    them in the order its problems finished, which the host's chunk sizes, chosen from
    wall-clock time, may change)."""
    def order(record):
        return (record.get("index", -1), json.dumps(record, sort_keys=True))

    return {str(p.relative_to(root)): sorted((_without_timing(json.loads(line)) for line in p.read_text().splitlines()),
                                             key=order)
            for p in sorted(root.rglob("*.jsonl"))}


def _comparable_tables(root: Path) -> dict:
    tables = {name: json.loads((root / "tables" / f"{name}.json").read_text())
              for name in ("table1", "paired", "predictive_validity", "lsub", "trajectories",
                           "compute")}
    return _without_timing(tables)


@pytest.mark.slow
def test_study_end_to_end_interrupted_and_resumed(degs, tmp_path, monkeypatch):
    import degs_jax.eval.runner as runner

    whole = tmp_path / "whole"
    rc, out, err = degs("reproduce", "--out", whole, *E2E)
    assert rc == 0, err
    st = json.loads((whole / "study.json").read_text())
    (inv,) = st["invocations"]
    assert inv["status"] == "finished" and not inv["skipped"]
    # one batch for each of 2 benchmarks x 2 methods, the pool, its layer pass
    assert [s["job"] for s in inv["steps"]] == [
        "runs/gsm8k/greedy", "runs/gsm8k/degs_mcmc", "pool/gsm8k", "pool/gsm8k/layers",
        "runs/humaneval/greedy", "runs/humaneval/degs_mcmc"]
    tables = json.loads((whole / "tables/status.json").read_text())
    assert tables["complete"] and {j["done"] for j in tables["jobs"]} == {2}
    assert inv["jobs"]["runs/gsm8k/degs_mcmc"]["deviations"]["num_blocks"] == {"paper": 16, "used": 2}
    assert inv["jobs"]["runs/humaneval/degs_mcmc"]["deviations"].get("alpha") is None  # paper's 2
    run_cfg = json.loads((whole / "runs/humaneval/degs_mcmc/run.json").read_text())["config"]
    assert run_cfg["hyperparameters"]["alpha"] == 2.0  # the paper's HumanEval setting
    pool = [json.loads(l) for l in (whole / "pool/gsm8k/results.jsonl").read_text().splitlines()]
    layers = [json.loads(l) for l in (whole / "pool/gsm8k/layers.jsonl").read_text().splitlines()]
    assert [len(r["candidates"]) for r in pool] == [2, 2]
    assert [len(c["entropy"]) for r in layers for c in r["candidates"]] == [BLOCKS + 1] * 4  # 0..L
    assert all(len(c["D"]) == 10 for r in layers for c in r["candidates"])  # the paper's ten sets
    lsub = json.loads((whole / "tables/lsub.json").read_text())["gsm8k"]
    # D(x) of the default grid (set 1), re-scored teacher-forced, against the value recorded
    # during generation: equal but where a collapse depth flips because an entropy is within
    # bf16 rounding of tau (cached decode and one full forward round differently). Scoring
    # the wrong positions would make nearly every candidate differ.
    assert lsub["rows"][1]["lsub"] == [1, 2, 3, 5, 6, 7, 8]  # default_lsub(8)
    rescored = [c["D"][1] for r in layers for c in r["candidates"]]
    recorded = [c["D"] for r in pool for c in r["candidates"]]
    assert sum(abs(a - b) < 1e-6 for a, b in zip(rescored, recorded)) >= len(recorded) / 2
    # the invocation records what the deviations table needs of the model: its source and
    # whether the prompts went through a chat template (SmolLM2-Instruct has one)
    assert inv["model"]["chat_template"] is True and inv["model"]["source"]
    deviations = {r["setting"]: r for r in json.loads((whole / "tables/deviations.json").read_text())}
    assert deviations["model"]["used"].endswith("prompts through its chat template")
    assert deviations["HumanEval prompt"]["deviates"]
    report_md = (whole / "report.md").read_text()
    assert "## Table 1" in report_md and "Partial results" not in report_md
    assert {p.name for p in (whole / "figures").iterdir()} >= {
        "table1.png", "paired.png", "predictive_validity_gsm8k.png", "trajectory_gsm8k.png"}

    # The same study, interrupted after three batches and the layer pass (as by Ctrl-C or a
    # kill between batches), then resumed by the same command.
    resumed = tmp_path / "resumed"
    real, calls = runner.run_eval, []

    def interrupting(*args, **kwargs):
        calls.append(kwargs["indices"])
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_eval", interrupting)
    rc, out, err = degs("reproduce", "--out", resumed, *E2E)
    assert rc == 130 and "degs: interrupted" in err  # the CLI's Ctrl-C ending
    st = json.loads((resumed / "study.json").read_text())
    assert st["invocations"][0]["status"] == "interrupted"
    assert len(st["invocations"][0]["steps"]) == 4
    monkeypatch.setattr(runner, "run_eval", real)
    rc, out, err = degs("reproduce", "--out", resumed, *E2E)
    assert rc == 0, err
    st = json.loads((resumed / "study.json").read_text())
    assert [i["status"] for i in st["invocations"]] == ["interrupted", "finished"]
    assert [s["job"] for s in st["invocations"][1]["steps"]] == [  # only what was left
        "runs/humaneval/greedy", "runs/humaneval/degs_mcmc"]
    assert _records(resumed) == _records(whole)
    assert _comparable_tables(resumed) == _comparable_tables(whole)

    # A third copy stopped by its time budget after two batches, then resumed.
    budgeted = tmp_path / "budgeted"
    allowed = iter([True, True])
    monkeypatch.setattr(study.Budget, "fits", lambda self, estimate: next(allowed, False))
    rc, out, err = degs("reproduce", "--out", budgeted, *E2E, "--time-budget", "1000")
    assert rc == 0, err
    st = json.loads((budgeted / "study.json").read_text())
    assert st["invocations"][0]["status"] == "stopped by the time budget"
    assert len(st["invocations"][0]["skipped"]) == 3  # the pool, both humaneval batches
    # refilled (the default): the finished problems lean towards the shorter chains, said so
    assert "Partial results" in (budgeted / "report.md").read_text()
    assert "lean towards the shorter chains: they are not a random sample" in (budgeted / "report.md").read_text()
    assert "Left for a later invocation" in (budgeted / "report.md").read_text()
    rc, out, err = degs("reproduce", "--out", budgeted, "--plan", *E2E)
    assert rc == 0 and "gsm8k greedy" in out and "never measured" in out
    monkeypatch.setattr(study.Budget, "fits", lambda self, estimate: True)
    rc, out, err = degs("reproduce", "--out", budgeted, *E2E)
    assert rc == 0, err
    assert _comparable_tables(budgeted) == _comparable_tables(whole)

    # the report needs only the files; the export drops candidate tokens, keeps the tables
    rc, out, err = degs("reproduce", "--out", whole, "--export", tmp_path / "export")
    assert rc == 0, err
    assert _comparable_tables(tmp_path / "export") == _comparable_tables(whole)
    for line in (tmp_path / "export/pool/gsm8k/results.jsonl").read_text().splitlines():
        assert all(set(c) & {"tokens", "tokens_packed"} == set()
                   for c in json.loads(line)["candidates"])


@pytest.mark.slow
def test_reranking_rows_are_the_decoders_choices(embedded_model, shared_prompt_width, tmp_path):
    """Best-of-N-Entropy, DEGS reranking and depth-only, selected from a best_of_n run's kept
    candidates, pick what the decoders themselves pick: same pool, same choice. (The pool
    settings of the end-to-end study: the compiled sampler is shared.)"""
    from degs_jax.eval import Grader
    from degs_jax.eval.runner import run_eval

    hp = {"n": 2, "max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9}
    runs = {}
    with Grader() as grader:
        for name, method, extra in (("best_of_n", "best_of_n", {}),
                                    ("best_of_n_entropy", "best_of_n_entropy", {}),
                                    ("degs_rerank", "degs_rerank", {}),
                                    ("depth_only", "degs_rerank", {"alpha": 0.0})):
            run_eval(embedded_model, tmp_path / name, benchmark="gsm8k", method=method,
                     hyperparameters={**hp, **extra}, limit=2, batch_size=2, keep_candidates=True,
                     grader=grader, progress=False, print_table=False)
            runs[name] = study.read_records(tmp_path / name)
    weights = {"best_of_n_entropy": {}, "degs_rerank": job_hyperparameters("degs_rerank", "gsm8k", {}),
               "depth_only": job_hyperparameters("depth_only", "gsm8k", {})}
    for name in weights:
        for pool, theirs in zip(runs["best_of_n"], runs[name]):
            # the same candidates (same keys, same sampler) ...
            assert [c["tokens"] for c in pool["candidates"]] == [c["tokens"] for c in theirs["candidates"]]
            # ... and the same choice
            chosen = [c["chosen"] for c in theirs["candidates"]].index(True)
            assert accuracy.select_candidate(name, pool["candidates"], weights[name]) == chosen


def test_the_default_batch_shrinks_to_what_fits_and_a_given_one_is_kept(embedded_model, tmp_path,
                                                                        monkeypatch):
    """A job given no --batch-size takes at most what `--batch-size auto` says fits in the
    free memory (so the study's own default never runs out of memory, as Scalable Power
    Sampling at 16 problems did on an H200); a size the user gives is kept. The free memory
    is set to hold two of this job's problems."""
    import dataclasses

    from degs_jax import batching
    from degs_jax.eval import Grader, load_benchmark
    from degs_jax.eval.runner import choose_problem_batch

    request = StudyRequest(benchmarks={"gsm8k": 3}, methods=("greedy",), pool_benchmarks={},
                           overrides={"*": {"max_new_tokens": 4}})
    decoder = study.plan_jobs(request)[0].decoder
    problems = load_benchmark("gsm8k")[:3]
    row = choose_problem_batch(embedded_model, "auto", decoder, problems, True)["bytes_per_row"]
    free = int(2.5 * row / batching.DEFAULT_MEMORY_FRACTION)
    monkeypatch.setattr(batching, "free_memory", lambda device=None: (free, "the test's"))

    messages = []
    with Grader() as grader:
        fitted = study.run_study(embedded_model, tmp_path / "default", request, progress=False,
                                 grader=grader, log=messages.append)
        given = study.run_study(embedded_model, tmp_path / "given",
                                dataclasses.replace(request, batch_sizes={"*": 16}),
                                progress=False, grader=grader, log=messages.append)
    (inv,) = fitted["invocations"]
    # one refilled call: the three problems stream through the two slots that fit
    assert [s["problems"] for s in inv["steps"]] == [[0, 1, 2]]
    assert inv["jobs"]["runs/gsm8k/greedy"]["batch_size"] == 2
    assert messages[0].startswith("gsm8k greedy: 2 problems per batch instead of the default 16 "
                                  "(batch size 2 (auto, limited by memory")
    (inv,) = given["invocations"]
    assert [s["problems"] for s in inv["steps"]] == [[0, 1, 2]]
    assert inv["jobs"]["runs/gsm8k/greedy"]["batch_size"] == 16
    assert not any("instead of the default" in m for m in messages[1:])
    # the given size is kept, and the study warns before compiling that the estimate fits 2
    warnings = [m for m in messages[1:] if "warning" in m]
    assert len(warnings) == 1 and warnings[0].startswith(
        "gsm8k greedy: warning: batch size 16 kept as given, but the memory estimate fits fewer: "
        "batch size 2 (auto, limited by memory")
