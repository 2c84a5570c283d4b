"""Equivalence tests and power for paired seed designs: what "matches" may mean in a pre-registration.

A difference between two arms is measured per seed, ``d_i = a_i - b_i`` (n paired seeds, mean ``d̄``, standard
deviation ``s``, ``se = s / sqrt(n)``).  Two questions:

* **Equivalence within a margin Δ (TOST).** Two one-sided t tests, ``H0: d <= -Δ`` and ``H0: d >= Δ``:

      t_low = (d̄ + Δ) / se,  p_low = P(T_{n-1} >= t_low);   t_up = (d̄ - Δ) / se,  p_up = P(T_{n-1} <= t_up)

  ``p = max(p_low, p_up)``; the arms are equivalent at level α exactly when ``p <= α``, i.e. when the
  ``1 - 2α`` confidence interval ``d̄ ± t_{1-α, n-1} se`` lies inside ``(-Δ, Δ)``.

* **Power.** With ``m`` tests under Holm's step-down, the first step rejects at ``α / m`` (two-sided), so the
  smallest difference the design detects with power ``1 - β`` is (the usual t approximation)

      δ = (t_{1 - α/(2m), n-1} + t_{1-β, n-1}) s / sqrt(n)

  and TOST at true difference 0 reaches power ``1 - β`` when ``Δ >= (t_{1-α, n-1} + t_{1-β/2, n-1}) s / sqrt(n)``.
  :func:`seeds_for_difference` and :func:`seeds_for_equivalence` give the least ``n`` that meets each.

Pure Python on top of :mod:`.stats_tests` (no SciPy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .stats_tests import betainc


def t_cdf(t: float, df: int) -> float:
    """``P(T_df <= t)`` of Student's t, symmetric about 0: for ``t >= 0`` it is ``1/2 + I_{t^2/(df+t^2)}(1/2, df/2) / 2``
    near 0 and ``1 - I_{df/(df+t^2)}(df/2, 1/2) / 2`` in the tail (each form where it keeps its digits)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    if t * t < df:  # |t| < sqrt(df): the central form
        half = betainc(0.5, df / 2.0, t * t / (df + t * t)) / 2.0
        return 0.5 + half if t >= 0 else 0.5 - half
    tail = betainc(df / 2.0, 0.5, df / (df + t * t)) / 2.0
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (``0 < q < 1``), by bisection to 1e-12."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def _paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, int]:
    """Mean and standard deviation of ``a - b`` over the positions where both are finite, and their count."""
    if len(a) != len(b):
        raise ValueError(f"a and b must have equal length, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b) if math.isfinite(x) and math.isfinite(y)]
    n = len(d)
    if n < 2:
        return (sum(d) / n if n else math.nan), math.nan, n
    m = sum(d) / n
    return m, math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)), n


@dataclass(frozen=True)
class EquivalenceResult:
    """TOST of a paired difference: its mean, the ``1 - 2α`` interval ``[low, high]``, the TOST p-value,
    ``equivalent`` (``p <= α``), the margin and ``n`` (seed pairs with both values finite)."""

    mean: float
    low: float
    high: float
    p: float
    equivalent: bool
    margin: float
    n: int


def tost(a: Sequence[float], b: Sequence[float], margin: float, alpha: float = 0.05) -> EquivalenceResult:
    """Paired TOST of ``a - b`` against the margin ``(-margin, margin)`` (module docstring); ``nan`` below 2 pairs.
    A zero standard deviation is equivalent exactly when ``|mean| < margin``."""
    if not margin > 0 or not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number > 0, got {margin}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    m, sd, n = _paired(a, b)
    if n < 2:
        return EquivalenceResult(m, math.nan, math.nan, math.nan, False, margin, n)
    se = sd / math.sqrt(n)
    if se == 0:
        inside = abs(m) < margin
        return EquivalenceResult(m, m, m, 0.0 if inside else 1.0, inside, margin, n)
    p = max(1.0 - t_cdf((m + margin) / se, n - 1), t_cdf((m - margin) / se, n - 1))
    half = t_quantile(1.0 - alpha, n - 1) * se
    return EquivalenceResult(m, m - half, m + half, p, p <= alpha, margin, n)


def detectable_difference(sd: float, n: int, *, alpha: float = 0.05, power: float = 0.8, tests: int = 1) -> float:
    """The smallest paired difference a two-sided t test at ``alpha / tests`` (Holm's first step) detects with
    ``power`` over ``n`` seeds of paired SD ``sd``: ``(t_{1-α/(2m), n-1} + t_{power, n-1}) sd / sqrt(n)``."""
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    return (t_quantile(1.0 - alpha / (2 * tests), n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


def equivalence_margin(sd: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest margin TOST at ``alpha`` meets with ``power`` when the true difference is 0, over ``n`` seeds of
    paired SD ``sd``: ``(t_{1-α, n-1} + t_{(1+power)/2, n-1}) sd / sqrt(n)``."""
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    return (t_quantile(1.0 - alpha, n - 1) + t_quantile((1.0 + power) / 2, n - 1)) * sd / math.sqrt(n)


def _least_n(meets, n_max: int) -> int:
    for n in range(2, n_max + 1):
        if meets(n):
            return n
    raise ValueError(f"no n <= {n_max} is enough")


def seeds_for_difference(sd: float, delta: float, *, alpha: float = 0.05, power: float = 0.8, tests: int = 1,
                         n_max: int = 10_000) -> int:
    """The least ``n`` whose :func:`detectable_difference` is ``<= delta``."""
    return _least_n(lambda n: detectable_difference(sd, n, alpha=alpha, power=power, tests=tests) <= delta, n_max)


def seeds_for_equivalence(sd: float, margin: float, *, alpha: float = 0.05, power: float = 0.8,
                          n_max: int = 10_000) -> int:
    """The least ``n`` whose :func:`equivalence_margin` is ``<= margin``."""
    return _least_n(lambda n: equivalence_margin(sd, n, alpha=alpha, power=power) <= margin, n_max)


__all__ = [
    "EquivalenceResult", "detectable_difference", "equivalence_margin", "seeds_for_difference", "seeds_for_equivalence",
    "t_cdf", "t_quantile", "tost",
]  # fmt: skip
