"""Goodness-of-fit helpers for the statistical losslessness tests (no SciPy needed)."""

from __future__ import annotations

import math

import numpy as np


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:  # series for the lower function P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    # Lentz's continued fraction for Q
    b = z + 1 - a
    c, d = 1e300, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def chi2_stat(counts, probs, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` and its degrees of freedom.

    Cells whose expected count is below `min_expected` are pooled into one, so
    the asymptotic distribution holds; observations in a zero-probability cell
    give an infinite statistic (the sampler produced something impossible).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    if np.any((probs <= 0) & (counts > 0)):
        return math.inf, 1
    expected = probs * n
    big = expected >= min_expected
    obs = list(counts[big]) + [counts[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    obs, exp = np.array(obs), np.array(exp)
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(exp) < 2:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of `counts` against `probs`, pooling sparse cells
    (see `chi2_stat`); 0 when a zero-probability cell was observed."""
    stat, dof = chi2_stat(counts, probs, min_expected)
    if stat == math.inf:
        return 0.0
    return 1.0 if dof == 0 else chi2_sf(stat, dof)
