"""EntropyMonitor, batch_entropy_change and EntropyDiscConfig against direct float64 computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import entropy_discriminator as ed
from entropy_discriminator.distributed import kth_smallest

P = "entropy_disc/"


def batch(seed: int, b: int = 6, t: int = 17):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(b, t, generator=g) * 3
    s_star = torch.randn(b, t, generator=g) * 0.2
    s_c = torch.randn(b, t, generator=g) * 0.1
    valid = torch.rand(b, t, generator=g) < 0.7
    adv = torch.randn(b, generator=g)
    ratio = 1 + 0.1 * torch.randn(b, t, generator=g)
    return entropy, s_star, s_c, valid, adv, ratio


def nearest_rank(values: np.ndarray, q: float) -> float:
    s = np.sort(values)
    return float(s[min(max(math.ceil(q / 100 * len(s)), 1), len(s)) - 1])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_monitor_metrics_equal_direct_float64_computation(seed):
    entropy, s_star, s_c, valid, adv, ratio = batch(seed)
    mask = ed.clip_b_mask(s_star, adv, valid, mu_low=0.5)
    m = ed.EntropyMonitor()(
        entropy=entropy, valid=valid, advantages=adv, s_star=s_star, s_centered=s_c, mask=mask, ratio=ratio, lr=0.1
    )
    v = valid.numpy()
    h = entropy.double().numpy()[v]
    a = adv.double()[:, None].expand_as(entropy).numpy()[v]
    y = (s_c.double() * ratio.double()).numpy()[v]
    assert m[P + "tokens/valid"] == v.sum()
    assert m[P + "entropy/mean"] == pytest.approx(h.mean(), rel=1e-12)
    for q in (10, 50, 90, 99):
        assert m[P + f"entropy/p{q}"] == nearest_rank(entropy.numpy()[v], q)
    assert m[P + "s_star/std"] == pytest.approx(s_star.double().numpy()[v].std(), rel=1e-9)
    assert m[P + "s_centered/mean"] == pytest.approx(s_c.double().numpy()[v].mean(), rel=1e-9, abs=1e-15)
    cov = np.mean(a * y) - a.mean() * y.mean()
    assert m[P + "cov/adv_s_centered"] == pytest.approx(cov, rel=1e-9, abs=1e-15)
    assert m[P + "delta_entropy/predicted"] == pytest.approx(-0.1 * cov, rel=1e-9, abs=1e-15)
    assert m[P + "delta_entropy/predicted"] == pytest.approx(
        ed.batch_entropy_change(adv, s_c, valid, lr=0.1, ratio=ratio), rel=1e-12, abs=1e-15
    )
    assert m[P + "entropy/mean_adv_pos"] == pytest.approx(h[a > 0].mean(), rel=1e-12) if (a > 0).any() else True
    kept = mask.keep.numpy()[v]
    assert m[P + "clip/frac"] == pytest.approx((~kept).mean())
    if (~kept).any():
        assert m[P + "entropy/clipped_mean"] == pytest.approx(h[~kept].mean(), rel=1e-12)
    assert m[P + "clip/threshold_low"] == mask.lower and P + "clip/threshold_high" not in m
    undefined = {P + "entropy/clipped_mean": not (~kept).any(), P + "entropy/mean_adv_pos": not (a > 0).any(),
                 P + "entropy/mean_adv_neg": not (a < 0).any(), P + "entropy/kept_mean": kept.all() and not kept.any()}
    for key, x in m.items():
        assert isinstance(x, float) and (math.isnan(x) if undefined.get(key) else math.isfinite(x)), key


def test_monitor_keys_do_not_depend_on_the_batch():
    """An all-masked batch (or one where nothing is clipped) has the keys of any other: NaN means, zero counts."""
    entropy, s_star, s_c, valid, adv, ratio = batch(3)
    mon = ed.EntropyMonitor()

    def metrics(v: torch.Tensor, mu: float) -> dict[str, float]:
        mask = ed.clip_b_mask(s_star, adv, v, mu_low=mu)
        return mon(entropy=entropy, valid=v, advantages=adv, s_star=s_star, s_centered=s_c, mask=mask, ratio=ratio,
                   lr=0.1)

    full, none_clipped, empty = metrics(valid, 0.5), metrics(valid, 50.0), metrics(torch.zeros_like(valid), 0.5)
    assert full.keys() == none_clipped.keys() == empty.keys()
    assert math.isnan(empty[P + "entropy/mean"]) and math.isnan(empty[P + "entropy/p50"])
    assert math.isnan(empty[P + "s_centered/std"]) and math.isnan(empty[P + "delta_entropy/predicted"])
    assert empty[P + "tokens/valid"] == 0 and empty[P + "clip/frac"] == 0 and empty[P + "clip/n_clipped"] == 0
    assert math.isnan(none_clipped[P + "entropy/clipped_mean"]) and math.isfinite(full[P + "entropy/clipped_mean"])
    assert math.isnan(mon.realised(entropy, entropy, torch.zeros_like(valid))[P + "delta_entropy/realised"])


def test_monitor_from_stats_and_realised():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, 30, generator=g)
    labels = torch.randint(0, 30, (4, 9), generator=g)
    labels[0, :3] = -100
    stats = ed.token_stats(logits, labels)
    mon = ed.EntropyMonitor(prefix="x/", percentiles=(50,))
    m = mon.from_stats(stats, advantages=torch.randn(4, generator=g))
    assert set(m) >= {"x/entropy/mean", "x/entropy/p50", "x/s_star/mean", "x/s_centered/std", "x/cov/adv_s_centered"}
    after = stats.entropy + 0.25
    assert mon.realised(stats.entropy, after, stats.valid)["x/delta_entropy/realised"] == pytest.approx(0.25)
    empty = mon(entropy=torch.zeros(0, 5), valid=torch.zeros(0, 5, dtype=torch.bool))
    assert empty.keys() == {"x/tokens/valid", "x/entropy/mean", "x/entropy/p50"} and empty["x/tokens/valid"] == 0.0
    assert math.isnan(empty["x/entropy/mean"]) and math.isnan(empty["x/entropy/p50"])
    assert math.isnan(mon.realised(torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.bool))["x/delta_entropy/realised"])


def test_percentiles_beyond_quantile_limit_without_gathering():
    """kth_smallest is exact where torch.quantile refuses (> 2**24 elements)."""
    x = torch.rand(2**24 + 5, generator=torch.Generator().manual_seed(3)) * 10 - 5
    with pytest.raises(RuntimeError):
        torch.quantile(x, 0.5)
    ks = [1, 2**23, 2**24 + 5]
    srt = torch.sort(x).values
    assert kth_smallest(x, ks, None) == [float(srt[k - 1]) for k in ks]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"entropy": torch.tensor([[float("nan"), 1.0]])}, "entropy"),
        ({"advantages": torch.tensor([1.0, 2.0, 3.0])}, "advantages"),
        ({"s_star": torch.zeros(1, 3)}, "s_star"),
        ({"ratio": torch.zeros(2, 2), "s_centered": torch.zeros(1, 2)}, "ratio"),
    ],
)
def test_monitor_bad_input(kwargs, needle):
    args = {"entropy": torch.ones(1, 2), "valid": torch.ones(1, 2), "advantages": torch.tensor([1.0])}
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=needle):
        ed.EntropyMonitor()(**args)


def test_batch_entropy_change_forms_and_errors():
    _, _, s_c, valid, adv, ratio = batch(5)
    a = adv[:, None].expand_as(s_c).double()[valid]
    y = s_c.double()[valid]
    assert ed.batch_entropy_change(adv, s_c, valid, lr=2.0, form="mean") == pytest.approx(-2 * float((a * y).mean()))
    assert ed.batch_entropy_change(adv, s_c, torch.zeros_like(valid), lr=2.0) == 0.0
    with pytest.raises(ValueError, match="form"):
        ed.batch_entropy_change(adv, s_c, valid, lr=1.0, form="exact")
    with pytest.raises(ValueError, match="ratio"):
        ed.batch_entropy_change(adv, s_c, valid, lr=1.0, ratio=ratio[:, :3])
    with pytest.raises(ValueError, match="lr"):
        ed.batch_entropy_change(adv, s_c, valid, lr=float("nan"))


def test_config_defaults_validation_and_dispatch():
    cfg = ed.EntropyDiscConfig.from_mapping({"method": "clip_v"})
    assert cfg.resolved() == (2.5, None) and cfg.needs_expected  # one default for both masks (README "Defaults")
    cfg_b = ed.EntropyDiscConfig(method="clip_b", max_frac=None)
    assert cfg_b.resolved() == (2.5, None) and not cfg_b.needs_expected
    assert ed.EntropyDiscConfig.from_mapping({"method": "clip_b", "mu_high": "inf"}).mu_high == math.inf
    _, s_star, s_c, valid, adv, _ = batch(1)
    got = cfg.compute_mask(advantages=adv, valid=valid, s_star=s_star, s_centered=s_c)
    want = ed.clip_v_mask(s_c, adv, valid)
    assert torch.equal(got.keep, want.keep) and got.method == "clip_v"
    for bad, needle in (
        ({"method": "clip_x"}, "method"),
        ({"mu_low": -1}, "mu_low"),
        ({"sides": "up"}, "sides"),
        ({"max_frac": 2}, "max_frac"),
        ({"mask_mode": "scale"}, "mask_mode"),
        ({"impl": "cuda"}, "impl"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"mu": 2}, "unknown"),
    ):
        with pytest.raises(ValueError, match=needle):
            ed.EntropyDiscConfig.from_mapping(bad)
    with pytest.raises(ValueError, match="s_centered"):
        cfg.compute_mask(advantages=adv, valid=valid, s_star=s_star)
    with pytest.raises(ValueError, match="none"):
        ed.EntropyDiscConfig().resolved()
