"""Predictive-validity statistics (degs_jax.stats) and the analysis built on them against
hand-computed values (synthetic data, no model)."""

import json
import math

import numpy as np
import pytest

from degs_jax import analysis as A
from degs_jax import stats as S
from degs_jax.cli.options import parse_lsub_sweep

# Two problems of four candidates (ties inside and across classes) and one all-correct.
#            problem a                  problem b
SCORES = [0.1, 0.2, 0.2, 0.3, 0.4, 0.4, 0.5, 0.6]
LABELS = [False, True, False, False, True, False, True, True]
PROBLEM = ["a"] * 4 + ["b"] * 4


def test_auc_with_ties_by_hand():
    # positives 0.2 0.4 0.5 0.6, negatives 0.1 0.2 0.3 0.4: of the 16 pairs 12 are won
    # and 2 tied (0.2/0.2, 0.4/0.4): AUC = (12 + 2/2) / 16.
    assert S.auc(SCORES, LABELS) == pytest.approx(13 / 16)
    assert S.auc([0.5] * 4, [True, False, True, False]) == pytest.approx(0.5)
    assert S.auc([1, 2, 3], [False, False, True]) == 1.0
    assert S.auc([1, 2, 3], [True, False, False]) == 0.0
    assert math.isnan(S.auc([1, 2], [True, True]))


def test_mann_whitney_u_is_the_unnormalised_auc():
    u, p = S.mann_whitney(SCORES, LABELS)
    assert u == pytest.approx(13.0)
    assert 0 < p < 1
    assert all(math.isnan(x) for x in S.mann_whitney([0.3] * 4, [True, False] * 2))
    # a clean separation of a larger sample is significant
    _, p = S.mann_whitney(list(range(40)), [i >= 20 for i in range(40)])
    assert p < 1e-6


def test_mean_gap():
    assert S.mean_gap(SCORES, LABELS) == pytest.approx((0.2 + 0.4 + 0.5 + 0.6) / 4 - (0.1 + 0.2 + 0.3 + 0.4) / 4)
    assert S.mean_gap(SCORES, LABELS) == pytest.approx(0.175)
    assert math.isnan(S.mean_gap([1.0], [False]))


def test_spearman_by_hand_with_tied_ranks():
    # average ranks: scores 1, 2.5, 2.5, 4, 5.5, 5.5, 7, 8; labels: 2.5 (false), 6.5 (true)
    rs = np.array([1, 2.5, 2.5, 4, 5.5, 5.5, 7, 8])
    rl = np.where(LABELS, 6.5, 2.5)
    expected = np.sum((rs - rs.mean()) * (rl - rl.mean())) / math.sqrt(
        np.sum((rs - rs.mean()) ** 2) * np.sum((rl - rl.mean()) ** 2))
    rho, p = S.spearman(SCORES, LABELS)
    assert rho == pytest.approx(expected)
    assert 0 < p < 1
    assert math.isnan(S.spearman([1, 2, 3], [True, True, True])[0])
    assert math.isnan(S.spearman([1, 1, 1], [True, False, True])[0])


def test_pairwise_ranking_accuracy_within_problems():
    # a: correct 0.2 vs incorrect 0.1 (win), 0.2 (tie), 0.3 (loss)
    # b: incorrect 0.4 vs correct 0.4 (tie), 0.5 (win), 0.6 (win)
    # c: all correct, no pairs
    groups = [(SCORES[:4], LABELS[:4]), (SCORES[4:], LABELS[4:]), ([0.9, 0.1], [True, True])]
    pw = S.pairwise_ranking_accuracy(groups)
    assert (pw.pairs, pw.wins, pw.ties, pw.problems) == (6, 3, 2, 2)
    assert pw.accuracy == pytest.approx((3 + 0.5 * 2) / 6)
    assert pw.tie_fraction == pytest.approx(2 / 6)
    # pooled AUC differs: pairs across problems count there, not here
    assert pw.accuracy != pytest.approx(S.auc(SCORES, LABELS))
    empty = S.pairwise_ranking_accuracy([([1.0, 2.0], [True, True])])
    assert math.isnan(empty.accuracy) and empty.pairs == 0


