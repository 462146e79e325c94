"""Statistics for comparing decoders on the same problems (no JAX, no model).

Two decoders A and B answer the same ``n`` problems; problem ``i`` gives a pair of
verdicts ``(a_i, b_i)`` in {0, 1}². Their accuracies are not independent (the same
problems are easy or hard for both), so the comparison uses the pairs:

- **McNemar's test** of "A and B are equally accurate" looks only at the discordant
  pairs: ``only_a`` problems A got right and B wrong, ``only_b`` the reverse. Under the
  null hypothesis each discordant pair goes either way with probability 1/2, so
  ``only_b ~ Binomial(only_a + only_b, 1/2)``. With fewer than
  :data:`EXACT_BELOW` discordant pairs the two-sided exact binomial p-value is used
  (``scipy.stats.binomtest``); with more, the continuity-corrected statistic
  ``(|only_b − only_a| − 1)² / (only_a + only_b)`` against chi-square with one degree of
  freedom (the usual large-sample form; at 25 discordant pairs the two p-values differ
  by a few percent of themselves). Without discordant pairs there is no evidence
  either way: p = 1.
- **Paired bootstrap interval** of the accuracy difference ``acc_B − acc_A``: problems
  are resampled with replacement, each keeping both of its verdicts, i.e. the
  bootstrap distribution of the mean of ``d_i = b_i − a_i``; the 95% percentile
  interval (``scipy.stats.bootstrap``, ``method="percentile"``, a fixed seed, so the
  interval is reproducible). The resampling noise of an end at quantile q is about
  ``sqrt(q(1−q)/R) / density``: for R = 10,000 and a near-normal bootstrap distribution
  about 0.03 of its standard deviation, i.e. at most ``0.03/sqrt(n)``, which is below one
  problem's worth ``1/n`` for n up to ~1,300 problems.
- **Wilson interval** of a single accuracy: :func:`degs_jax.eval.results.wilson_interval`.
- **Sign test over cells** (the paper's one-sided test that the β = 5 minus β = 0
  difference is positive in every (model, benchmark) cell): the number of positive
  differences among the non-zero ones against Binomial(·, 1/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy import stats as _stats

from degs_jax.eval.results import wilson_interval

__all__ = ["EXACT_BELOW", "BOOTSTRAP_RESAMPLES", "PairedComparison", "mcnemar",
           "paired_bootstrap_interval", "compare_paired", "sign_test", "wilson_interval"]

EXACT_BELOW = 25  # discordant pairs below which McNemar's test uses the exact binomial
BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95


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


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> tuple[str, Optional[float], float]:
    """McNemar's test of equal accuracy for paired verdicts (module docstring).

    Returns ``(test, statistic, p)``: ``test`` is ``"exact binomial"``,
    ``"chi-square, continuity-corrected"`` or ``"none (no discordant pairs)"``;
    ``statistic`` the chi-square value (None for the exact test); ``p`` two-sided.
    """
    a, b = _verdicts(a, b)
    only_a = int(np.sum(a & ~b))
    only_b = int(np.sum(~a & b))
    discordant = only_a + only_b
    if discordant == 0:
        return "none (no discordant pairs)", None, 1.0
    if discordant < EXACT_BELOW:
        p = _stats.binomtest(only_b, discordant, 0.5, alternative="two-sided").pvalue
        return "exact binomial", None, float(min(1.0, p))
    chi2 = (abs(only_b - only_a) - 1) ** 2 / discordant
    return "chi-square, continuity-corrected", float(chi2), float(_stats.chi2.sf(chi2, df=1))


def paired_bootstrap_interval(a: Sequence[bool], b: Sequence[bool], *,
                              confidence: float = CONFIDENCE,
                              n_resamples: int = BOOTSTRAP_RESAMPLES,
                              seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(b) − mean(a)``, resampling problems (pairs).

    ``(nan, nan)`` for no pairs; a single point when every difference is equal.
    """
    a, b = _verdicts(a, b)
    if a.size == 0:
        return (math.nan, math.nan)
    d = b.astype(np.float64) - a.astype(np.float64)
    if np.all(d == d[0]):  # every resample has the same mean
        return (float(d[0]), float(d[0]))
    res = _stats.bootstrap((d,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                           method="percentile", vectorized=True,
                           rng=np.random.default_rng(seed))
    return (float(res.confidence_interval.low), float(res.confidence_interval.high))


@dataclass(frozen=True)
class PairedComparison:
    """Decoder B against decoder A on the same ``n`` problems.

    accuracy_a/accuracy_b: each one's accuracy on these problems; difference:
    accuracy_b − accuracy_a with its paired-bootstrap interval (ci_low, ci_high);
    both_correct/only_a/only_b/both_wrong: the 2×2 table of verdicts; test, statistic,
    p_value: McNemar's test (:func:`mcnemar`).
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
    test: str
    statistic: Optional[float]
    p_value: float


def compare_paired(a: Sequence[bool], b: Sequence[bool], *, confidence: float = CONFIDENCE,
                   n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> PairedComparison:
    """Every paired statistic of B against A (see :class:`PairedComparison`)."""
    a, b = _verdicts(a, b)
    n = int(a.size)
    test, statistic, p = mcnemar(a, b) if n else ("none (no pairs)", None, math.nan)
    low, high = paired_bootstrap_interval(a, b, confidence=confidence, n_resamples=n_resamples,
                                          seed=seed)
    acc_a = float(a.mean()) if n else math.nan
    acc_b = float(b.mean()) if n else math.nan
    return PairedComparison(
        n=n, accuracy_a=acc_a, accuracy_b=acc_b, difference=acc_b - acc_a,
        ci_low=low, ci_high=high,
        both_correct=int(np.sum(a & b)), only_a=int(np.sum(a & ~b)),
        only_b=int(np.sum(~a & b)), both_wrong=int(np.sum(~a & ~b)),
        test=test, statistic=statistic, p_value=p)


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
    p = float(_stats.binomtest(pos, n, 0.5, alternative=alternative).pvalue) if n else math.nan
    return {"positive": pos, "negative": neg, "zero": int(d.size - n), "alternative": alternative,
            "p_value": p}
