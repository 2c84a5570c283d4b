"""Per-token statistics folded over vocabulary chunks of logits that exist one tile at a time.

A framework whose LM head reduces ``[n, C]`` logits tiles and drops them hands every tile to :class:`VocabFold` too.
Per token it keeps, in base-2 units ``y = x c`` (``c = log2(e) scale / T``), the running maximum ``m`` and, against
it (``d_i = y_i - m``, ``e_i = 2^d_i``)::

    s0 = sum e,  s1 = sum e d,  s2 = sum e^2,  s3 = sum e^2 d,  and y_k of the label k.

A new maximum rescales them (``kernels/_reduce.py`` writes out the algebra).  :meth:`VocabFold.finish` gives::

    H = log s0 - ln2 s1/s0,   log p_k = ln2 (y_k - m) - log s0,   S* = p_k (H + log p_k),
    E_p[S] = ln2 (s3 - s2 s1/s0) / s0^2,   S_c = S* - E_p[S].
"""

from __future__ import annotations

import math

import torch

from . import kernels
from ._checks import one_of, real_number
from .stats import IMPLS

__all__ = ["VocabFold"]

_LOG2E = 1.4426950408889634
_LN2 = math.log(2.0)
# d is clamped here before e*d is formed: 2^-256 is 0 in fp32 (keeps 0 * -inf out of s1, s3).
_D_FLOOR = -256.0


class VocabFold:
    """Accumulator of the statistics of ``n`` tokens over vocabulary tiles, of ``z = x * scale / temperature`` for a
    tile entry ``x``; ``state``: ``[6, n]`` float32 ``m, s0, s1, s2, s3, y_k``.  ``impl``: ``"auto"`` (Triton for CUDA
    tiles when available), ``"torch"`` or ``"triton"``; ``ValueError`` for a bad temperature, scale or impl."""

    def __init__(self, n: int, device: torch.device | str, *, temperature: float = 1.0, scale: float = 1.0,
                 impl: str = "auto") -> None:
        temperature = real_number("temperature", temperature, above=0)
        if real_number("scale", scale) == 0:
            raise ValueError(f"scale must be finite and nonzero, got {scale!r}")
        one_of("impl", impl, IMPLS)
        self.c = _LOG2E * float(scale) / temperature
        self.state = torch.zeros((6, n), dtype=torch.float32, device=device)
        self.state[0].fill_(-math.inf)
        self.impl = impl

    def fold(self, tile: torch.Tensor, labels: torch.Tensor, row_start: int, vocab_start: int) -> None:
        """Fold ``tile`` ``[rows, C]`` (any float dtype, unit stride along C for Triton): vocabulary ids from
        ``vocab_start`` of the tokens from ``row_start``, with global label ids ``labels`` ``[rows]``."""
        rows, cols = tile.shape
        if labels.shape != (rows,) or row_start < 0 or row_start + rows > self.state.shape[1]:
            raise ValueError(f"tile {tuple(tile.shape)} with labels {tuple(labels.shape)} at row {row_start} does not "
                             f"fit {self.state.shape[1]} tokens")
        if rows == 0 or cols == 0:
            return
        part = self.state[:, row_start : row_start + rows]
        triton = self.impl != "torch" and tile.is_cuda and tile.stride(1) == 1 and kernels.is_available()
        if self.impl == "triton" and not triton:
            raise RuntimeError("impl='triton' needs a CUDA tile with unit column stride and an importable Triton")
        if triton:
            from .kernels import triton_fold

            triton_fold.fold_tile(tile, labels, vocab_start, self.c, part)
        else:
            _fold_torch(tile, labels, vocab_start, self.c, part)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logp, entropy, s_star, s_expected)``, each float32 ``[n]`` (module doc)."""
        m, s0, s1, s2, s3, yk = self.state.unbind(0)
        log_s0 = torch.log(s0)
        dbar = s1 / s0
        entropy = log_s0 - _LN2 * dbar
        s_expected = _LN2 * (s3 - s2 * dbar) / (s0 * s0)
        logp = _LN2 * (yk - m) - log_s0
        s_star = torch.where(logp == -math.inf, torch.zeros_like(logp), logp.exp() * (entropy + logp))
        return logp, entropy, s_star, s_expected


def _fold_torch(tile: torch.Tensor, labels: torch.Tensor, vocab_start: int, c: float, part: torch.Tensor) -> None:
    """The fold of one tile in torch ops (any device); updates ``part`` ``[6, rows]`` in place."""
    y = tile.to(torch.float32) * c
    m = part[0]
    m_new = torch.maximum(m, y.amax(dim=-1))
    a = torch.where(m == -math.inf, torch.zeros_like(m), torch.exp2(m - m_new))
    ad = torch.where(a > 0, a * (m - m_new), torch.zeros_like(a))
    s0, s1, s2, s3 = part[1].clone(), part[2].clone(), part[3].clone(), part[4].clone()
    d = torch.where(y == -math.inf, torch.full_like(y, _D_FLOOR), y - m_new[:, None]).clamp_(min=_D_FLOOR)
    e = torch.exp2(d)
    ed = e * d
    part[1] = a * s0 + e.sum(-1)
    part[2] = a * s1 + ad * s0 + ed.sum(-1)
    part[3] = a * a * s2 + (e * e).sum(-1)
    part[4] = a * a * s3 + a * ad * s2 + (ed * e).sum(-1)
    part[0] = m_new
    k = labels.to(torch.int64) - vocab_start
    here = (k >= 0) & (k < tile.shape[1])
    yk = y.gather(1, torch.where(here, k, 0)[:, None])[:, 0]
    part[5] = torch.where(here, yk, part[5])
