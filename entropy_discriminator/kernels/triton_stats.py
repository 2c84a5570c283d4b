"""One-pass Triton kernel for the per-token vocabulary statistics.

Each logits row is read once.  A program streams its row (or, for small N, one slice of it:
split-V) in blocks of BLOCK logits: an unmasked main loop over the whole blocks, then one masked
tail.  Per block it takes the block max (the only cross-thread reduction inside the loop), moves
the reference m only when that max exceeds m by more than TAU (lazy rescaling: a branch taken a
handful of times per row), and adds into four per-lane accumulators

    e = exp2(x * c - m)   (log2(e)/T folded into the one FMA),   s0 += e, s1 += e d,
    s2 += e*e, s3 += e*e d   (e^(2(z-m)) as the square of e^(z-m)),

see :mod:`._reduce` for the algebra.  The lanes are summed once at the end of the row.  With
split-V, each program writes its six partials (m, s0..s3, max) and a second kernel merges them per
row in a fixed order, so two runs give identical bits.  Rows whose label is ``ignore_index`` are
not read at all.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from . import interpreting
from . import is_available as _is_available
from ._reduce import D_FLOOR, LN2, LOG2E, finalize, max_nan, merge_block, merge_kernel, rescale

__all__ = ["token_stats_triton", "is_available", "choose_config"]

SPLIT_TARGET = 4  # programs per multiprocessor below which rows are split (split-V)
TAU = 8.0  # lazy-rescale slack in base-2 units: e <= 2^8, e^2 <= 2^16, sums stay far from overflow
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_available() -> bool:
    """Triton importable and a CUDA device present."""
    return _is_available()


@triton.jit
def _update(x, c, m, mx, s0, s1, s2, s3, TAU: tl.constexpr):
    """Fold one block of raw logits x (fp32) into the running state of one row."""
    bm = tl.reduce(x, 0, max_nan)
    mx = max_nan(mx, bm)
    bm2 = bm * c
    if bm2 > m + TAU:  # lazy rescale; False for NaN, taken once for the first finite block
        s0, s1, s2, s3 = rescale(s0, s1, s2, s3, m, bm2)
        m = bm2
    mu = tl.where(m > float("-inf"), m, 0.0)
    d = tl.maximum(x * c - mu, -D_FLOOR)
    e = tl.exp2(d)
    e2 = e * e
    s0 += e
    s1 += e * d
    s2 += e2
    s3 += e2 * d
    return m, mx, s0, s1, s2, s3


@triton.jit
def _stats_kernel(
    x_ptr,
    stride_row,
    lab_ptr,
    V,
    chunk,
    c,
    ignore_index,
    logp_ptr,
    ent_ptr,
    ss_ptr,
    se_ptr,
    rmax_ptr,
    part_ptr,
    yk_ptr,
    N,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    TAU: tl.constexpr,
    STAGES: tl.constexpr,
):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    label = tl.load(lab_ptr + row)
    valid = label != ignore_index
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    start = sp * chunk
    n = tl.where(valid, tl.minimum(V - start, chunk), 0)
    n_full = n // BLOCK
    p = row_ptr + start
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    mx = float("-inf")
    s0 = tl.zeros([BLOCK], dtype=tl.float32)
    s1 = tl.zeros([BLOCK], dtype=tl.float32)
    s2 = tl.zeros([BLOCK], dtype=tl.float32)
    s3 = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, n_full, num_stages=STAGES):
        x = tl.load(p + i * BLOCK + offs).to(tl.float32)
        m, mx, s0, s1, s2, s3 = _update(x, c, m, mx, s0, s1, s2, s3, TAU)
    rem = n - n_full * BLOCK
    if rem > 0:
        x = tl.load(p + n_full * BLOCK + offs, mask=offs < rem, other=float("-inf")).to(tl.float32)
        m, mx, s0, s1, s2, s3 = _update(x, c, m, mx, s0, s1, s2, s3, TAU)
    t0 = tl.sum(s0, axis=0)
    t1 = tl.sum(s1, axis=0)
    t2 = tl.sum(s2, axis=0)
    t3 = tl.sum(s3, axis=0)
    in_range = (label >= 0) & (label < V)
    if SPLIT == 1:
        xk = tl.load(row_ptr + label, mask=valid & in_range, other=float("nan")).to(tl.float32)
        mu = tl.where(m > float("-inf"), m, 0.0)
        logp, ent, s_star, s_exp = finalize(mu, t0, t1, t2, t3, xk * c, valid)
        tl.store(logp_ptr + row, logp)
        tl.store(ent_ptr + row, ent)
        tl.store(ss_ptr + row, s_star)
        tl.store(se_ptr + row, s_exp)
        tl.store(rmax_ptr + row, tl.where(valid, mx * c * LN2, 0.0))
    else:
        stride_f = N.to(tl.int64) * SPLIT
        q = part_ptr + row.to(tl.int64) * SPLIT + sp
        tl.store(q, m)
        tl.store(q + stride_f, t0)
        tl.store(q + 2 * stride_f, t1)
        tl.store(q + 3 * stride_f, t2)
        tl.store(q + 4 * stride_f, t3)
        tl.store(q + 5 * stride_f, mx * c)
        if sp == 0:
            xk = tl.load(row_ptr + label, mask=valid & in_range, other=float("nan")).to(tl.float32)
            tl.store(yk_ptr + row, xk * c)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_config(n_rows: int, vocab: int, dtype: torch.dtype, num_sms: int) -> dict:
    """Block size, warps, pipelining depth and split-V factor for an [n_rows, vocab] problem.

    Measured on an H100 (V=151936; benchmarks/sweep.sh, benchmarks/RESULTS.md): 16-bit logits run
    best in blocks of 1024 with 2 warps and 4 cp.async stages (N=16384: the torch.sum time), fp32
    logits at the read floor with 2048 / 4 warps / 3 stages.  Split-V is used when the rows alone
    give fewer than SPLIT_TARGET programs per multiprocessor: the split is the power of two that
    reaches it (N=256 on the H100: split 4 took 45.5 us, 8 45.8, 3 46.3, 6 52.2; results/h100/
    tune_stats.csv), capped so that each slice holds >= 2 blocks.
    """
    return dict(_choose(n_rows, vocab, dtype, num_sms))


@functools.lru_cache(maxsize=4096)
def _choose(n_rows: int, vocab: int, dtype: torch.dtype, num_sms: int) -> tuple:
    if dtype == torch.float32:
        block, num_warps, stages = 2048, 4, 3
    else:
        block, num_warps, stages = 1024, 2, 4
    block = min(block, max(128, triton.next_power_of_2(vocab)))
    split = 1
    target = SPLIT_TARGET * num_sms
    if n_rows < target:
        max_split = max(1, vocab // (2 * block))
        split = max(1, min(max_split, triton.next_power_of_2(-(-target // max(n_rows, 1)))))
    return (("block", block), ("num_warps", num_warps), ("stages", stages), ("split", split))


def token_stats_triton(
    logits2d: torch.Tensor,
    labels1d: torch.Tensor,
    temperature: float,
    ignore_index: int,
    *,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-pass statistics of every row of ``logits2d`` [N, V] (bf16/fp16/fp32, CUDA).

    With z = logits/T (fp32), p = softmax(z), k = labels1d[n] (int64 [N]) returns fp32 [N] tensors
    ``(logp, entropy, s_star, s_expected, row_max)``: log p_k, H = -sum p log p,
    S* = p_k (H + log p_k), E_p[S] = H sum p^2 + sum p^2 log p, and row_max = max_i z_i (NaN if the
    row holds a NaN, +inf if it holds +inf, -inf if all entries are -inf).  Rows with
    label == ignore_index are not read and give 0 in all five outputs.  A non-ignored label outside
    [0, V) gives NaN logp (the caller validates labels).  Any row stride is accepted; a last
    dimension that is not contiguous is copied.  ``config`` overrides :func:`choose_config`
    (benchmarks).  Deterministic: the same inputs give the same bits.
    """
    if logits2d.dim() != 2:
        raise ValueError(f"logits2d must be 2-D [N, V], got shape {tuple(logits2d.shape)}")
    if logits2d.dtype not in _DTYPES:
        raise ValueError(f"logits2d dtype must be bf16, fp16 or fp32, got {logits2d.dtype}")
    if not interpreting() and logits2d.device.type != "cuda":
        raise ValueError(f"logits2d must be a CUDA tensor, got device {logits2d.device}")
    if labels1d.dim() != 1 or labels1d.shape[0] != logits2d.shape[0]:
        raise ValueError(
            f"labels1d must be 1-D with {logits2d.shape[0]} entries, got shape {tuple(labels1d.shape)}"
        )
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    n_rows, vocab = logits2d.shape
    if vocab == 0:
        raise ValueError("logits2d must have a non-empty vocabulary dimension")
    if logits2d.stride(1) != 1:
        logits2d = logits2d.contiguous()
    labels1d = labels1d.to(device=logits2d.device, dtype=torch.int64).contiguous()
    dev = logits2d.device
    outs = torch.empty((5, n_rows), device=dev, dtype=torch.float32).unbind(0)  # one allocation
    if n_rows == 0:
        return tuple(outs)
    cfg = config or choose_config(n_rows, vocab, logits2d.dtype, _num_sms(dev))
    block, split = cfg["block"], cfg["split"]
    nblocks = triton.cdiv(vocab, block)
    split = max(1, min(split, nblocks))
    chunk = triton.cdiv(nblocks, split) * block
    split = triton.cdiv(vocab, chunk)
    c = LOG2E / float(temperature)
    if split > 1:
        work = torch.empty(n_rows * (6 * split + 1), device=dev, dtype=torch.float32)
        part, yk = work[: 6 * n_rows * split], work[6 * n_rows * split :]  # [6, N, split] and [N]
    else:
        part = yk = outs[0]  # unused by the SPLIT == 1 specialisation
    # Host time matters at small N (the launch path costs more than the kernel): no device switch
    # unless the tensors live on another GPU, cached configuration, two allocations.
    switch = dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device()
    with torch.cuda.device(dev) if switch else contextlib.nullcontext():
        _stats_kernel[(n_rows, split)](
            logits2d, logits2d.stride(0), labels1d, vocab, chunk, c, int(ignore_index),
            *outs, part, yk, n_rows,
            SPLIT=split, BLOCK=block, TAU=TAU, STAGES=cfg["stages"], num_warps=cfg["num_warps"],
        )  # fmt: skip
        if split > 1:
            merge_kernel[(n_rows,)](
                part, yk, labels1d, *outs, n_rows, split, int(ignore_index),
                PB=merge_block(split), num_warps=1,
            )  # fmt: skip
    return tuple(outs)
