"""entropy_discriminator.baselines against verl 0.9.1's own functions on random float64 batches.

Clip-Cov and KL-Cov: ``verl.trainer.ppo.core_algos.compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``
with a real ``FSDPActorConfig``; the token-mean loss, its gradient with respect to ``log_prob`` and the clip
fraction must agree (Clip-Cov's random draw is made equal by seeding the global RNG before each call: ours uses
``torch.randperm`` over the candidates in the same order).  Entropy bonus: ``-entropy_coeff * agg_loss(entropy,
token-mean)`` as verl's actor adds it.  Nothing is stubbed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from entropy_discriminator.baselines import (
    clip_cov_losses,
    entropy_bonus,
    kl_cov_losses,
)

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
actor_cfg = pytest.importorskip("verl.workers.config.actor")
verl_F = pytest.importorskip("verl.utils.torch_functional")

F64 = torch.float64


def _batch(seed: int, b: int, t: int, adv_scale: float):
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(b, t, generator=g, dtype=F64) * 5
    old = log_prob + 0.25 * torch.randn(b, t, generator=g, dtype=F64)
    adv = (torch.randn(b, 1, generator=g, dtype=F64) * adv_scale).expand(b, t).clone()
    mask = torch.ones(b, t, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask[torch.arange(t)[None, :] >= lengths[:, None]] = 0.0
    return log_prob, old, adv, mask


def _config(**policy_loss):
    return actor_cfg.FSDPActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        policy_loss=actor_cfg.PolicyLossConfig(**policy_loss),
    )


def _ours_token_mean(pg: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (pg * mask).sum() / mask.sum()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    ratio=st.sampled_from([2e-4, 0.02, 0.1, 0.4]),
    lb=st.sampled_from([-0.5, 0.0, 1.0]),
    width=st.sampled_from([0.5, 4.0]),
    adv_scale=st.sampled_from([1.0, 3.0]),
)
def test_clip_cov_equals_verl(seed, ratio, lb, width, adv_scale):
    log_prob, old, adv, mask = _batch(seed, 6, 11, adv_scale)
    cfg = _config(loss_mode="clip_cov", clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=lb + width)
    lp_v = log_prob.clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss_v, metrics = core_algos.compute_policy_loss_clip_cov(old, lp_v, adv, mask, "token-mean", cfg)
    loss_v.backward()

    lp_o = log_prob.clone().requires_grad_(True)
    torch.manual_seed(seed)
    res = clip_cov_losses(lp_o, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=ratio,
                          clip_cov_lb=lb, clip_cov_ub=lb + width)
    loss_o = _ours_token_mean(res.pg_losses, mask)
    loss_o.backward()

    assert float(loss_o.detach()) == pytest.approx(float(loss_v.detach()), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(lp_o.grad, lp_v.grad, rtol=1e-10, atol=1e-12)
    assert res.selected_frac == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-6, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    ratio=st.sampled_from([2e-4, 2e-3, 0.05, 0.3]),
    coef=st.sampled_from([0.1, 1.0]),
    adv_scale=st.sampled_from([1.0, 3.0]),
)
def test_kl_cov_equals_verl(seed, ratio, coef, adv_scale):
    log_prob, old, adv, mask = _batch(seed, 5, 13, adv_scale)
    cfg = _config(loss_mode="kl_cov", kl_cov_ratio=ratio, ppo_kl_coef=coef)
    lp_v = log_prob.clone().requires_grad_(True)
    loss_v, _ = core_algos.compute_policy_loss_kl_cov(old, lp_v, adv, mask, "token-mean", cfg)
    loss_v.backward()

    lp_o = log_prob.clone().requires_grad_(True)
    res = kl_cov_losses(lp_o, old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    loss_o = _ours_token_mean(res.pg_losses, mask)
    loss_o.backward()

    assert float(loss_o.detach()) == pytest.approx(float(loss_v.detach()), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(lp_o.grad, lp_v.grad, rtol=1e-10, atol=1e-12)
    assert res.n_selected == max(1, int(int(mask.sum()) * ratio))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), coef=st.sampled_from([1e-3, 0.01, 0.5]))
def test_entropy_bonus_equals_verl_entropy_term(seed, coef):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 9, 17, generator=g, dtype=F64) * 2
    _, _, _, mask = _batch(seed, 4, 9, 1.0)
    ent_v = verl_F.entropy_from_logits(logits)
    verl_term = -coef * core_algos.agg_loss(loss_mat=ent_v, loss_mask=mask, loss_agg_mode="token-mean")
    assert float(entropy_bonus(ent_v, mask, coef=coef)) == pytest.approx(float(verl_term), rel=1e-12)
