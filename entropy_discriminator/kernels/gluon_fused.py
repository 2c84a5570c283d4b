"""The fused LM-head statistics as a warp-specialised Gluon kernel (Hopper, sm_90): the streaming kernel's schedule
with the tile's epilogue taken off the tensor cores' critical path.

:func:`ws_kernel` writes what :func:`.triton_fused._fused_stream_kernel` writes, for the same launch plan (one
program per SM), from the same per-tile operations.  Each program has a one-warp TMA producer filling a ring of
STAGES slots and two consumer warp groups of BMW rows each sharing every W slice; consumer 1 starts each tile's K
loop once consumer 0 has issued LAG of its K steps, so that while one folds its finished tile the other still has
tensor-core work in flight.  Where a row-order plan leaves SMs idle, extra programs take the tiles past shortened
chunks (``extra_rows``, :func:`.triton_fused.row_order_extras`).  No bias: a head with one runs the streaming kernel,
the faster of the two there.  Measurements: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import triton_fused

__all__ = ["ws_kernel", "ws_descriptors", "WS_CONFIG"]

# The Triton-language helpers of the streaming kernel, compiled as Gluon (same operations, same rounding).
_round_logits = gluon.jit(triton_fused._round_logits.fn)
_fold_tile = gluon.jit(triton_fused._fold_tile.fn)
_store_partials = gluon.jit(triton_fused._store_partials.fn)
_stream_coords = gluon.jit(triton_fused._stream_coords.fn)

# 2 x 64 rows x 256 columns per tile, 64-deep K slices, a ring of 4 slots (197 KB of shared memory: one program
# per SM), consumer 1 one K step behind (benchmarks/RESULTS.md); registers a thread: kernel, consumers, producer.
WS_CONFIG = {"bmw": 64, "bn": 256, "bk": 64, "stages": 4, "lag": 1, "maxnreg": 168, "consumer_regs": 232,
             "producer_regs": 24}  # fmt: skip


@gluon.jit
def _ring(a_desc, w_desc, STAGES: gl.constexpr, A_SLOTS: gl.constexpr, READERS: gl.constexpr):
    """A ring of STAGES slots in shared memory, each A_SLOTS hidden slices and one W slice, with its barriers:
    ``ready`` (a slot's copies landed) and ``empty`` (released by READERS consumers)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * A_SLOTS] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=READERS)
    return a_bufs, b_bufs, ready, empty


@gluon.jit
def _producer(a_desc, w_desc, a_bufs, b_bufs, ready, empty, row0, n_segs, t0, n_tiles, k_tiles, BMW: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, NCONS: gl.constexpr):
    """One warp: K step j = i k_tiles + kk of the program's i-th tile (over ``n_segs`` segments of NCONS BMW rows)
    into slot j % STAGES once its readers released it: NCONS hidden slices [BMW, BK] and the W tile's [BN, BK]
    slice (past the tensors' ends: zero-filled by the copy engine)."""
    nbytes: gl.constexpr = NCONS * a_desc.block_type.nbytes + w_desc.block_type.nbytes
    for i in range(n_segs * n_tiles):
        r0 = row0 + (i // n_tiles) * NCONS * BMW
        for kk in range(k_tiles):
            j = i * k_tiles + kk
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            for w in gl.static_range(NCONS):
                tma.async_copy_global_to_shared(a_desc, [r0 + w * BMW, kk * BK], ready.index(slot),
                                                a_bufs.index(slot * NCONS + w))
            tma.async_copy_global_to_shared(w_desc, [(t0 + i % n_tiles) * BN, kk * BK], ready.index(slot),
                                            b_bufs.index(slot))


@gluon.jit
def _k_steps(a_bufs, b_bufs, ready, empty, base, k_tiles, acc, a_off, go, go_at, A_SLOTS: gl.constexpr,
             STAGES: gl.constexpr):
    """acc plus one tile's K steps j = base ... base + k_tiles - 1 from the ring (slot j % STAGES; hidden slice
    A_SLOTS slot + a_off), one wgmma in flight: each slot is released once the next wgmma is issued, the last
    one's by the caller; after issuing step ``go_at`` (-1: none) it arrives on the barrier ``go``."""
    for kk in range(k_tiles):
        j = base + kk
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(slot * A_SLOTS + a_off), b_bufs.index(slot).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), pred=kk > 0)
        mbarrier.arrive(go, pred=kk == go_at)
    return acc


