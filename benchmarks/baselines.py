"""The ways one can compute (logp, H, E_p[S]) today, written out for timing against the kernel.

Each function takes logits [N, V] (any float dtype), labels [N] int64 and a temperature, and
returns fp32 (logp, entropy, s_expected) of shape [N]; ignore_index handling is left out (every
label is valid in the benchmarks).
"""

from __future__ import annotations

import torch

Stats3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def naive_eager(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> Stats3:
    """The textbook version: fp32 log_softmax, p, p^2 as full [N, V] tensors."""
    z = logits.float() / temperature
    logq = torch.log_softmax(z, dim=-1)
    p = logq.exp()
    entropy = -(p * logq).sum(-1)
    p2 = p * p
    s_expected = entropy * p2.sum(-1) + (p2 * logq).sum(-1)
    logp = logq.gather(-1, labels[:, None])[:, 0]
    return logp, entropy, s_expected


def token_chunked_eager(logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk: int = 1024) -> Stats3:
    """``naive_eager`` over slices of ``chunk`` rows (bounded memory, same math)."""
    parts = [naive_eager(logits[i : i + chunk], labels[i : i + chunk], temperature) for i in range(0, logits.shape[0], chunk)]
    return tuple(torch.cat(t) for t in zip(*parts))  # type: ignore[return-value]


def framework_style(logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk: int = 2048) -> Stats3:
    """Chunked entropy + sum p^2 + sum p^2 log p the way RL frameworks compute entropy today.

    Per 2048-row slice (fp32): entropy = logsumexp(z) - sum softmax(z) z; sum p^2 = exp(lse(2z) - 2 lse(z));
    sum p^2 log p = sum p^2 (z - lse); logp = z_k - lse.
    """
    n = logits.shape[0]
    logp = torch.empty(n, device=logits.device)
    entropy = torch.empty(n, device=logits.device)
    s_expected = torch.empty(n, device=logits.device)
    for i in range(0, n, chunk):
        z = logits[i : i + chunk].float() / temperature
        lse = torch.logsumexp(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        h = lse - (p * z).sum(-1)
        sum_p2 = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * lse)
        sum_p2_logp = (p * p * (z - lse[:, None])).sum(-1)
        entropy[i : i + chunk] = h
        s_expected[i : i + chunk] = h * sum_p2 + sum_p2_logp
        logp[i : i + chunk] = z.gather(-1, labels[i : i + chunk, None])[:, 0] - lse
    return logp, entropy, s_expected
