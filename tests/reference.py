"""Plain float64 references, written independently of the library (tests and benchmarks import them)."""

from __future__ import annotations

import math
from decimal import Decimal

import torch


def reference_token_stats(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """float64 logp, entropy, s_star, s_expected, s_centered from a full log-softmax; ignored -> 0."""
    z = logits.to(torch.float64) / temperature
    logq = torch.log_softmax(z, dim=-1)
    p = logq.exp()
    plogp = torch.where(p > 0, p * logq, torch.zeros_like(p))
    entropy = -plogp.sum(-1)
    valid = labels != ignore_index
    k = torch.where(valid, labels, torch.zeros_like(labels)).to(torch.int64)
    logp = logq.gather(-1, k[..., None])[..., 0]
    pk = logp.exp()
    s_star = torch.where(pk > 0, pk * (entropy + logp), torch.zeros_like(pk))
    s_i = torch.where(p > 0, p * (entropy[..., None] + logq), torch.zeros_like(p))
    s_expected = (p * s_i).sum(-1)
    out = {"logp": logp, "entropy": entropy, "s_star": s_star, "s_expected": s_expected, "s_centered": s_star - s_expected}
    return {name: torch.where(valid, v, torch.zeros_like(v)) for name, v in out.items()}


def reference_entropy(z: torch.Tensor) -> torch.Tensor:
    """float64 entropy of softmax(z) over the last dimension."""
    logq = torch.log_softmax(z.to(torch.float64), dim=-1)
    p = logq.exp()
    return -(torch.where(p > 0, p * logq, torch.zeros_like(p))).sum(-1)


def reference_outlier_keep(
    scores: list[float],
    advantages: list[float],
    valid: list[bool],
    *,
    recentre: bool,
    mu_low: float,
    mu_high: float,
    sides: str,
    max_frac: float | None,
) -> list[bool]:
    """Plain-Python Clip_B (recentre=True) / Clip_V (recentre=False) keep-list over a flat batch."""
    xs = [s for s, v in zip(scores, valid) if v]
    n = len(xs)
    if n == 0:
        return [True] * len(scores)
    mean = math.fsum(xs) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / n)
    if std <= 1e-12:
        return [True] * len(scores)
    center = mean if recentre else 0.0
    lo = center - mu_low * std if math.isfinite(mu_low) else -math.inf
    hi = center + mu_high * std if math.isfinite(mu_high) else math.inf

    def eligible(a: float) -> bool:
        return (sides in ("negative", "both") and a < 0) or (sides in ("positive", "both") and a > 0)

    violators = [
        i for i, (s, a, v) in enumerate(zip(scores, advantages, valid)) if v and eligible(a) and (s < lo or s > hi)
    ]
    if max_frac is not None:
        limit = math.floor(Decimal(repr(max_frac)) * n)  # the cap on the share: at most max_frac * n
        if len(violators) > limit:
            beyond = {i: max(lo - scores[i], scores[i] - hi) / std for i in violators}
            violators = sorted(violators, key=lambda i: (-beyond[i], i))[:limit]
    clipped = set(violators)
    return [i not in clipped for i in range(len(scores))]
