"""Clip_B and Clip_V keep-masks (paper eqs. 15-16; semantics in docs/api.md, "Mask semantics").

The first argument may be the :class:`~entropy_discriminator.TokenStats` itself: then only positions valid in both
``valid`` and ``stats.valid`` count (with a plain score tensor pass ``response_mask & stats.valid``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import (DataChecks, as_valid_mask, broadcast_advantages, exact_fraction, one_of, real_number,
                      require_float, require_tensor, valid_mask, valid_within)
from .distributed import Group, all_reduce, reduce_or_raise, top_k_mask
from .stats import TokenStats, field_of

SIDES = ("negative", "positive", "both")
MASK_MODES = ("zero_pg", "drop_token")
#: How ``max_frac`` turns into a token count (:func:`cap_limit`): ``"share"`` (ours) or ``"reference"`` (Trinity-RFT's).
CAP_RULES = ("share", "reference")
#: The default mu of both masks: the paper's Clip_B value, and where Clip_V helped in docs/reproduction/compare.
DEFAULT_MU = 2.5
#: A batch standard deviation at or below this counts as zero: every token is kept (as in the reference).
ZERO_STD = 1e-12


@dataclass(frozen=True)
class MaskResult:
    """A keep-mask and the batch statistics behind it (counts are global over the process group).

    ``keep``: bool of the scores' shape, True where the token stays (always at invalid positions); ``lower`` /
    ``upper``: thresholds in score units (``-inf`` / ``inf`` for an infinite ``mu``); ``capped``: ``max_frac`` acted.
    """

    keep: torch.Tensor
    method: str
    center: float
    std: float
    lower: float
    upper: float
    n_valid: int
    n_valid_pos: int
    n_valid_neg: int
    n_clipped: int
    n_clipped_pos: int
    n_clipped_neg: int
    capped: bool

    @property
    def clip_frac(self) -> float:
        """Clipped share of the valid tokens (0 for an empty batch)."""
        return self.n_clipped / self.n_valid if self.n_valid else 0.0


def clip_b_mask(s_star: torch.Tensor | TokenStats, advantages: torch.Tensor, valid: torch.Tensor, *,
                mu_low: float = DEFAULT_MU, mu_high: float = math.inf, sides: str = "negative",
                max_frac: float | None = None, cap_rule: str = "share", process_group: Group = None) -> MaskResult:
    """Clip_B: keep token t when ``-mu_low*sigma <= S*_t - mean(S*) <= mu_high*sigma``.

    Args:
        s_star: ``[B, T]`` (or any shape) float scores ``S* = p_k (H + log p_k)``, or their ``TokenStats``.
        advantages: ``[B]`` per sequence (GRPO) or the scores' shape (per token, GAE).
        valid: bool or 0/1 tensor of the scores' shape (the response mask).
        mu_low, mu_high: bounds in batch stds (reals >= 0); ``math.inf`` disables a side.
        sides: advantage sign whose tokens may be clipped: ``negative`` (A < 0), ``positive`` or ``both``.
        max_frac, cap_rule: at most :func:`cap_limit` tokens (None: no cap), the most violating first.
        process_group: statistics and the cap are global over it; a bad value on one rank raises on every rank.

    Returns :class:`MaskResult`; ``ValueError`` / ``TypeError`` naming a bad argument, or NaN / inf at a valid position.
    """
    return _outlier_mask("clip_b", "s_star", s_star, advantages, valid, True, mu_low, mu_high, sides, max_frac,
                         cap_rule, process_group)


def clip_v_mask(s_centered: torch.Tensor | TokenStats, advantages: torch.Tensor, valid: torch.Tensor, *,
                mu_low: float = DEFAULT_MU, mu_high: float = math.inf, sides: str = "negative",
                max_frac: float | None = None, cap_rule: str = "share", process_group: Group = None) -> MaskResult:
    """Clip_V: keep token t when ``-mu_low*sigma' <= S_c,t <= mu_high*sigma'``, sigma' = std(S_c).

    ``S_c = S* - E_p[S]`` from :func:`~entropy_discriminator.token_stats` (or the ``TokenStats`` itself); no
    re-centring (its batch mean is ~0, Corollary 2).  Arguments, defaults and errors as in :func:`clip_b_mask`.
    """
    return _outlier_mask("clip_v", "s_centered", s_centered, advantages, valid, False, mu_low, mu_high, sides, max_frac,
                         cap_rule, process_group)


def apply_keep_mask(pg_losses: torch.Tensor, keep: torch.Tensor, loss_mask: torch.Tensor, *,
                    mode: str = "zero_pg") -> tuple[torch.Tensor, torch.Tensor]:
    """``(pg_losses * keep, loss_mask)`` for ``"zero_pg"``, ``(pg_losses, loss_mask * keep)`` for ``"drop_token"``
    (docs/api.md), in the input dtypes.  All three ``[B, T]`` (one shape); ``keep`` bool or 0/1, ``loss_mask`` real
    or bool; ``ValueError`` for a bad mode, shape or keep value."""
    require_float("pg_losses", pg_losses)
    one_of("mode", mode, MASK_MODES)
    keep = as_valid_mask(keep, pg_losses.shape, "keep")
    require_tensor("loss_mask", loss_mask)
    if loss_mask.shape != pg_losses.shape:
        raise ValueError(f"loss_mask must have pg_losses' shape {tuple(pg_losses.shape)}, got {tuple(loss_mask.shape)}")
    if mode == "zero_pg":
        return pg_losses * keep.to(pg_losses.dtype), loss_mask
    return pg_losses, loss_mask * keep.to(loss_mask.dtype)


def _outlier_mask(method: str, name: str, scores: torch.Tensor | TokenStats, advantages: torch.Tensor,
                  valid: torch.Tensor, recentre: bool, mu_low: object, mu_high: object, sides: str, max_frac: object,
                  cap_rule: str, group: Group) -> MaskResult:
    scores, within = field_of(scores, name)

    def local() -> tuple[torch.Tensor, tuple]:
        mu = (real_number("mu_low", mu_low, finite=False, minimum=0),
              real_number("mu_high", mu_high, finite=False, minimum=0))
        one_of("sides", sides, SIDES)
        if max_frac is not None:
            real_number("max_frac", max_frac, minimum=0, maximum=1)
        one_of("cap_rule", cap_rule, CAP_RULES)
        require_float(name, scores)
        checks = DataChecks()
        valid_b = valid_mask(valid_within(valid, within), scores.shape, checks)
        adv = broadcast_advantages(advantages, scores.shape).to(scores.device)
        x = scores.to(torch.float64)
        total = torch.where(valid_b, x, 0.0).sum()
        checks.finite(name, scores, valid_b, witness=total)
        checks.finite("advantages", adv, valid_b)
        pos, neg = valid_b & (adv > 0), valid_b & (adv < 0)
        sums = [t.sum().to(torch.float64) for t in (valid_b, pos, neg)]
        return torch.stack([*checks.witnesses(), total, *sums]), (mu, checks, valid_b, x, pos, neg)

    values, ((mu_low, mu_high), checks, valid, x, pos, neg) = reduce_or_raise(local, _N_CHECKS + 4, group)
    checks.verdict(values[:_N_CHECKS], group)
    total, n, n_pos, n_neg = values[_N_CHECKS:]
    mean = total / n if n > 0 else 0.0
    sq = all_reduce(torch.where(valid, (x - mean) ** 2, 0.0).sum(), group)
    std = math.sqrt(float(sq) / n) if n > 0 else 0.0

    center = mean if recentre else 0.0
    lower = center - mu_low * std if math.isfinite(mu_low) else -math.inf
    upper = center + mu_high * std if math.isfinite(mu_high) else math.inf
    eligible = {"negative": neg, "positive": pos, "both": pos | neg}[sides]
    clipped = eligible & ((x < lower) | (x > upper)) if std > ZERO_STD else torch.zeros_like(valid)

    n_clip = int(all_reduce(clipped.sum(), group))
    limit = cap_limit(max_frac, int(n), cap_rule)
    capped = limit is not None and n_clip > limit
    if capped:
        clipped = top_k_mask(torch.maximum(lower - x, x - upper) / std, clipped, limit, group)
        n_clip = limit  # the top-k takes exactly `limit` of the more than `limit` candidates
    # Clipped tokens are eligible, so the split by advantage sign needs a count only for sides="both".
    n_clip_pos = {"negative": 0, "positive": n_clip}.get(sides)
    if n_clip_pos is None:
        n_clip_pos = int(all_reduce((clipped & pos).sum(), group))
    return MaskResult(keep=~clipped, method=method, center=center, std=std, lower=lower, upper=upper, n_valid=int(n),
                      n_valid_pos=int(n_pos), n_valid_neg=int(n_neg), n_clipped=n_clip, n_clipped_pos=n_clip_pos,
                      n_clipped_neg=n_clip - n_clip_pos, capped=capped)


#: DataChecks of a mask call: valid is 0/1, scores and advantages finite at the valid positions.
_N_CHECKS = 3


def cap_limit(max_frac: object, n_valid: int, cap_rule: str = "share") -> int | None:
    """Most tokens a mask may clip (None: no cap): ``floor(max_frac * n_valid)`` (``cap_rule="share"``) or at least
    1 (``"reference"``, Trinity-RFT 0.6.0's rule), ``max_frac`` read as the decimal it was written as (0.29 = 29/100).
    """
    if max_frac is None:
        return None
    limit = math.floor(exact_fraction(max_frac) * n_valid)
    return max(limit, 1) if cap_rule == "reference" else limit
