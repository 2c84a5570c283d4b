"""TOST and the power computation of the pre-registrations against references written here: the t distribution
by numerical integration of its density, the tests' error rates by simulation."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from entropy_lab.equivalence import (
    detectable_difference,
    equivalence_margin,
    seeds_for_difference,
    seeds_for_equivalence,
    t_cdf,
    t_quantile,
    tost,
)
from entropy_lab.stats_tests import paired_test


def t_cdf_by_integration(t: float, df: int, steps: int = 20_000) -> float:
    """``1/2 + ∫_0^t f(x) dx`` with Student's density ``f`` (composite Simpson, float64)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    h = t / steps
    s = f(0.0) + f(t) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))
    return 0.5 + s * h / 3


@settings(max_examples=40, deadline=None)
@given(t=st.floats(-8, 8), df=st.integers(1, 60))
@example(t=5.960464477539063e-08, df=12)  # near 0: 1 - tail loses the digits the central form keeps
def test_t_cdf_and_quantile_match_the_integrated_density(t, df):
    assert t_cdf(t, df) == pytest.approx(t_cdf_by_integration(t, df), abs=1e-9)
    q = t_cdf(t, df)
    if 1e-6 < q < 1 - 1e-6:
        assert t_quantile(q, df) == pytest.approx(t, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 20), shift=st.floats(-0.05, 0.05), margin=st.floats(0.001, 0.05))
def test_tost_is_the_90_percent_interval_inside_the_margin(seed, n, shift, margin):
    rng = random.Random(seed)
    a = [rng.gauss(0.5 + shift, 0.02) for _ in range(n)]
    b = [x - shift + rng.gauss(0, 0.02) for x in a]
    res = tost(a, b, margin)
    d = [x - y for x, y in zip(a, b)]
    m = sum(d) / n
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n)
    half = t_quantile(0.95, n - 1) * se
    assert res.mean == pytest.approx(m) and res.n == n
    assert (res.low, res.high) == pytest.approx((m - half, m + half))
    inside = -margin < m - half and m + half < margin
    if abs(abs(m) + half - margin) > 1e-9:  # away from the boundary the two readings agree
        assert res.equivalent == inside
    # the p-value is the larger one-sided p; equivalent exactly when it is <= 0.05
    assert res.equivalent == (res.p <= 0.05)


def test_tost_refuses_bad_margins_and_ignores_nonfinite_pairs():
    with pytest.raises(ValueError, match="margin"):
        tost([1.0, 2.0], [1.0, 2.0], 0.0)
    with pytest.raises(ValueError, match="alpha"):
        tost([1.0, 2.0], [1.0, 2.0], 0.1, alpha=0.5)
    res = tost([1.0, 2.0, math.nan, 3.0], [1.01, 1.99, 0.0, math.inf], 0.1)
    assert res.n == 2
    assert tost([1.0], [1.0], 0.1).n == 1 and not tost([1.0], [1.0], 0.1).equivalent


def _rejection_rate(delta: float, sd: float, n: int, level: float, sims: int, seed: int, equivalence_margin=None):
    rng = random.Random(seed)
    hits = 0
    for _ in range(sims):
        b = [0.0] * n
        a = [rng.gauss(delta, sd) for _ in range(n)]
        if equivalence_margin is None:
            hits += paired_test(a, b).p <= level
        else:
            hits += tost(a, b, equivalence_margin, alpha=level).equivalent
    return hits / sims


@pytest.mark.parametrize("n, tests", [(10, 1), (10, 4), (16, 4)])
def test_detectable_difference_is_detected_at_the_stated_power(n, tests):
    """Simulated paired t tests at alpha / tests reject a true difference of detectable_difference in about 80 % of
    designs (the t approximation is within 3 points of the exact noncentral-t power), and a true 0 in about alpha."""
    sd = 0.03
    delta = detectable_difference(sd, n, tests=tests)
    power = _rejection_rate(delta, sd, n, 0.05 / tests, 4000, seed=n + tests)
    assert 0.77 <= power <= 0.85, power
    size = _rejection_rate(0.0, sd, n, 0.05 / tests, 4000, seed=100 + n)
    assert size <= 0.05 / tests + 0.012, size


@pytest.mark.parametrize("n", [8, 12, 20])
def test_equivalence_margin_is_met_at_the_stated_power(n):
    """At a true difference of 0, TOST with the computed margin declares equivalence in about 80 % of designs; at a
    true difference equal to the margin, in at most alpha."""
    sd = 0.03
    margin = equivalence_margin(sd, n)
    power = _rejection_rate(0.0, sd, n, 0.05, 4000, seed=n, equivalence_margin=margin)
    assert 0.77 <= power <= 0.86, power
    size = _rejection_rate(margin, sd, n, 0.05, 4000, seed=1000 + n, equivalence_margin=margin)
    assert size <= 0.062, size


def test_seed_counts_are_the_least_that_suffice():
    sd, delta = 0.03, 0.02
    n = seeds_for_difference(sd, delta, tests=4)
    assert detectable_difference(sd, n, tests=4) <= delta < detectable_difference(sd, n - 1, tests=4)
    m = seeds_for_equivalence(sd, delta)
    assert equivalence_margin(sd, m) <= delta < equivalence_margin(sd, m - 1)
    with pytest.raises(ValueError, match="no n"):
        seeds_for_difference(1.0, 1e-6, n_max=50)
