"""Statistics against values computed by hand or by an independent closed form written
out here (synthetic data, no model)."""

import itertools
import math

import numpy as np
import pytest

from degs_jax import stats as S
from degs_jax.stats import wilson_interval

Z = 1.959963984540054


def _pairs(both, only_a, only_b, neither):
    a = [True] * both + [True] * only_a + [False] * only_b + [False] * neither
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * neither
    return a, b


def _wilson(k, n):
    """The Wilson score interval, solved from |p̂ − p| = z·sqrt(p(1 − p)/n) (quadratic)."""
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return centre - half, centre + half


# --------------------------------------------------------------------------- McNemar


def test_mcnemar_is_exact_binomial_by_hand():
    # 7 discordant pairs, 1 of them for A: two-sided p = 2 · P(X <= 1), X ~ Bin(7, 1/2)
    # = 2 · (1 + 7) / 2^7 = 0.125.
    a, b = _pairs(both=5, only_a=1, only_b=6, neither=3)
    assert S.mcnemar(a, b) == pytest.approx(16 / 128, rel=1e-12)
    assert S.mcnemar(b, a) == pytest.approx(16 / 128, rel=1e-12)  # symmetric
    assert S.mcnemar(*_pairs(2, 3, 3, 2)) == pytest.approx(1.0)  # a balanced split
    # exact at any count (no chi-square switch): 35 discordant pairs, 10 for A:
    # 2 · Σ_{k<=10} C(35, k) / 2^35
    expected = 2 * sum(math.comb(35, k) for k in range(11)) / 2 ** 35
    assert S.mcnemar(*_pairs(40, 10, 25, 25)) == pytest.approx(expected, rel=1e-9)
    assert 0.0165 < expected < 0.0170  # the chi-square form gave 0.018


def test_mcnemar_without_discordant_pairs_or_pairs():
    assert S.mcnemar([True, False, True], [True, False, True]) == 1.0
    assert math.isnan(S.mcnemar([], []))


# --------------------------------------------------------------------------- Newcombe


def test_newcombe_interval_altman_table_6_2_by_hand():
    # Altman et al. (2000), Table 6.2: both positive 14, only the first 5, only the second
    # 0, neither 22 (n = 41); the difference of the first minus the second is 5/41.
    # Newcombe (1998) method 10, written out:
    n = 41
    p1, p2 = 19 / n, 14 / n
    l1, u1 = _wilson(19, n)
    l2, u2 = _wilson(14, n)
    # phi: AD − BC = 14·22 − 5·0 = 308 > 0, so the numerator is max(308 − 41/2, 0) = 287.5;
    # the margins 19 (first +), 22 (first −), 14 (second +), 27 (second −)
    phi = 287.5 / math.sqrt(19 * 22 * 14 * 27)
    assert phi == pytest.approx(0.72328, abs=1e-5)
    lower = (p1 - p2) - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    upper = (p1 - p2) + math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    # B = the first test (its accuracy is p1): only_a = 0, only_b = 5
    low, high = S.newcombe_paired_interval(14, 0, 5, 22)
    assert (low, high) == (pytest.approx(lower, abs=1e-12), pytest.approx(upper, abs=1e-12))
    assert (low, high) == (pytest.approx(0.01148, abs=1e-5), pytest.approx(0.22649, abs=1e-5))
    # the other direction mirrors it
    assert S.newcombe_paired_interval(14, 5, 0, 22) == (pytest.approx(-upper), pytest.approx(-lower))
    # the same table from verdicts
    a, b = _pairs(both=14, only_a=0, only_b=5, neither=22)
    c = S.compare_paired(a, b)
    assert (c.ci_low, c.ci_high) == (pytest.approx(lower), pytest.approx(upper))
    assert c.difference == pytest.approx(5 / 41)


