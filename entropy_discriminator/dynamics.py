"""The paper's first-order entropy-change predictions (Theorems 1-2, Corollaries 4 and 4.1).

The step size ``eta`` (``alpha = eta * r * A``) is measured on the temperature-scaled logits ``u = z / T`` that
:func:`~entropy_discriminator.token_stats` reads with ``temperature=T``.  In the tabular case (every token owns its
raw logits ``z``), plain SGD at learning rate ``lambda`` on ``L = -(1/N) sum_t A_t log softmax(z_t / T)[k_t]`` moves
``z_t`` by ``(lambda / (N T)) A_t (e_k - p_t)``, hence ``u_t`` by ``(lambda / (N T^2)) A_t (e_k - p_t)``:
``eta = lambda / (N * T^2)``.  For a network ``eta`` is an effective rate.
"""

from __future__ import annotations

import torch

from ._checks import (DataChecks, broadcast_advantages, one_of, real_number, real_or_tensor, require_float,
                      require_shape, valid_mask, valid_within)
from .distributed import Group, reduce_or_raise
from .stats import TokenStats, field_of

FORMS = ("cov", "mean")


def entropy_change_logit(eps: torch.Tensor | float, s_star: torch.Tensor) -> torch.Tensor:
    """Theorem 1: raising the sampled token's logit by ``eps`` changes entropy by ``-eps * S*``.

    ``ΔH = -eps * S* + O(eps^2)`` for ``δz = eps * e_k``; element-wise.  ``eps``: a real number (or 0-d tensor) or
    a tensor broadcasting to ``s_star``'s shape; the result has that shape.
    """
    require_float("s_star", s_star)
    eps = real_or_tensor("eps", eps, s_star.shape, "s_star")
    return -eps * s_star


def entropy_change_step(alpha: torch.Tensor | float, s_star: torch.Tensor, s_expected: torch.Tensor) -> torch.Tensor:
    """Theorem 2: a policy-gradient step ``δz = alpha (e_k - p)``, ``alpha = lr * r * A``.

    ``ΔH = -alpha * (S* - E_p[S]) + O(alpha^2)``; element-wise.  ``s_expected`` has ``s_star``'s shape; ``alpha``:
    a real number (or 0-d tensor) or a tensor broadcasting to it (per sequence: ``alpha[:, None]``).
    """
    require_float("s_star", s_star)
    require_float("s_expected", s_expected)
    require_shape("s_expected", s_expected, s_star.shape, "s_star")
    alpha = real_or_tensor("alpha", alpha, s_star.shape, "s_star")
    return -alpha * (s_star - s_expected)


def batch_entropy_change(
    advantages: torch.Tensor, s_centered: torch.Tensor | TokenStats, valid: torch.Tensor, *, lr: float,
    ratio: torch.Tensor | None = None, form: str = "cov", process_group: Group = None,
) -> float:
    """First-order change of the batch-mean token entropy after one step on this batch.

    * ``form="cov"`` (Corollaries 4 and 4.1): ``-lr * Cov_B(A, r * S_c)``, the population covariance over the
      valid tokens of the whole batch (across ``process_group``).
    * ``form="mean"`` (eq. 23, before Corollary 2 drops ``E_B[A] E_B[r S_c]``): ``-lr * E_B[A * r * S_c]``.

    Args:
        advantages: ``[B]`` per sequence or per token with ``s_centered``'s shape.
        s_centered: ``S_c = S* - E_p[S]``, ``[B, T]`` (or any shape), or the ``TokenStats`` it comes from (then only
            positions valid in both ``valid`` and its ``valid`` count).
        valid: bool or 0/1 tensor of ``s_centered``'s shape.
        lr: the step size ``eta`` in ``alpha = eta * r * A`` on the temperature-scaled logits, a finite real >= 0
            (``lambda / (N * T^2)`` in the tabular case, module docstring; for a network an effective rate).
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
        a = broadcast_advantages(advantages, s_centered.shape).to(s_centered.device)
        y = s_centered.to(torch.float64)
        if ratio is not None:
            require_float("ratio", ratio)
            require_shape("ratio", ratio, s_centered.shape, "s_centered")
            checks.finite("ratio", ratio, valid_b)
            checks.count("ratio must be >= 0 (pi / pi_sample); negative at {} valid position(s)",
                         ((ratio < 0) & valid_b).sum())
            y = y * ratio.to(torch.float64)
        checks.finite("s_centered", s_centered, valid_b)
        terms = covariance_terms(a, y, valid_b)
        checks.finite("advantages", a, valid_b, witness=terms[1])
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


def covariance_terms(a: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Local float64 ``[count, sum a, sum y, sum a*y]`` over ``valid`` (to be summed over ranks)."""
    zero = torch.zeros((), dtype=torch.float64, device=a.device)
    a = torch.where(valid, a.to(torch.float64), zero)
    y = torch.where(valid, y.to(torch.float64), zero)
    return torch.stack([valid.sum().to(torch.float64), a.sum(), y.sum(), (a * y).sum()])
