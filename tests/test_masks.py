"""Clip_B / Clip_V keep-masks: hand-computed cases, a plain-Python reference, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_outlier_keep

import entropy_discriminator as ed

# scores [0, 0, 0, 0, -10]: mean -2, population std 4
S = torch.tensor([[0.0, 0.0, 0.0, 0.0, -10.0]])
ALL = torch.ones(1, 5, dtype=torch.bool)


def token_adv(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)])


def test_clip_b_hand_case_negative_side():
    res = ed.clip_b_mask(S, token_adv(1, 1, -1, -1, -1), ALL, mu_low=1.5)
    assert (res.center, res.std, res.lower) == (-2.0, 4.0, -8.0) and res.upper == math.inf
    assert res.keep.tolist() == [[True, True, True, True, False]]
    assert (res.n_clipped, res.n_clipped_neg, res.n_clipped_pos) == (1, 1, 0)
    assert (res.n_valid, res.n_valid_pos, res.n_valid_neg) == (5, 2, 3)
    assert res.clip_frac == pytest.approx(0.2)


@pytest.mark.parametrize(
    "adv4, sides, clipped",
    [(1, "negative", False), (1, "positive", True), (1, "both", True), (-1, "positive", False), (0, "both", False)],
)
def test_sides_select_which_advantage_sign_may_be_clipped(adv4, sides, clipped):
    res = ed.clip_b_mask(S, token_adv(1, 1, -1, -1, adv4), ALL, mu_low=1.5, sides=sides)
    assert res.keep[0, 4].item() is (not clipped)


def test_upper_bound_and_both_sides():
    res = ed.clip_b_mask(S, token_adv(1, -1, 1, -1, -1), ALL, mu_low=1.5, mu_high=0.4, sides="both")
    assert res.upper == pytest.approx(-0.4)
    assert res.keep.tolist() == [[False] * 5]


def test_clip_v_does_not_recentre():
    adv = token_adv(-1, -1, -1, -1, -1)
    v = ed.clip_v_mask(S, adv, ALL, mu_low=2.0, max_frac=None)
    b = ed.clip_b_mask(S, adv, ALL, mu_low=2.0)
    assert v.center == 0.0 and v.lower == -8.0 and not v.keep[0, 4]
    assert b.lower == -10.0 and bool(b.keep[0, 4])  # -10 is not below mean - 2 sigma = -10


def test_sequence_advantages_broadcast_over_tokens():
    scores = torch.tensor([[0.0, 0.0, -9.0], [0.0, -9.0, 0.0]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]])
    seq = ed.clip_b_mask(scores, torch.tensor([1.0, -1.0]), valid, mu_low=1.0)
    tok = ed.clip_b_mask(scores, torch.tensor([[1.0] * 3, [-1.0] * 3]), valid, mu_low=1.0)
    assert torch.equal(seq.keep, tok.keep)
    assert seq.keep.tolist() == [[True, True, True], [True, False, True]]


def test_cap_keeps_only_the_most_violating_clipped_ties_by_position():
    scores = torch.tensor([0.0] * 96 + [-50.0, -60.0, -60.0, -40.0])
    adv = -torch.ones(100)
    valid = torch.ones(100, dtype=torch.bool)
    uncapped = ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=None)
    assert uncapped.n_clipped == 4 and not uncapped.capped
    capped = ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=0.02)  # floor(2) = 2 tokens
    assert capped.capped and capped.n_clipped == 2
    assert (~capped.keep).nonzero().reshape(-1).tolist() == [97, 98]
    one = ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=0.01)  # floor(1) = 1
    assert (~one.keep).nonzero().reshape(-1).tolist() == [97]  # tie at -60: the earlier position


def test_zero_std_and_no_valid_token_keep_everything():
    flat = ed.clip_b_mask(torch.full((2, 3), 0.3), torch.tensor([-1.0, -1.0]), torch.ones(2, 3), mu_low=0.0)
    assert bool(flat.keep.all()) and flat.n_clipped == 0 and flat.std == 0.0
    none = ed.clip_v_mask(torch.randn(2, 3), torch.tensor([-1.0, -1.0]), torch.zeros(2, 3), mu_low=0.0)
    assert bool(none.keep.all()) and none.n_valid == 0 and none.clip_frac == 0.0
    empty = ed.clip_b_mask(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, 4, dtype=torch.bool))
    assert empty.keep.shape == (0, 4) and empty.n_valid == 0


def test_invalid_tokens_never_enter_statistics_or_get_clipped():
    scores = torch.tensor([[0.0, 0.0, -10.0, 1e6]])
    valid = torch.tensor([[True, True, True, False]])
    res = ed.clip_b_mask(scores, torch.tensor([-1.0]), valid, mu_low=1.0)
    ref = ed.clip_b_mask(scores[:, :3], torch.tensor([-1.0]), valid[:, :3], mu_low=1.0)
    assert res.std == ref.std and res.center == ref.center and bool(res.keep[0, 3])
    nan_pad = scores.clone()
    nan_pad[0, 3] = float("nan")  # padding may hold garbage
    assert torch.equal(ed.clip_b_mask(nan_pad, torch.tensor([-1.0]), valid, mu_low=1.0).keep, res.keep)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 6),
    t=st.integers(1, 30),
    method=st.sampled_from(["clip_b", "clip_v"]),
    mu_low=st.sampled_from([0.0, 0.5, 1.0, 2.5, math.inf]),
    mu_high=st.sampled_from([0.5, 2.0, math.inf]),
    sides=st.sampled_from(["negative", "positive", "both"]),
    max_frac=st.sampled_from([None, 0.0, 0.01, 0.1, 0.5]),
    per_token=st.booleans(),
)
def test_masks_match_plain_python_reference(seed, b, t, method, mu_low, mu_high, sides, max_frac, per_token):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, t, generator=g) * torch.rand(b, t, generator=g) ** 3
    valid = torch.rand(b, t, generator=g) < 0.8
    adv = torch.randint(-2, 3, (b, t) if per_token else (b,), generator=g).float()
    fn = ed.clip_b_mask if method == "clip_b" else ed.clip_v_mask
    res = fn(scores, adv, valid, mu_low=mu_low, mu_high=mu_high, sides=sides, max_frac=max_frac)
    adv_full = adv if per_token else adv[:, None].expand(b, t)
    want = reference_outlier_keep(
        scores.double().reshape(-1).tolist(),
        adv_full.reshape(-1).tolist(),
        valid.reshape(-1).tolist(),
        recentre=method == "clip_b",
        mu_low=mu_low,
        mu_high=mu_high,
        sides=sides,
        max_frac=max_frac,
    )
    assert res.keep.reshape(-1).tolist() == want
    assert res.n_clipped == want.count(False)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), method=st.sampled_from(["clip_b", "clip_v"]))
def test_clip_count_is_monotone_in_mu(seed, method):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(8, 40, generator=g) ** 3
    adv = torch.randn(8, generator=g)
    valid = torch.ones(8, 40, dtype=torch.bool)
    fn = ed.clip_b_mask if method == "clip_b" else ed.clip_v_mask
    counts = [fn(scores, adv, valid, mu_low=mu, max_frac=None).n_clipped for mu in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)]
    assert counts == sorted(counts, reverse=True)
    masks = [fn(scores, adv, valid, mu_low=mu, max_frac=None).keep for mu in (0.5, 2.0)]
    assert bool((masks[1] | ~masks[0]).all())  # kept at small mu => kept at larger mu


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"scores": torch.tensor([[0.0, float("nan")]])}, ValueError, "s_star"),
        ({"advantages": torch.tensor([1.0, 2.0])}, ValueError, "advantages"),
        ({"advantages": torch.tensor([[float("inf"), 1.0]])}, ValueError, "advantages"),
        ({"valid": torch.tensor([[2, 1]])}, ValueError, "valid"),
        ({"valid": torch.ones(1, 3)}, ValueError, "valid"),
        ({"sides": "left"}, ValueError, "sides"),
        ({"mu_low": -1.0}, ValueError, "mu_low"),
        ({"mu_high": float("nan")}, ValueError, "mu_high"),
        ({"max_frac": 1.5}, ValueError, "max_frac"),
        ({"scores": torch.tensor([[1, 2]])}, TypeError, "s_star"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, exc, needle):
    args = {"scores": torch.tensor([[0.0, 1.0]]), "advantages": torch.tensor([-1.0]), "valid": torch.ones(1, 2)}
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(exc, match=needle):
        ed.clip_b_mask(args["scores"], args["advantages"], args["valid"], **kwargs)


def test_apply_keep_mask_two_modes():
    pg = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    keep = torch.tensor([[True, False, True]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss_zero, mask_zero = ed.apply_keep_mask(pg, keep, mask)
    assert loss_zero.tolist() == [[1.0, 0.0, 3.0]] and mask_zero is mask
    token_mean = (loss_zero * mask_zero).sum() / mask_zero.sum()
    token_mean.backward()
    assert pg.grad.tolist() == [[0.5, 0.0, 0.0]]  # normaliser stays 2 tokens
    loss_drop, mask_drop = ed.apply_keep_mask(pg, keep, mask, mode="drop_token")
    assert loss_drop is pg and mask_drop.tolist() == [[1.0, 0.0, 0.0]] and mask_drop.dtype == mask.dtype
    _, bool_mask = ed.apply_keep_mask(pg, keep, mask.bool(), mode="drop_token")
    assert bool_mask.tolist() == [[True, False, False]]
    with pytest.raises(ValueError, match="mode"):
        ed.apply_keep_mask(pg, keep, mask, mode="scale")
    with pytest.raises(ValueError, match="keep"):
        ed.apply_keep_mask(pg, keep[:, :2], mask)


def test_one_default_mu_and_cap_everywhere():
    """API, EntropyDiscConfig and the demo CLI share one default: mu = 2.5, no cap, for Clip_B and Clip_V."""
    import inspect

    from entropy_discriminator.config import DEFAULT_MAX_FRAC, DEFAULT_MU_LOW
    from entropy_discriminator.demo.runner import DemoOptions

    for fn in (ed.clip_b_mask, ed.clip_v_mask):
        params = inspect.signature(fn).parameters
        assert (params["mu_low"].default, params["max_frac"].default, params["cap_rule"].default) == (2.5, None, "share")
    assert DEFAULT_MU_LOW == {"clip_b": 2.5, "clip_v": 2.5} and DEFAULT_MAX_FRAC == {"clip_b": None, "clip_v": None}
    assert (DemoOptions.mu_b, DemoOptions.mu_v, DemoOptions.max_frac_v) == (2.5, 2.5, None)


def test_default_masks_clip_tokens_in_a_256_token_batch():
    """README's custom-loop snippet with the defaults does something on a small batch (it once clipped 0)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 32, 64, generator=g) * torch.rand(8, 32, 1, generator=g) * 6
    labels = torch.multinomial(torch.softmax(logits, -1).reshape(-1, 64), 1, generator=g).reshape(8, 32)  # seeded
    stats = ed.token_stats(logits, labels)
    adv = torch.tensor([1.0, -1.0] * 4)
    valid = torch.ones(8, 32, dtype=torch.bool)
    assert ed.clip_v_mask(stats.s_centered, adv, valid).n_clipped > 0
    assert ed.EntropyDiscConfig(method="clip_v").compute_mask(
        advantages=adv, valid=valid, s_centered=stats.s_centered).n_clipped > 0
    # the reference's 7B setting clips nothing here, which is why it is not the default
    assert ed.clip_v_mask(stats.s_centered, adv, valid, mu_low=8.5, max_frac=1e-4).n_clipped == 0


