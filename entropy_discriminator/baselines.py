"""Peer entropy controls, for comparison with Clip_B / Clip_V on the same batches.

* :func:`clip_cov_losses`, :func:`kl_cov_losses`: Clip-Cov and KL-Cov (Cui et al. 2025), verl 0.9.1's semantics;
* :func:`high_entropy_mask`: forking tokens (Wang et al. 2025), as TRL's ``top_entropy_quantile``;
* :func:`unlikeliness_scores`: rewarding the unlikely (He et al. 2025), the rank penalty of their release;
* :func:`entropy_bonus`: ``-coef * token-mean entropy`` added to the loss (verl's ``actor.entropy_coeff``).

Conventions as :func:`~entropy_discriminator.clip_b_mask`: per-token tensors are ``[B, T]`` (any common shape),
``valid`` is the bool / 0-1 response mask, advantages are ``[B]`` or per token, and every batch statistic is global
over ``process_group``.  An empty batch is a no-op.  Losses are per token: the caller applies its ``loss_agg_mode``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import as_valid_mask, broadcast_advantages, real_number, require_finite, require_float, require_shape
from .distributed import Group, all_reduce, global_top_k, kth_smallest, rank_offset, top_k_mask
from .dynamics import covariance_terms

#: verl 0.9.1's defaults (``verl/workers/config/actor.py``, ``PolicyLossConfig``).
VERL_CLIP_COV_RATIO = 2e-4
VERL_CLIP_COV_LB = 1.0
VERL_CLIP_COV_UB = 5.0
VERL_KL_COV_RATIO = 2e-4
VERL_PPO_KL_COEF = 0.1


@dataclass(frozen=True)
class CovLossResult:
    """Per-token losses of a covariance-based control and the tokens it acted on: ``pg_losses`` (``log_prob``'s shape
    and dtype, with the gradient), ``selected`` (bool: the tokens whose gradient Clip-Cov removed or that KL-Cov
    penalised), ``ppo_clipped`` (bool: the PPO clip was active; Clip-Cov only).  Counts are global."""

    pg_losses: torch.Tensor
    selected: torch.Tensor
    ppo_clipped: torch.Tensor
    n_valid: int
    n_selected: int

    @property
    def selected_frac(self) -> float:
        """Selected share of the valid tokens (0 for an empty batch)."""
        return self.n_selected / self.n_valid if self.n_valid else 0.0


def ppo_clip_losses(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *,
                    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, ``r = exp(logp - old)``.

    Shapes ``[B, T]`` (``advantages`` may be ``[B]``).  Returns ``(pg_losses, clipped)``: the losses in ``log_prob``'s
    dtype and the bool mask where the clipped branch is the larger one (``-A clip(r) > -A r``).
    """
    require_float("log_prob", log_prob)
    require_shape("old_log_prob", old_log_prob, log_prob.shape, "log_prob")
    real_number("clip_ratio_low", clip_ratio_low, finite=False, minimum=0)  # inf: no clip
    real_number("clip_ratio_high", clip_ratio_high, finite=False, minimum=0)
    adv = broadcast_advantages(advantages, log_prob.shape).to(log_prob.device, log_prob.dtype)
    ratio = torch.exp(log_prob - old_log_prob)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    return torch.maximum(pg1, pg2), pg2 > pg1


def _token_covariance(adv: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor,
                      group: Group) -> tuple[torch.Tensor, int]:
    """``(A - mean_B A) (logp - mean_B logp)`` per token in float64 (means over valid tokens, global), and n_valid."""
    n, s_a, s_l, _ = all_reduce(covariance_terms(adv, log_prob.detach(), valid), group).tolist()
    mean_a, mean_l = (s_a / n, s_l / n) if n > 0 else (0.0, 0.0)
    return (adv.double() - mean_a) * (log_prob.detach().double() - mean_l), int(n)


def _checked(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor):
    require_float("log_prob", log_prob)
    require_float("old_log_prob", old_log_prob)
    require_shape("old_log_prob", old_log_prob, log_prob.shape, "log_prob")
    valid = as_valid_mask(valid, log_prob.shape)
    adv = broadcast_advantages(advantages, log_prob.shape).to(log_prob.device)
    require_finite("log_prob", log_prob.detach(), valid)
    require_finite("old_log_prob", old_log_prob, valid)
    require_finite("advantages", adv, valid)
    return adv, valid