def test_newcombe_correlation_branches_by_hand():
    def by_hand(both, only_a, only_b, neither, phi):
        n = both + only_a + only_b + neither
        pb, pa = (both + only_b) / n, (both + only_a) / n
        lb, ub = _wilson(both + only_b, n)
        la, ua = _wilson(both + only_a, n)
        return ((pb - pa) - math.sqrt((pb - lb) ** 2 - 2 * phi * (pb - lb) * (ua - pa) + (ua - pa) ** 2),
                (pb - pa) + math.sqrt((ub - pb) ** 2 - 2 * phi * (ub - pb) * (pa - la) + (pa - la) ** 2))

    # AD − BC = 1 − 80 < 0: no continuity adjustment, phi = −79 / sqrt(11·9·9·11) = −79/99
    got = S.newcombe_paired_interval(1, 10, 8, 1)
    assert got == pytest.approx(by_hand(1, 10, 8, 1, -79 / 99), abs=1e-12)
    # 0 < AD − BC = 10 − 9 = 1 <= n/2 = 6.5: the adjusted numerator is 0, so phi = 0
    got = S.newcombe_paired_interval(2, 3, 3, 5)
    assert got == pytest.approx(by_hand(2, 3, 3, 5, 0.0), abs=1e-12)


def test_newcombe_keeps_its_width_with_few_discordant_pairs():
    # no discordant pair, 10 both right and 10 both wrong (n = 20): the estimate 0, the
    # Wilson limits of 10/20 at x = 0.5 − l on either side, phi = (100 − 10)/100 = 0.9:
    # ±x·sqrt(2 − 2·0.9)
    low, high = S.newcombe_paired_interval(10, 0, 0, 10)
    x = 0.5 - _wilson(10, 20)[0]
    assert (low, high) == (pytest.approx(-x * math.sqrt(0.2)), pytest.approx(x * math.sqrt(0.2)))
    assert high > 0.08  # not [0, 0], as the percentile bootstrap gave
    # every problem right for both: the margins of "wrong" are empty, phi = 0, and the
    # interval is ±(1 − l) with l = 20 / (20 + z²) the Wilson lower limit of 20/20
    low, high = S.newcombe_paired_interval(20, 0, 0, 0)
    assert (low, high) == (pytest.approx(-Z * Z / (20 + Z * Z)), pytest.approx(Z * Z / (20 + Z * Z)))
    # one or two discordant pairs, all one way: the interval still contains 0 (as the exact
    # McNemar test, p = 1 and 0.5, does not reject) and is wider than one problem's worth
    for only_b in (1, 2):
        low, high = S.newcombe_paired_interval(40, 0, only_b, 80)
        assert low < 0 < only_b / 122 < high and high - low > 2 / 122
    assert all(math.isnan(x) for x in S.newcombe_paired_interval(0, 0, 0, 0))
    c = S.compare_paired([], [])
    assert c.n == 0 and math.isnan(c.ci_low) and math.isnan(c.p_value)


@pytest.mark.parametrize("n, cells, exact", [
    # (problems, probabilities of both / only A / only B / neither, the exact coverage
    # enumerated over every table once)
    (128, (0.25, 0.05, 0.08, 0.62), 0.9545),
    (50, (0.30, 0.02, 0.04, 0.64), 0.9832),
    (128, (0.10, 0.004, 0.012, 0.884), 0.9990),  # about 2 discordant pairs per table
    # accuracies near 0 (where Wald limits in place of Wilson's cover only 0.869)
    (40, (0.0, 0.01, 0.05, 0.94), 0.9964),
])
def test_newcombe_coverage_monte_carlo(n, cells, exact):
    # 40,000 tables drawn at once; the Monte-Carlo standard error of a coverage near 0.95
    # is 0.0011, so the bounds below are more than 8 standard errors from the exact values
    tables = np.random.default_rng(0).multinomial(n, cells, size=40_000)
    low, high = S.newcombe_paired_interval(*tables.T)
    truth = cells[2] - cells[1]
    coverage = float(np.mean((low <= truth) & (truth <= high)))
    assert coverage == pytest.approx(exact, abs=0.01)
    assert coverage >= 0.945
    # not by being needlessly wide: at the first setting the interval is within 15% of the
    # normal-theory width 2·1.96·sd(b − a)/sqrt(n) of the true table
    if exact < 0.96:
        p = np.array(cells)
        sd = math.sqrt(p[1] + p[2] - (p[2] - p[1]) ** 2)
        assert float(np.mean(high - low)) == pytest.approx(2 * Z * sd / math.sqrt(n), rel=0.15)


def test_compare_paired_table_and_fields():
    a, b = _pairs(both=5, only_a=1, only_b=6, neither=3)
    c = S.compare_paired(a, b)
    assert (c.n, c.both_correct, c.only_a, c.only_b, c.both_wrong) == (15, 5, 1, 6, 3)
    assert c.accuracy_a == pytest.approx(6 / 15) and c.accuracy_b == pytest.approx(11 / 15)
    assert c.difference == pytest.approx(5 / 15)
    assert c.p_value == pytest.approx(0.125)
    assert (c.ci_low, c.ci_high) == tuple(pytest.approx(float(x)) for x in
                                          S.newcombe_paired_interval(5, 1, 6, 3))
    assert c.ci_low <= c.difference <= c.ci_high


