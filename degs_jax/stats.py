"""Every statistic of the package, in one place (no JAX, no model; scipy on first use):
accuracies with Wilson intervals, paired decoder comparisons and the predictive validity
of a score, with intervals that respect how the data were drawn.

**Accuracy** of ``k`` correct among ``n``: ``k / n`` with the 95% Wilson score interval
(:func:`wilson_interval`; :func:`wilson_limits` element-wise; its ends are exactly 0 at
``k = 0`` and 1 at ``k = n``), the interval of every `degs eval` summary.

**Paired decoders.** Two decoders A and B answer the same ``n`` problems; problem ``i``
gives a pair of verdicts ``(a_i, b_i)`` in {0, 1}², tabulated as ``both`` (both right),
``only_a``, ``only_b`` and ``neither``. The accuracies are not independent (the same
problems are easy or hard for both), so everything uses the pairs:

- **Exact McNemar test** of "A and B are equally accurate": under the null hypothesis
  each discordant pair goes either way with probability 1/2, so
  ``only_b ~ Binomial(only_a + only_b, 1/2)``; the two-sided p-value is
  ``min(1, 2·P(X ≤ min(only_a, only_b)))`` (``scipy.stats.binomtest``). Always exact:
  the binomial is exact at every count, while the chi-square form is an approximation
  that was only ever a computational shortcut. Without discordant pairs p = 1.
- **Newcombe's paired score interval** (Newcombe 1998, Stat. Med. 17:2635, method 10)
  of ``acc_B − acc_A``, the headline interval. With ``p_b = (both + only_b)/n``,
  ``p_a = (both + only_a)/n`` and their 95% Wilson limits ``[l_b, u_b]``, ``[l_a, u_a]``::

      lower = (p_b − p_a) − sqrt((p_b − l_b)² − 2·φ·(p_b − l_b)(u_a − p_a) + (u_a − p_a)²)
      upper = (p_b − p_a) + sqrt((u_b − p_b)² − 2·φ·(u_b − p_b)(p_a − l_a) + (p_a − l_a)²)

  where φ is the correlation of the two verdicts, ``(AD − BC)/sqrt(product of the four
  margins)`` with ``A = both``, ``D = neither``, ``B, C`` the discordant cells, its
  numerator continuity-adjusted as Newcombe recommends: ``max(AD − BC − n/2, 0)`` when
  ``AD > BC`` (else ``AD − BC``); φ = 0 when a margin is empty. The Wilson limits never
  collapse onto the estimate, so neither does the interval: with 0–2 discordant pairs it
  still has the width that n problems allow. A percentile bootstrap of the paired
  difference gives ``[0, 0]`` without discordant pairs and covers the true difference far
  less often than 95% with few (simulated over 1,000 tables, 1,000 resamples each: 0.79
  at n = 128 with 0.5 and 1.5 expected discordant pairs each way, 0.85 at n = 50 with 1
  and 2, where this interval covers 0.999 and 0.983 exactly), so it is not used;
  ``tests/test_stats.py`` checks this interval's coverage by simulation.
- **Holm's step-down adjustment** of the p-values of a table of ``m`` comparisons:
  the ``k``-th smallest p is multiplied by ``m − k + 1`` and made monotone; rejecting
  where the adjusted p < 0.05 keeps the chance of any false rejection among the ``m``
  below 5% whatever their dependence.
- **Sign test over cells** (the paper's one-sided test that the β = 5 minus β = 0
  difference is positive in every (model, benchmark) cell): the number of positive
  differences among the non-zero ones against Binomial(·, 1/2); zero differences
  carry no sign and are left out (and counted).

**Predictive validity of a score D** over a pool of graded candidates grouped by problem
(``N`` candidates per problem): the AUC is ``P(D_correct > D_incorrect) + ½·P(tie)`` over
all (correct, incorrect) pairs of the pool (:func:`auc`: the Mann–Whitney statistic
normalised); beside it the mean gap, the Mann–Whitney test, Spearman's ρ, the pairwise
ranking accuracy within problems, accuracy by score quantile and the accuracy of a rerank
rule (what `degs_jax.analysis` reports; each defined at its function). Candidates of one problem share its
difficulty, so they are not independent; two statistics respect that:

- the **cluster bootstrap**: resample *problems* with replacement, each with all of its
  candidates, and take the percentile interval of the statistic (``R`` resamples, a
  fixed seed). Drawing ``k`` of ``k`` problems with replacement is giving problem ``c``
  a count ``w_c ~ Multinomial(k, 1/k)``; a pair (correct candidate of problem c,
  incorrect one of problem d) then appears ``w_c·w_d`` times, so the resample's AUC is
  the quadratic form ``w·U·w / ((w·P)(w·N))``, with ``U[c, d]`` the pairs of c's correct
  and d's incorrect candidates that the correct one wins (ties ½) and ``P``, ``N`` the
  correct and incorrect candidates per problem: ``U`` is counted once from sorted
  scores, then every resample is two matrix products. A resample without a correct or
  without an incorrect candidate has no AUC; such resamples are left out and counted
  (``undefined_resamples``).
  The resampling noise of an end at quantile q is about ``sqrt(q(1−q)/R)/density``: for
  R = 10,000 about 0.03 of the bootstrap standard deviation.
- the **problem-demeaned AUC**: D minus the mean D of its problem, then the AUC over all
  candidates. Differences in D *between* problems (a problem where every candidate
  collapses late) no longer count; what is left ranks candidates against their own
  problem's level, as a decoder choosing among one problem's candidates would. Its
  interval is the same cluster bootstrap (a resampled problem keeps its own mean, so
  the demeaned scores are computed once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["BOOTSTRAP_RESAMPLES", "CONFIDENCE", "Z_95", "Accuracy", "accuracy", "wilson_interval",
           "wilson_limits", "PairedComparison", "mcnemar", "newcombe_paired_interval",
           "compare_paired", "holm", "sign_test", "auc", "mean_gap", "mann_whitney", "spearman",
           "PairwiseStat", "pairwise_ranking_accuracy", "BucketStat", "bucket_accuracy",
           "rerank_accuracy", "demean_by_cluster", "ClusterBootstrap", "cluster_bootstrap_auc"]

BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95
Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def _scipy():
    """scipy.stats, imported on first use: it costs about a second of start-up, which
    `degs eval` and the study (they need only the Wilson interval) do not pay."""
    import scipy.stats  # start-up: see the docstring

    return scipy.stats


# --------------------------------------------------------------------------- proportions


@dataclass(frozen=True)
class Accuracy:
    """Accuracy with a Wilson score interval (``z`` = 1.96 for 95%)."""

    n: int
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (``(nan, nan)`` if n == 0): the
    scalar form of :func:`wilson_limits`."""
    if n == 0:
        return (math.nan, math.nan)
    low, high = wilson_limits(successes, n, z)
    return (float(low), float(high))


