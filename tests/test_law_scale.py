"""The calibration schedule of the cheap entropy prediction (``entropy_discriminator.law_scale``), which the three
adapters and the lab's autopilot arm share: its schedule, the least-squares scale against a float64 fit written
here, the rule that keeps a bound controller's ``kappa`` positive, and its state."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import entropy_discriminator as ed
from entropy_discriminator.law_scale import (
    CHEAP_KEY,
    PREDICTED_KEY,
    SCALE_KEY,
    LawScale,
    calibration_rows,
    cheap_change,
)


def test_tick_marks_the_first_batch_and_every_kth_after_it() -> None:
    scale = LawScale(3)
    assert [scale.tick() for _ in range(7)] == [True, False, False, True, False, False, True]
    off = LawScale(0)
    assert not any(off.tick() for _ in range(5))


@settings(max_examples=30, deadline=None)
@given(pairs=st.lists(st.tuples(st.floats(-1e-3, 1e-3).filter(lambda x: abs(x) > 1e-9), st.floats(-0.1, 0.1)),
                      min_size=1, max_size=12))
def test_unbound_scale_is_the_forgetting_least_squares_fit(pairs: list[tuple[float, float]]) -> None:
    scale = LawScale(1)
    for x, y in pairs:
        assert scale.feed(x, y)
    n = len(pairs)
    w = [0.9 ** (n - 1 - i) for i in range(n)]
    s_xy = math.fsum(wi * x * y for wi, (x, y) in zip(w, pairs))
    s_xx = math.fsum(wi * x * x for wi, (x, _) in zip(w, pairs))
    assert scale.scale == pytest.approx(s_xy / s_xx, rel=1e-9, abs=1e-12)


def test_bound_controller_never_gets_a_non_positive_scale() -> None:
    pilot = ed.EntropyDiscConfig(method="autopilot").build_autopilot()
    scale = LawScale(1)
    scale.bind(pilot)
    assert scale.feed(1e-6, 2e-2)  # kappa = 2e4
    assert pilot.calibration.scale == pytest.approx(2e4)
    assert not scale.feed(1e-6, -1.0)  # would flip kappa's sign: left out
    assert pilot.calibration.scale == pytest.approx(2e4)
    assert not scale.feed(float("nan"), 1.0)
    unbound = LawScale(1)
    assert unbound.feed(1e-6, 2e-2) and unbound.feed(1e-6, -1.0)  # without a controller every pair is fed
    assert unbound.scale < 0


def test_metrics_and_state_round_trip() -> None:
    scale = LawScale(2)
    scale.tick()
    scale.feed(2e-6, 1e-2)
    m = scale.metrics(2e-6)
    assert m["entropy_disc/" + CHEAP_KEY] == 2e-6
    assert m["entropy_disc/" + SCALE_KEY] == pytest.approx(5e3)
    assert m["entropy_disc/" + PREDICTED_KEY] == pytest.approx(1e-2)
    assert scale.metrics(None) == {}
    restored = LawScale(2)
    restored.load_state_dict(scale.state_dict())
    assert restored.state_dict() == scale.state_dict() and restored.scale == scale.scale
    with pytest.raises(ValueError, match="version"):
        restored.load_state_dict({**scale.state_dict(), "version": 99})
    with pytest.raises(ValueError, match="calibrate_every"):
        LawScale(-1)


def test_cheap_change_is_minus_eta_times_the_covariance() -> None:
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(4, 6, generator=gen)
    s_c = torch.randn(4, 6, generator=gen) * 1e-3
    valid = torch.rand(4, 6, generator=gen) > 0.2
    a, y = adv[valid].double(), s_c[valid].double()
    cov = ((a - a.mean()) * (y - y.mean())).mean()
    assert cheap_change(adv, s_c, valid, eta=0.5) == pytest.approx(float(-0.5 * cov), rel=1e-6)
    assert cheap_change(adv, s_c, valid, eta=None) is None


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 5000), share=st.floats(1e-4, 1.0), multiple=st.sampled_from([1, 1, 2, 3, 8, 64]))
def test_calibration_rows_are_the_evenly_spread_ceil_share_of_the_rows(rows: int, share: float, multiple: int) -> None:
    """``ceil(share * rows)`` rounded up to a multiple of ``multiple`` and capped at ``rows``: that many distinct
    sorted indices in range, starting at row 0, consecutive picks at most ``ceil(1 / share)`` apart and each row's
    gap to the next pick at most ``rows / m`` rounded up (no region of the batch left out); every row at share 1."""
    idx = calibration_rows(rows, share, multiple)
    m = math.ceil(math.ceil(share * rows - 1e-9) / multiple) * multiple
    assert idx.dtype == torch.int64 and idx.tolist() == sorted(set(idx.tolist()))
    assert len(idx) == min(rows, m) and (rows == 0 or (idx[0] == 0 and idx[-1] < rows))
    if multiple == 1:
        assert idx.tolist() == [i * rows // max(m, 1) for i in range(min(rows, m))]
    if len(idx) > 1:
        gaps = (idx[1:] - idx[:-1]).tolist()
        assert max(gaps) <= math.ceil(rows / len(idx)) and min(gaps) >= rows // len(idx)
    assert calibration_rows(rows, 1.0).tolist() == list(range(rows))


def test_calibration_rows_examples_and_refusals() -> None:
    assert calibration_rows(64, 0.25).tolist() == list(range(0, 64, 4))
    assert calibration_rows(10, 0.25).tolist() == [0, 3, 6] and calibration_rows(3, 0.25).tolist() == [0]
    assert calibration_rows(30, 0.1).tolist() == [0, 10, 20]  # 0.1 * 30 is 3.0000000000000004 in floating point
    for share in (0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError, match="calibrate_share"):
            calibration_rows(8, share)
    with pytest.raises(ValueError, match="rows"):
        calibration_rows(-1, 0.5)
    assert calibration_rows(64, 0.1, multiple=8).tolist() == list(range(0, 64, 8))  # 7 rounded up to 8
    assert calibration_rows(10, 0.25, multiple=4).tolist() == [0, 2, 5, 7]  # 3 rounded up to 4
    assert calibration_rows(10, 0.5, multiple=8).tolist() == [0, 1, 2, 3, 5, 6, 7, 8]  # 5 rounded up to 8
    assert calibration_rows(10, 0.5, multiple=16).tolist() == list(range(10))  # 16 capped at 10
    with pytest.raises(ValueError, match="multiple"):
        calibration_rows(8, 0.5, multiple=0)
