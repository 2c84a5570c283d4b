"""Peer entropy controls (entropy_discriminator.baselines) against plain float64 references written from the
formulas, hand cases, bad input, empty batches, and a 2-process gloo run equal to one process."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from entropy_discriminator.baselines import (
    clip_cov_losses,
    entropy_bonus,
    high_entropy_mask,
    kl_cov_losses,
    ppo_clip_losses,
    unlikeliness_scores,
)

F64 = torch.float64


def batch(seed: int, b: int = 6, t: int = 7, pad: bool = True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=F64) * 4
    old = lp + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64) * 3
    valid = torch.ones(b, t, dtype=torch.bool)
    if pad:
        valid[:, -2:] = torch.rand(b, 2, generator=g) < 0.5
    return lp, old, adv, valid


# ------------------------------------------------------------------ references (plain python over valid tokens)


def ref_cov(lp, adv_tok, valid):
    idx = [(i, j) for i in range(lp.shape[0]) for j in range(lp.shape[1]) if valid[i, j]]
    ma = sum(float(adv_tok[i, j]) for i, j in idx) / len(idx)
    ml = sum(float(lp[i, j]) for i, j in idx) / len(idx)
    return {(i, j): (float(adv_tok[i, j]) - ma) * (float(lp[i, j]) - ml) for i, j in idx}


def ref_ppo(lp, old, a, eps):
    r = math.exp(lp - old)
    return max(-a * r, -a * min(max(r, 1 - eps), 1 + eps)), (-a * min(max(r, 1 - eps), 1 + eps)) > -a * r


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), eps=st.floats(0.05, 0.4))
def test_ppo_clip_losses_match_reference(seed, eps):
    lp, old, adv, _ = batch(seed)
    pg, clipped = ppo_clip_losses(lp, old, adv, clip_ratio_low=eps, clip_ratio_high=eps)
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            want, c = ref_ppo(float(lp[i, j]), float(old[i, j]), float(adv[i]), eps)
            assert float(pg[i, j]) == pytest.approx(want, rel=1e-12, abs=1e-12)
            assert bool(clipped[i, j]) == c


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), ratio=st.sampled_from([0.02, 0.1, 0.3]), coef=st.floats(0.0, 2.0))
def test_kl_cov_matches_reference(seed, ratio, coef):
    lp, old, adv, valid = batch(seed)
    adv_tok = adv[:, None].expand_as(lp)
    res = kl_cov_losses(lp, old, adv, valid, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    cov = ref_cov(lp, adv_tok, valid)
    k = max(1, int(len(cov) * ratio))
    top = set(sorted(cov, key=lambda ij: -cov[ij])[:k])
    assert {(i, j) for i, j in torch.nonzero(res.selected).tolist()} == top
    assert res.n_selected == k and res.n_valid == len(cov)
    for (i, j) in cov:
        d = float(lp[i, j] - old[i, j])
        want = -float(adv[i]) * math.exp(d) + (coef * abs(d) if (i, j) in top else 0.0)
        assert float(res.pg_losses[i, j]) == pytest.approx(want, rel=1e-12, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), lb=st.floats(-1.0, 0.5), width=st.floats(0.2, 3.0), ratio=st.sampled_from([0.01, 0.1, 0.5]))
def test_clip_cov_matches_reference(seed, lb, width, ratio):
    lp, old, adv, valid = batch(seed)
    adv_tok = adv[:, None].expand_as(lp)
    res = clip_cov_losses(lp, old, adv, valid, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=lb + width,
                          generator=torch.Generator().manual_seed(seed))
    cov = ref_cov(lp, adv_tok, valid)
    cand = []
    for (i, j), c in cov.items():
        _, clipped = ref_ppo(float(lp[i, j]), float(old[i, j]), float(adv[i]), 0.2)
        if not clipped and lb < c < lb + width:
            cand.append((i, j))
    limit = max(int(ratio * len(cov)), 1)
    perm = torch.randperm(len(cand), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = {cand[p] for p in perm[: min(limit, len(cand))]}
    assert {tuple(x) for x in torch.nonzero(res.selected).tolist()} == chosen
    for (i, j) in cov:
        want, _ = ref_ppo(float(lp[i, j]), float(old[i, j]), float(adv[i]), 0.2)
        assert float(res.pg_losses[i, j]) == pytest.approx(0.0 if (i, j) in chosen else want, abs=1e-12)


def test_clip_cov_gradient_is_removed_on_selected_tokens_only():
    lp, old, adv, valid = batch(3)
    lp = lp.clone().requires_grad_(True)
    res = clip_cov_losses(lp, old, adv, valid, clip_cov_ratio=0.5, clip_cov_lb=-10, clip_cov_ub=10)
    (res.pg_losses * valid).sum().backward()
    assert res.n_selected > 0
    assert (lp.grad[res.selected] == 0).all()
    free = valid & ~res.selected & ~res.ppo_clipped
    assert (lp.grad[free] != 0).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), rho=st.sampled_from([0.05, 0.2, 0.5, 0.9]))
def test_high_entropy_mask_matches_torch_quantile(seed, rho):
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(5, 9, generator=g, dtype=F64) * 3
    valid = torch.rand(5, 9, generator=g) < 0.8
    valid[0, 0] = True
    got = high_entropy_mask(h, valid, rho=rho)
    thr = float(torch.quantile(h.float()[valid].double(), 1 - rho))
    want = valid & (h.float().double() >= thr)
    assert torch.equal(got, want)
    n = int(valid.sum())
    assert int(got.sum()) >= math.floor(rho * n) - 1


def test_high_entropy_mask_edges():
    h = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5]])
    v = torch.ones(1, 5, dtype=torch.bool)
    assert high_entropy_mask(h, v, rho=0.2).tolist() == [[False, False, False, False, True]]
    assert high_entropy_mask(h, v, rho=1.0).all()
    assert not high_entropy_mask(h, torch.zeros(1, 5, dtype=torch.bool)).any()
    assert high_entropy_mask(h[:, :0], v[:, :0]).shape == (1, 0)


def test_unlikeliness_hand_case_and_reference():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F64)
    lp = torch.tensor([-0.5, -3.0, -0.1, -1.0], dtype=F64)
    # ranks (0 = least likely): [2, 0, 3, 1]; score * (1 - 0.25 * rank / 4)
    assert unlikeliness_scores(scores, lp, 4).tolist() == [1 - 0.125, 1.0, 0.0, 1 - 0.0625]
    g = torch.Generator().manual_seed(0)
    s, l = (torch.rand(12, generator=g, dtype=F64) > 0.5).double(), torch.randn(12, generator=g, dtype=F64)
    got = unlikeliness_scores(s, l, 3, rank_penalty=0.4)
    for grp in range(4):
        sl = slice(3 * grp, 3 * grp + 3)
        for i, (si, li) in enumerate(zip(s[sl].tolist(), l[sl].tolist())):
            rank = sum(lj < li for lj in l[sl].tolist())
            assert float(got[3 * grp + i]) == pytest.approx(si * (1 - 0.4 * rank / 3), abs=1e-15)


def test_entropy_bonus_value_and_gradient():
    h = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64, requires_grad=True)
    v = torch.tensor([[True, True, False]])
    out = entropy_bonus(h, v, coef=0.1)
    assert float(out.detach()) == pytest.approx(-0.1 * 1.5)
    out.backward()
    assert h.grad.tolist() == [[-0.05, -0.05, 0.0]]
    assert float(entropy_bonus(h.detach()[:, :0], v[:, :0], coef=0.1)) == 0.0


def test_empty_batch_is_a_no_op():
    lp, old, adv, _ = batch(0)
    none = torch.zeros_like(lp, dtype=torch.bool)
    for fn in (clip_cov_losses, kl_cov_losses):
        res = fn(lp, old, adv, none)
        assert res.n_valid == 0 and res.n_selected == 0 and not res.selected.any() and res.selected_frac == 0.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda b: clip_cov_losses(*b, clip_cov_ratio=0), "clip_cov_ratio"),
        (lambda b: clip_cov_losses(*b, clip_cov_lb=2, clip_cov_ub=1), "clip_cov_lb"),
        (lambda b: kl_cov_losses(*b, kl_cov_ratio=1.5), "kl_cov_ratio"),
        (lambda b: kl_cov_losses(*b, ppo_kl_coef=-1), "ppo_kl_coef"),
        (lambda b: kl_cov_losses(b[0], b[1][:, :3], b[2], b[3]), "old_log_prob"),
        (lambda b: kl_cov_losses(b[0], b[1], b[2][:2], b[3]), "advantages"),
        (lambda b: high_entropy_mask(-b[0], b[3], rho=0), "rho"),
        (lambda b: unlikeliness_scores(b[2], b[2], 4), "group_size"),
        (lambda b: unlikeliness_scores(b[2], b[2], 3, rank_penalty=2), "rank_penalty"),
        (lambda b: entropy_bonus(-b[0], b[3], coef=math.nan), "coef"),
        (lambda b: ppo_clip_losses(b[0], b[1], b[2], clip_ratio_low=-0.1), "clip_ratio_low"),
    ],
)
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(batch(1))


def test_integer_log_prob_is_a_type_error():
    lp, old, adv, valid = batch(1)
    with pytest.raises(TypeError, match="log_prob"):
        kl_cov_losses(lp.long(), old, adv, valid)


def test_nan_in_valid_log_prob_raises():
    lp, old, adv, valid = batch(2)
    lp[0, 0] = math.nan
    with pytest.raises(ValueError, match="log_prob"):
        kl_cov_losses(lp, old, adv, valid)


# --------------------------------------------------------------------- distributed: 2 ranks == 1 process

ROWS = [2, 4]


def _all(group):
    lp, old, adv, valid = batch(77, b=6, t=9)
    h = -lp  # any non-negative per-token value
    if group is not None:
        r = dist.get_rank()
        lo, hi = sum(ROWS[:r]), sum(ROWS[: r + 1])
        lp, old, adv, valid, h = lp[lo:hi], old[lo:hi], adv[lo:hi], valid[lo:hi], h[lo:hi]
    kl = kl_cov_losses(lp, old, adv, valid, kl_cov_ratio=0.1, ppo_kl_coef=0.5, process_group=group)
    cc = clip_cov_losses(lp, old, adv, valid, clip_cov_ratio=1.0, clip_cov_lb=-100, clip_cov_ub=100, process_group=group)
    fork = high_entropy_mask(h, valid, rho=0.2, process_group=group)
    bonus = entropy_bonus(h, valid, coef=1.0, process_group=group)
    return kl, cc, fork, bonus


def _worker(rank: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        kl, cc, fork, bonus = _all(dist.group.WORLD)
        torch.save({"kl": kl.selected, "kl_loss": kl.pg_losses, "cc": cc.selected, "cc_n": cc.n_selected,
                    "fork": fork, "bonus": bonus}, f"{path}/r{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"r{r}.pt") for r in range(2)]
    kl, cc, fork, bonus = _all(None)
    assert torch.equal(torch.cat([p["kl"] for p in parts]), kl.selected)
    assert torch.allclose(torch.cat([p["kl_loss"] for p in parts]), kl.pg_losses, rtol=1e-12)
    assert torch.equal(torch.cat([p["fork"] for p in parts]), fork)
    # clip-cov with every candidate drawn (ratio 1): the random draw cannot matter
    assert torch.equal(torch.cat([p["cc"] for p in parts]), cc.selected) and parts[0]["cc_n"] == cc.n_selected
    assert float(sum(p["bonus"] for p in parts)) == pytest.approx(float(bonus), rel=1e-12)
