"""Paired statistics against values computed by hand (synthetic verdicts, no model)."""

import math

import numpy as np
import pytest

from degs_jax import stats as S


def _pairs(both, only_a, only_b, neither):
    a = [True] * both + [True] * only_a + [False] * only_b + [False] * neither
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * neither
    return a, b


def test_mcnemar_exact_binomial_by_hand():
    # 7 discordant pairs, 1 of them for A: two-sided p = 2 * P(X <= 1), X ~ Bin(7, 1/2)
    # = 2 * (1 + 7) / 2^7 = 0.125.
    a, b = _pairs(both=5, only_a=1, only_b=6, neither=3)
    test, statistic, p = S.mcnemar(a, b)
    assert test == "exact binomial" and statistic is None
    assert p == pytest.approx(16 / 128, rel=1e-12)
    # symmetric in the direction
    assert S.mcnemar(b, a)[2] == pytest.approx(p, rel=1e-12)
    # a balanced split: p = 1
    assert S.mcnemar(*_pairs(2, 3, 3, 2))[2] == pytest.approx(1.0)


def test_mcnemar_chi_square_by_hand():
    # 35 discordant pairs (>= 25): chi2 = (|25 - 10| - 1)^2 / 35 = 5.6; with one degree of
    # freedom the survival function is erfc(sqrt(chi2 / 2)).
    a, b = _pairs(both=40, only_a=10, only_b=25, neither=25)
    test, statistic, p = S.mcnemar(a, b)
    assert test == "chi-square, continuity-corrected"
    assert statistic == pytest.approx(5.6, rel=1e-12)
    assert p == pytest.approx(math.erfc(math.sqrt(5.6 / 2)), rel=1e-9)
    assert 0.017 < p < 0.019


def test_mcnemar_switches_to_chi_square_at_25_discordant_pairs():
    assert S.mcnemar(*_pairs(0, 12, 12, 0))[0] == "exact binomial"  # 24
    assert S.mcnemar(*_pairs(0, 12, 13, 0))[0].startswith("chi-square")  # 25


def test_mcnemar_without_discordant_pairs():
    test, statistic, p = S.mcnemar([True, False, True], [True, False, True])
    assert test.startswith("none") and statistic is None and p == 1.0


def test_paired_bootstrap_interval_matches_the_exact_bootstrap_distribution():
    # d = b - a = (1, 0, 0, 0): a resample's mean is K/4 with K ~ Bin(4, 1/4):
    # P(K <= 0) = 81/256 = 0.316 > 0.025, so the 2.5% point is 0; P(K <= 2) = 243/256 =
    # 0.949 < 0.975 <= P(K <= 3) = 255/256, so the 97.5% point is 3/4. Both quantiles lie
    # well inside one atom, so 10,000 resamples find them exactly.
    a = [False, True, False, True]
    b = [True, True, False, True]
    low, high = S.paired_bootstrap_interval(a, b)
    assert (low, high) == (0.0, 0.75)


def test_paired_bootstrap_interval_is_seeded_and_degenerate_cases():
    rng = np.random.default_rng(1)
    a, b = rng.random(60) < 0.4, rng.random(60) < 0.55
    assert S.paired_bootstrap_interval(a, b, seed=3) == S.paired_bootstrap_interval(a, b, seed=3)
    low, high = S.paired_bootstrap_interval(a, b)
    diff = b.mean() - a.mean()
    assert low < diff < high
    # the normal-theory width of the paired difference, 2 * 1.96 * sd(d) / sqrt(n), is
    # what the percentile interval approximates (within 15% at n = 60)
    d = b.astype(float) - a.astype(float)
    assert high - low == pytest.approx(2 * 1.96 * d.std() / math.sqrt(60), rel=0.15)
    assert S.paired_bootstrap_interval([True, True], [False, False]) == (-1.0, -1.0)
    assert all(math.isnan(x) for x in S.paired_bootstrap_interval([], []))


def test_compare_paired_table_and_fields():
    a, b = _pairs(both=5, only_a=1, only_b=6, neither=3)
    c = S.compare_paired(a, b)
    assert (c.n, c.both_correct, c.only_a, c.only_b, c.both_wrong) == (15, 5, 1, 6, 3)
    assert c.accuracy_a == pytest.approx(6 / 15) and c.accuracy_b == pytest.approx(11 / 15)
    assert c.difference == pytest.approx(5 / 15)
    assert c.p_value == pytest.approx(0.125)
    assert c.ci_low <= c.difference <= c.ci_high


def test_bad_verdicts_are_rejected():
    with pytest.raises(ValueError, match="one length"):
        S.compare_paired([True], [True, False])
    with pytest.raises(ValueError, match="booleans"):
        S.mcnemar([0.5, 1], [1, 0])


def test_sign_test_by_hand():
    # the paper's twelve positive cells: p = 2^-12
    r = S.sign_test([0.02] * 12)
    assert (r["positive"], r["negative"], r["zero"]) == (12, 0, 0)
    assert r["p_value"] == pytest.approx(2.0 ** -12)
    # 4 positive, 1 negative, 1 zero: P(X >= 4), X ~ Bin(5, 1/2) = 6/32
    r = S.sign_test([0.1, 0.2, -0.1, 0.0, 0.3, 0.05])
    assert (r["positive"], r["negative"], r["zero"]) == (4, 1, 1)
    assert r["p_value"] == pytest.approx(6 / 32)
    assert math.isnan(S.sign_test([0.0, 0.0])["p_value"])


def test_wilson_interval_by_hand():
    # 7 of 10: centre (0.7 + z²/20) / (1 + z²/10), half z·sqrt(0.21/10 + z²/400) / (1 + z²/10)
    z = 1.959963984540054
    centre = (0.7 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.021 + z * z / 400) / (1 + z * z / 10)
    low, high = S.wilson_interval(7, 10)
    assert low == pytest.approx(centre - half) and high == pytest.approx(centre + half)
    assert low == pytest.approx(0.3968, abs=1e-4) and high == pytest.approx(0.8922, abs=1e-4)