def test_reference_cap_rule_clips_at_least_one_token_when_over_the_cap():
    """cap_rule="reference" is Trinity-RFT 0.6.0's max(int(max_frac * n), 1); "share" is floor(max_frac * n)."""
    scores = torch.tensor([-51.0, -52.0, -53.0, -54.0] + [0.0] * 96)
    adv, valid = -torch.ones(100), torch.ones(100, dtype=torch.bool)
    share = ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=1e-4)
    reference = ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=1e-4, cap_rule="reference")
    assert (share.n_clipped, share.capped) == (0, True)
    assert (reference.n_clipped, reference.capped) == (1, True) and reference.keep.tolist()[:4] == [True] * 3 + [False]
    assert ed.clip_v_mask(scores, adv, valid, mu_low=1.0, max_frac=0.5, cap_rule="reference").n_clipped == 4
    cfg = ed.EntropyDiscConfig(method="clip_v", mu_low=1.0, max_frac=1e-4, cap_rule="reference")
    assert cfg.compute_mask(advantages=adv, valid=valid, s_centered=scores).n_clipped == 1
    with pytest.raises(ValueError, match="cap_rule"):
        ed.clip_b_mask(scores, adv, valid, cap_rule="trinity")
    with pytest.raises(ValueError, match="entropy_disc.cap_rule"):
        ed.EntropyDiscConfig(method="clip_v", cap_rule="trinity")
