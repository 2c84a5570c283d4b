"""Choosing mu: the mu that makes Clip_B or Clip_V clip a target share of a logged batch's tokens
(:func:`mu_for_share`; docs/choosing-mu.md is the procedure around it), and the saved batch it reads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from ._checks import as_valid_mask, broadcast_advantages, exact_fraction, one_of, real_number, require_float
from .masks import SIDES, clip_b_mask, clip_v_mask

#: The masks a mu is chosen for, and the score each reads (the :class:`~entropy_discriminator.TokenStats` field).
METHODS = {"clip_b": "s_star", "clip_v": "s_centered"}
#: The tensors a saved batch holds (:func:`save_batch`, ``entropy-discriminator suggest-mu --batch``).
BATCH_KEYS = ("s_star", "s_centered", "advantages", "valid")


@dataclass(frozen=True)
class MuSuggestion:
    """The mu :func:`mu_for_share` chose and what it clips on that batch: ``n_clipped`` and ``share = n_clipped /
    n_valid`` as the mask returns them with ``mu_low=mu`` (other arguments at their defaults); ``max_share``: the most
    any ``mu >= 0`` clips there (``mu = 0``: every eligible token below the centre)."""

    method: str
    sides: str
    mu: float
    target_share: float
    share: float
    n_clipped: int
    n_valid: int
    max_share: float


def mu_for_share(scores: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, *, target_share: float,
                 method: str = "clip_b", sides: str = "negative") -> MuSuggestion:
    """The ``mu_low`` with which ``method``'s mask clips the share of ``valid`` tokens nearest ``target_share``.

    ``scores``: ``[B, T]`` (or any shape) float, ``S*`` for ``method="clip_b"``, ``S_c`` for ``"clip_v"``;
    ``advantages`` (``[B]`` or the scores' shape), ``valid`` (bool or 0/1) and ``sides`` as the masks take them;
    ``target_share`` in ``(0, 1)``, the wanted share of clipped tokens among the valid ones.

    With the eligible tokens (valid, advantage of sign ``sides``) sorted by score ``x_(1) <= x_(2) <= ...``, the
    masks clip exactly ``c`` of them when ``x_(c) < center - mu * sigma <= x_(c + 1)``.  The count chosen is the
    reachable one (tied scores make some unreachable) nearest ``target_share * n_valid``, ties toward fewer;
    ``mu_high`` stays infinite, no cap.  A mask called with ``mu_low=result.mu`` clips ``result.n_clipped`` tokens
    on this batch, bit for bit.  ``ValueError`` naming ``target_share`` when it is not in ``(0, 1)`` or above
    ``max_share``, naming ``valid`` when no token is valid; the masks' own checks apply to the tensors.
    """
    one_of("method", method, tuple(METHODS))
    one_of("sides", sides, SIDES)
    target = real_number("target_share", target_share, above=0, maximum=1)
    if target >= 1:
        raise ValueError(f"target_share must be a real number in (0, 1), got {target_share!r}")
    mask = clip_b_mask if method == "clip_b" else clip_v_mask
    stats = mask(scores, advantages, valid, mu_low=math.inf, sides=sides)  # the mask's own centre and sigma
    n_valid = stats.n_valid
    if n_valid == 0:
        raise ValueError("valid marks no token: a mu cannot be chosen on an empty batch")
    center, sigma = float(stats.center), stats.std
    x = _eligible_scores(scores, advantages, valid, sides, center)
    max_share = mask(scores, advantages, valid, mu_low=0.0, sides=sides).n_clipped / n_valid
    if target > max_share:
        raise ValueError(
            f"target_share must be at most {max_share:.6g} on this batch (what mu = 0 clips: {method} with "
            f"sides={sides!r} can clip only tokens below the centre), got {target_share!r}"
        )
    wanted = exact_fraction(target) * n_valid
    for count in _reachable_counts(x, wanted):
        mu = _mu_inside(x, count, center, sigma)
        if mu is None:
            continue
        n_clipped = mask(scores, advantages, valid, mu_low=mu, sides=sides).n_clipped
        if n_clipped == count:
            return MuSuggestion(method, sides, mu, target, n_clipped / n_valid, n_clipped, n_valid, max_share)
    raise AssertionError("no mu reproduces a reachable count")  # unreachable: count 0 always has one


def _eligible_scores(scores: torch.Tensor, advantages: object, valid: object, sides: str, center: float) -> torch.Tensor:
    """Float64 scores of the valid tokens whose advantage has the sign ``sides`` and that lie below ``center``, sorted."""
    x = require_float("scores", scores).detach().to(torch.float64)
    adv = broadcast_advantages(advantages, x.shape).to(x.device)
    keep = as_valid_mask(valid, x.shape)
    side = {"negative": adv < 0, "positive": adv > 0, "both": adv != 0}[sides]
    x = x[keep & side]
    return torch.sort(x[x < center]).values.cpu()


def _reachable_counts(x: torch.Tensor, wanted: Fraction) -> list[int]:
    """Counts ``c`` that a threshold can clip (0, every ``c`` with ``x_(c) < x_(c+1)``, all of ``x``), nearest ``wanted`` first."""
    distinct = (torch.nonzero(x[1:] > x[:-1]).flatten() + 1).tolist()
    return sorted({0, x.numel(), *distinct}, key=lambda c: (abs(c - wanted), c))


def _mu_inside(x: torch.Tensor, count: int, center: float, sigma: float) -> float | None:
    """The shortest decimal ``mu >= 0`` with ``x_(count) < center - mu * sigma <= x_(count + 1)`` (None if no float
    fits), ``x_(0) = -inf`` and ``x_(len + 1) = center``."""
    above = float(x[count]) if count < x.numel() else center  # lower must be <= this
    below = float(x[count - 1]) if count > 0 else -math.inf  # and > this
    lo = (center - above) / sigma
    if count == 0:  # any lower <= x_(1): the smallest mu that clips nothing
        candidates = [_round_up(lo, digits) for digits in range(1, 18)] + [math.nextafter(lo, math.inf)]
    else:
        hi = (center - below) / sigma
        mid = (lo + hi) / 2
        candidates = [float(f"{mid:.{digits}g}") for digits in range(1, 18)] + [lo, math.nextafter(lo, math.inf)]
    for mu in candidates:
        lower = center - mu * sigma  # the masks' arithmetic
        if mu >= 0 and below < lower <= above:
            return mu
    return None


def _round_up(value: float, digits: int) -> float:
    """``value`` rounded up to ``digits`` significant decimal digits (0 stays 0)."""
    if value <= 0:
        return 0.0
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale) / scale


def save_batch(path: str | Path, *, s_star: torch.Tensor, s_centered: torch.Tensor, advantages: torch.Tensor,
               valid: torch.Tensor) -> Path:
    """Save one batch's mask inputs (``torch.save`` of a dict of CPU tensors) for ``entropy-discriminator suggest-mu``:
    ``s_star``/``s_centered`` ``[B, T]`` float, ``advantages`` ``[B]`` or ``[B, T]``, ``valid`` ``[B, T]`` bool or 0/1.
    Returns the path."""
    path = Path(path)
    tensors = {"s_star": s_star, "s_centered": s_centered, "advantages": advantages, "valid": valid}
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, path)
    return path


def load_batch(path: str | Path) -> dict[str, torch.Tensor]:
    """A batch written by :func:`save_batch`; ``ValueError`` naming the file when a tensor is missing."""
    batch = torch.load(Path(path), map_location="cpu", weights_only=True)
    missing = [k for k in BATCH_KEYS if not isinstance(batch, dict) or k not in batch]
    if missing:
        raise ValueError(f"{path} is not a batch saved by save_batch: it lacks {', '.join(missing)}")
    return {k: batch[k] for k in BATCH_KEYS}