@gluon.jit
def _consumer(w, a_bufs, b_bufs, ready, empty, go, part_ptr, row0, n_segs, t0, n_tiles, k_tiles, N, V, n_cols, col,
              c, c_lo, inv_t, ROUND: gl.constexpr, T_ROUND: gl.constexpr, BMW: gl.constexpr, BN: gl.constexpr,
              STAGES: gl.constexpr, LAG: gl.constexpr):
    """Consumer warp group ``w``: for each of ``n_segs`` segments (2 BMW rows from row0 on), rows w BMW ... of
    its tiles (:func:`_tiles`), partials at column ``col``.  With LAG > 0 consumer 0 arrives on ``go`` after issuing
    K step min(LAG, k_tiles) - 1 of each tile, and consumer 1 waits for that before the tile's K loop."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    go_at = -1
    if w == 0:
        go_at = gl.minimum(k_tiles, LAG) - 1
    for seg in range(n_segs):
        m, s0, s1, s2, s3 = _tiles(w, a_bufs, b_bufs, ready, empty, go, go_at, seg * n_tiles, t0, n_tiles, k_tiles, V,
                                   c, c_lo, inv_t, ROUND, T_ROUND, BMW, BN, STAGES, LAG)
        rm = row0 + seg * 2 * BMW + w * BMW + gl.arange(0, BMW, layout=rows_l)
        _store_partials(part_ptr, rm, rm < N, N, n_cols, col, m, s0, s1, s2, s3)


@gluon.jit
def _tiles(w, a_bufs, b_bufs, ready, empty, go, go_at, first, t0, n_tiles, k_tiles, V, c, c_lo, inv_t,
           ROUND: gl.constexpr, T_ROUND: gl.constexpr, BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
           LAG: gl.constexpr):
    """Running statistics (m, s0..s3) of consumer ``w``'s rows over tiles t0 ... t0 + n_tiles - 1 (rounding,
    columns >= V set to -inf), the program's tiles ``first`` ... in ring order."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    m = gl.full([BMW], float("-inf"), gl.float32, rows_l)
    s0 = gl.zeros([BMW], gl.float32, rows_l)
    s1 = s0
    s2 = s0
    s3 = s0
    for i in range(n_tiles):
        base = (first + i) * k_tiles
        if LAG > 0:
            mbarrier.wait(go, (first + i) & 1, pred=w == 1)
        acc = _k_steps(a_bufs, b_bufs, ready, empty, base, k_tiles, gl.zeros([BMW, BN], gl.float32, mma), w, go,
                       go_at, 2, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES))
        x = _round_logits(acc, inv_t, ROUND, T_ROUND)
        if (t0 + i) * BN + BN > V:  # the last, partial vocabulary tile
            rn = (t0 + i) * BN + gl.arange(0, BN, layout=cols_l)
            x = gl.where(gl.expand_dims(rn < V, 0), x, float("-inf"))
        m, s0, s1, s2, s3 = _fold_tile(x, c, c_lo, m, s0, s1, s2, s3, 4, True)
    return m, s0, s1, s2, s3


@gluon.jit(do_not_specialize=["tiles_per_chunk", "group_rows", "extra_rows"])
def ws_kernel(a_desc, w_desc, part_ptr, N, V, H, tiles_per_chunk, group_rows, extra_rows, c, c_lo, inv_t,
              ROUND: gl.constexpr, T_ROUND: gl.constexpr, BMW: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, LAG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """One program: 2 BMW rows x one chunk of ``tiles_per_chunk`` [2 BMW, BN] tiles, in the streaming kernel's
    program order; partials to part_ptr, fp32 [6, N, S] at column ``chunk``.  With ``extra_rows`` R > 0, the first
    rb S programs (rb row blocks, row order) take the S chunks, and each of the last ceil(rb / R) programs the tiles
    left after them for R row blocks, its partials at column S of [6, N, S + 1].  Launch with ``num_warps=4`` and
    ``maxnreg`` = :data:`WS_CONFIG`'s."""
    if extra_rows > 0:
        n_rb = gl.cdiv(N, 2 * BMW)
        pid = gl.program_id(0)
        n_home = gl.num_programs(0) - gl.cdiv(n_rb, extra_rows)
        n_cols = n_home // n_rb + 1
        extra = pid >= n_home  # the tiles past the chunks, for extra_rows row blocks
        rb = gl.where(extra, (pid - n_home) * extra_rows, pid % n_rb)
        chunk = gl.where(extra, n_cols - 1, pid // n_rb)
        n_segs = gl.where(extra, gl.minimum(extra_rows, n_rb - rb), 1)
    else:
        rb, chunk, n_cols = _stream_coords(N, group_rows, 2 * BMW)
        n_segs = rb * 0 + 1  # one segment, typed as the other branch's (an i32 value, not a constant)
    row0 = rb * 2 * BMW
    t0 = chunk * tiles_per_chunk
    n_tiles = gl.minimum(tiles_per_chunk, gl.cdiv(V, BN) - t0)
    k_tiles = gl.cdiv(H, BK)
    a_bufs, b_bufs, ready, empty = _ring(a_desc, w_desc, STAGES, 2, 2)
    go = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(go.index(0), count=1)
    gl.warp_specialize([
        (_consumer, (0, a_bufs, b_bufs, ready, empty, go.index(0), part_ptr, row0, n_segs, t0, n_tiles, k_tiles, N, V,
                     n_cols, chunk, c, c_lo, inv_t, ROUND, T_ROUND, BMW, BN, STAGES, LAG)),
        (_consumer, (1, a_bufs, b_bufs, ready, empty, go.index(0), part_ptr, row0, n_segs, t0, n_tiles, k_tiles, N, V,
                     n_cols, chunk, c, c_lo, inv_t, ROUND, T_ROUND, BMW, BN, STAGES, LAG)),
        (_producer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, row0, n_segs, t0, n_tiles, k_tiles, BMW, BN, BK,
                     STAGES, 2)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


def ws_descriptors(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of hidden [N, H] ([BMW, BK] blocks) and weight [V, H] ([BN, BK] blocks), 16-bit."""
    dt = gl.bfloat16 if hidden.dtype == torch.bfloat16 else gl.float16
    bmw, bn, bk = WS_CONFIG["bmw"], WS_CONFIG["bn"], WS_CONFIG["bk"]
    return (TensorDescriptor.from_tensor(hidden, [bmw, bk], gl.NVMMASharedLayout.get_default_for([bmw, bk], dt)),
            TensorDescriptor.from_tensor(weight, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dt)))
