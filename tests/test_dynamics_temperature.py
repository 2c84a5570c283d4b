"""Corollary 4's step size under a sampling temperature: plain SGD at learning rate ``lambda`` on raw logits
``z`` with the policy ``softmax(z / T)`` has ``eta = lambda / (N * T^2)`` (the ``dynamics`` module docstring).

A tabular softmax experiment (every token owns its logits, float64): one SGD step on the GRPO loss, then the
realised change of the batch-mean entropy against :func:`batch_entropy_change` with that ``eta``.
"""

from __future__ import annotations

import pytest
import torch

import entropy_discriminator as ed
from entropy_discriminator import dynamics


def realised_and_predicted(temperature: float, seed: int, *, lam: float) -> tuple[float, float, int]:
    """One SGD step at learning rate ``lam`` on ``-(1/N) sum A log softmax(z / T)[k]``: the realised ``dH_B``,
    ``batch_entropy_change(..., lr=1)`` (the prediction per unit ``eta``) and ``N``."""
    gen = torch.Generator().manual_seed(seed)
    batch, length, vocab = 32, 4, 12
    z = (2.0 * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64)).requires_grad_(True)
    with torch.no_grad():
        probs = torch.softmax(z / temperature, -1)
        labels = torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).view(batch, length)
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    adv -= adv.mean()  # per sequence, equal lengths: the token mean of A is 0, so Cov_B = E_B[A S_c]
    valid = torch.ones(batch, length, dtype=torch.bool)
    before = ed.token_stats(z.detach(), labels, temperature=temperature)
    n = batch * length
    per_unit_eta = ed.batch_entropy_change(adv, before.s_centered, valid, lr=1.0)

    logp = torch.log_softmax(z / temperature, -1).gather(-1, labels[..., None])[..., 0]
    loss = -(adv[:, None] * logp).sum() / n
    (grad,) = torch.autograd.grad(loss, z)
    with torch.no_grad():
        z_after = z - lam * grad
    after = ed.token_stats(z_after, labels, temperature=temperature)
    return float((after.entropy - before.entropy).mean()), per_unit_eta, n


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sgd_step_size_is_lambda_over_n_t_squared(temperature: float, seed: int) -> None:
    n_tokens = 32 * 4
    lam = 1e-5 * n_tokens * temperature**2  # eta = 1e-5 in scaled-logit units: the O(eta^2) rest is negligible
    realised, per_unit_eta, n = realised_and_predicted(temperature, seed, lam=lam)
    assert n == n_tokens and abs(per_unit_eta) > 1e-4  # a clear signal to compare against
    right = realised / (per_unit_eta * lam / (n * temperature**2))
    wrong = realised / (per_unit_eta * lam / n)  # the T = 1 rule, lambda / N
    assert right == pytest.approx(1.0, abs=1e-2)  # 40 draws per T: at most 4e-3 off
    assert wrong == pytest.approx(1.0 / temperature**2, rel=1e-2)  # 4 at T = 0.5


def test_docstrings_state_the_temperature_rule() -> None:
    assert "lambda / (N * T^2)" in dynamics.__doc__
    assert "lambda / (N * T^2)" in ed.batch_entropy_change.__doc__
