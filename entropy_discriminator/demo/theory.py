"""Does the first-order law predict the realised per-batch entropy change?  The tabular case.

Every token owns its logits ``z_t`` (the paper's assumption): SGD at learning rate ``lambda`` on ``L = -(1/N) sum_t
A_t log p_t(k_t)`` moves each row by ``dz_t = (lambda/N) A_t (e_k - p_t)``, Theorem 2 with ``alpha_t = eta A_t``,
``eta = lambda/N``; averaged over the batch, Corollary 4: ``dH_B = -eta Cov_B(A, S_c)`` up to ``O(eta^2)``.  The
network case is measured inside :func:`~entropy_discriminator.demo.train.run_arm` (``pred_dH`` vs ``real_dH``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import batch_entropy_change, token_stats
from .model import TinyGPT
from .task import AdditionTask
from .train import group_advantages, pearson, sign_agreement


@dataclass
class Agreement:
    """Per-step predicted and realised ``dH_B`` and their agreement: ``slope`` (least squares ``realised ~ slope *
    predicted`` through 0; 1: the right size), ``corr`` (Pearson) and ``sign`` (share of steps with the same sign)."""

    predicted: list[float]
    realised: list[float]

    @property
    def corr(self) -> float:
        return pearson(self.predicted, self.realised)

    @property
    def sign(self) -> float:
        return sign_agreement(self.predicted, self.realised)

    @property
    def slope(self) -> float:
        den = sum(p * p for p in self.predicted)
        return sum(p * r for p, r in zip(self.predicted, self.realised)) / den if den > 0 else math.nan


def tabular_start(
    model: TinyGPT, task: AdditionTask, n_prompts: int, *, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Starting point of :func:`tabular_check` from a network: its float64 CPU response logits ``[P, T, V]`` on
    ``n_prompts`` training prompts (one answer sampled at temperature 1) and their operands ``a, b`` (int64 ``[P]``)."""
    a, b = task.sample(n_prompts, torch.Generator().manual_seed(seed), split="train")
    seq = model.generate(task.prompts(a, b).to(device), task.response_len, temperature=1.0,
                         generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        init = model.response_logits(seq, task.prompt_len).double().cpu()
    return init, a, b


def tabular_check(task: AdditionTask, *, init_logits: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group_size: int,
                  steps: int, step_size: float, seed: int) -> Agreement:
    """GRPO on a logit table; Corollary 4's prediction vs the realised batch-entropy change per step.  ``init_logits``
    ``[P, T, V]`` (copied ``group_size`` times, float64) for the prompts of operands ``a, b`` (int64 ``[P]``);
    ``step_size``: ``eta`` of Theorem 2 (SGD at ``lambda = eta * N``); ``seed`` seeds the sampling.  ``ValueError``
    when ``init_logits`` is not ``[P, T, V]`` or ``step_size`` is not finite and > 0."""
    if init_logits.dim() != 3 or init_logits.shape[:2] != (len(a), task.response_len):
        raise ValueError(f"init_logits must be [P={len(a)}, T={task.response_len}, V], got {tuple(init_logits.shape)}")
    if not (step_size > 0 and math.isfinite(step_size)):
        raise ValueError(f"step_size must be a finite number > 0, got {step_size}")
    gen = torch.Generator().manual_seed(seed)
    z = init_logits.detach().to("cpu", torch.float64).repeat_interleave(group_size, 0).requires_grad_(True)
    a_rep, b_rep = a.repeat_interleave(group_size).cpu(), b.repeat_interleave(group_size).cpu()
    out = Agreement([], [])
    for _ in range(steps):
        with torch.no_grad():
            probs = torch.softmax(z, -1)
            k = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=gen).view(z.shape[:2])
        adv = group_advantages(task.rewards(a_rep, b_rep, k), group_size).double()
        before = token_stats(z.detach(), k)
        n = float(before.valid.sum())
        out.predicted.append(batch_entropy_change(adv, before.s_centered, before.valid, lr=step_size, form="cov"))
        logp = torch.log_softmax(z, -1).gather(-1, k[..., None])[..., 0]
        loss = -(adv[:, None] * logp).sum() / n
        (grad,) = torch.autograd.grad(loss, z)
        with torch.no_grad():
            z -= (step_size * n) * grad
        after = token_stats(z.detach(), k)
        out.realised.append(float((after.entropy - before.entropy)[before.valid].mean()))
    return out
