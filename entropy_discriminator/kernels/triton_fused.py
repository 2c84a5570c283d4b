"""Fused LM-head statistics: logits = hidden @ weight.T (+ bias) never reach device memory.

z = (hidden @ weight.T + bias) / T in base-2 units y = z log2(e) (:mod:`._reduce`), with hidden [N, H] and weight
[V, H] in bf16/fp16/fp32, fp32 accumulation.  Two schedules write the same partials, fp32 [6, N, P]: per row and
partial j, the reference m_j (the NaN-propagating max of y over the partial's columns), the sums s0..s3 against it
(against 0 when m_j is -inf: the sums are then 0), and m_j again as the max the merge validates; the label's y_k
(rounding included) comes from its own kernel, :func:`_label_kernel`, launched first, into fp32 [N].
:func:`._reduce.merge_kernel` then merges the P partials of every row in a fixed order and writes the statistics,
``valid`` and the error counters.  Forward only (the statistics are used under no_grad).

- Streaming (:func:`_fused_stream_kernel`; 16-bit inputs with TMA-addressable strides on Hopper or newer): each
  program owns BM rows and one chunk of the vocabulary (P = S chunks) and walks the chunk's [BM, BN] logits tiles
  with TMA-loaded operands, the V and K loops pipelined as one, keeping running statistics per row; the chunk
  count and a grouped program order come from :func:`stream_plan` (fill one wave at the compiled occupancy; keep
  the hidden blocks in flight within L2), and :func:`stream_slices` may split the rows into a body of whole waves
  and a tail, each its own launch.
- Warp-specialised (:mod:`.gluon_fused`; the streaming kernel's inputs on sm_90 below H = :data:`EXACT_WAVE_FROM_H`,
  :func:`_gluon_ok`): the same plan, tiles and per-tile operations, with a TMA producer warp and two consumer warp
  groups taking turns so that each tile's statistics run while the other's matmul does.
- Per tile (:func:`_fused_tile_kernel`; fp32, unaligned strides, pre-Hopper GPUs): one program per [BM, BN] tile
  (in groups of GROUP_M row blocks), operands through pointers, P = ceil(V / BN) partials.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
import triton
import triton.language as tl

from . import interpreting
from ._reduce import D_FLOOR, ERR_WORDS, LOG2E, exp2, max_nan, merge_block, merge_kernel, rescale
from .triton_stats import KernelStats

try:  # host-side TMA descriptors (Triton >= 3.2); without them the pointer kernel is used
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None

__all__ = ["token_stats_fused_triton", "DEFAULT_CONFIG", "stream_plan", "stream_slices", "stream_spec"]

# Tiles: bm x bn logits, bk deep K steps, num_warps, stages (both kernels); moments (4: every statistic; 2: logp and
# H alone, sum p^2 and E_p[S] read 0; 0: the matmul and the row max alone, a timing floor); branch: the per-tile
# kernel masks the columns past V only in the last column tile (a block-uniform branch; 0: in every tile); maxnreg:
# register cap per thread (0: none; benchmarks only).
# stream: 1 runs the streaming TMA kernel where the inputs allow it (0: the per-tile pointer kernel);
# flatten: its V and K loops pipelined as one (1), or not (0; -1: not where :func:`stream_slices` splits the rows
# into a body and a tail, else as one); chunks / group_rows: its vocabulary chunks and row blocks per group
# (0: :func:`stream_plan`'s rule); group_mib: the rule's L2 budget for a group's hidden blocks (MiB).  group_m:
# the per-tile kernel's row blocks per group.  128 x 256 x 64 tiles, 8 warps, 3 stages, flattened: the streaming
# schedule's best tiles on an H200 (benchmarks/fused_ws_probe.py, benchmarks/RESULTS.md).
# gluon: 1 runs the warp-specialised Gluon kernel (:mod:`.gluon_fused`) where it applies (:func:`_gluon_ok`), 0 never.
DEFAULT_CONFIG = {"bm": 128, "bn": 256, "bk": 64, "num_warps": 8, "stages": 3, "moments": 4, "branch": 1,
                  "maxnreg": 0, "stream": 1, "flatten": -1, "chunks": 0, "group_rows": 0,
                  "group_mib": 16, "group_m": 8, "gluon": 1}  # fmt: skip
# The streaming Triton kernel's own keys: a caller's config that sets one of them asks for that kernel.
_STREAM_KEYS = ("bm", "bn", "bk", "num_warps", "stages", "moments", "branch", "maxnreg", "flatten")
# From this hidden size on, with 8 or more groups of row blocks, :func:`stream_plan` widens a group to fill the wave
# (H200, N 65536: 3-5 % faster at H 1536 and 2048; H 896 1-2 % slower; 4 groups: neutral or slower).
FILL_WAVE_FROM_H = 1536
# From this hidden size on, under the same condition, :func:`stream_plan` takes the group (within the L2 budget)
# whose chunks fill the wave most exactly (H200, H 3584: 11 x 12 programs ran 1.019-1.020x cuBLAS at N 65536
# against 1.065-1.080x for 7 x 18, and 1.047-1.048x for the per-tile persistent kernel this replaced).
EXACT_WAVE_FROM_H = 3072
# Under that rule the chunks are then split k-fold (k S chunks, each at least this many tiles) where the launch
# fills its last wave more fully, so that a smaller last group leaves no SM idle (H200, H 3584 and 5120, N 16384:
# 33 x 12 programs of 18 tiles ran 0.991-1.002x cuBLAS against 1.011-1.030x for 11 x 12 of 54 tiles).
SPLIT_MIN_TILES = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# logits_dtype -> the epilogue's ROUND code (fp32 logits need no rounding)
_ROUND_CODES = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Rows and K step of the label logits' own kernel (:func:`_label_kernel`): H200, fp16, N 4096: 11 us at H 896 and
# 21 us at H 2048, against 59 and 128 us in the 128 x 64 blocks the streaming kernel's programs used to form.
_LABEL_BM, _LABEL_BK = 8, 512
# Row slices are sized so that the partials ([6, rows, P] fp32) stay under this.
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
def _round_logits(acc, inv_t, ROUND: tl.constexpr, T_ROUND: tl.constexpr):
    """L = acc (+ bias) rounded as ROUND says (0: none, 1: bf16, 2: fp16; round to nearest even), and with T_ROUND
    ``L * inv_t`` rounded again (torch's ``low / T``: a multiply by the fp32 reciprocal)."""
    if ROUND == 1:
        acc = _round_bf16(acc)
        if T_ROUND:
            acc = _round_bf16(acc * inv_t)
    elif ROUND == 2:
        acc = acc.to(tl.float16).to(tl.float32)
        if T_ROUND:
            acc = (acc * inv_t).to(tl.float16).to(tl.float32)
    return acc


@triton.jit
def _base2(x, c, c_lo):
    """x (c + c_lo) rounded once: c + c_lo is log2(e) / T (or log2(e)) to about 2^-48 (the fp32 c alone, off by up
    to 2^-25, moved log p by 1e-5 at |z| ~ 300); infinite and NaN x skip the correction (inf * c_lo may be -inf)."""
    return tl.fma(x, c, tl.where(tl.abs(x) < float("inf"), x * c_lo, 0.0))


@triton.jit
def _label_kernel(h_ptr, w_ptr, b_ptr, lab_ptr, yk_ptr, N, V, H, stride_h, stride_w, c, c_lo, inv_t,
                  HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, T_ROUND: tl.constexpr, BM: tl.constexpr,
                  BK: tl.constexpr):
    """Store y_k = :func:`_base2` (round(hidden[r] . weight[k] + bias[k])) at ``yk_ptr + r`` for the BM rows
    r = program_id * BM ... below N: NaN where the label k lies outside [0, V) (products and sums in fp32; rounding
    as :func:`_round_logits`).  Launched before every fused kernel, ceil(N / BM) programs.

    The label logit is formed apart from the logits tiles (a compare and select over every tile costs the matmul
    loop 2-8 %; label rows inside the kernels' programs delayed them), so it may differ from the tiles' value in the
    last bits: the merge caps y_k at the row max."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    labels = tl.load(lab_ptr + rm, mask=rm < N, other=-1)
    ok = (rm < N) & (labels >= 0) & (labels < V)
    h_rows = h_ptr + tl.where(ok, rm, 0).to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + tl.where(ok, labels, 0).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        msk = ok[:, None] & (rk[None, :] < H)
        a = tl.load(h_rows + rk[None, :], mask=msk, other=0.0).to(tl.float32)
        acc += tl.sum(a * tl.load(w_rows + rk[None, :], mask=msk, other=0.0).to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.where(ok, labels, 0), mask=ok, other=0.0).to(tl.float32)
    yk = _base2(_round_logits(acc, inv_t, ROUND=ROUND, T_ROUND=T_ROUND), c, c_lo)
    tl.store(yk_ptr + rm, tl.where(ok, yk, float("nan")), mask=rm < N)


@triton.jit
def _store_partials(part_ptr, rm, row_ok, N, n_cols, col, m, s0, s1, s2, s3):
    """Store rows ``rm``'s partials at column ``col`` of part_ptr, fp32 [6, N, n_cols]: m, s0..s3, and m again (the
    max the merge validates); rows past N (``row_ok`` False) are not stored."""
    stride_f = tl.cast(N, tl.int64) * n_cols
    q = part_ptr + rm.to(tl.int64) * n_cols + col
    tl.store(q, m, mask=row_ok)
    tl.store(q + stride_f, s0, mask=row_ok)
    tl.store(q + 2 * stride_f, s1, mask=row_ok)
    tl.store(q + 3 * stride_f, s2, mask=row_ok)
    tl.store(q + 4 * stride_f, s3, mask=row_ok)
    tl.store(q + 5 * stride_f, m, mask=row_ok)


@triton.jit
def _tile_epilogue(acc, pid_m, pid_n, b_ptr, part_ptr, N, V, c, c_lo, inv_t, num_pid_n, HAS_BIAS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, MOMENTS: tl.constexpr, ROUND: tl.constexpr,
                   T_ROUND: tl.constexpr, FTZ: tl.constexpr, BRANCH: tl.constexpr):
    """Reduce one [BM, BN] fp32 logits tile to the six partials per row.

    The partials go to part_ptr, fp32 [6, N, num_pid_n] at this tile's column pid_n: m (the
    NaN-propagating row max of y), the sums s0..s3 against it, and m again as the max the merge
    validates.

    ROUND / T_ROUND: :func:`_round_logits`; with T_ROUND ``c`` is ``log2(e)`` alone, otherwise
    ``c = log2(e) / T``.  FTZ: the exponential flushes results below 2^-126 to 0
    (:func:`._reduce.exp2`; off in the interpreter).
    """
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn % V).to(tl.float32)[None, :]
    acc = _round_logits(acc, inv_t, ROUND=ROUND, T_ROUND=T_ROUND)
    if (pid_n * BN + BN > V) if BRANCH else True:  # BRANCH: the last column tile only; columns past V are -inf
        acc = tl.where(rn[None, :] < V, acc, float("-inf"))
    # y = acc c with c > 0: the row max m of y is that of acc times c (rounding is monotone), and d = y - m is
    # one FMA.  A row whose tile is all -inf (masked vocabulary) keeps m = -inf as its partial's reference but
    # forms d against 0, so that d is -inf (e = 0), never -inf - -inf = NaN.
    m = _base2(tl.reduce(acc, 1, max_nan), c, c_lo)
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
    _store_partials(part_ptr, rm, rm < N, N, num_pid_n, pid_n, m, s0, s1, s2, s3)


@triton.jit
def _fused_tile_kernel(h_ptr, w_ptr, b_ptr, part_ptr, N, V, H, stride_h, stride_w, c, c_lo, inv_t,
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
    _tile_epilogue(acc, pid_m, pid_n, b_ptr, part_ptr, N, V, c, c_lo, inv_t, num_pid_n, HAS_BIAS=HAS_BIAS, BM=BM,
                   BN=BN, MOMENTS=MOMENTS, ROUND=ROUND, T_ROUND=T_ROUND, FTZ=FTZ, BRANCH=BRANCH)  # fmt: skip


@triton.jit
def _stream_tile(a_desc, w_desc, rb, t, H, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr):
    """fp32 [BM, BN] = hidden[rb*BM : +BM] @ weight[t*BN : +BN].T over K = H in BK steps, operands by TMA (rows,
    columns and K past the tensors' ends are zero-filled by the copy engine)."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(H, BK), num_stages=STAGES):
        a = a_desc.load([rb * BM, kk * BK])
        b = w_desc.load([t * BN, kk * BK])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _fold_tile(x, c, c_lo, m, s0, s1, s2, s3, MOMENTS: tl.constexpr, FTZ: tl.constexpr):
    """Fold one tile of logits x (fp32 [BM, BN]; bias and rounding applied), in base 2 y = x c, into each row's
    running statistics.

    m: the NaN-propagating running max of y (:func:`_base2` of x's row max); s0..s3 (:mod:`._reduce`) against
    m_ref = m, or 0 while m is -inf (the sums are then 0).  On a new max the sums move with
    :func:`._reduce.rescale`; d = y - m_ref (one FMA of x) is clamped at -D_FLOOR (-inf logits: e = 0 and e d = 0).
    MOMENTS: 4 all sums, 2 s0 and s1 (s2, s3 stay 0), 0 the max alone (a timing floor)."""
    m_new = max_nan(m, _base2(tl.reduce(x, 1, max_nan), c, c_lo))
    if MOMENTS != 0:
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        s0, s1, s2, s3 = rescale(s0, s1, s2, s3, m, m_ref)
        d = tl.maximum(tl.fma(x, c, -m_ref[:, None]), -D_FLOOR)
        e = exp2(d, FTZ)
        s0 += tl.sum(e, axis=1)
        s1 += tl.sum(e * d, axis=1)
        if MOMENTS == 4:
            e2 = e * e
            s2 += tl.sum(e2, axis=1)
            s3 += tl.sum(e2 * d, axis=1)
    return m_new, s0, s1, s2, s3


@triton.jit
def _stream_coords(N, group_rows, BM: tl.constexpr):
    """(row block, chunk, chunks) of this program in the streaming order: the grid is ceil(N / BM) row blocks x
    the chunks; the row blocks form groups of ``group_rows`` (the last may be smaller), and within a group the row
    block runs fastest, then the chunk."""
    pid = tl.program_id(0)
    num_rb = tl.cdiv(N, BM)
    n_chunks = tl.num_programs(0) // num_rb
    per_group = group_rows * n_chunks
    gid = pid // per_group
    first = gid * group_rows
    gsize = tl.minimum(num_rb - first, group_rows)
    local = pid - gid * per_group
    return first + local % gsize, local // gsize, n_chunks


@triton.jit(do_not_specialize=["tiles_per_chunk", "group_rows"])
def _fused_stream_kernel(a_desc, w_desc, b_ptr, part_ptr, N, V, H, tiles_per_chunk, group_rows, c, c_lo, inv_t,
                         HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, T_ROUND: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, MOMENTS: tl.constexpr,
                         FLATTEN: tl.constexpr, FTZ: tl.constexpr):
    """Row-stationary streaming schedule: one program, BM rows x one chunk of the vocabulary.

    The grid is ceil(N / BM) row blocks x S chunks of ``tiles_per_chunk`` [BM, BN] tiles (the last chunk may be
    shorter).  Program order: the row blocks form groups of ``group_rows`` (the last may be smaller); a group's
    programs run together, row block fastest, then chunk, so the programs in flight share the group's hidden
    blocks and each W tile in L2 (``group_rows`` >= the row blocks: plain row order).  Each program walks its
    chunk's tiles (with FLATTEN the V and K loops pipelined as one: the next tile's loads in flight during this
    tile's epilogue), forms each tile's final logits (bias, rounding: as :func:`_tile_epilogue`), folds them into
    running statistics (:func:`_fold_tile`).  The last, partial vocabulary tile is peeled off the loop (columns
    >= V set to -inf there only).  It writes its chunk's partials to part_ptr, fp32 [6, N, S] at column ``chunk``:
    m, s0..s3 against m (0 when m is -inf), and m again as the max the merge validates: the per-tile partials of
    :func:`_tile_epilogue`, over a chunk of tiles.
    """
    rb, chunk, n_chunks = _stream_coords(N, group_rows, BM)
    n_full = V // BN  # tiles with no column past V
    t0 = chunk * tiles_per_chunk
    t1 = tl.minimum(t0 + tiles_per_chunk, tl.cdiv(V, BN))
    t1f = tl.minimum(t1, n_full)
    rm = rb * BM + tl.arange(0, BM)
    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    s0 = tl.zeros([BM], dtype=tl.float32)
    s1 = tl.zeros([BM], dtype=tl.float32)
    s2 = tl.zeros([BM], dtype=tl.float32)
    s3 = tl.zeros([BM], dtype=tl.float32)
    for t in tl.range(t0, t1f, flatten=FLATTEN):
        acc = _stream_tile(a_desc, w_desc, rb, t, H, BM=BM, BN=BN, BK=BK, STAGES=STAGES)
        if HAS_BIAS:  # a full tile: every column < V
            acc += tl.load(b_ptr + t * BN + tl.arange(0, BN)).to(tl.float32)[None, :]
        x = _round_logits(acc, inv_t, ROUND=ROUND, T_ROUND=T_ROUND)
        m, s0, s1, s2, s3 = _fold_tile(x, c, c_lo, m, s0, s1, s2, s3, MOMENTS=MOMENTS, FTZ=FTZ)
    if t1 > n_full:  # this chunk holds the last, partial tile: peeled so that the loop has no column mask
        acc = _stream_tile(a_desc, w_desc, rb, n_full, H, BM=BM, BN=BN, BK=BK, STAGES=STAGES)
        rn = n_full * BN + tl.arange(0, BN)
        x = acc + (tl.load(b_ptr + rn, mask=rn < V, other=0.0).to(tl.float32)[None, :] if HAS_BIAS else 0.0)
        x = tl.where(rn[None, :] < V, _round_logits(x, inv_t, ROUND=ROUND, T_ROUND=T_ROUND), float("-inf"))
        m, s0, s1, s2, s3 = _fold_tile(x, c, c_lo, m, s0, s1, s2, s3, MOMENTS=MOMENTS, FTZ=FTZ)
    _store_partials(part_ptr, rm, rm < N, N, n_chunks, chunk, m, s0, s1, s2, s3)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def stream_spec(cfg: dict, has_bias: bool, round_code: int, t_round: bool, ftz: bool) -> tuple[object, dict]:
    """The streaming TMA kernel (:func:`_fused_stream_kernel`) and a configuration's compile-time arguments."""
    return _fused_stream_kernel, {"HAS_BIAS": has_bias, "ROUND": round_code, "T_ROUND": t_round, "BM": cfg["bm"],
                                  "BN": cfg["bn"], "BK": cfg["bk"], "STAGES": cfg["stages"],
                                  "MOMENTS": cfg["moments"], "FLATTEN": bool(cfg["flatten"]), "FTZ": ftz}  # fmt: skip


def _schedule(cfg: dict, config: dict | None, hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """``"gluon"``, ``"stream"`` or ``"tile"``: which kernel runs (``cfg``'s ``branch`` set to 0 when the caller's
    ``config`` chooses the per-tile kernel for inputs the streaming kernel takes and leaves ``branch`` unset)."""
    if not _tma_ok(hidden, weight):
        return "tile"
    if "branch" not in (config or {}) and not cfg["stream"]:
        cfg["branch"] = 0
    if cfg["stream"] and cfg["gluon"] and _gluon_ok(hidden, config):
        return "gluon"
    return "stream" if cfg["stream"] else "tile"


def _gluon_ok(hidden: torch.Tensor, config: dict | None) -> bool:
    """Whether the warp-specialised Gluon kernel takes these (TMA-addressable, 16-bit) inputs: a Hopper GPU (sm_90:
    its wgmma), H below :data:`EXACT_WAVE_FROM_H` (the sizes it was measured at, H200), Triton 3.6 (the Gluon API
    it was written and tested against), and a ``config`` that sets none of the streaming kernel's own keys
    (:data:`_STREAM_KEYS`)."""
    if hidden.device.type != "cuda" or not triton.__version__.startswith("3.6."):
        return False
    if torch.cuda.get_device_capability(hidden.device) != (9, 0):
        return False
    if hidden.shape[1] >= EXACT_WAVE_FROM_H or set(config or {}) & set(_STREAM_KEYS):
        return False
    try:
        from . import gluon_fused  # noqa: F401
    except ImportError:  # a Triton without Gluon's Hopper API
        return False
    return True


def _tma_ok(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the TMA kernels can take these inputs: 16-bit, on a Hopper-or-newer GPU, 16-byte aligned row strides
    and bases (H a multiple of 8); fp32 inputs keep the pointer kernel (its full-precision dot)."""
    if TensorDescriptor is None or hidden.dtype == torch.float32:
        return False
    if hidden.device.type == "cuda" and torch.cuda.get_device_capability(hidden.device)[0] < 9:
        return False
    return all(t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (hidden, weight))


@functools.lru_cache(maxsize=512)
def stream_plan(rows: int, vocab: int, hdim: int, elt: int, bm: int, bn: int, wave: int, chunks: int = 0,
                group_rows: int = 0, group_mib: float = 16.0) -> tuple[int, int, int]:
    """(tiles per chunk, chunks S, row blocks per group G) of the streaming kernel for ``rows`` rows.

    rb = ceil(rows / bm) row blocks, T = ceil(vocab / bn) tiles, ``wave`` programs resident at once (SMs x the
    compiled kernel's occupancy), gmax = floor(group_mib MiB / (bm hdim elt)) row blocks whose hidden blocks fit
    the L2 budget.

    - G: ``group_rows`` when given (> 0); else rb (row order) when rb <= gmax; else gmax evened out over the
      groups, ceil(rb / ceil(rb / gmax)).
    - S: ``chunks`` when given (> 0); else, in the grouped order, floor(wave / G) (one group per wave: its programs
      share the group's hidden blocks and each W tile in L2); else (row order) the smallest S in [1, T] whose
      estimate ceil(rb S / wave) (ceil(T / S) + 1) (waves x the tiles of a chunk, plus about one tile's worth for
      a program's pipeline fill and partials) is within 2 % of the least.
    - S is clipped to [1, T] and evened: tiles per chunk ceil(T / S), S = ceil(T / that) (no empty chunk); one
      chunk makes every order the row order (G = rb).
    - With neither given and rb >= 8 G (grouped order): from hdim = :data:`EXACT_WAVE_FROM_H`, G becomes the
      k in [1, min(gmax, wave)] whose evened S = floor(wave / k) fills the wave most (S k the largest, then k the
      largest); then S becomes the multiple k S (evened, still a multiple of S, at least :data:`SPLIT_MIN_TILES` tiles
      per chunk) with the least estimate ceil(rb k S / wave) ceil(T / (k S)), the fewest chunks among equals: a
      group's programs fill k waves, and a last, smaller group no longer leaves SMs idle.  Below it, from hdim =
      :data:`FILL_WAVE_FROM_H`, G widens to min(rb, floor(wave / S)): one group fills the wave, so that a wave's
      programs do not span two groups.

    On an H200 (132 SMs, occupancy 1; bm 128, bn 256, bf16; V 151936 / 152064) this gives, (H, N): S, G:
    (896, 4096) 4, row order; (896, 16384 and 65536) 2, 64; (1536 and 2048, 4096) 4, row order;
    (1536, 16384) 4, 32; (1536, 65536) 3, 44; (2048, 16384) 4, 32; (2048, 65536) 4, 33; (3584, 4096) 8, 16;
    (3584, 16384 and 65536) 33, 12; (5120, 4096) 12, 11; (5120, 16384 and 65536) 33, 12.
    """
    rb = -(-rows // bm)
    nvt = -(-vocab // bn)
    gmax = max(1, int(group_mib * 2**20) // (bm * hdim * elt))
    if group_rows > 0:
        g = min(group_rows, rb)
    elif rb <= gmax:
        g = rb
    else:
        g = -(-rb // -(-rb // gmax))
    if chunks > 0:
        s = chunks
    elif g < rb:
        s = max(1, wave // g)
    else:
        cost = {k: _waves_estimate(rows, bm, wave, -(-nvt // k), k) for k in range(1, nvt + 1)}
        best = min(cost.values())
        s = min(k for k, v in cost.items() if v <= 1.02 * best)
    tpc, s = _evened(s, nvt)
    if chunks <= 0 and group_rows <= 0 and rb >= 8 * g:
        if hdim >= EXACT_WAVE_FROM_H:
            g = max(range(1, min(gmax, rb, wave) + 1), key=lambda k: (_evened(wave // k, nvt)[1] * k, k))
            tpc, s = _evened(wave // g, nvt)
            splits = [_evened(k * s, nvt) for k in range(2, nvt // s + 1)]
            splits = [(tk, sk) for tk, sk in splits if sk % s == 0 and tk >= SPLIT_MIN_TILES]
            tpc, s = min([(tpc, s), *splits], key=lambda o: -(-rb * o[1] // wave) * o[0])  # ties: the fewest chunks
        elif hdim >= FILL_WAVE_FROM_H:
            g = min(rb, max(g, wave // s))
    return tpc, s, (rb if s == 1 else g)


@functools.lru_cache(maxsize=512)
def stream_slices(rows: int, vocab: int, hdim: int, elt: int, bm: int, bn: int, wave: int,
                  group_mib: float = 16.0) -> tuple[tuple[int, int, int, int], ...]:
    """The streaming kernel's launches for ``rows`` rows under the default rule: a tuple of (rows, tiles per chunk,
    chunks S, row blocks per group G), one per launch, in row order, the rows summing to ``rows``.

    One launch of :func:`stream_plan`'s (tpc, S, G), unless, below H = :data:`EXACT_WAVE_FROM_H`, its grouped order
    (G < rb = ceil(rows / bm)) leaves part of the last wave idle where whole groups could fill it: with S dividing
    ``wave``, W = wave / S row blocks make a group of exactly one wave.  Then a body of the largest multiple of W
    row blocks runs (tpc, S, W), and the remaining row blocks (the tail) run next, planned alone by
    :func:`stream_plan`; taken when the estimate waves x (tiles per chunk + 1), summed over the launches as in
    :func:`stream_plan`, is below the one launch's.  Such a body and tail run their V and K loops unflattened
    (:data:`DEFAULT_CONFIG`'s ``flatten`` -1).

    On an H200 (wave 132; bm 128, bn 256, bf16), (H, N): body + tail row blocks, their chunks: (896, 16384)
    66 + 62, 2 and 17; (896, 65536) 462 + 50, 2 and 13; (1536 and 2048, 16384) 99 + 29, 4 and 9; (1536, 65536)
    484 + 28, 3 and 9; (2048, 65536) 495 + 17, 4 and 15.  Their one-launch plans fill 128 of 132 SMs in the last
    wave (N a power of two); a probe ran the split unflattened 1-6 % faster than the one launch at all twelve
    (benchmarks/results/h200/slices_2026-11-30/).  Row order (N 4096 there) stays one launch: a body and tail,
    or a short last chunk whose row blocks the 4 free SMs took in turn, ran up to 2.5 and 3.6 % slower.
    """
    tpc, s, g = stream_plan(rows, vocab, hdim, elt, bm, bn, wave, group_mib=group_mib)
    rb, whole = -(-rows // bm), wave // s
    one = ((rows, tpc, s, g),)
    if hdim >= EXACT_WAVE_FROM_H or not g < rb or s == 1 or wave % s or whole > rb:
        return one
    body = rb // whole * whole * bm
    parts = ((min(body, rows), tpc, s, whole),)
    if rows > body:
        parts += ((rows - body, *stream_plan(rows - body, vocab, hdim, elt, bm, bn, wave, group_mib=group_mib)),)
    cost = sum(_waves_estimate(n, bm, wave, t, c) for n, t, c, _ in parts)
    return parts if cost < _waves_estimate(rows, bm, wave, tpc, s) else one


def _waves_estimate(rows: int, bm: int, wave: int, tpc: int, chunks: int) -> int:
    """ceil(ceil(rows / bm) chunks / wave) (tpc + 1): waves x the tiles of a chunk, plus about one tile's worth for
    a program's pipeline fill and partials."""
    return -(-(-(-rows // bm)) * chunks // wave) * (tpc + 1)


def _evened(s: int, nvt: int) -> tuple[int, int]:
    """(tiles per chunk, chunks) for about ``s`` chunks of ``nvt`` tiles: s clipped to [1, nvt], then
    ceil(nvt / s) tiles per chunk and as many chunks as that needs (no empty chunk)."""
    tpc = -(-nvt // max(1, min(s, nvt)))
    return tpc, -(-nvt // tpc)


def row_order_extras(rows: int, vocab: int, bm: int, bn: int, wave: int, tpc: int, chunks: int,
                     group_rows: int) -> tuple[int, int] | None:
    """(tiles per chunk c, row blocks per extra program R) that balance a row-order plan over a part-filled wave,
    or None.

    A plan in row order (``group_rows`` >= rb = ceil(rows / bm)) whose rb ``chunks`` programs leave E = wave - rb
    ``chunks`` SMs idle runs (:func:`.gluon_fused.ws_kernel`'s ``extra_rows``) its chunks c = ceil(R T / (1 + R
    chunks)) tiles long (T = ceil(vocab / bn) tiles, R = ceil(rb / E)), and ceil(rb / R) extra programs take the
    T - c chunks tiles left, R row blocks each: the longest program does max(c, R (T - c chunks)) tiles instead of
    ``tpc``.  None where that is not shorter, nothing is left over, or the plan is grouped.  On an H200 (wave 132,
    bm 128, bn 256) at N 4096, V 151936: 4 chunks of 144 tiles and 4 extra programs of 8 row blocks x 18 tiles,
    where the plan's 4 chunks of 149 tiles left 4 SMs idle."""
    rb, nvt = -(-rows // bm), -(-vocab // bn)
    spare = wave - rb * chunks
    if group_rows < rb or spare <= 0:
        return None
    r = -(-rb // spare)
    c = -(-r * nvt // (1 + r * chunks))
    if c * chunks >= nvt or max(c, r * (nvt - c * chunks)) >= tpc:
        return None
    return c, r


# programs per SM of the compiled streaming kernel, by (device, compile-time arguments, launch options, dtype)
_OCCUPANCY: dict[tuple, int] = {}


def _programs_per_wave(kernel, make_args, consts: dict, launch_opts: dict, dtype: torch.dtype,
                       device: torch.device) -> int:
    """SMs x programs per SM of ``kernel`` as compiled for the arguments ``make_args()`` and these options: the
    registers and shared memory of the compiled kernel against the SM's (compiled and read once per device,
    dtype and configuration; the interpreter: one program per SM)."""
    if device.type != "cuda":
        return _num_sms(device)
    key = (device.index, dtype, tuple(sorted(consts.items())), tuple(sorted(launch_opts.items())))
    occ = _OCCUPANCY.get(key)
    if occ is None:
        compiled = kernel.warmup(*make_args(), grid=(1,), **consts, **launch_opts)
        if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
            compiled = compiled.result()
        compiled._init_handles()  # loads the binary: n_regs
        props = torch.cuda.get_device_properties(device)
        warps = launch_opts["num_warps"]
        regs_per_warp = -(-max(1, compiled.n_regs) * 32 // 256) * 256  # allocated per warp in units of 256
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
        by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (compiled.metadata.shared + 1024)
        by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
        occ = _OCCUPANCY[key] = max(1, min(by_regs, by_smem, by_threads))
    return occ * _num_sms(device)


def token_stats_fused_triton(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None, temperature: float,
    ignore_index: int, *, config: dict | None = None, rows_per_launch: int | None = None,
    logits_dtype: torch.dtype | None = None, temperature_in_logits_dtype: bool = False,
) -> KernelStats:
    """Statistics of z = (hidden @ weight.T + bias) / T without materialising [N, V] logits.

    hidden [N, H], weight [V, H] (bf16/fp16/fp32, same dtype, CUDA, last dim contiguous), bias [V] or None, labels
    [N] int64.  Returns :class:`.triton_stats.KernelStats` (fp32 [N] statistics, bool ``valid``, int32 error
    counters).  Matmul in the input dtype on tensor cores with fp32 accumulation (fp32 inputs: the slow "ieee" dot).
    16-bit inputs with TMA-addressable strides on Hopper or newer run the streaming kernel
    (:func:`_fused_stream_kernel`, launch plan :func:`stream_plan`), partials fp32 [6, rows, S], or below H 3072 on
    sm_90 its warp-specialised Gluon form (:mod:`.gluon_fused`, the same plan; ``config={"gluon": 0}``, or any key
    of the streaming kernel's own, keeps the Triton kernel); others the
    per-tile pointer kernel, partials fp32 [6, rows, ceil(V / bn)]; then :func:`._reduce.merge_kernel`.  Rows go in
    slices of ``rows_per_launch``, one plan for all (default: the launches of :func:`stream_slices` for the whole
    batch, or slices whose partials stay <= 256 MiB).  ``config`` overrides :data:`DEFAULT_CONFIG`
    (benchmarks and tests; ``moments=2`` skips sum p^2 and E_p[S], which read 0; ``moments=0`` every exponential, a
    timing floor).  ``logits_dtype`` rounds L = hidden @ W.T + b in the epilogue, z = fp32(round(L)) / T; with
    ``temperature_in_logits_dtype`` z = fp32(round(round(L) * fp32(1/T))), as torch's ``low_logits / T``
    (``entropy_discriminator.token_stats_from_hidden``).
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
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    # num_stages also pipelines the streaming kernel's inner K loop when its tile loop is not flattened
    launch_opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["stages"],
                   **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {})}  # fmt: skip
    ftz = not interpreting()
    bm, bn, bk = cfg["bm"], cfg["bn"], cfg["bk"]
    schedule = _schedule(cfg, config, hidden, weight)
    stream = schedule in ("stream", "gluon")
    n_tiles = triton.cdiv(vocab, bn)
    if logits_dtype not in _ROUND_CODES:
        raise ValueError(f"logits_dtype must be None or one of {_DTYPES}, got {logits_dtype!r}")
    if temperature_in_logits_dtype and logits_dtype is None:
        raise ValueError("temperature_in_logits_dtype=True needs a logits_dtype to round to")
    round_code = _ROUND_CODES[logits_dtype]
    t_round = bool(temperature_in_logits_dtype) and round_code != 0  # fp32: round(L / T) = L / T
    # torch's `low / T` multiplies by the reciprocal computed in fp32 (its CPU and CUDA kernels)
    inv_t = float(np.float32(1.0) / np.float32(temperature))
    c = LOG2E if t_round else LOG2E / float(temperature)
    c_lo = c - float(np.float32(c))  # the kernels take fp32 c and c_lo: c + c_lo is c to about 2^-48
    bias_arg = bias.contiguous() if bias is not None else hidden
    extra_rows = 0  # the Gluon kernel's row blocks per extra program (row_order_extras), 0: none
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        if schedule == "gluon":
            from . import gluon_fused

            ws = gluon_fused.WS_CONFIG
            bm, bn, bk = 2 * ws["bmw"], ws["bn"], ws["bk"]
            wave = _num_sms(dev)  # one program per SM: its ring takes 197 KB of shared memory
        elif stream:
            w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
            kernel, consts = stream_spec(cfg, bias is not None, round_code, t_round, ftz)

            def args(r0: int, r1: int, part, tpc: int, g: int) -> tuple:
                return (TensorDescriptor.from_tensor(hidden[r0:r1], [bm, bk]), w_desc, bias_arg, part, r1 - r0,
                        vocab, hdim, tpc, g, c, c_lo, inv_t)  # fmt: skip

            # the compiled kernel's occupancy: the argument types and specialisations of a one-slice launch
            wave = _programs_per_wave(kernel, lambda: args(0, n_rows, out, 1, 1), consts, launch_opts,
                                      hidden.dtype, dev)  # fmt: skip
        if stream:
            def plan(rows: int) -> tuple[int, int, int]:
                return stream_plan(rows, vocab, hdim, hidden.element_size(), bm, bn, wave, int(cfg["chunks"]),
                                   int(cfg["group_rows"]), float(cfg["group_mib"]))  # fmt: skip

            fixed = rows_per_launch is not None or cfg["chunks"] or cfg["group_rows"]
            if rows_per_launch is None:  # the largest slice whose partials fit, re-planned for that slice
                rows_per_launch = n_rows
                for _ in range(4):
                    s = plan(rows_per_launch)[1]
                    if 24 * rows_per_launch * s <= _WORKSPACE_BYTES or rows_per_launch <= bm:
                        break
                    rows_per_launch = max(bm, (_WORKSPACE_BYTES // (24 * s)) // bm * bm)
            if fixed or rows_per_launch < n_rows:  # slices of rows_per_launch rows, one plan
                launches = [(r0, min(n_rows, r0 + rows_per_launch), *plan(min(n_rows, rows_per_launch)))
                            for r0 in range(0, n_rows, rows_per_launch)]  # fmt: skip
            else:  # the whole batch: one launch, or a body of whole waves and its tail (stream_slices)
                launches, r0 = [], 0
                for rows, tpc, s, g in stream_slices(n_rows, vocab, hdim, hidden.element_size(), bm, bn, wave,
                                                     float(cfg["group_mib"])):  # fmt: skip
                    launches.append((r0, r0 + rows, tpc, s, g))
                    r0 += rows
                if schedule == "stream" and cfg["flatten"] < 0 and len(launches) > 1:  # body and tail: unflattened
                    consts["FLATTEN"] = False
                if schedule == "gluon" and len(launches) == 1:  # the idle SMs take the tiles past shorter chunks
                    extras = row_order_extras(n_rows, vocab, bm, bn, wave, *launches[0][2:])
                    if extras:
                        extra_rows = extras[1]
                        launches = [(0, n_rows, extras[0], launches[0][3] + 1, launches[0][4])]
        else:
            if rows_per_launch is None:
                rows_per_launch = max(bm, (_WORKSPACE_BYTES // (24 * n_tiles)) // bm * bm)
            launches = [(r0, min(n_rows, r0 + rows_per_launch), 0, n_tiles, 0)
                        for r0 in range(0, n_rows, rows_per_launch)]  # fmt: skip
        for r0, r1, tpc, n_cols, g in launches:
            rows = r1 - r0
            part = torch.empty((6, rows, n_cols), device=dev, dtype=torch.float32)
            yk = torch.empty(rows, device=dev, dtype=torch.float32)
            lab = labels[r0:r1]
            _label_kernel[(triton.cdiv(rows, _LABEL_BM),)](
                hidden[r0:r1], weight, bias_arg, lab, yk, rows, vocab, hdim, hidden.stride(0), weight.stride(0), c,
                c_lo, inv_t, HAS_BIAS=bias is not None, ROUND=round_code, T_ROUND=t_round, BM=_LABEL_BM, BK=_LABEL_BK,
                num_warps=4,
            )  # fmt: skip
            if schedule == "gluon":
                rbs = triton.cdiv(rows, bm)
                grid = rbs * (n_cols - 1) + triton.cdiv(rbs, extra_rows) if extra_rows else rbs * n_cols
                gluon_fused.ws_kernel[(grid,)](
                    *gluon_fused.ws_descriptors(hidden[r0:r1], weight), bias_arg, part, rows, vocab, hdim, tpc, g,
                    extra_rows, c, c_lo, inv_t, HAS_BIAS=bias is not None, ROUND=round_code, T_ROUND=t_round,
                    BMW=ws["bmw"], BN=bn, BK=bk, STAGES=ws["stages"], LAG=ws["lag"], CONSUMER_REGS=ws["consumer_regs"],
                    PRODUCER_REGS=ws["producer_regs"], num_warps=4, maxnreg=ws["maxnreg"],
                )  # fmt: skip
            elif stream:
                kernel[(triton.cdiv(rows, bm) * n_cols,)](*args(r0, r1, part, tpc, g), **consts, **launch_opts)
            else:
                _fused_tile_kernel[(triton.cdiv(rows, bm) * n_tiles,)](
                    hidden[r0:r1], weight, bias_arg, part, rows, vocab, hdim,
                    hidden.stride(0), weight.stride(0), c, c_lo, inv_t,
                    HAS_BIAS=bias is not None, ROUND=round_code, T_ROUND=t_round, EVEN_K=hdim % bk == 0,
                    IEEE=hidden.dtype == torch.float32,
                    BM=bm, BN=bn, BK=bk, GROUP_M=cfg["group_m"], STAGES=cfg["stages"], MOMENTS=cfg["moments"],
                    FTZ=ftz, BRANCH=bool(cfg["branch"]), **launch_opts,
                )  # fmt: skip
            merge_kernel[(rows,)](
                part, yk, lab, out[:, r0:], valid[r0:], errors, rows, n_rows, n_cols, vocab, int(ignore_index),
                PB=merge_block(n_cols), num_warps=4 if n_cols >= 128 else 1,
            )  # fmt: skip
    return result