def wilson_limits(successes, n, z: float = Z_95) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score limits of ``successes / n``, element-wise over arrays (``n > 0``)."""
    k = np.asarray(successes, np.float64)
    n = np.asarray(n, np.float64)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # exactly 0 at k = 0 and 1 at k = n (centre ∓ half reaches them only up to rounding)
    low = np.where(k == 0, 0.0, np.maximum(0.0, centre - half))
    high = np.where(k == n, 1.0, np.minimum(1.0, centre + half))
    return low, high


def accuracy(records: Iterable[Mapping[str, Any]], key: str = "correct") -> Accuracy:
    """Accuracy of the boolean ``key`` over records, with a 95% Wilson interval."""
    values = [bool(r[key]) for r in records]
    n, k = len(values), sum(values)
    low, high = wilson_interval(k, n)
    return Accuracy(n=n, correct=k, accuracy=k / n if n else math.nan, ci_low=low, ci_high=high)




# --------------------------------------------------------------------------- paired decoders


def _verdicts(a: Sequence[bool], b: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(a)
    b = np.asarray(b)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"paired verdicts must be two 1-D sequences of one length, got shapes "
                         f"{a.shape} and {b.shape}")
    for name, v in (("a", a), ("b", b)):
        if v.size and not np.isin(v, (0, 1)).all():
            raise ValueError(f"verdicts {name} must be booleans (or 0/1)")
    return a.astype(bool), b.astype(bool)


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> float:
    """Two-sided exact McNemar p-value for paired verdicts (module docstring); NaN
    without pairs, 1 without discordant pairs."""
    a, b = _verdicts(a, b)
    if a.size == 0:
        return math.nan
    only_a = int(np.sum(a & ~b))
    only_b = int(np.sum(~a & b))
    if only_a + only_b == 0:
        return 1.0
    return float(min(1.0, _scipy().binomtest(only_b, only_a + only_b, 0.5).pvalue))


def newcombe_paired_interval(both, only_a, only_b, neither,
                             confidence: float = CONFIDENCE) -> tuple[np.ndarray, np.ndarray]:
    """Newcombe's (1998, method 10) interval for ``acc_B − acc_A`` from the paired 2×2
    table (module docstring). Element-wise over arrays of counts; NaN where n = 0."""
    cells = [np.asarray(x, np.float64) for x in (both, only_a, only_b, neither)]
    both, only_a, only_b, neither = np.broadcast_arrays(*cells)
    n = both + only_a + only_b + neither
    z = float(_scipy().norm.ppf(0.5 + confidence / 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        safe_n = np.where(n > 0, n, 1.0)
        p_b, p_a = (both + only_b) / safe_n, (both + only_a) / safe_n
        l_b, u_b = wilson_limits(both + only_b, safe_n, z)
        l_a, u_a = wilson_limits(both + only_a, safe_n, z)
        cross = both * neither - only_a * only_b
        numerator = np.where(cross > 0, np.maximum(cross - n / 2, 0.0), cross)
        margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
        phi = np.where(margins > 0, numerator / np.sqrt(np.where(margins > 0, margins, 1.0)), 0.0)
        diff = p_b - p_a
        down = np.sqrt(np.maximum(0.0, (p_b - l_b) ** 2 - 2 * phi * (p_b - l_b) * (u_a - p_a)
                                  + (u_a - p_a) ** 2))
        up = np.sqrt(np.maximum(0.0, (u_b - p_b) ** 2 - 2 * phi * (u_b - p_b) * (p_a - l_a)
                                + (p_a - l_a) ** 2))
    low = np.where(n > 0, diff - down, np.nan)
    high = np.where(n > 0, diff + up, np.nan)
    return low, high


@dataclass(frozen=True)
class PairedComparison:
    """Decoder B against decoder A on the same ``n`` problems.

    accuracy_a/accuracy_b: each one's accuracy on these problems; difference:
    accuracy_b − accuracy_a with Newcombe's paired score interval (ci_low, ci_high);
    both_correct/only_a/only_b/both_wrong: the 2×2 table of verdicts; p_value: the
    two-sided exact McNemar test (:func:`mcnemar`).
    """

    n: int
    accuracy_a: float
    accuracy_b: float
    difference: float
    ci_low: float
    ci_high: float
    both_correct: int
    only_a: int
    only_b: int
    both_wrong: int
    p_value: float


def compare_paired(a: Sequence[bool], b: Sequence[bool], *,
                   confidence: float = CONFIDENCE) -> PairedComparison:
    """Every paired statistic of B against A (see :class:`PairedComparison`)."""
    a, b = _verdicts(a, b)
    n = int(a.size)
    table = (int(np.sum(a & b)), int(np.sum(a & ~b)), int(np.sum(~a & b)), int(np.sum(~a & ~b)))
    low, high = newcombe_paired_interval(*table, confidence=confidence)
    acc_a = float(a.mean()) if n else math.nan
    acc_b = float(b.mean()) if n else math.nan
    return PairedComparison(
        n=n, accuracy_a=acc_a, accuracy_b=acc_b, difference=acc_b - acc_a,
        ci_low=float(low), ci_high=float(high), both_correct=table[0], only_a=table[1],
        only_b=table[2], both_wrong=table[3], p_value=mcnemar(a, b))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the given order (module docstring). NaN entries stay
    NaN and are not counted in the family."""
    p = np.asarray(p_values, np.float64)
    out = np.full(p.shape, np.nan)
    valid = np.flatnonzero(~np.isnan(p))
    m = valid.size
    order = valid[np.argsort(p[valid], kind="stable")]
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * p[i]))
        out[i] = running
    return [float(x) for x in out]


