"""Fused LM-head statistics: logits = hidden @ weight.T (+ bias) never reach device memory.

Each [BM, BN] tile of logits is a tensor-core matmul over H (tiles in groups of GROUP_M row blocks, so the operand
tiles in flight stay in L2), configured per shape (:data:`SHAPE_CONFIGS`).  By default one persistent program per
multiprocessor walks the tiles with TMA-loaded operands (the next tile's loads in flight during this tile's epilogue
when the loop is flattened); otherwise (fp32, unaligned strides, pre-Hopper GPUs) one program per tile loads through
pointers.  The epilogue reduces the tile on chip to six numbers per row (the reference m, the sums s0..s3 of
:mod:`._reduce`, a NaN-propagating max), and the tile holding a row's label writes that logit.
:func:`._reduce.merge_kernel` then merges the ceil(V/BN) partials of every row in a fixed order and writes the
statistics, ``valid`` and the error counters.  Forward only (the statistics are used under no_grad).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from . import interpreting
from ._reduce import D_FLOOR, ERR_WORDS, LOG2E, exp2, max_nan, merge_block, merge_kernel
from .triton_stats import KernelStats

try:  # host-side TMA descriptors (Triton >= 3.2); without them the pointer kernel is used
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None

__all__ = ["token_stats_fused_triton", "DEFAULT_CONFIG", "SHAPE_CONFIGS", "choose_fused_config", "persistent_spec"]

# persistent: programs per multiprocessor of the persistent TMA kernel (0: one program per tile); flatten / ws: its
# tile loop pipelined as one with the K loop / warp-specialised; maxnreg: register cap per thread (0: none;
# benchmarks only); branch: mask the columns past V and form the label logit only in the tiles that need it
# (block-uniform branches; 0: in every tile); max_programs: a cap on the persistent programs (0: none).  H100,
# N=16384, H=3584, V=152064 (results/h100/tune_fused.csv): persistent 666 TFLOP/s, one program per tile 595.
DEFAULT_CONFIG = {"bm": 128, "bn": 256, "bk": 64, "group_m": 8, "num_warps": 8, "stages": 3, "moments": 4,
                  "persistent": 1, "flatten": 1, "ws": 0, "maxnreg": 0, "branch": 1, "max_programs": 0}  # fmt: skip
# Per-shape overrides of DEFAULT_CONFIG for 16-bit inputs: (largest hidden size, overrides), first match wins; fp32
# takes DEFAULT_CONFIG.  Small H runs best with the tile loop not flattened, larger H flattened and unbranched
# (benchmarks/RESULTS.md, "Fused head against cuBLAS").
SHAPE_CONFIGS: tuple[tuple[int, dict], ...] = ((1536, {"flatten": 0}), (2**62, {"branch": 0}))
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# logits_dtype -> the epilogue's ROUND code (fp32 logits need no rounding)
_ROUND_CODES = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Row slices are sized so that the partials ([6, rows, ceil(V/BN)] fp32) stay under this.
_WORKSPACE_BYTES = 256 * 2**20


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks sweep the vocabulary together (weight tiles reused in L2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest bf16 (ties to even) -> fp32, by integer ops on the bits (Triton's
    interpreter truncates ``.to(tl.bfloat16)``; the GPU's cvt.rn rounds; this agrees with both the
    GPU and torch).  inf stays inf, NaN stays NaN, finite values past bf16's range round to inf."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _tile_epilogue(acc, pid_m, pid_n, b_ptr, lab_ptr, part_ptr, yk_ptr, N, V, c, inv_t, num_pid_n,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MOMENTS: tl.constexpr,
                   ROUND: tl.constexpr, T_ROUND: tl.constexpr, FTZ: tl.constexpr, BRANCH: tl.constexpr):
    """Reduce one [BM, BN] fp32 logits tile to the six partials per row (and the label logit).

    The partials go to part_ptr, fp32 [6, N, num_pid_n] at this tile's column pid_n: m (the
    NaN-propagating row max of y), the sums s0..s3 against it, and m again as the max the merge
    validates; y_k is stored for the rows whose label lies in the tile.

    ROUND (0: none, 1: bf16, 2: fp16) rounds L = acc + bias to that dtype (round to nearest even);
    with T_ROUND also ``L * inv_t`` (torch's ``low / T``: a multiply by the fp32 reciprocal) is
    rounded, and ``c`` is then ``log2(e)`` alone; otherwise ``c = log2(e) / T``.  FTZ: the
    exponential flushes results below 2^-126 to 0 (:func:`._reduce.exp2`; off in the interpreter).
    """
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn % V).to(tl.float32)[None, :]
    if ROUND == 1:
        acc = _round_bf16(acc)
        if T_ROUND:
            acc = _round_bf16(acc * inv_t)
    elif ROUND == 2:
        acc = acc.to(tl.float16).to(tl.float32)
        if T_ROUND:
            acc = (acc * inv_t).to(tl.float16).to(tl.float32)
    if BRANCH:
        if pid_n * BN + BN > V:  # the last column tile only: columns past V are -inf
            acc = tl.where(rn[None, :] < V, acc, float("-inf"))
    else:
        acc = tl.where(rn[None, :] < V, acc, float("-inf"))
    # y = acc * c with c > 0: the row max of y is c times that of acc (rounding is monotone), and
    # d = y - m is one FMA.  A row whose tile is all -inf (masked vocabulary) keeps m = -inf as its
    # partial's reference but forms d against 0, so that d is -inf (e = 0), never -inf - -inf = NaN.
    m = tl.reduce(acc, 1, max_nan) * c
    m_ref = tl.where(m > float("-inf"), m, 0.0)
    if MOMENTS == 0:  # benchmarks only: the matmul and the row max alone (no exponential; sums 0)
        s0 = tl.zeros_like(m)
        s1 = s0
    else:
        d = tl.maximum(acc * c - m_ref[:, None], -D_FLOOR)
        e = exp2(d, FTZ)
        s0 = tl.sum(e, axis=1)
        s1 = tl.sum(e * d, axis=1)
    if MOMENTS == 4:
        e2 = e * e
        s2 = tl.sum(e2, axis=1)
        s3 = tl.sum(e2 * d, axis=1)
    else:  # benchmarks only: what logp and H alone cost (E_p[S] then reads 0)
        s2 = tl.zeros_like(s0)
        s3 = tl.zeros_like(s0)
    row_ok = rm < N
    labels = tl.load(lab_ptr + rm % N)
    in_tile = row_ok & (labels >= pid_n * BN) & (labels < pid_n * BN + BN)
    # the label's column inside the tile in int32 (an [BM, BN] int64 compare costs twice the
    # registers); rows whose label is not in the tile are masked at the store
    col = tl.where(in_tile, labels - pid_n * BN, -1).to(tl.int32)
    cols = tl.arange(0, BN)
    if BRANCH:
        if tl.max(in_tile.to(tl.int32), axis=0) > 0:  # about one tile in five holds a label of its rows
            yk = tl.sum(tl.where(cols[None, :] == col[:, None], acc, 0.0), axis=1) * c
            tl.store(yk_ptr + rm, yk, mask=in_tile)
    else:
        yk = tl.sum(tl.where(cols[None, :] == col[:, None], acc, 0.0), axis=1) * c
        tl.store(yk_ptr + rm, yk, mask=in_tile)
    stride_f = tl.cast(N, tl.int64) * num_pid_n
    q = part_ptr + rm.to(tl.int64) * num_pid_n + pid_n
    tl.store(q, m, mask=row_ok)
    tl.store(q + stride_f, s0, mask=row_ok)
    tl.store(q + 2 * stride_f, s1, mask=row_ok)
    tl.store(q + 3 * stride_f, s2, mask=row_ok)
    tl.store(q + 4 * stride_f, s3, mask=row_ok)
    tl.store(q + 5 * stride_f, m, mask=row_ok)


@triton.jit
def _fused_tile_kernel(h_ptr, w_ptr, b_ptr, lab_ptr, part_ptr, yk_ptr, N, V, H, stride_h, stride_w, c, inv_t,
                       HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, T_ROUND: tl.constexpr, EVEN_K: tl.constexpr,
                       IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       STAGES: tl.constexpr, MOMENTS: tl.constexpr, FTZ: tl.constexpr, BRANCH: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(N, BM)
    num_pid_n = tl.cdiv(V, BN)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = h_ptr + (rm % N).to(tl.int64)[:, None] * stride_h + rk[None, :]
    b_ptrs = w_ptr + (rn % V).to(tl.int64)[:, None] * stride_w + rk[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(H, BK), num_stages=STAGES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = rk[None, :] < H - k * BK
            a = tl.load(a_ptrs, mask=kmask, other=0.0)
            b = tl.load(b_ptrs, mask=kmask, other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    _tile_epilogue(acc, pid_m, pid_n, b_ptr, lab_ptr, part_ptr, yk_ptr, N, V, c, inv_t, num_pid_n, HAS_BIAS=HAS_BIAS,
                   BM=BM, BN=BN, MOMENTS=MOMENTS, ROUND=ROUND, T_ROUND=T_ROUND, FTZ=FTZ, BRANCH=BRANCH)  # fmt: skip


@triton.jit
def _fused_persistent_kernel(a_desc, w_desc, b_ptr, lab_ptr, part_ptr, yk_ptr, N, V, H, c, inv_t,
                             HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, T_ROUND: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
                             MOMENTS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
                             WARP_SPECIALIZE: tl.constexpr, FTZ: tl.constexpr, BRANCH: tl.constexpr):
    """Persistent variant: NUM_PROGRAMS programs walk the tiles; operands arrive by TMA descriptors.

    With FLATTEN the tile loop and the K loop are pipelined as one, so the loads of the next tile
    are in flight while this tile's epilogue runs.  Out-of-range rows, columns and K are zero-filled
    by the copy engine (columns >= V are then masked to -inf in the epilogue).
    """
    num_pid_m = tl.cdiv(N, BM)
    num_pid_n = tl.cdiv(V, BN)
    k_tiles = tl.cdiv(H, BK)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE,
                         num_stages=STAGES):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        _tile_epilogue(acc, pid_m, pid_n, b_ptr, lab_ptr, part_ptr, yk_ptr, N, V, c, inv_t, num_pid_n,
                       HAS_BIAS=HAS_BIAS, BM=BM, BN=BN, MOMENTS=MOMENTS, ROUND=ROUND, T_ROUND=T_ROUND, FTZ=FTZ,
                       BRANCH=BRANCH)  # fmt: skip


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def persistent_spec(
    cfg: dict, has_bias: bool, round_code: int, t_round: bool, n_prog: int, ftz: bool
) -> tuple[object, dict]:
    """The persistent TMA kernel (:func:`_fused_persistent_kernel`) and a configuration's compile-time arguments."""
    return _fused_persistent_kernel, {"HAS_BIAS": has_bias, "ROUND": round_code, "T_ROUND": t_round, "BM": cfg["bm"],
                                      "BN": cfg["bn"], "BK": cfg["bk"], "GROUP_M": cfg["group_m"],
                                      "STAGES": cfg["stages"], "MOMENTS": cfg["moments"], "NUM_PROGRAMS": n_prog,
                                      "FTZ": ftz, "BRANCH": bool(cfg["branch"]), "FLATTEN": bool(cfg["flatten"]),
                                      "WARP_SPECIALIZE": bool(cfg["ws"])}  # fmt: skip


def _use_persistent(cfg: dict, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """The persistent TMA kernel runs when asked for, on 16-bit inputs the copy engine can address.

    TMA needs 16-byte aligned row strides and bases (H a multiple of 8 for 16-bit data) and a
    Hopper-or-newer GPU; fp32 inputs keep the pointer kernel (its full-precision dot).
    """
    if not cfg["persistent"] or TensorDescriptor is None or hidden.dtype == torch.float32:
        return False
    if hidden.device.type == "cuda" and torch.cuda.get_device_capability(hidden.device)[0] < 9:
        return False
    return all(t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (hidden, weight))


def choose_fused_config(hdim: int, dtype: torch.dtype) -> dict:
    """The kernel configuration for hidden size ``hdim``: DEFAULT_CONFIG with the overrides of the
    first SHAPE_CONFIGS entry whose bound holds (16-bit inputs), else DEFAULT_CONFIG.  The sweep
    found no N dependence beyond its noise (N = 4096, 16384, 65536)."""
    if dtype != torch.float32:
        for h_max, over in SHAPE_CONFIGS:
            if hdim <= h_max:
                return {**DEFAULT_CONFIG, **over}
    return dict(DEFAULT_CONFIG)


def token_stats_fused_triton(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None, temperature: float,
    ignore_index: int, *, config: dict | None = None, rows_per_launch: int | None = None,
    logits_dtype: torch.dtype | None = None, temperature_in_logits_dtype: bool = False,
) -> KernelStats:
    """Statistics of z = (hidden @ weight.T + bias) / T without materialising [N, V] logits.

    hidden [N, H], weight [V, H] (bf16/fp16/fp32, same dtype, CUDA, last dim contiguous), bias [V] or None, labels
    [N] int64.  Returns :class:`.triton_stats.KernelStats` (fp32 [N] statistics, bool ``valid``, int32 error
    counters).  Matmul in the input dtype on tensor cores with fp32 accumulation (fp32 inputs: the slow "ieee" dot),
    in row slices of ``rows_per_launch`` (default: partials <= 256 MiB).  ``config`` overrides
    :func:`choose_fused_config` (benchmarks; ``moments=2`` skips sum p^2 and E_p[S], which read 0; ``moments=0``
    every exponential, a timing floor).  ``logits_dtype`` rounds L = hidden @ W.T + b in the epilogue,
    z = fp32(round(L)) / T; with ``temperature_in_logits_dtype`` z = fp32(round(round(L) * fp32(1/T))), as torch's
    ``low_logits / T`` (``entropy_discriminator.token_stats_from_hidden``).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight must share a bf16/fp16/fp32 dtype, got {hidden.dtype}, {weight.dtype}")
    if not interpreting() and hidden.device.type != "cuda":
        raise ValueError(f"hidden must be a CUDA tensor, got device {hidden.device}")
    unknown = sorted(set(config or {}) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(f"config has unknown keys {unknown}; the keys are {sorted(DEFAULT_CONFIG)}")
    n_rows, hdim = hidden.shape
    vocab = weight.shape[0]
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    labels = labels.to(device=hidden.device, dtype=torch.int64).contiguous()
    dev = hidden.device
    out = torch.empty((5, n_rows), device=dev, dtype=torch.float32)
    valid = torch.empty(n_rows, device=dev, dtype=torch.bool)
    errors = torch.zeros(ERR_WORDS, device=dev, dtype=torch.int32)
    result = KernelStats(*out.unbind(0), valid, errors)
    if n_rows == 0:
        return result
    cfg = {**choose_fused_config(hdim, hidden.dtype), **(config or {})}
    # num_stages also pipelines the persistent kernel's inner K loop when the tile loop is not flattened
    launch_opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["stages"],
                   **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {})}  # fmt: skip
    ftz = not interpreting()
    bm, bn, bk = cfg["bm"], cfg["bn"], cfg["bk"]
    persistent = _use_persistent(cfg, hidden, weight)
    n_tiles = triton.cdiv(vocab, bn)
    if rows_per_launch is None:
        rows_per_launch = max(bm, (_WORKSPACE_BYTES // (24 * n_tiles)) // bm * bm)
    if logits_dtype not in _ROUND_CODES:
        raise ValueError(f"logits_dtype must be None or one of {_DTYPES}, got {logits_dtype!r}")
    if temperature_in_logits_dtype and logits_dtype is None:
        raise ValueError("temperature_in_logits_dtype=True needs a logits_dtype to round to")
    round_code = _ROUND_CODES[logits_dtype]
    t_round = bool(temperature_in_logits_dtype) and round_code != 0  # fp32: round(L / T) = L / T
    # torch's `low / T` multiplies by the reciprocal computed in fp32 (its CPU and CUDA kernels)
    inv_t = float(np.float32(1.0) / np.float32(temperature))
    c = LOG2E if t_round else LOG2E / float(temperature)
    bias_arg = bias.contiguous() if bias is not None else hidden
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk]) if persistent else None
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        for r0 in range(0, n_rows, rows_per_launch):
            r1 = min(n_rows, r0 + rows_per_launch)
            rows = r1 - r0
            part = torch.empty((6, rows, n_tiles), device=dev, dtype=torch.float32)
            yk = torch.full((rows,), float("nan"), device=dev, dtype=torch.float32)
            lab = labels[r0:r1]
            n_all = triton.cdiv(rows, bm) * n_tiles
            if persistent:
                n_prog = min(n_all, cfg["persistent"] * _num_sms(dev), cfg["max_programs"] or n_all)
                kernel, consts = persistent_spec(cfg, bias is not None, round_code, t_round, n_prog, ftz)
                kernel[(n_prog,)](
                    TensorDescriptor.from_tensor(hidden[r0:r1], [bm, bk]), w_desc, bias_arg, lab, part, yk,
                    rows, vocab, hdim, c, inv_t, **consts, **launch_opts,
                )  # fmt: skip
            else:
                _fused_tile_kernel[(n_all,)](
                    hidden[r0:r1], weight, bias_arg, lab, part, yk, rows, vocab, hdim,
                    hidden.stride(0), weight.stride(0), c, inv_t,
                    HAS_BIAS=bias is not None, ROUND=round_code, T_ROUND=t_round, EVEN_K=hdim % bk == 0, IEEE=hidden.dtype == torch.float32,
                    BM=bm, BN=bn, BK=bk, GROUP_M=cfg["group_m"], STAGES=cfg["stages"], MOMENTS=cfg["moments"],
                    FTZ=ftz, BRANCH=bool(cfg["branch"]), **launch_opts,
                )  # fmt: skip
            merge_kernel[(rows,)](
                part, yk, lab, out[:, r0:], valid[r0:], errors, rows, n_rows, n_tiles, vocab, int(ignore_index),
                PB=merge_block(n_tiles), num_warps=4 if n_tiles >= 128 else 1,
            )  # fmt: skip
    return result