def test_bucket_accuracy_quartiles_by_hand():
    # sorted 0.1 0.2 0.2 0.3 0.4 0.4 0.5 0.6; numpy linear quantiles at positions 7q:
    # q25 = 0.2, q50 = 0.35, q75 = 0.425. Buckets: (<=0.2) {0.1F, 0.2T, 0.2F},
    # (0.2, 0.35] {0.3F}, (0.35, 0.425] {0.4T, 0.4F}, (0.425, 0.6] {0.5T, 0.6T}.
    buckets = S.bucket_accuracy(SCORES, LABELS)
    assert [b.n for b in buckets] == [3, 1, 2, 2]
    assert [b.correct for b in buckets] == [1, 0, 1, 2]
    assert [b.accuracy for b in buckets] == pytest.approx([1 / 3, 0.0, 0.5, 1.0])
    assert [b.high for b in buckets] == pytest.approx([0.2, 0.35, 0.425, 0.6])
    assert buckets[0].low == pytest.approx(0.1)
    assert (buckets[2].min_score, buckets[2].max_score) == (0.4, 0.4)
    for b in buckets:
        assert b.ci_low <= b.accuracy <= b.ci_high


def test_bucket_accuracy_keeps_ties_together():
    # all equal: every candidate in the first bucket, the others empty (NaN accuracy)
    buckets = S.bucket_accuracy([0.5] * 6, [True, False, False, True, True, False])
    assert [b.n for b in buckets] == [6, 0, 0, 0]
    assert buckets[0].accuracy == pytest.approx(0.5)
    assert all(math.isnan(b.accuracy) for b in buckets[1:])
    # two blocks of equal scores: q25 = 0.1, q50 = 0.5 (halfway between the middle ones),
    # q75 = 0.9 (position 5.25 lies inside the 0.9 block), so the 0.9s fall in (0.5, 0.9]
    # and the top bucket is empty
    buckets = S.bucket_accuracy([0.1] * 4 + [0.9] * 4, [False] * 4 + [True] * 4)
    assert [b.high for b in buckets] == pytest.approx([0.1, 0.5, 0.9, 0.9])
    assert [b.n for b in buckets] == [4, 0, 4, 0]
    assert [buckets[0].accuracy, buckets[2].accuracy] == [0.0, 1.0]
    assert sum(b.n for b in S.bucket_accuracy(np.linspace(0, 1, 10), [True] * 10, 3)) == 10


def test_rerank_accuracy():
    groups = [
        {"log_p": [-1.0, -1.2], "D": [0.1, 0.9], "correct": [False, True]},
        {"log_p": [-5.0, -1.0], "D": [0.9, 0.1], "correct": [True, False]},
    ]
    assert S.rerank_accuracy(groups, 1.0, 0.0) == 0.0  # likelihood picks the wrong ones
    assert S.rerank_accuracy(groups, 0.0, 1.0) == 1.0  # depth-only picks the right ones
    # alpha 4, beta 5: problem 1: -4 + 0.5 = -3.5 vs -4.8 + 4.5 = -0.3 -> correct;
    # problem 2: -20 + 4.5 vs -4 + 0.5 -> the incorrect one
    assert S.rerank_accuracy(groups, 4.0, 5.0) == 0.5
    # ties go to the first candidate, as the decoder's argmax
    assert S.rerank_accuracy([{"log_p": [0, 0], "D": [0, 0], "correct": [True, False]}], 1, 1) == 1.0


def _records():
    by_problem = {}
    for pid, d, y in zip(PROBLEM, SCORES, LABELS):
        by_problem.setdefault(pid, []).append({"tokens": [1, 2], "log_p": -d, "D": d, "correct": y})
    return [{"id": pid, "index": index, "correct": cands[0]["correct"], "D": cands[0]["D"],
             "log_p": -1.0, "candidates": cands}
            for index, (pid, cands) in enumerate(by_problem.items())]


