"""Arguments of the public API: real numbers and 0-d tensors accepted, bad values refused naming the argument.

A bad input on one rank of a process group (every rank raises the same error) is tested in test_distributed.py.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import entropy_discriminator as ed
from entropy_discriminator._checks import ignore_index_value, integer, real_number
from entropy_discriminator.distributed import _radix_select, _sortable_int, kth_smallest, top_k_mask
from entropy_discriminator.masks import cap_limit

P = "entropy_disc/"


def batch(seed: int = 0, b: int = 5, t: int = 40):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, t, generator=g) ** 3
    valid = torch.rand(b, t, generator=g) < 0.8
    adv = torch.randn(b, generator=g)
    return scores, adv, valid


def same_mask(a: ed.MaskResult, b: ed.MaskResult) -> bool:
    return torch.equal(a.keep, b.keep) and (a.std, a.lower, a.n_clipped, a.capped) == (b.std, b.lower, b.n_clipped, b.capped)


# ---- real numbers and 0-d tensors -----------------------------------------------------------------


@pytest.mark.parametrize("wrap", [np.float32, np.float64, torch.tensor, lambda x: torch.tensor(x, dtype=torch.float64), np.array])
def test_masks_take_numpy_scalars_and_0d_tensors(wrap):
    scores, adv, valid = batch()
    for fn in (ed.clip_b_mask, ed.clip_v_mask):
        want = fn(scores, adv, valid, mu_low=float(wrap(0.5)), mu_high=float(wrap(2.0)), max_frac=0.05)
        got = fn(scores, adv, valid, mu_low=wrap(0.5), mu_high=wrap(2.0), max_frac=wrap(0.05))
        assert same_mask(got, want) and want.n_clipped > 0


def test_masks_take_ints_and_inf():
    scores, adv, valid = batch()
    assert same_mask(ed.clip_b_mask(scores, adv, valid, mu_low=1), ed.clip_b_mask(scores, adv, valid, mu_low=1.0))
    assert same_mask(
        ed.clip_v_mask(scores, adv, valid, mu_low=1, max_frac=1), ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=None)
    )
    assert ed.clip_b_mask(scores, adv, valid, mu_low=np.float64(np.inf)).lower == -math.inf


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"mu_low": "2.5"}, TypeError, "mu_low"),
        ({"mu_low": True}, TypeError, "mu_low"),
        ({"mu_low": torch.ones(2)}, TypeError, "mu_low"),
        ({"mu_high": torch.tensor(float("nan"))}, ValueError, "mu_high"),
        ({"mu_low": np.float32(-1)}, ValueError, "mu_low"),
        ({"max_frac": np.float32(1.5)}, ValueError, "max_frac"),
        ({"max_frac": math.inf}, ValueError, "max_frac"),
        ({"max_frac": "auto"}, TypeError, "max_frac"),
        ({"sides": None}, ValueError, "sides"),
    ],
)
def test_masks_refuse_bad_numbers_naming_them(kwargs, exc, needle):
    scores, adv, valid = batch()
    with pytest.raises(exc, match=needle):
        ed.clip_v_mask(scores, adv, valid, **kwargs)


def test_lr_alpha_eps_and_percentiles_take_real_numbers():
    scores, adv, valid = batch()
    s_c = scores * 0.1
    want = ed.batch_entropy_change(adv, s_c, valid, lr=0.5)
    for lr in (np.float32(0.5), torch.tensor(0.5), np.float64(0.5)):
        assert ed.batch_entropy_change(adv, s_c, valid, lr=lr) == want
    assert ed.batch_entropy_change(adv, s_c, valid, lr=1) == ed.batch_entropy_change(adv, s_c, valid, lr=1.0)
    mon = ed.EntropyMonitor(percentiles=(np.float32(50), torch.tensor(90), 10))
    m = mon(entropy=scores.abs(), valid=valid, advantages=adv, s_centered=s_c, lr=torch.tensor(0.5))
    assert {P + "entropy/p50", P + "entropy/p90", P + "entropy/p10"} <= set(m)
    assert m[P + "delta_entropy/predicted"] == pytest.approx(want, rel=1e-12, abs=1e-15)
    s_exp = scores * 0.5
    want_step = ed.entropy_change_step(0.25, scores, s_exp)
    for alpha in (np.float32(0.25), torch.tensor(0.25), torch.full((5, 1), 0.25)):
        assert torch.equal(ed.entropy_change_step(alpha, scores, s_exp), want_step)
    assert torch.equal(ed.entropy_change_logit(np.float64(0.25), scores), -0.25 * scores)


def test_config_takes_real_numbers_and_stores_floats():
    cfg = ed.EntropyDiscConfig(
        method="clip_v", mu_low=np.float32(2.5), mu_high=torch.tensor(4), max_frac=np.float32(1e-4), chunk_size=np.int64(8)
    )
    assert (cfg.mu_low, cfg.mu_high, cfg.max_frac, cfg.chunk_size) == (2.5, 4.0, 1e-4, 8)
    assert all(type(v) in (float, int) for v in (cfg.mu_low, cfg.mu_high, cfg.max_frac, cfg.chunk_size))
    with pytest.raises(ValueError, match="entropy_disc.chunk_size"):
        ed.EntropyDiscConfig(chunk_size=2.0)
    with pytest.raises(ValueError, match="entropy_disc.log_metrics"):
        ed.EntropyDiscConfig(log_metrics="yes")


def test_shared_coercion_helpers_for_token_stats_arguments():
    """real_number / integer / ignore_index_value: what token_stats' temperature and ignore_index use."""
    for t in (0.7, np.float32(0.7), torch.tensor(0.7), torch.tensor(0.7, dtype=torch.bfloat16), 1, np.int64(2)):
        assert real_number("temperature", t, above=0) == float(t)
    for bad, exc in (("0.7", TypeError), (True, TypeError), (0, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                     (float("nan"), ValueError), (torch.ones(2), TypeError), (1j, TypeError)):
        with pytest.raises(exc, match="temperature"):
            real_number("temperature", bad, above=0)
    assert integer("ignore_index", torch.tensor(-100)) == -100 and integer("ignore_index", np.int16(-1)) == -1
    assert ignore_index_value(None) < -(2**62) and ignore_index_value(np.int64(-100)) == -100
    for bad in (1.0, True, "x", torch.tensor(1.5)):
        with pytest.raises(TypeError, match="ignore_index"):
            ignore_index_value(bad)


# ---- bad arguments get a clear error naming them --------------------------------------------------


def test_apply_keep_mask_refuses_a_list_loss_mask():
    pg = torch.ones(1, 3)
    keep = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="loss_mask"):
        ed.apply_keep_mask(pg, keep, [[1, 1, 1]])
    with pytest.raises(TypeError, match="loss_mask"):
        ed.apply_keep_mask(pg, keep, [[1, 1, 1]], mode="drop_token")
    with pytest.raises(ValueError, match="mode"):
        ed.apply_keep_mask(pg, keep, torch.ones(1, 3), mode=None)