def clip_cov_losses(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
                    *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                    clip_cov_ratio: float = VERL_CLIP_COV_RATIO, clip_cov_lb: float = VERL_CLIP_COV_LB,
                    clip_cov_ub: float = VERL_CLIP_COV_UB, generator: torch.Generator | None = None,
                    process_group: Group = None) -> CovLossResult:
    """Clip-Cov (verl 0.9.1 ``compute_policy_loss_clip_cov``), per token.

    ``cov_t = (A_t - mean_B A) (logp_t - mean_B logp)`` over the valid tokens; of the valid tokens with
    ``clip_cov_lb < cov_t < clip_cov_ub`` where the PPO clip is not active, ``max(floor(clip_cov_ratio * N), 1)``
    (all if fewer) drawn uniformly at random lose their loss (times 0); elsewhere PPO's (:func:`ppo_clip_losses`).
    Without ``process_group`` the draw is ``torch.randperm(n_candidates, generator=generator)`` in row-major order
    (verl's); with a group the globally largest uniform keys win.  Shapes ``[B, T]``, ``advantages`` ``[B]`` or
    ``[B, T]``.
    """
    adv, valid = _checked(log_prob, old_log_prob, advantages, valid)
    real_number("clip_cov_ratio", clip_cov_ratio, above=0, maximum=1)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb ({clip_cov_lb}) must be < clip_cov_ub ({clip_cov_ub})")
    pg, clipped = ppo_clip_losses(log_prob, old_log_prob, adv, clip_ratio_low=clip_ratio_low,
                                  clip_ratio_high=clip_ratio_high)
    clipped = clipped & valid
    cov, n = _token_covariance(adv, log_prob, valid, process_group)
    cand = valid & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    limit = max(int(clip_cov_ratio * n), 1)
    idx = torch.nonzero(cand.reshape(-1)).reshape(-1)
    if process_group is None:
        won = torch.randperm(len(idx), generator=generator)[:limit].to(idx.device)
    else:
        keys = torch.rand(len(idx), generator=generator, dtype=torch.float64).to(idx.device)
        won = global_top_k(keys, idx + rank_offset(cand.numel(), process_group, idx.device), limit, process_group)
    selected = torch.zeros_like(cand.reshape(-1)).index_fill_(0, idx[won], True).reshape(cand.shape)
    n_sel = int(all_reduce(selected.sum().to(torch.float64), process_group))
    return CovLossResult(pg_losses=pg * (~selected).to(pg.dtype), selected=selected, ppo_clipped=clipped, n_valid=n,
                         n_selected=n_sel)


def kl_cov_losses(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, *,
                  kl_cov_ratio: float = VERL_KL_COV_RATIO, ppo_kl_coef: float = VERL_PPO_KL_COEF,
                  process_group: Group = None) -> CovLossResult:
    """KL-Cov (verl 0.9.1 ``compute_policy_loss_kl_cov``), per token: ``-A_t r_t`` (no PPO clip), plus
    ``ppo_kl_coef * |logp_t - old_logp_t|`` on the ``max(1, floor(kl_cov_ratio * N))`` valid tokens with the largest
    ``cov_t`` (as in :func:`clip_cov_losses`; ties by row-major position).  ``r_t = exp(logp_t - old_logp_t)``; shapes
    as :func:`clip_cov_losses`; the losses have ``log_prob``'s dtype and carry the gradient.
    """
    adv, valid = _checked(log_prob, old_log_prob, advantages, valid)
    real_number("kl_cov_ratio", kl_cov_ratio, above=0, maximum=1)
    real_number("ppo_kl_coef", ppo_kl_coef, minimum=0)
    diff = log_prob - old_log_prob
    a = adv.to(log_prob.dtype)
    pg = -a * torch.exp(diff)
    cov, n = _token_covariance(adv, log_prob, valid, process_group)
    selected = top_k_mask(cov, valid, max(1, int(n * kl_cov_ratio)) if n > 0 else 0, process_group)
    pg = torch.where(selected, pg + ppo_kl_coef * diff.abs(), pg)
    n_sel = int(all_reduce(selected.sum().to(torch.float64), process_group))
    return CovLossResult(pg_losses=pg, selected=selected, ppo_clipped=torch.zeros_like(selected), n_valid=n,
                         n_selected=n_sel)