def test_pool_and_predictive_validity_from_records():
    pool = A.pool_from_records(_records())
    assert pool.unit == "candidates" and pool.problem == PROBLEM
    stats = A.predictive_validity(pool)
    assert stats["auc"] == pytest.approx(13 / 16)
    # problem-demeaned (means 0.2 and 0.475): correct 0 | -0.075, 0.025, 0.125 vs incorrect
    # -0.1, 0, 0.1 | -0.075: wins 2.5 + 1.5 + 3 + 4 of 16 (ties ½)
    assert stats["demeaned_auc"] == pytest.approx(11 / 16)
    for name in ("auc", "demeaned_auc"):  # problem-level cluster bootstrap intervals
        assert stats[f"{name}_ci_low"] <= stats[name] <= stats[f"{name}_ci_high"]
    assert stats["cluster_bootstrap"]["clusters"] == 2
    assert stats["gap"] == pytest.approx(0.175)
    assert stats["pairwise"]["accuracy"] == pytest.approx(4 / 6)
    assert [b["n"] for b in stats["buckets"]] == [3, 1, 2, 2]
    assert (stats["n"], stats["n_correct"], stats["n_problems"]) == (8, 4, 2)
    json.dumps(stats)  # JSON-able
    text = A.format_report(stats)
    assert "AUC 0.812 [" in text and "pairwise ranking accuracy 0.667" in text
    assert "problem-demeaned AUC 0.688 [" in text
    # without kept candidates: one chosen output per problem
    chosen = A.pool_from_records([{k: v for k, v in r.items() if k != "candidates"}
                                  for r in _records()])
    assert chosen.unit == "chosen" and len(chosen.D) == 2
    with pytest.raises(ValueError, match="without D"):
        A.pool_from_records([{"id": "x", "correct": True, "D": None, "log_p": 0.0}])


def test_analyze_run_writes_json_and_png(tmp_path, capsys):
    run = {"config": {"model": {"name": "synthetic"}, "benchmark": "math500", "method": "best_of_n"},
           "invocations": []}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    stats = A.analyze_run(tmp_path)
    assert stats["auc"] == pytest.approx(13 / 16)
    saved = json.loads((tmp_path / "analysis.json").read_text())
    assert saved["predictive_validity"]["pairwise"]["pairs"] == 6
    png = (tmp_path / "analysis.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "accuracy by D(x) bucket" in capsys.readouterr().out


def test_degenerate_pools_still_report_and_plot(tmp_path):
    # one class only (a tiny model that never answers): statistics needing both are NaN
    # (buckets of 3 all-incorrect candidates: the Wilson lower bound of 0/3 is 5.6e-17, not
    # 0, which once made the error bars negative)
    pool = A.Pool(["a"] * 6 + ["b"] * 6, np.linspace(0.6, 0.9, 12), -np.arange(12.0),
                  np.zeros(12, bool), "candidates")
    stats = A.predictive_validity(pool)
    assert all(math.isnan(stats[k]) for k in ("auc", "gap", "spearman_rho", "mann_whitney_p"))
    assert stats["pairwise"]["pairs"] == 0
    assert [(b["n"], b["accuracy"]) for b in stats["buckets"]] == [(3, 0.0)] * 4
    assert "n/a" in A.format_report(stats)
    assert A.plot_predictive_validity(pool, stats, tmp_path / "one_class.png")
    pool.correct[:] = True
    stats = A.predictive_validity(pool)
    assert A.plot_predictive_validity(pool, stats, tmp_path / "all_correct.png")


def test_parse_lsub_sweep():
    assert parse_lsub_sweep("4,8,12; 16,20,24,28;all;default", 30) == [
        (4, 8, 12), (16, 20, 24, 28), tuple(range(1, 31)), (4, 9, 14, 18, 22, 26, 30)]
    with pytest.raises(ValueError, match="out of range"):
        parse_lsub_sweep("4,40", 30)
    with pytest.raises(ValueError, match="bad L_sub"):
        parse_lsub_sweep("4,x", 30)
    with pytest.raises(ValueError, match="empty"):
        parse_lsub_sweep(" ; ", 30)


def test_degs_analyze_cli(tmp_path, capsys):
    from degs_jax import cli

    run = {"config": {"model": {"name": "synthetic"}, "benchmark": "math500", "method": "best_of_n"},
           "invocations": []}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert cli.main(["analyze", str(tmp_path), "--out", str(tmp_path / "a")]) == 0
    assert "AUC 0.812" in capsys.readouterr().out
    assert (tmp_path / "a" / "analysis.png").exists()
    # outputs without D(x) (power_mcmc does not probe): a clear error unless re-scored
    (tmp_path / "results.jsonl").write_text(json.dumps(
        {"id": "x", "index": 0, "correct": True, "D": None, "log_p": -1.0}) + "\n")
    assert cli.main(["analyze", str(tmp_path)]) == 2
    assert "--lsub-sweep default" in capsys.readouterr().err
    assert cli.main(["analyze", str(tmp_path / "missing")]) == 2