def test_config_from_mapping_names_the_field_of_a_bad_string():
    with pytest.raises(ValueError, match=r"entropy_disc\.mu_low.*'abc'"):
        ed.EntropyDiscConfig.from_mapping({"mu_low": "abc"})
    with pytest.raises(ValueError, match=r"entropy_disc\.max_frac"):
        ed.EntropyDiscConfig.from_mapping({"max_frac": "lots"})
    cfg = ed.EntropyDiscConfig.from_mapping({"method": "clip_b", "mu_low": "3", "max_frac": "1e-3", "mu_high": "inf"})
    assert (cfg.mu_low, cfg.max_frac, cfg.mu_high) == (3.0, 1e-3, math.inf)


def test_config_validates_on_assignment():
    cfg = ed.EntropyDiscConfig(method="clip_b")
    with pytest.raises(ValueError, match=r"entropy_disc\.method.*clip_x"):
        cfg.method = "clip_x"
    assert cfg.method == "clip_b"  # a refused assignment leaves the field as it was
    for field, bad in (("mu_low", -1.0), ("mu_high", "x"), ("sides", "up"), ("max_frac", 2), ("mask_mode", "scale"),
                       ("impl", "cuda"), ("chunk_size", 0)):
        with pytest.raises(ValueError, match=f"entropy_disc.{field}"):
            setattr(cfg, field, bad)
    cfg.method = "clip_v"
    cfg.mu_low = np.float32(1.5)
    assert cfg.resolved() == (1.5, None) and type(cfg.mu_low) is float  # default: no cap


