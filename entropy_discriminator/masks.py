"""Clip_B and Clip_V keep-masks (paper eqs. 15-16; DESIGN.md "Masks").

Both drop from the loss the tokens whose score is a batch outlier, only among tokens whose
advantage has the sign named by ``sides``:

* Clip_B on ``S*``: keep when ``-mu_low * sigma <= S* - mean <= mu_high * sigma``;
* Clip_V on ``S_c``: keep when ``-mu_low * sigma' <= S_c <= mu_high * sigma'`` (no re-centring:
  the batch mean of ``S_c`` is ~0 by Corollary 2).

``mean`` and ``sigma`` are the population mean and standard deviation over every valid token of
the batch, in float64, across all ranks of ``process_group``.  Zero-advantage tokens are never
clipped: their policy-gradient term is already zero (the reference Clip_V clips them too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import as_valid_mask, broadcast_advantages, require_finite, require_float
from .distributed import Group, all_reduce, global_top_k, rank_offset

SIDES = ("negative", "positive", "both")
MASK_MODES = ("zero_pg", "drop_token")
#: A batch standard deviation at or below this counts as zero: every token is kept (as in the reference).
ZERO_STD = 1e-12


@dataclass(frozen=True)
class MaskResult:
    """A keep-mask and the batch statistics behind it (counts are global over the process group).

    ``keep`` is bool with the scores' shape, True where the token stays in the loss; invalid
    positions are always True.  ``lower``/``upper`` are the thresholds in score units
    (``-inf``/``inf`` where the matching ``mu`` is infinite); ``capped`` tells whether
    ``max_frac`` limited the number of clipped tokens.
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


def clip_b_mask(
    s_star: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    mu_low: float = 2.5,
    mu_high: float = math.inf,
    sides: str = "negative",
    max_frac: float | None = None,
    process_group: Group = None,
) -> MaskResult:
    """Clip_B: keep token t when ``-mu_low*sigma <= S*_t - mean(S*) <= mu_high*sigma``.

    Args:
        s_star: ``[B, T]`` (or any shape) float scores ``S* = p_k (H + log p_k)``.
        advantages: ``[B]`` per sequence (GRPO) or the scores' shape (per token, GAE).
        valid: bool or 0/1 tensor of the scores' shape (the response mask).
        mu_low, mu_high: bounds in units of the batch std; ``math.inf`` disables a side.
        sides: advantage sign whose tokens may be clipped: ``negative`` (A < 0, the paper's and
            the reference's default), ``positive`` (A > 0) or ``both``.
        max_frac: if set, clip at most ``max(floor(max_frac * n_valid), 1)`` tokens, the most
            violating first (distance beyond the bound in units of sigma), ties by position.
        process_group: statistics and the cap are global over this group.

    Returns:
        :class:`MaskResult`; ``keep`` has the scores' shape.
    """
    return _outlier_mask(
        "clip_b", "s_star", s_star, advantages, valid, True, mu_low, mu_high, sides, max_frac, process_group
    )


def clip_v_mask(
    s_centered: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    mu_low: float = 8.5,
    mu_high: float = math.inf,
    sides: str = "negative",
    max_frac: float | None = 1e-4,
    process_group: Group = None,
) -> MaskResult:
    """Clip_V: keep token t when ``-mu_low*sigma' <= S_c,t <= mu_high*sigma'``, sigma' = std(S_c).

    ``S_c = S* - E_p[S]`` from :func:`~entropy_discriminator.token_stats`.  Arguments as in
    :func:`clip_b_mask`; the defaults are the reference's (mu = 8.5, one side, at most 1e-4 of the
    valid tokens clipped).
    """
    return _outlier_mask(
        "clip_v", "s_centered", s_centered, advantages, valid, False, mu_low, mu_high, sides, max_frac, process_group
    )