def sign_test(differences: Sequence[float], alternative: str = "greater") -> dict:
    """Sign test of per-cell differences: are positive ones more frequent than chance?

    Zero differences carry no sign and are left out (as in the usual sign test).
    ``alternative``: ``"greater"`` (more positive than negative), ``"less"`` or
    ``"two-sided"``. Returns counts and the binomial p-value (NaN with no non-zero cell).
    """
    d = np.asarray(differences, np.float64)
    if d.ndim != 1 or np.isnan(d).any():
        raise ValueError("sign_test needs a 1-D sequence of numbers without NaN")
    pos, neg = int(np.sum(d > 0)), int(np.sum(d < 0))
    n = pos + neg
    p = float(_scipy().binomtest(pos, n, 0.5, alternative=alternative).pvalue) if n else math.nan
    return {"positive": pos, "negative": neg, "zero": int(d.size - n), "alternative": alternative,
            "p_value": p}


# --------------------------------------------------------------------------- scores vs correctness


def _split(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels, bool)
    if scores.shape != labels.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and labels {labels.shape} must be equal 1-D shapes")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    return scores[labels], scores[~labels]


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True = positive).

    Equals ``U / (n_pos · n_neg)`` with ``U`` the Mann–Whitney statistic of the positives:
    the probability that a random positive scores above a random negative, ties counted
    one half. NaN when either class is empty.
    """
    pos, neg = _split(scores, labels)
    if len(pos) == 0 or len(neg) == 0:
        return math.nan
    ranks = _scipy().rankdata(np.concatenate([pos, neg]))  # average ranks for ties
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def mean_gap(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """``mean(score | correct) − mean(score | incorrect)`` (NaN if a class is empty)."""
    pos, neg = _split(scores, labels)
    if len(pos) == 0 or len(neg) == 0:
        return math.nan
    return float(pos.mean() - neg.mean())


def mann_whitney(scores: Sequence[float], labels: Sequence[bool]) -> tuple[float, float]:
    """Two-sided Mann–Whitney U test of correct vs incorrect scores: ``(U, p)``.

    ``U`` is the statistic of the correct group (scipy's convention); NaNs when a class
    is empty or every score is equal.
    """
    pos, neg = _split(scores, labels)
    if len(pos) == 0 or len(neg) == 0 or np.all(np.concatenate([pos, neg]) == pos[0]):
        return math.nan, math.nan
    res = _scipy().mannwhitneyu(pos, neg, alternative="two-sided")
    return float(res.statistic), float(res.pvalue)


def spearman(scores: Sequence[float], labels: Sequence[bool]) -> tuple[float, float]:
    """Spearman ρ between scores and correctness (0/1), with its p-value.

    NaNs when either variable is constant.
    """
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels, np.float64)
    if len(scores) < 2 or np.all(scores == scores[0]) or np.all(labels == labels[0]):
        return math.nan, math.nan
    res = _scipy().spearmanr(scores, labels)
    return float(res.statistic), float(res.pvalue)


@dataclass(frozen=True)
class PairwiseStat:
    """Within-problem ranking of (correct, incorrect) pairs.

    accuracy: (wins + ½·ties) / pairs, where a win is a pair whose correct candidate has
    the strictly larger score (NaN without pairs); ties: tied pairs; tie_fraction:
    ties / pairs; problems: problems contributing at least one pair.
    """

    accuracy: float
    pairs: int
    wins: int
    ties: int
    tie_fraction: float
    problems: int


def pairwise_ranking_accuracy(groups: Iterable[tuple[Sequence[float], Sequence[bool]]]) -> PairwiseStat:
    """Pairwise ranking accuracy over problems; ``groups`` yields (scores, labels) per problem."""
    pairs = wins = ties = problems = 0
    for scores, labels in groups:
        pos, neg = _split(scores, labels)
        if len(pos) == 0 or len(neg) == 0:
            continue
        diff = pos[:, None] - neg[None, :]
        pairs += diff.size
        wins += int((diff > 0).sum())
        ties += int((diff == 0).sum())
        problems += 1
    if pairs == 0:
        return PairwiseStat(math.nan, 0, 0, 0, math.nan, 0)
    return PairwiseStat((wins + 0.5 * ties) / pairs, pairs, wins, ties, ties / pairs, problems)


@dataclass(frozen=True)
class BucketStat:
    """One quantile bucket: score range ``(low, high]`` (the first bucket is closed), the
    smallest and largest score actually in it, its size and accuracy with a 95% Wilson
    interval (NaN when empty)."""

    bucket: int
    low: float
    high: float
    min_score: float
    max_score: float
    n: int
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float


def bucket_accuracy(scores: Sequence[float], labels: Sequence[bool],
                    n_buckets: int = 4) -> list[BucketStat]:
    """Accuracy by score quantile bucket (quartiles by default): bucket ``b`` holds
    ``q_b < D ≤ q_{b+1}`` (the first bucket also ``D = q_0``), where ``q`` are the scores'
    quantiles (numpy's linear interpolation), so equal scores always share a bucket and a
    bucket may be empty when many scores tie."""
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be positive, got {n_buckets}")
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels, bool)
    _split(scores, labels)
    if len(scores) == 0:
        return []
    edges = np.quantile(scores, np.linspace(0.0, 1.0, n_buckets + 1))
    index = np.searchsorted(edges[1:-1], scores, side="left")
    out = []
    for b in range(n_buckets):
        sel = index == b
        n, k = int(sel.sum()), int(labels[sel].sum())
        lo, hi = wilson_interval(k, n)
        out.append(BucketStat(
            bucket=b, low=float(edges[b]), high=float(edges[b + 1]),
            min_score=float(scores[sel].min()) if n else math.nan,
            max_score=float(scores[sel].max()) if n else math.nan,
            n=n, correct=k, accuracy=k / n if n else math.nan, ci_low=lo, ci_high=hi))
    return out


def rerank_accuracy(groups: Iterable[Mapping[str, Sequence]], alpha: float, beta: float) -> float:
    """Accuracy of choosing, per problem, ``argmax alpha·log_p + beta·D`` (first on ties,
    as the decoder `degs_rerank`); groups: dicts with ``log_p``, ``D`` and ``correct`` lists."""
    chosen = []
    for g in groups:
        score = alpha * np.asarray(g["log_p"], np.float64) + beta * np.asarray(g["D"], np.float64)
        chosen.append(bool(np.asarray(g["correct"])[int(np.argmax(score))]))
    return float(np.mean(chosen)) if chosen else math.nan


# --------------------------------------------------------------------------- clustered AUC


def _scores_and_labels(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels, bool)
    if scores.ndim != 1 or scores.shape != labels.shape:
        raise ValueError(f"scores {scores.shape} and labels {labels.shape} must be equal 1-D shapes")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    return scores, labels


def _pair_counts(scores: np.ndarray, labels: np.ndarray, index: np.ndarray,
                 k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``U[c, d]``: over (correct candidate of cluster c, incorrect one of cluster d), the
    pairs the correct one wins plus half the ties; ``P[c]``, ``N[c]``: correct and
    incorrect candidates of cluster c."""
    pos, pos_cluster = scores[labels], index[labels]
    U = np.zeros((k, k))
    for d in range(k):
        negatives = np.sort(scores[~labels & (index == d)])
        below = np.searchsorted(negatives, pos, side="left")
        tied = np.searchsorted(negatives, pos, side="right") - below
        U[:, d] = np.bincount(pos_cluster, below + 0.5 * tied, minlength=k)
    return (U, np.bincount(index, labels, minlength=k).astype(np.float64),
            np.bincount(index, ~labels, minlength=k).astype(np.float64))


def _cluster_index(clusters: Sequence, size: int) -> np.ndarray:
    if len(clusters) != size:
        raise ValueError(f"{len(clusters)} cluster labels for {size} scores")
    _, index = np.unique(np.array([str(c) for c in clusters]), return_inverse=True)
    return index.reshape(-1)


# Demeaned scores are rounded to this many decimals, so that differences equal in exact
# arithmetic (0.9 − 0.8 and 0.4 − 0.3) tie, as the AUC's ½ counts them, instead of
# differing in their last bits; D(x) lies in [0, 1].
DEMEANED_DECIMALS = 12


def demean_by_cluster(scores: Sequence[float], clusters: Sequence) -> np.ndarray:
    """``scores`` minus the mean score of their cluster (a one-member cluster gives 0),
    rounded to :data:`DEMEANED_DECIMALS` decimals."""
    scores = np.asarray(scores, np.float64)
    index = _cluster_index(clusters, scores.size)
    means = np.bincount(index, scores) / np.bincount(index)
    return np.round(scores - means[index], DEMEANED_DECIMALS)


@dataclass(frozen=True)
class ClusterBootstrap:
    """A statistic with its cluster-bootstrap percentile interval.

    estimate: on the data; ci_low/ci_high: the interval (NaN when the estimate is
    undefined or no resample is defined); clusters: how many were resampled;
    resamples: drawn; undefined_resamples: left out for lack of one class; seed.
    """

    estimate: float
    ci_low: float
    ci_high: float
    clusters: int
    resamples: int
    undefined_resamples: int
    seed: int


def cluster_bootstrap_auc(scores: Sequence[float], labels: Sequence[bool], clusters: Sequence, *,
                          demean: bool = False, confidence: float = CONFIDENCE,
                          n_resamples: int = BOOTSTRAP_RESAMPLES,
                          seed: int = 0) -> ClusterBootstrap:
    """AUC of ``scores`` (problem-demeaned with ``demean``) and its percentile interval
    under the cluster bootstrap over ``clusters`` (module docstring). ``n_resamples = 0``
    gives the estimate alone (NaN interval). NaN without a correct or an incorrect
    candidate, and with ``demean`` when no cluster has two candidates (every demeaned
    score is then 0)."""
    scores, labels = _scores_and_labels(scores, labels)
    index = _cluster_index(clusters, scores.size)
    k = int(index.max()) + 1 if index.size else 0
    if demean:
        scores = demean_by_cluster(scores, index)
    U, P, N = _pair_counts(scores, labels, index, k)
    defined = P.sum() > 0 and N.sum() > 0 and not (demean and k == scores.size)
    estimate = float(U.sum() / (P.sum() * N.sum())) if defined else math.nan
    if n_resamples == 0 or math.isnan(estimate):
        return ClusterBootstrap(estimate, math.nan, math.nan, k, 0, 0, seed)
    # resample r draws problem c counts[r, c] times: its AUC is the quadratic form
    # counts·U·counts over (counts·P)(counts·N)
    counts = np.random.default_rng(seed).multinomial(k, np.full(k, 1.0 / k),
                                                     size=n_resamples).astype(np.float64)
    u = np.einsum("rc,rc->r", counts @ U, counts)
    total = (counts @ P) * (counts @ N)
    values = u[total > 0] / total[total > 0]
    tail = (1 - confidence) / 2
    low, high = np.quantile(values, [tail, 1 - tail]) if values.size else (math.nan, math.nan)
    return ClusterBootstrap(estimate, float(low), float(high), k, n_resamples,
                            int(n_resamples - values.size), seed)