def test_bad_verdicts_are_rejected():
    with pytest.raises(ValueError, match="one length"):
        S.compare_paired([True], [True, False])
    with pytest.raises(ValueError, match="booleans"):
        S.mcnemar([0.5, 1], [1, 0])


# --------------------------------------------------------------------------- Holm, sign test, Wilson


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> monotone
    # 0.02, 0.03, 0.06, 0.06; back in the given order
    assert S.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # NaN is not part of the family (m = 2), and adjusted values stop at 1
    adjusted = S.holm([math.nan, 0.2, 0.01, ])
    assert math.isnan(adjusted[0]) and adjusted[1:] == pytest.approx([0.2, 0.02])
    assert S.holm([0.6, 0.7]) == [1.0, 1.0]
    assert S.holm([]) == []


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


def test_wilson_interval_by_hand_and_vectorised():
    # 7 of 10: centre (0.7 + z²/20) / (1 + z²/10), half z·sqrt(0.21/10 + z²/400) / (1 + z²/10)
    low, high = S.wilson_interval(7, 10)
    assert (low, high) == (pytest.approx(_wilson(7, 10)[0]), pytest.approx(_wilson(7, 10)[1]))
    assert low == pytest.approx(0.3968, abs=1e-4) and high == pytest.approx(0.8922, abs=1e-4)
    for n in (1, 7, 40):
        k = np.arange(n + 1)
        lows, highs = S.wilson_limits(k, n)
        assert [(float(x), float(y)) for x, y in zip(lows, highs)] == [
            wilson_interval(int(j), n) for j in k]


# --------------------------------------------------------------------------- clustered AUC

# Four problems: one mixed pair, one mixed triple, one with a single candidate and one
# with every candidate correct.
PROBLEMS = [([0.9, 0.7], [True, False]),
            ([0.3, 0.5, 0.1], [True, False, False]),
            ([0.6], [True]),
            ([0.2, 0.4], [True, True])]
SCORES = [s for scores, _ in PROBLEMS for s in scores]
LABELS = [y for _, labels in PROBLEMS for y in labels]
CLUSTERS = [f"p{i}" for i, (scores, _) in enumerate(PROBLEMS) for _ in scores]


def _pair_auc(candidates):
    """AUC by counting (correct, incorrect) pairs; None without both classes."""
    pos = [s for s, y in candidates if y]
    neg = [s for s, y in candidates if not y]
    if not pos or not neg:
        return None
    return sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))


def _demeaned(problem):
    scores, labels = problem
    mean = sum(scores) / len(scores)
    return [(s - mean, y) for s, y in zip(scores, labels)]


def test_auc_and_problem_demeaned_auc_by_hand():
    # raw: correct .9 .3 .6 .2 .4 vs incorrect .7 .5 .1: wins 3 + 1 + 2 + 1 + 1 = 8 of 15
    whole = S.cluster_bootstrap_auc(SCORES, LABELS, CLUSTERS, n_resamples=0)
    assert whole.estimate == pytest.approx(8 / 15) == S.auc(SCORES, LABELS)
    assert math.isnan(whole.ci_low) and whole.clusters == 4
    # demeaned (problem means .8, .3, .6, .3): correct .1, 0, 0, −.1, .1 vs incorrect
    # −.1, .2, −.2: wins 2 + 2 + 2 + (1 + ½ tie) + 2 = 9.5 of 15
    demeaned = S.demean_by_cluster(SCORES, CLUSTERS)
    assert demeaned == pytest.approx([0.1, -0.1, 0.0, 0.2, -0.2, 0.0, -0.1, 0.1])
    got = S.cluster_bootstrap_auc(SCORES, LABELS, CLUSTERS, demean=True, n_resamples=0)
    assert got.estimate == pytest.approx(9.5 / 15)