def test_discriminator_score_shape_mismatch_names_both_arguments():
    with pytest.raises(ValueError, match=r"logp \(2, 3\).*entropy \(4,\)"):
        ed.discriminator_score(torch.zeros(2, 3), torch.zeros(4))
    assert ed.discriminator_score(torch.zeros(2, 3), torch.zeros(2, 1)).shape == (2, 3)  # broadcasting stays


def test_entropy_change_step_shape_mismatches_name_the_argument():
    s_star = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="s_expected"):
        ed.entropy_change_step(0.1, s_star, torch.zeros(3))
    with pytest.raises(ValueError, match="alpha"):
        ed.entropy_change_step(torch.ones(2), s_star, torch.zeros(2, 3))  # per-row alpha needs alpha[:, None]
    with pytest.raises(ValueError, match="alpha"):
        ed.entropy_change_step(torch.ones(2, 3, 1), s_star, torch.zeros(2, 3))  # would enlarge the result
    with pytest.raises(TypeError, match="alpha"):
        ed.entropy_change_step("0.1", s_star, s_star)
    with pytest.raises(ValueError, match="eps"):
        ed.entropy_change_logit(torch.ones(5), s_star)
    assert ed.entropy_change_step(torch.ones(2, 1), s_star, s_star).shape == (2, 3)


# ---- no silent NaN ----------------------------------------------------------------------------------


def test_nan_logp_gives_a_nan_score_that_the_masks_refuse():
    logp = torch.tensor([[-0.5, float("nan"), -float("inf"), -1.0]])
    entropy = torch.ones(1, 4)
    s = ed.discriminator_score(logp, entropy)
    assert math.isnan(s[0, 1]) and s[0, 2] == 0.0 and s[0, 0] == pytest.approx(math.exp(-0.5) * 0.5)
    adv, valid = torch.tensor([-1.0]), torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="s_star contains NaN or inf at 1 valid position"):
        ed.clip_b_mask(s, adv, valid)
    with pytest.raises(ValueError, match="s_centered contains NaN"):
        ed.clip_v_mask(s, adv, valid)
    valid[0, 1] = False  # a NaN at an invalid (padding) position is ignored
    assert ed.clip_b_mask(s, adv, valid).n_valid == 3


@pytest.mark.parametrize("lr", [float("nan"), math.inf, -math.inf, torch.tensor(float("nan")), "0.1"])
def test_monitor_refuses_non_finite_lr_like_batch_entropy_change(lr):
    g = torch.Generator().manual_seed(0)
    stats = ed.token_stats(torch.randn(2, 5, 11, generator=g), torch.randint(0, 11, (2, 5), generator=g))
    adv = torch.tensor([1.0, -1.0])
    with pytest.raises((ValueError, TypeError), match="lr"):
        ed.EntropyMonitor().from_stats(stats, advantages=adv, lr=lr)
    with pytest.raises((ValueError, TypeError), match="lr"):
        ed.batch_entropy_change(adv, stats.s_centered, stats.valid, lr=lr)


def test_monitor_refuses_nan_in_every_tensor_naming_it():
    entropy, valid = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    for name in ("entropy", "s_star", "s_centered", "ratio"):
        kw = {"entropy": entropy, "s_star": torch.zeros(2, 3), "s_centered": torch.zeros(2, 3), "ratio": torch.ones(2, 3)}
        kw[name] = kw[name].clone()
        kw[name][1, 2] = float("nan")
        with pytest.raises(ValueError, match=f"{name} contains NaN"):
            ed.EntropyMonitor()(valid=valid, advantages=torch.tensor([1.0, -1.0]), **kw)
    with pytest.raises(ValueError, match="valid must hold only 0 and 1"):
        ed.EntropyMonitor()(entropy=entropy, valid=torch.full((2, 3), 2))


