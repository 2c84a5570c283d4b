"""Endpoints and tests of the head-to-head protocol: Pass@K at a matched Avg@K read off a checkpoint curve,
paired Student-t tests, Holm's step-down adjustment and the 95% interval of a mean over seeds (:func:`mean_ci`).
Pure Python (no SciPy)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Two-sided 95% Student t quantiles t_{0.975, df} for df = 1 .. 30 (beyond 30, df = 30's: conservative).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean of the finite ``values`` and the half-width of its two-sided 95% Student-t interval
    (``t_{0.975, n-1} * sd / sqrt(n)``); nan half-width below 2 finite values, nan mean for none."""
    v = [x for x in values if math.isfinite(x)]
    n = len(v)
    m = sum(v) / n if n else math.nan
    if n < 2:
        return m, math.nan
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1))
    return m, T975[min(n - 1, len(T975)) - 1] * sd / math.sqrt(n)


def value_at_level(avgs: Sequence[float], values: Sequence[float], level: float) -> float:
    """``values`` read off a checkpoint curve where Avg@K first reaches ``level``.

    Checkpoints in training order give points ``(a_i, v_i)``.  If ``a_0 >= level`` the answer is ``v_0``; otherwise
    with ``j`` the first index where ``a_j >= level`` (so ``a_{j-1} < level``), the answer is the linear interpolation
    ``v_{j-1} + (level - a_{j-1}) / (a_j - a_{j-1}) * (v_j - v_{j-1})``.  ``nan`` when the curve never reaches it.
    """
    if len(avgs) != len(values) or not avgs:
        raise ValueError(f"avgs and values must be non-empty and of equal length, got {len(avgs)} and {len(values)}")
    if avgs[0] >= level:
        return float(values[0])
    for j in range(1, len(avgs)):
        if avgs[j] >= level:
            a0, a1, v0, v1 = avgs[j - 1], avgs[j], values[j - 1], values[j]
            return float(v0 + (level - a0) / (a1 - a0) * (v1 - v0))
    return math.nan


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes' ``betacf``)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta ``I_x(a, b)`` for ``a, b > 0`` and ``0 <= x <= 1``."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    ln_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln_front) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with ``df`` degrees of freedom: ``P(|T| >= |t|) = I_{df/(df+t^2)}(df/2, 1/2)``."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile_975(df: int) -> float:
    """``t_{0.975, df}``: the root of ``t_two_sided_p(t, df) = 0.05`` by bisection (to 1e-10)."""
    lo, hi = 0.0, 100.0
    while hi - lo > 1e-10:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > 0.05 else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class PairedResult:
    """Paired difference over seeds: mean ``d_bar``, 95% half-width ``t_{0.975,n-1} s / sqrt(n)``, two-sided p of
    ``t = d_bar / (s / sqrt(n))``, and ``n`` (seeds where both arms have a finite value)."""

    mean: float
    ci95: float
    p: float
    n: int


def paired_test(a: Sequence[float], b: Sequence[float]) -> PairedResult:
    """Paired Student-t test of ``a - b`` over the positions where both are finite; ``nan`` fields below 2 pairs.
    A zero standard deviation gives p = 1 for a zero mean, else p = 0."""
    if len(a) != len(b):
        raise ValueError(f"a and b must have equal length, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b) if math.isfinite(x) and math.isfinite(y)]
    n = len(d)
    if n < 2:
        return PairedResult(sum(d) / n if n else math.nan, math.nan, math.nan, n)
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    if se == 0:
        return PairedResult(m, 0.0, 1.0 if m == 0 else 0.0, n)
    return PairedResult(m, t_quantile_975(n - 1) * se, t_two_sided_p(m / se, n - 1), n)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in input order: with the ``m`` finite p sorted ascending ``p_(1) <= ...``,
    ``p~_(i) = min(1, max_{j <= i} (m - j + 1) p_(j))``.  ``nan`` entries stay ``nan`` and do not count in ``m``.
    Reject at level ``alpha`` exactly where ``p~ <= alpha``."""
    idx = sorted((i for i, p in enumerate(pvalues) if math.isfinite(p)), key=lambda i: pvalues[i])
    m = len(idx)
    out = [math.nan] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


__all__ = ["PairedResult", "betainc", "holm", "paired_test", "t_quantile_975", "t_two_sided_p", "value_at_level"]