@pytest.mark.parametrize("demean", [False, True])
def test_cluster_bootstrap_matches_the_exact_bootstrap_distribution(demean):
    # Every resample of 4 problems with replacement is a multiset of counts (35 of them)
    # with probability 4! / Π c_j! / 4^4; its AUC is counted pair by pair on the problems
    # repeated. The percentile interval is the 2.5% and 97.5% quantiles of that
    # distribution given a defined AUC (resamples of only problems 2 and 3, all correct,
    # have none: probability 2^4 / 4^4 = 1/16).
    distribution, undefined = {}, 0.0
    for counts in itertools.product(range(5), repeat=4):
        if sum(counts) != 4:
            continue
        probability = math.factorial(4) / math.prod(map(math.factorial, counts)) / 4 ** 4
        sample = [c for j, k in enumerate(counts) for _ in range(k)
                  for c in (_demeaned(PROBLEMS[j]) if demean else zip(*PROBLEMS[j]))]
        value = _pair_auc(sample)
        if value is None:
            undefined += probability
        else:
            distribution[round(value, 12)] = distribution.get(round(value, 12), 0.0) + probability
    assert undefined == pytest.approx(1 / 16)
    values = sorted(distribution)
    cdf = np.cumsum([distribution[v] for v in values]) / (1 - undefined)

    def quantile(q):
        # the test's precondition: q is well inside one atom, more than 8 standard errors
        # (sqrt(q(1 − q)/R) = 0.00036 at R = 200,000) from its edges
        assert np.min(np.abs(cdf - q)) > 0.003
        return values[int(np.searchsorted(cdf, q))]

    R = 200_000
    got = S.cluster_bootstrap_auc(SCORES, LABELS, CLUSTERS, demean=demean, n_resamples=R, seed=1)
    assert (got.ci_low, got.ci_high) == (pytest.approx(quantile(0.025)), pytest.approx(quantile(0.975)))
    assert got.undefined_resamples / R == pytest.approx(1 / 16, abs=5 * math.sqrt(1 / 16 * 15 / 16 / R))
    assert (got.resamples, got.seed) == (R, 1)
    # the interval of the raw AUC: [1/6, 4/5]; of the demeaned: [1/2, 1]
    assert (got.ci_low, got.ci_high) == ((0.5, 1.0) if demean else
                                         (pytest.approx(1 / 6), pytest.approx(0.8)))


def test_cluster_bootstrap_resamples_problems_not_candidates():
    # 40 problems of 16 candidates whose D is its problem's level plus small noise, and
    # correctness set per problem: between-problem differences make the candidate-level
    # AUC look precise; the cluster interval is as wide as 40 problems allow.
    rng = np.random.default_rng(0)
    level = rng.normal(size=40)
    scores = np.repeat(level, 16) + 0.01 * rng.normal(size=640)
    labels = np.repeat(rng.random(40) < 0.5, 16)
    clusters = np.repeat(np.arange(40), 16)
    got = S.cluster_bootstrap_auc(scores, labels, clusters)
    # resampling the 640 candidates as if independent (the same percentile bootstrap)
    iid = S.cluster_bootstrap_auc(scores, labels, np.arange(640), n_resamples=2000)
    assert got.estimate == iid.estimate
    assert (got.ci_high - got.ci_low) > 3 * (iid.ci_high - iid.ci_low)
    # reproducible with its seed
    assert S.cluster_bootstrap_auc(scores, labels, clusters) == got
    # demeaned: every problem is all right or all wrong, so the within-problem ranking
    # carries no signal and the AUC is near 0.5
    demeaned = S.cluster_bootstrap_auc(scores, labels, clusters, demean=True)
    assert demeaned.ci_low < 0.5 < demeaned.ci_high


def test_cluster_bootstrap_degenerate_pools():
    # one class only: no AUC and no interval
    got = S.cluster_bootstrap_auc([0.1, 0.2, 0.3], [True, True, True], ["a", "a", "b"])
    assert math.isnan(got.estimate) and math.isnan(got.ci_low) and got.resamples == 0
    # one candidate per problem: the AUC is the ordinary one, the demeaned AUC undefined
    scores, labels, problems = [0.1, 0.4, 0.35, 0.8], [False, True, False, True], "abcd"
    assert S.cluster_bootstrap_auc(scores, labels, problems, n_resamples=0).estimate == 1.0
    assert math.isnan(S.cluster_bootstrap_auc(scores, labels, problems, demean=True).estimate)
    with pytest.raises(ValueError, match="cluster labels"):
        S.cluster_bootstrap_auc([0.1, 0.2], [True, False], ["a"])
