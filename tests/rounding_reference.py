"""Inputs with exact fp32 logits and the float64 statistics of their rounded logits: the reference
for ``logits_dtype`` (tests/test_hidden.py, tests/test_kernels.py)."""

from __future__ import annotations

import torch
from reference import reference_token_stats


def exact_problem(seed: int, n: int, h: int, v: int, dtype: torch.dtype, scale: float, neg_inf: bool):
    """Inputs whose fp32-accumulated ``hidden @ W.T + b`` is exact (multiples of 2^-7 below 2^8, a
    power-of-two ``scale``), so the float64 reference rounds the very same L the library rounds."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randint(-16, 17, (n, h), generator=g) / 8).to(dtype)
    weight = (torch.randint(-16, 17, (v, h), generator=g) / 16 * scale).to(dtype)
    bias = (torch.randint(-8, 9, (v,), generator=g) / 8).to(dtype)
    if neg_inf:
        bias[torch.rand(v, generator=g) < 0.3] = float("-inf")
        bias[0] = 0.0  # every row keeps a finite logit
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = -100
    if neg_inf:  # a sampled token has a finite logit
        labels = torch.where(torch.isinf(bias[labels.clamp(min=0)]) & (labels >= 0), 0, labels)
    return hidden, weight, bias, labels


def rounded_reference(hidden, weight, bias, labels, temperature, logits_dtype, t_low):
    """float64 statistics of the framework's distribution: L exact (``bias`` None: no bias), rounded to
    ``logits_dtype``, divided by T (in ``logits_dtype`` and rounded again when ``t_low``, as ``low / T`` in torch)."""
    logits = hidden.double() @ weight.double().T + (0.0 if bias is None else bias.double())
    low = logits.to(logits_dtype)
    if t_low:
        return reference_token_stats((low / temperature).to(logits_dtype), labels, 1.0)
    return reference_token_stats(low, labels, temperature)
