"""Triton kernel of :class:`entropy_discriminator.vocab_fold.VocabFold`: one tile into the running sums, one
program per token row, in blocks of BLOCK (the running max moved per block, the sums rescaled by ``2^(m - m')``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._reduce import D_FLOOR, rescale

_BLOCK = 2048


@triton.jit
def _fold_kernel(tile_ptr, stride, labels_ptr, vocab_start, n_cols, c, state_ptr, state_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = tile_ptr + row * stride
    m = tl.load(state_ptr + row)
    s0 = tl.load(state_ptr + state_stride + row)
    s1 = tl.load(state_ptr + 2 * state_stride + row)
    s2 = tl.load(state_ptr + 3 * state_stride + row)
    s3 = tl.load(state_ptr + 4 * state_stride + row)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        y = tl.load(base + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32) * c
        m_new = tl.maximum(m, tl.max(y, axis=0))
        s0, s1, s2, s3 = rescale(s0, s1, s2, s3, m, m_new)
        d = tl.maximum(tl.where(y == float("-inf"), -D_FLOOR, y - m_new), -D_FLOOR)
        e = tl.exp2(d)
        ed = e * d
        s0 += tl.sum(e, axis=0)
        s1 += tl.sum(ed, axis=0)
        s2 += tl.sum(e * e, axis=0)
        s3 += tl.sum(ed * e, axis=0)
        m = m_new
    tl.store(state_ptr + row, m)
    tl.store(state_ptr + state_stride + row, s0)
    tl.store(state_ptr + 2 * state_stride + row, s1)
    tl.store(state_ptr + 3 * state_stride + row, s2)
    tl.store(state_ptr + 4 * state_stride + row, s3)
    k = tl.load(labels_ptr + row).to(tl.int64) - vocab_start
    if (k >= 0) & (k < n_cols):
        tl.store(state_ptr + 5 * state_stride + row, tl.load(base + k).to(tl.float32) * c)


def fold_tile(tile: torch.Tensor, labels: torch.Tensor, vocab_start: int, c: float, part: torch.Tensor) -> None:
    """Fold ``tile`` ``[rows, C]`` (unit column stride, CUDA) into ``part`` ``[6, rows]`` float32 (a
    column slice of the fold's state: row stride ``part.stride(0)``, unit column stride)."""
    rows, cols = tile.shape
    if part.stride(1) != 1 or part.dtype != torch.float32:
        raise ValueError("part must be a float32 [6, rows] view with unit column stride")
    labels = labels.contiguous()
    _fold_kernel[(rows,)](tile, tile.stride(0), labels, vocab_start, cols, c, part, part.stride(0),
                          BLOCK=_BLOCK, num_warps=8)
