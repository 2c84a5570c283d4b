"""Fused LM-head statistics: logits = hidden @ weight.T (+ bias) never reach device memory.

z = (hidden @ weight.T + bias) / T in base-2 units y = z log2(e) (:mod:`._reduce`), hidden [N, H] and weight [V, H]
in bf16/fp16/fp32, fp32 accumulation.  Every schedule writes partials fp32 [6, N, P]: per row and partial j the
NaN-propagating max m_j of y over the partial's columns, s0..s3 against it (against 0 when m_j is -inf: the sums
are then 0), and m_j again (the max the merge validates).  :func:`_label_kernel`, launched first, writes the label's
y_k, fp32 [N]; :func:`._reduce.merge_kernel` merges the P partials in a fixed order into the statistics, ``valid``
and the error counters.  Forward only.

- Streaming (:func:`_fused_stream_kernel`; 16-bit, TMA-addressable inputs on Hopper or newer): a program owns BM rows
  and one vocabulary chunk (P = S chunks), launch plan :func:`stream_plan` / :func:`stream_slices`.
- Warp-specialised (:mod:`.gluon_fused`; those inputs without a bias on sm_90 below H = :data:`EXACT_WAVE_FROM_H`):
  the same plan and per-tile operations, a TMA producer warp and two consumer warp groups taking turns.
- Per tile (:func:`_fused_tile_kernel`; fp32, unaligned strides, pre-Hopper): one program per [BM, BN] tile, in
  groups of GROUP_M row blocks, P = ceil(V / BN).
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
from .triton_stats import KernelStats, _num_sms

try:  # host-side TMA descriptors (Triton >= 3.2); without them the pointer kernel is used
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None

__all__ = ["token_stats_fused_triton", "DEFAULT_CONFIG", "stream_plan", "stream_slices", "stream_spec"]

# bm x bn x bk tiles, num_warps, stages (both Triton kernels); moments 4: every statistic, 2: logp and H alone (sum
# p^2 and E_p[S] read 0), 0: matmul and row max alone (a timing floor); branch: the per-tile kernel masks columns
# past V in the last tile only (0: every tile); maxnreg: register cap (0: none; benchmarks).  stream 0: the per-tile
# kernel; flatten: the streaming V and K loops as one (1), not (0), not for a body and tail (-1); chunks /
# group_rows (0: :func:`stream_plan`'s rule), group_mib: its L2 budget (MiB); group_m: the per-tile kernel's groups;
# gluon 0: never the Gluon kernel.  Tiles chosen on an H200 (benchmarks/RESULTS.md).
DEFAULT_CONFIG = {"bm": 128, "bn": 256, "bk": 64, "num_warps": 8, "stages": 3, "moments": 4, "branch": 1,
                  "maxnreg": 0, "stream": 1, "flatten": -1, "chunks": 0, "group_rows": 0,
                  "group_mib": 16, "group_m": 8, "gluon": 1}  # fmt: skip
# The streaming Triton kernel's own keys: a caller's config that sets one of them asks for that kernel.
_STREAM_KEYS = ("bm", "bn", "bk", "num_warps", "stages", "moments", "branch", "maxnreg", "flatten")
# :func:`stream_plan`'s hidden-size thresholds and least chunk length (H200 measurements: benchmarks/RESULTS.md)
FILL_WAVE_FROM_H = 1536
EXACT_WAVE_FROM_H = 3072
SPLIT_MIN_TILES = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROUND_CODES = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # logits_dtype -> ROUND
_LABEL_BM, _LABEL_BK = 8, 512  # :func:`_label_kernel`'s rows and K step (benchmarks/RESULTS.md)
_WORKSPACE_BYTES = 256 * 2**20  # row slices keep their partials ([6, rows, P] fp32) under this


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks sweep the vocabulary together (weight tiles reused in L2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    return pid_m, pid_n


# fp32 -> bf16 by the GPU's conversion (ties to even, as torch); Triton's interpreter truncates it, so there
# :func:`_round_bf16` rounds on the bits.  On the GPU one packed conversion rounds two values, widened back by a
# shift and a mask (Triton's ``.to(tl.bfloat16)`` converts one at a time on a slower pipe: benchmarks/RESULTS.md).
_CVT_BF16 = tl.constexpr(not interpreting())
_BF16X2_ROUND = tl.constexpr("{.reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; "
                              "and.b32 $1, t, 0xffff0000;}")


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest bf16 (ties to even) -> fp32, as torch rounds: the GPU's packed conversion
    (``cvt.rn.bf16x2.f32``), or in the interpreter integer ops on the bits; inf and NaN stay, finite values past
    bf16's range round to inf."""
    if _CVT_BF16:
        y = tl.inline_asm_elementwise(_BF16X2_ROUND, "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        y = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return y


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
    r = program_id * BM ... below N, NaN where the label k lies outside [0, V) (fp32; rounding as
    :func:`_round_logits`).  Formed apart from the tiles (benchmarks/RESULTS.md), it may differ from their value in
    the last bits: the merge caps y_k at the row max."""
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
    """Reduce one [BM, BN] fp32 logits tile to its rows' six partials at column pid_n of part_ptr, fp32 [6, N,
    num_pid_n].  ROUND / T_ROUND: :func:`_round_logits` (with T_ROUND ``c`` = log2(e), else log2(e) / T); FTZ:
    :func:`._reduce.exp2`."""
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn % V).to(tl.float32)[None, :]
    acc = _round_logits(acc, inv_t, ROUND=ROUND, T_ROUND=T_ROUND)
    if (pid_n * BN + BN > V) if BRANCH else True:  # BRANCH: the last column tile only; columns past V are -inf
        acc = tl.where(rn[None, :] < V, acc, float("-inf"))
    # m = c times acc's row max (c > 0, rounding is monotone); a row of -inf only keeps m = -inf as its reference
    # but forms d against 0: d = -inf (e = 0), never -inf - -inf = NaN
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
    """Fold a tile of final logits x (fp32 [BM, BN]), y = x c, into each row's running NaN-propagating max m and
    sums s0..s3 against m (against 0 while m is -inf), rescaled on a new max; d clamped at -D_FLOOR.  MOMENTS: as
    :data:`DEFAULT_CONFIG`'s ``moments``."""
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
    """One program: BM rows x one chunk of ``tiles_per_chunk`` [BM, BN] tiles, in :func:`_stream_coords`'s order
    (a group's programs share its hidden blocks and each W tile in L2); FLATTEN pipelines the V and K loops as one.
    The last, partial tile is peeled off the loop (columns >= V set to -inf).  Partials to part_ptr, fp32 [6, N, S]
    at column ``chunk``."""
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