# ---- max_frac caps the share --------------------------------------------------------------------------


def violators(n_bad: int, n: int = 100):
    scores = torch.zeros(n)
    scores[:n_bad] = -torch.arange(1, n_bad + 1, dtype=torch.float32) - 50
    return scores, -torch.ones(n), torch.ones(n, dtype=torch.bool)


def test_max_frac_zero_clips_nothing():
    scores, adv, valid = violators(4)
    res = ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=0.0)
    assert res.n_clipped == 0 and bool(res.keep.all()) and res.capped
    cfg = ed.EntropyDiscConfig(method="clip_v", mu_low=1.0, max_frac=0)
    assert cfg.compute_mask(advantages=adv, valid=valid, s_centered=scores).n_clipped == 0


def test_max_frac_below_one_token_clips_nothing_and_the_share_never_exceeds_it():
    scores, adv, valid = violators(4)
    assert ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=0.009).n_clipped == 0  # 0.9 tokens
    assert ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=0.01).n_clipped == 1
    assert ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=1e-4).n_clipped == 0  # 1e-4 of 100 tokens


def test_max_frac_limit_is_exact_decimal_arithmetic():
    scores, adv, valid = violators(40)
    assert 0.29 * 100 < 29  # floating point would allow 28
    res = ed.clip_v_mask(scores, adv, valid, mu_low=0.5, max_frac=0.29)
    assert res.capped and res.n_clipped == 29
    assert (~res.keep).nonzero().reshape(-1).tolist() == list(range(11, 40))  # the 29 most violating
    assert cap_limit(0.29, 100) == 29 and cap_limit(np.float32(0.29), 100) == 29 and cap_limit(None, 5) is None
    assert ed.EntropyDiscConfig(method="clip_v", max_frac=np.float32(0.29)).max_frac == 0.29


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), max_frac=st.sampled_from([0.0, 0.003, 0.01, 0.07, 0.29, 0.5, 1.0]),
       method=st.sampled_from([ed.clip_b_mask, ed.clip_v_mask]))
def test_clipped_share_never_exceeds_max_frac(seed, max_frac, method):
    scores, adv, valid = batch(seed, b=4, t=int(torch.randint(1, 90, (1,), generator=torch.Generator().manual_seed(seed))))
    res = method(scores, adv, valid, mu_low=0.2, sides="both", max_frac=max_frac)
    assert Fraction(res.n_clipped) <= Fraction(repr(max_frac)) * res.n_valid
    uncapped = method(scores, adv, valid, mu_low=0.2, sides="both", max_frac=None)
    assert res.n_clipped == min(uncapped.n_clipped, math.floor(Fraction(repr(max_frac)) * res.n_valid))
    assert bool((res.keep | ~uncapped.keep).all())  # the cap only un-clips


# ---- exact percentile ranks -----------------------------------------------------------------------------


def test_percentile_ranks_are_exact():
    mon = ed.EntropyMonitor(percentiles=(7, 99.9, 10, 50, 100, 0.1))
    m = mon(entropy=torch.arange(1, 101, dtype=torch.float32), valid=torch.ones(100, dtype=torch.bool))
    assert 7 / 100 * 100 > 7  # floating point would take the 8th value
    assert m[P + "entropy/p7"] == 7.0 and m[P + "entropy/p10"] == 10.0 and m[P + "entropy/p100"] == 100.0
    assert m[P + "entropy/p0.1"] == 1.0
    m = mon(entropy=torch.arange(1, 1001, dtype=torch.float32), valid=torch.ones(1000, dtype=torch.bool))
    assert 99.9 / 100 * 1000 > 999  # floating point would take the 1000th value
    assert m[P + "entropy/p99.9"] == 999.0 and m[P + "entropy/p7"] == 70.0 and m[P + "entropy/p0.1"] == 1.0
    with pytest.raises(ValueError, match="percentiles"):
        ed.EntropyMonitor(percentiles=(0,))
    with pytest.raises(TypeError, match="percentiles"):
        ed.EntropyMonitor(percentiles=("p50",))


