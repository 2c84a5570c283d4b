"""The paper's first-order entropy-change predictions (Theorems 1-2, Corollaries 4 and 4.1).

``eta`` (``alpha = eta * r * A``) is measured on the temperature-scaled logits ``u = z / T`` of
:func:`~entropy_discriminator.token_stats`: for plain SGD at rate ``lambda`` on tabular logits
``eta = lambda / (N * T^2)``; for a network ``eta`` is an effective rate (docs/law.md).
"""

from __future__ import annotations

import torch

from ._checks import (DataChecks, broadcast_advantages, one_of, real_number, real_or_tensor, require_float,
                      require_shape, valid_mask, valid_within)
from .distributed import Group, reduce_or_raise
from .stats import TokenStats, field_of

FORMS = ("cov", "mean")


def entropy_change_logit(eps: torch.Tensor | float, s_star: torch.Tensor) -> torch.Tensor:
    """Theorem 1: raising the sampled token's logit by ``eps`` changes entropy by ``ΔH = -eps * S* + O(eps^2)``.

    Element-wise; ``eps``: a real number (or 0-d tensor) or a tensor broadcasting to ``s_star``'s shape, the result's.
    """
    require_float("s_star", s_star)
    eps = real_or_tensor("eps", eps, s_star.shape, "s_star")
    return -eps * s_star


def entropy_change_step(alpha: torch.Tensor | float, s_star: torch.Tensor, s_expected: torch.Tensor) -> torch.Tensor:
    """Theorem 2: a policy-gradient step ``δz = alpha (e_k - p)``, ``alpha = lr * r * A``, changes entropy by
    ``ΔH = -alpha * (S* - E_p[S]) + O(alpha^2)``, element-wise; ``s_expected`` has ``s_star``'s shape, ``alpha`` is a
    real number (or 0-d tensor) or a tensor broadcasting to it (per sequence: ``alpha[:, None]``)."""
    require_float("s_star", s_star)
    require_float("s_expected", s_expected)
    require_shape("s_expected", s_expected, s_star.shape, "s_star")
    alpha = real_or_tensor("alpha", alpha, s_star.shape, "s_star")
    return -alpha * (s_star - s_expected)


def batch_entropy_change(advantages: torch.Tensor, s_centered: torch.Tensor | TokenStats, valid: torch.Tensor, *,
                         lr: float, ratio: torch.Tensor | None = None, form: str = "cov",
                         process_group: Group = None) -> float:
    """First-order change of the batch-mean token entropy after one step on this batch: ``-lr * Cov_B(A, r * S_c)``
    (``form="cov"``, Corollaries 4 and 4.1, the population covariance over the valid tokens of the whole group) or
    ``-lr * E_B[A * r * S_c]`` (``form="mean"``, eq. 23).

    Args:
        advantages: ``[B]`` per sequence or per token with ``s_centered``'s shape.
        s_centered: ``S_c = S* - E_p[S]``, ``[B, T]`` (or any shape), or the ``TokenStats`` it comes from (then only
            positions valid in both ``valid`` and its ``valid`` count).
        valid: bool or 0/1 tensor of ``s_centered``'s shape.
        lr: the step size ``eta``, a finite real >= 0 (``lambda / (N * T^2)`` in the tabular case, module docstring).
        ratio: importance ratio ``r = pi / pi_sample`` per token, finite and >= 0 (None: on-policy, r = 1).
        process_group: reduce the sums over this group; a bad value on one rank raises on every rank.

    Returns the predicted ``ΔH_B`` as a Python float (0.0 for an empty batch).
    """
    s_centered, within = field_of(s_centered, "s_centered")

    def local() -> tuple[torch.Tensor, tuple[DataChecks, float]]:
        require_float("s_centered", s_centered)
        one_of("form", form, FORMS)
        eta = real_number("lr", lr, minimum=0)
        checks = DataChecks()
        valid_b = valid_mask(valid_within(valid, within), s_centered.shape, checks)
        _, _, terms = _weighted_terms(advantages, s_centered, valid_b, ratio, checks)
        return torch.cat([torch.stack(checks.witnesses()), terms]), (checks, eta)

    n_checks = 3 + 2 * (ratio is not None)
    values, (checks, eta) = reduce_or_raise(local, n_checks + 4, process_group)
    checks.verdict(values[:n_checks], process_group)
    n, s_a, s_y, s_ay = values[n_checks:]
    if n == 0:
        return 0.0
    moment = s_ay / n
    if form == "cov":
        moment -= (s_a / n) * (s_y / n)
    return -eta * moment


def _weighted_terms(advantages: torch.Tensor, s_centered: torch.Tensor, valid: torch.Tensor,
                   ratio: torch.Tensor | None, checks: DataChecks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``(A, r * S_c, their covariance_terms)``, adding the checks of ``ratio``, ``s_centered``, ``A``."""
    a = broadcast_advantages(advantages, s_centered.shape).to(s_centered.device)
    y = s_centered.to(torch.float64)
    if ratio is not None:
        require_float("ratio", ratio)
        require_shape("ratio", ratio, s_centered.shape, "s_centered")
        checks.finite("ratio", ratio, valid)
        checks.count("ratio must be >= 0 (pi / pi_sample); negative at {} valid position(s)",
                     ((ratio < 0) & valid).sum())
        y = y * ratio.to(device=y.device, dtype=torch.float64)
    checks.finite("s_centered", s_centered, valid)
    terms = covariance_terms(a, y, valid)
    checks.finite("advantages", a, valid, witness=terms[1])
    return a, y, terms


def covariance_terms(a: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Local float64 ``[count, sum a, sum y, sum a*y]`` over ``valid`` (to be summed over ranks)."""
    a = torch.where(valid, a.to(torch.float64), 0.0)
    y = torch.where(valid, y.to(torch.float64), 0.0)
    return torch.stack([valid.sum().to(torch.float64), a.sum(), y.sum(), (a * y).sum()])