def high_entropy_mask(entropy: torch.Tensor, valid: torch.Tensor, *, rho: float = 0.2,
                      process_group: Group = None) -> torch.Tensor:
    """Forking tokens: bool mask of the valid tokens whose entropy is at least the global ``1 - rho`` quantile.

    As TRL 1.16's ``top_entropy_quantile = rho``: ``torch.quantile`` (linear interpolation) of the float32 entropies of
    every valid token on every rank, its two order statistics found exactly without gathering (:func:`kth_smallest`).
    ``rho = 1`` keeps every valid token; an empty batch gives an all-False mask.  ``entropy``, ``valid`` ``[B, T]``
    (any common shape); returns bool of that shape.
    """
    require_float("entropy", entropy)
    valid = as_valid_mask(valid, entropy.shape)
    real_number("rho", rho, above=0, maximum=1)
    require_finite("entropy", entropy, valid)
    n = int(all_reduce(valid.sum().to(torch.float64), process_group))
    if n == 0:
        return torch.zeros_like(valid)
    if rho == 1:
        return valid.clone()
    pos = (1.0 - rho) * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    v_lo, v_hi = kth_smallest(entropy.detach(), [lo + 1, hi + 1], process_group, where=valid)
    threshold = v_lo + (pos - lo) * (v_hi - v_lo)
    return valid & (entropy.detach().float().double() >= threshold)


def unlikeliness_scores(scores: torch.Tensor, seq_log_prob: torch.Tensor, group_size: int, *,
                        rank_penalty: float = 0.25) -> torch.Tensor:
    """Rewarding the unlikely (He et al. 2025), the rule of their release (``ray_lean_trainer._compute_advantages``):
    ``score_i <- score_i * (1 - rank_penalty * rank_i / G)``, ``rank_i`` in {0, .., G-1} ordering each group of
    ``G = group_size`` consecutive samples by mean token log-probability (0 = least likely; ties by position).

    ``scores`` and ``seq_log_prob`` float ``[B]``, ``B`` a multiple of ``group_size`` (groups must not straddle ranks);
    returns ``[B]`` in ``scores``' dtype, before GRPO's group normalisation.
    """
    require_float("scores", scores)
    require_float("seq_log_prob", seq_log_prob)
    if scores.dim() != 1 or seq_log_prob.shape != scores.shape:
        raise ValueError(f"scores and seq_log_prob must be 1-D of equal shape, got {tuple(scores.shape)} and "
                         f"{tuple(seq_log_prob.shape)}")
    if group_size < 1 or len(scores) % group_size:
        raise ValueError(f"group_size must be >= 1 and divide the batch ({len(scores)}), got {group_size}")
    real_number("rank_penalty", rank_penalty, minimum=0, maximum=1)
    require_finite("seq_log_prob", seq_log_prob)
    lp = seq_log_prob.detach().view(-1, group_size)
    order = torch.argsort(lp, dim=1, stable=True)
    rank = torch.argsort(order, dim=1, stable=True).to(scores.dtype)
    return (scores.view(-1, group_size) * (1 - rank_penalty * rank / group_size)).reshape(-1)


def entropy_bonus(entropy: torch.Tensor, valid: torch.Tensor, *, coef: float,
                  process_group: Group = None) -> torch.Tensor:
    """``-coef * sum_t H_t / N`` over the valid tokens, ``N`` the global valid count: add it to the loss.

    ``entropy`` ``[B, T]`` must carry the gradient; returns a 0-d tensor in its dtype (0 for an empty batch).  With
    gradients averaged over data-parallel ranks, multiply by the world size as verl's ``token-mean`` does.
    """
    require_float("entropy", entropy)
    valid = as_valid_mask(valid, entropy.shape)
    real_number("coef", coef)
    n = float(all_reduce(valid.sum().to(torch.float64), process_group))
    total = torch.where(valid, entropy, 0.0).sum()
    return -coef * total / max(n, 1.0)


__all__ = ["CovLossResult", "clip_cov_losses", "entropy_bonus", "high_entropy_mask", "kl_cov_losses", "ppo_clip_losses",
           "unlikeliness_scores"]