def stream_spec(cfg: dict, has_bias: bool, round_code: int, t_round: bool, ftz: bool) -> tuple[object, dict]:
    """The streaming TMA kernel (:func:`_fused_stream_kernel`) and a configuration's compile-time arguments."""
    return _fused_stream_kernel, {"HAS_BIAS": has_bias, "ROUND": round_code, "T_ROUND": t_round, "BM": cfg["bm"],
                                  "BN": cfg["bn"], "BK": cfg["bk"], "STAGES": cfg["stages"],
                                  "MOMENTS": cfg["moments"], "FLATTEN": bool(cfg["flatten"]), "FTZ": ftz}  # fmt: skip


def _schedule(cfg: dict, config: dict | None, hidden: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> str:
    """``"gluon"``, ``"stream"`` or ``"tile"``: which kernel runs (``cfg``'s ``branch`` set to 0 when the caller's
    ``config`` chooses the per-tile kernel for inputs the streaming kernel takes and leaves ``branch`` unset)."""
    if not _tma_ok(hidden, weight):
        return "tile"
    if "branch" not in (config or {}) and not cfg["stream"]:
        cfg["branch"] = 0
    if cfg["stream"] and cfg["gluon"] and _gluon_ok(hidden, bias, config):
        return "gluon"
    return "stream" if cfg["stream"] else "tile"


def _gluon_ok(hidden: torch.Tensor, bias: torch.Tensor | None, config: dict | None) -> bool:
    """Whether the Gluon kernel takes these (TMA-addressable, 16-bit) inputs: sm_90 (its wgmma), H below
    :data:`EXACT_WAVE_FROM_H` (where it was measured), no bias (the streaming kernel is faster with one), Triton 3.6
    (its Gluon API), and a ``config`` that sets none of :data:`_STREAM_KEYS`."""
    if bias is not None or hidden.device.type != "cuda" or not triton.__version__.startswith("3.6."):
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

    rb = ceil(rows / bm) row blocks, T = ceil(vocab / bn) tiles, ``wave`` programs resident at once, gmax =
    floor(group_mib MiB / (bm hdim elt)) row blocks whose hidden blocks fit the L2 budget.

    - G: ``group_rows`` when > 0; else rb (row order) when rb <= gmax; else ceil(rb / ceil(rb / gmax)).
    - S: ``chunks`` when > 0; else, grouped, floor(wave / G) (one group per wave); else (row order) the smallest S
      in [1, T] whose :func:`_waves_estimate` is within 2 % of the least.
    - S is clipped to [1, T] and evened (:func:`_evened`); one chunk makes every order the row order (G = rb).
    - With neither given and rb >= 8 G: from hdim = :data:`EXACT_WAVE_FROM_H`, G becomes the k in [1, min(gmax,
      wave)] whose evened S = floor(wave / k) fills the wave most (S k, then k, the largest); then S becomes the
      multiple k S (evened, a multiple of S, chunks of at least :data:`SPLIT_MIN_TILES` tiles) with the least
      ceil(rb k S / wave) ceil(T / (k S)), the fewest chunks among equals.  Below it, from hdim =
      :data:`FILL_WAVE_FROM_H`, G widens to min(rb, floor(wave / S)): one group fills the wave.

    H200 examples: ``tests/test_kernels.py::test_stream_plan_on_an_h200``.
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
    """The streaming kernel's launches for ``rows`` rows under the default rule: (rows, tiles per chunk, chunks S,
    row blocks per group G) per launch, in row order.

    One launch of :func:`stream_plan`'s (tpc, S, G), unless, below H = :data:`EXACT_WAVE_FROM_H`, its grouped order
    (G < rb = ceil(rows / bm)) could fill the last wave with whole groups: with S dividing ``wave``, a body of the
    largest multiple of W = wave / S row blocks runs (tpc, S, W) and the tail is planned alone, taken when the
    summed :func:`_waves_estimate` is below the one launch's.  Such a body and tail run unflattened (``flatten``
    -1).  H200 examples: ``tests/test_kernels.py::test_stream_slices_on_an_h200``; measurements:
    benchmarks/RESULTS.md.
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
    """ceil(ceil(rows / bm) chunks / wave) (tpc + 1): waves x a chunk's tiles, plus about one for a program's
    pipeline fill and partials."""
    return -(-(-(-rows // bm)) * chunks // wave) * (tpc + 1)


def _evened(s: int, nvt: int) -> tuple[int, int]:
    """(ceil(nvt / s) tiles per chunk, the chunks that needs) for ``s`` clipped to [1, nvt]: no empty chunk."""
    tpc = -(-nvt // max(1, min(s, nvt)))
    return tpc, -(-nvt // tpc)


def row_order_extras(rows: int, vocab: int, bm: int, bn: int, wave: int, tpc: int, chunks: int,
                     group_rows: int) -> tuple[int, int] | None:
    """(tiles per chunk c, row blocks per extra program R) that balance a row-order plan over a part-filled wave,
    or None.

    A row-order plan (``group_rows`` >= rb = ceil(rows / bm)) whose rb ``chunks`` programs leave E = wave - rb
    ``chunks`` SMs idle runs (:func:`.gluon_fused.ws_kernel`'s ``extra_rows``) chunks of c = ceil(R T / (1 + R
    chunks)) tiles (T = ceil(vocab / bn), R = ceil(rb / E)), and ceil(rb / R) extra programs take the T - c chunks
    tiles left, R row blocks each.  None where the longest program, max(c, R (T - c chunks)) tiles, is not shorter
    than ``tpc``, nothing is left over, or the plan is grouped (example: benchmarks/RESULTS.md)."""
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
    """SMs x programs per SM of ``kernel`` compiled for ``make_args()`` and these options, by its registers and
    shared memory (compiled once per device, dtype and configuration; the interpreter: one per SM)."""
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
    counters).  Matmul in the input dtype with fp32 accumulation (fp32 inputs: the "ieee" dot); the kernel as the
    module docstring says (``config={"gluon": 0}``, or any key of :data:`_STREAM_KEYS`, keeps the Triton streaming
    kernel), then :func:`._reduce.merge_kernel`.  Rows go in slices of ``rows_per_launch``, one plan for all
    (default: :func:`stream_slices`' launches, or slices whose partials stay <= 256 MiB).  ``config`` overrides
    :data:`DEFAULT_CONFIG` (benchmarks and tests).  ``logits_dtype`` rounds L = hidden @ W.T + b in the epilogue,
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
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    # num_stages also pipelines the streaming kernel's inner K loop when its tile loop is not flattened
    launch_opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["stages"],
                   **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {})}  # fmt: skip
    ftz = not interpreting()
    bm, bn, bk = cfg["bm"], cfg["bn"], cfg["bk"]
    schedule = _schedule(cfg, config, hidden, weight, bias)
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
                    *gluon_fused.ws_descriptors(hidden[r0:r1], weight), part, rows, vocab, hdim, tpc, g, extra_rows,
                    c, c_lo, inv_t, ROUND=round_code, T_ROUND=t_round,
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