@settings(max_examples=200, deadline=None)
@given(digits=st.integers(1, 10**6), scale=st.sampled_from([1, 10, 100, 1000, 10**4]), n=st.integers(1, 10**7))
def test_percentile_rank_equals_integer_ceiling(digits, scale, n):
    q = Fraction(digits, scale)
    if not 0 < q <= 100:
        return
    qf = float(str(digits / scale)) if scale > 1 else digits
    if Fraction(repr(float(qf))) != q:
        return  # q has no short decimal float; the rule is stated for decimals
    want = max(1, min(n, -((-digits * n) // (scale * 100))))
    assert ed.EntropyMonitor(percentiles=(qf,)).percentile_ranks(n) == [want]


# ---- exactness of the device paths ----------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3000), special=st.booleans())
def test_radix_select_and_device_sort_equal_a_sort_of_the_float32_bits(seed, n, special):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10 ** torch.randint(-40, 38, (n,), generator=g).float()
    if special:
        pool = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-45, -1e-45, 3.4e38])
        x = torch.where(torch.rand(n, generator=g) < 0.5, pool[torch.randint(0, 7, (n,), generator=g)], x.round())
    where = torch.rand(n, generator=g) < 0.7
    where[0] = True
    m = int(where.sum())
    ks = sorted({1, m, *torch.randint(1, m + 1, (5,), generator=g).tolist()})
    want_keys = torch.sort(_sortable_int(x[where])).values[torch.tensor(ks) - 1]
    got_radix = _radix_select(torch.where(where, _sortable_int(x), 2**31 - 1), where, torch.tensor(ks), None)
    assert torch.equal(got_radix, want_keys.to(torch.int64))
    values = kth_smallest(x, ks, None, where=where)
    ref = [float(v) for v in torch.sort(x[where]).values[torch.tensor(ks) - 1]]
    assert values == ref  # equal as numbers (-0.0 == 0.0); the keys above are equal bit for bit


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 200), k=st.integers(0, 60))
def test_device_top_k_takes_the_largest_then_the_earliest(seed, n, k):
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(0, 6, (n,), generator=g).double()  # many ties
    cand = torch.rand(n, generator=g) < 0.6
    got = top_k_mask(score, cand, k, None)
    order = sorted((i for i in range(n) if cand[i]), key=lambda i: (-float(score[i]), i))[:k]
    assert got.nonzero().reshape(-1).tolist() == sorted(order)


@pytest.mark.parametrize("fn", ["token_stats", "token_stats_from_hidden"])
def test_token_stats_take_real_temperatures_and_ignore_index_none(fn):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    if fn == "token_stats":
        source = (torch.randn(2, 5, 11, generator=g),)
    else:
        source = (torch.randn(2, 5, 4, generator=g), torch.randn(11, 4, generator=g))
    call = getattr(ed, fn)
    want = call(*source, labels, temperature=0.7)
    for t in (np.float32(0.7), np.float64(0.7), torch.tensor(0.7)):
        got = call(*source, labels, temperature=t)
        torch.testing.assert_close(got.entropy, want.entropy)
    for bad, err in (("0.7", TypeError), (0, ValueError), (math.nan, ValueError), (True, TypeError)):
        with pytest.raises(err, match="temperature"):
            call(*source, labels, temperature=bad)
    # ignore_index=None: nothing skipped, so a label of -100 is out of range (not silently ignored).
    assert bool(call(*source, labels, ignore_index=None).valid.all())
    labels[0, 0] = -100
    assert not bool(call(*source, labels).valid[0, 0])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 11\); got \[-100\]"):
        call(*source, labels, ignore_index=None)