def apply_keep_mask(
    pg_losses: torch.Tensor, keep: torch.Tensor, loss_mask: torch.Tensor, *, mode: str = "zero_pg"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a keep-mask to a per-token policy-gradient loss, one of two documented ways.

    * ``"zero_pg"`` (default): ``pg_losses * keep``; ``loss_mask`` unchanged, so the loss
      normaliser (token count) stays what the framework computes.
    * ``"drop_token"``: ``loss_mask * keep``; the token leaves the loss and its denominator
      (the reference implementation's behaviour); ``pg_losses`` unchanged.

    Shapes: all three ``[B, T]`` (or any common shape). Returns ``(pg_losses, loss_mask)`` with
    the input dtypes.
    """
    require_float("pg_losses", pg_losses)
    if mode not in MASK_MODES:
        raise ValueError(f"mode must be one of {MASK_MODES}, got {mode!r}")
    keep = as_valid_mask(keep, pg_losses.shape, "keep")
    if loss_mask.shape != pg_losses.shape:
        raise ValueError(f"loss_mask must have pg_losses' shape {tuple(pg_losses.shape)}, got {tuple(loss_mask.shape)}")
    if mode == "zero_pg":
        return pg_losses * keep.to(pg_losses.dtype), loss_mask
    if loss_mask.dtype == torch.bool:
        return pg_losses, loss_mask & keep
    return pg_losses, loss_mask * keep.to(loss_mask.dtype)


def _outlier_mask(
    method: str,
    name: str,
    scores: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    recentre: bool,
    mu_low: float,
    mu_high: float,
    sides: str,
    max_frac: float | None,
    group: Group,
) -> MaskResult:
    require_float(name, scores)
    valid = as_valid_mask(valid, scores.shape)
    adv = broadcast_advantages(advantages, scores.shape).to(scores.device)
    _check_params(mu_low, mu_high, sides, max_frac)
    require_finite(name, scores, valid)
    require_finite("advantages", adv, valid)

    x = scores.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    pos, neg = valid & (adv > 0), valid & (adv < 0)
    n, total = all_reduce(torch.stack([valid.sum().to(torch.float64), torch.where(valid, x, zero).sum()]), group)
    mean = float(total / n) if n > 0 else 0.0
    sq = all_reduce(torch.where(valid, (x - mean) ** 2, zero).sum(), group)
    std = math.sqrt(float(sq / n)) if n > 0 else 0.0

    center = mean if recentre else 0.0
    lower = center - mu_low * std if math.isfinite(mu_low) else -math.inf
    upper = center + mu_high * std if math.isfinite(mu_high) else math.inf
    eligible = {"negative": neg, "positive": pos, "both": pos | neg}[sides]
    clipped = eligible & ((x < lower) | (x > upper)) if std > ZERO_STD else torch.zeros_like(valid)

    capped = False
    if max_frac is not None and std > ZERO_STD:
        limit = max(math.floor(round(max_frac * float(n), 9)), 1)
        n_violating = int(all_reduce(clipped.sum().to(torch.float64), group))
        if n_violating > limit:
            capped = True
            beyond = torch.maximum(lower - x, x - upper) / std
            flat = clipped.reshape(-1)
            idx = torch.nonzero(flat).reshape(-1)
            offset = rank_offset(flat.numel(), group, x.device)
            chosen = global_top_k(beyond.reshape(-1)[idx], idx + offset, limit, group)
            new_flat = torch.zeros_like(flat)
            new_flat[idx[chosen]] = True
            clipped = new_flat.reshape(clipped.shape)

    counts = all_reduce(
        torch.stack([t.sum() for t in (pos, neg, clipped, clipped & pos, clipped & neg)]).to(torch.float64), group
    )
    n_pos, n_neg, n_clip, n_clip_pos, n_clip_neg = (int(c) for c in counts.tolist())
    return MaskResult(
        keep=~clipped,
        method=method,
        center=center,
        std=std,
        lower=lower,
        upper=upper,
        n_valid=int(n),
        n_valid_pos=n_pos,
        n_valid_neg=n_neg,
        n_clipped=n_clip,
        n_clipped_pos=n_clip_pos,
        n_clipped_neg=n_clip_neg,
        capped=capped,
    )


def _check_params(mu_low: float, mu_high: float, sides: str, max_frac: float | None) -> None:
    for label, mu in (("mu_low", mu_low), ("mu_high", mu_high)):
        if not isinstance(mu, (int, float)) or math.isnan(mu) or mu < 0:
            raise ValueError(f"{label} must be a number >= 0 (math.inf disables that side), got {mu!r}")
    if sides not in SIDES:
        raise ValueError(f"sides must be one of {SIDES}, got {sides!r}")
    if max_frac is not None and (not isinstance(max_frac, (int, float)) or not 0 <= max_frac <= 1):
        raise ValueError(f"max_frac must be None or a number in [0, 1], got {max_frac!r}")
