"""Probe: a row-stationary, streaming fused LM-head kernel with TMA loads, with and without warp specialisation.

``python benchmarks/fused_ws_probe.py [--budget-s 240] [--shapes H:N[:V[:dtype]] ...] [--chunks auto,2,4,8,wave]
[--orders row,group] [--floor-top 3]`` (a CUDA GPU, Hopper for the TMA schedules) or
``TRITON_INTERPRET=1 python benchmarks/fused_ws_probe.py --smoke`` (CPU, Triton's interpreter).

The project's per-tile kernel (``kernels/triton_fused._fused_tile_kernel``) is tile-stationary: each [BM, BN]
logits tile is reduced to partials and a second kernel merges ceil(V/BN) partials per row.  This probe tries the
flash-attention shape instead (``kernels/triton_fused._fused_stream_kernel`` runs this schedule with every feature
of the public call; this file keeps the standalone version and its measurements): each program owns BLOCK_N rows
and one chunk of the vocabulary, walks that chunk in [BLOCK_N, BLOCK_V] logits tiles (tl.dot over K = H, operands
from host TMA descriptors or pointers), and keeps per row the running statistics, in base-2 units y = z log2(e),
d = y - m, e = 2^d = e^(z - m ln 2):

    m (running max),  s0 = sum e,  s1 = sum e d,  s2 = sum e^2,  s3 = sum e^2 d.

Moving the reference from m to m' >= m multiplies e by a = 2^(m - m') and shifts d by dl = m - m', so
s0' = a s0, s1' = a (s1 + dl s0), s2' = a^2 s2, s3' = a^2 (s3 + dl s2); the chunks of one row merge the same
way.  With p_i = e_i / s0 (natural logs, ln2 = log 2):

    lse = ln2 m + log s0,  log p_i = ln2 d_i - log s0,
    H = -sum p log p = log s0 - ln2 s1 / s0,
    E_p[S] = sum p_i^2 (H + log p_i) = H s2 / s0^2 + (ln2 s3 - log s0 s2) / s0^2 = ln2 (s3 - s2 s1 / s0) / s0^2.

The label's logit is not picked out of the tiles (that would put a compare and a select on every logit of the
hot loop): the small merge kernel recomputes it as an fp32 dot of the row of h with the label's row of W, then
merges the chunks and writes lse, log p_label, H, E_p[S].  A "floor" mode of the same schedule keeps only the
running row max (no exponentials, no sums): the schedule's matmul speed.

Schedules (``SCHEDULES``): ``tma`` (host TensorDescriptor loads, V loop plain), ``tma-flat`` (V and K loops
flattened into one pipelined loop, so the next tile's loads run during this tile's epilogue), ``tma-ws``
(``tl.range(..., warp_specialize=True)`` on the V loop: Triton's automatic warp specialisation, on sm_90 its
Hopper pass), ``tma-wsflat`` (both), ``ptr`` (pointer loads, cp.async pipelining).  The grid is (row blocks) x (V chunks); by
default the number of chunks is chosen so that the programs fill one wave at the compiled kernel's occupancy (two
4-warp programs per SM let one program's epilogue run while the other's wgmma does: ping-pong by the warp
scheduler).  ``--chunks`` sweeps other counts ('auto' that rule, numbers, 'wave': one wave per program group) and
``--orders`` the program order: 'row' (all row blocks of chunk 0, then chunk 1, ...: the programs running
together share W tiles in L2, but each re-reads its own h block per W tile, so a wave's h blocks compete with W
for L2 once wave x BM x H x 2 bytes nears its 50 MB: 52 MB at H=1536 N=16384, the first run's worst shape) or
'group' / 'g<k>' (groups of row blocks, all chunks of a group before the next group: fewer h blocks in flight,
each W tile read once per group).  The default sweep (``DEFAULT_CONFIGS``) is the tma-flat family; warp
specialisation is left out of it (a no-op on sm_90 with Triton 3.6, see below).

Every configuration is first compiled in a child process (a compiler crash is then a reported failure, not the
end of the run; the children also run in parallel), then checked against float64 on 8 rows and timed
(``triton.testing.do_bench``, median) beside cuBLAS ``h @ W.T`` (timed before and after, mean) and the public
``entropy_discriminator.token_stats_from_hidden``.  A CSV and the log go to ``$OUT`` when set (``--csv`` too).

Not a drop-in kernel: no bias, temperature, logits rounding, ignore_index or error counters (the public call has
all of them, and its check waits for the kernel).  cuBLAS's time includes writing the bf16 [N, V] logits, which
no fused kernel does.  First run: ``results/h200/fused_ws_probe/`` (H200, 2026-11-29).  Its ``ws_marks`` column
(and the log's "specialised: yes") is a false positive of an earlier marker list ("ttng.warp_group" matched every
wgmma, ``ttng.warp_group_dot``); its TTGIR shows the loop's ``tt.warp_specialize`` attribute left unconsumed, no
partitions and the warp count unchanged, so Triton 3.6 compiled and ran ``warp_specialize=True`` on sm_90 without
specialising anything (``tl.range``'s docstring: "only supported on Blackwell GPUs").  Its ws TTGIR file names
lack the schedule, so ``ws_128x128_w4.ttgir`` holds whichever of tma-ws / tma-wsflat wrote last (tt.flatten: the
latter).  Second run (chunk counts, program orders, H up to 5120, N up to 65536, fp16): ``results/h200/fused_ws_probe2/``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import ctypes
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

try:
    import torch
except ImportError:  # pragma: no cover - --help still works
    torch = None
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - --help still works
    triton = tl = None
try:  # host-side TMA descriptors (Triton >= 3.2)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover
    TensorDescriptor = None

ROOT = Path(__file__).resolve().parent.parent
LOG2E = 1.4426950408889634
ERR_MAX = 2e-3  # max |error| of logp, H, E_p[S] against float64 for a configuration to count as correct
HIT = 1.031  # confirm mode's count: median probe / cuBLAS at or below this
TARGET = 1 / 0.97  # probe / cuBLAS at or below this is ">= 0.97x cuBLAS"
DEV = "cuda"  # where the benchmark and the compile children run

# name -> (DESC, WS, FLAT)
SCHEDULES = {"tma": (1, 0, 0), "tma-flat": (1, 0, 1), "tma-ws": (1, 1, 0), "tma-wsflat": (1, 1, 1), "ptr": (0, 0, 0)}
# (schedule, BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages)
CONFIGS = (
    ("tma", 128, 128, 64, 4, 3),
    ("tma", 128, 128, 64, 4, 4),
    ("tma", 128, 256, 64, 8, 3),
    ("tma", 256, 128, 64, 8, 3),
    ("tma", 64, 256, 64, 4, 3),
    ("tma-flat", 128, 128, 64, 4, 3),
    ("tma-flat", 128, 256, 64, 8, 3),
    ("ptr", 128, 128, 64, 4, 3),
    ("tma-ws", 128, 128, 64, 4, 3),  # warp-specialised last: a hang there loses least
    ("tma-ws", 128, 256, 64, 8, 3),
    ("tma-wsflat", 128, 128, 64, 4, 3),
    ("tma-flat", 256, 128, 64, 8, 3),
)
# the default sweep (indices into CONFIGS): the flattened TMA schedule, the first run's best family (warp_specialize
# dropped: a no-op on sm_90 with Triton 3.6); chunk counts and program orders are swept per shape around these
DEFAULT_CONFIGS = (6, 5, 11)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16} if torch is not None else {}


def cfg_name(cfg) -> str:
    s, bm, bv, bk, w, st = cfg
    return f"{s} {bm}x{bv}x{bk} w{w} s{st}"


def _jit(*args, **kw):
    """triton.jit, or the plain function when Triton is missing (so that --help works without it)."""
    if triton is not None:
        return triton.jit(*args, **kw)
    return args[0] if args else (lambda fn: fn)


# ----------------------------------------------------------------------------------------------- kernels


@_jit
def _exp2(x, FTZ: tl.constexpr):
    """2^x; FTZ: one ex2.approx.ftz.f32 (results below 2^-126 flush to 0), else tl.exp2 (interpreter)."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@_jit
def _logits_tile(h_ptr, w_ptr, h_desc, w_desc, rb, t, N, V, H, stride_h, stride_w, BM: tl.constexpr,
                 BV: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, DESC: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 [BM, BV] = h[rb*BM : +BM] @ W[t*BV : +BV].T over K = H in BK steps (rows/columns past N/V: finite)."""
    acc = tl.zeros([BM, BV], dtype=tl.float32)
    n_k = tl.cdiv(H, BK)
    if DESC:  # TMA: out-of-range rows, columns and K are zero-filled by the copy engine
        for kk in tl.range(0, n_k, num_stages=STAGES):
            a = h_desc.load([rb * BM, kk * BK])
            b = w_desc.load([t * BV, kk * BK])
            acc = tl.dot(a, b.T, acc)
    else:
        rm = (rb * BM + tl.arange(0, BM)) % N
        rn = (t * BV + tl.arange(0, BV)) % V
        rk = tl.arange(0, BK)
        a_ptrs = h_ptr + rm.to(tl.int64)[:, None] * stride_h + rk[None, :]
        b_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]
        for kk in tl.range(0, n_k, num_stages=STAGES):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                kmask = rk[None, :] < H - kk * BK
                a = tl.load(a_ptrs, mask=kmask, other=0.0)
                b = tl.load(b_ptrs, mask=kmask, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BK
            b_ptrs += BK
    return acc


@_jit
def _online_update(acc, m, s0, s1, s2, s3, c, FLOOR: tl.constexpr, FTZ: tl.constexpr, CLAMP: tl.constexpr):
    """Fold one fp32 logits tile (raw accumulator; y = acc * c, c = log2(e) > 0) into the running statistics."""
    m_new = tl.maximum(m, tl.max(acc, axis=1) * c)  # c > 0: the max of y is c times the max of acc
    if FLOOR:  # timing floor: the running max alone
        return m_new, s0, s1, s2, s3
    dl = m - m_new  # <= 0; -inf before the first tile (then a = 0 and the old sums, all 0, drop out)
    a = tl.exp2(dl)
    ad = tl.where(a > 0, a * dl, 0.0)
    d = acc * c - m_new[:, None]  # one FMA per logit
    if CLAMP:  # masked (-inf) columns of the last tile: e = 0 and e * d = 0, not 0 * -inf
        d = tl.maximum(d, -256.0)
    e = _exp2(d, FTZ)
    e2 = e * e
    s1 = a * s1 + ad * s0 + tl.sum(e * d, axis=1)
    s0 = a * s0 + tl.sum(e, axis=1)
    s3 = a * a * s3 + a * ad * s2 + tl.sum(e2 * d, axis=1)
    s2 = a * a * s2 + tl.sum(e2, axis=1)
    return m_new, s0, s1, s2, s3


@_jit(do_not_specialize=["tiles_per_chunk", "group_rb"])
def _stream_kernel(h_ptr, w_ptr, h_desc, w_desc, part_ptr, N, V, H, stride_h, stride_w, tiles_per_chunk, group_rb, c,
                   BM: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, DESC: tl.constexpr,
                   WS: tl.constexpr, FLAT: tl.constexpr, FLOOR: tl.constexpr, FTZ: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """One program: BM rows x one chunk of tiles_per_chunk vocabulary tiles; writes (m, s0..s3) per row.

    part is fp32 [5, n_chunks, N].  Program order: the row blocks form groups of group_rb (the last one may be
    smaller); the programs of a group come together, row block fastest, then chunk.  group_rb >= the number of row
    blocks is the plain row order (all row blocks of chunk 0, then chunk 1, ...): the programs running together
    walk the same vocabulary chunk (its W tiles are shared in L2) but each re-reads its own h block per tile, so a
    wave's h blocks (wave x BM x H elements) must stay in L2 too; a smaller group keeps fewer h blocks in flight, and
    a W tile is then read from memory once per group that runs it.
    """
    pid = tl.program_id(0)
    num_rb = tl.cdiv(N, BM)
    n_chunks = tl.num_programs(0) // num_rb
    per_group = group_rb * n_chunks
    gid = pid // per_group
    first = gid * group_rb
    gsize = tl.minimum(num_rb - first, group_rb)
    local = pid - gid * per_group
    rb = first + local % gsize
    chunk = local // gsize
    n_full = V // BV  # tiles with no column past V
    t0 = chunk * tiles_per_chunk
    t1 = tl.minimum(t0 + tiles_per_chunk, tl.cdiv(V, BV))
    t1f = tl.minimum(t1, n_full)
    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    s0 = tl.zeros([BM], dtype=tl.float32)
    s1 = tl.zeros([BM], dtype=tl.float32)
    s2 = tl.zeros([BM], dtype=tl.float32)
    s3 = tl.zeros([BM], dtype=tl.float32)
    for t in tl.range(t0, t1f, warp_specialize=WS, flatten=FLAT):
        acc = _logits_tile(h_ptr, w_ptr, h_desc, w_desc, rb, t, N, V, H, stride_h, stride_w, BM=BM, BV=BV, BK=BK,
                           STAGES=STAGES, DESC=DESC, EVEN_K=EVEN_K)
        m, s0, s1, s2, s3 = _online_update(acc, m, s0, s1, s2, s3, c, FLOOR=FLOOR, FTZ=FTZ, CLAMP=False)
    if t1 > n_full:  # this chunk holds the last, partial tile: peeled so that the hot loop has no mask
        acc = _logits_tile(h_ptr, w_ptr, h_desc, w_desc, rb, n_full, N, V, H, stride_h, stride_w, BM=BM, BV=BV,
                           BK=BK, STAGES=STAGES, DESC=DESC, EVEN_K=EVEN_K)
        cols = n_full * BV + tl.arange(0, BV)
        acc = tl.where(cols[None, :] < V, acc, float("-inf"))
        m, s0, s1, s2, s3 = _online_update(acc, m, s0, s1, s2, s3, c, FLOOR=FLOOR, FTZ=FTZ, CLAMP=True)
    rm = rb * BM + tl.arange(0, BM)
    ok = rm < N
    q = part_ptr + chunk * N + rm
    plane = n_chunks * N
    tl.store(q, m, mask=ok)
    tl.store(q + plane, s0, mask=ok)
    tl.store(q + 2 * plane, s1, mask=ok)
    tl.store(q + 3 * plane, s2, mask=ok)
    tl.store(q + 4 * plane, s3, mask=ok)


@_jit(do_not_specialize=["S"])
def _merge_kernel(part_ptr, h_ptr, w_ptr, lab_ptr, out_ptr, N, H, stride_h, stride_w, S, BR: tl.constexpr,
                  SP: tl.constexpr, BKM: tl.constexpr):
    """Merge the S chunk partials of BR rows, recompute the label logit in fp32, write lse, logp, H, E_p[S], max z."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rok = rows < N
    js = tl.arange(0, SP)
    offs = js[None, :] * N + rows[:, None]
    msk = rok[:, None] & (js[None, :] < S)
    plane = S * N
    mj = tl.load(part_ptr + offs, mask=msk, other=float("-inf"))
    s0j = tl.load(part_ptr + plane + offs, mask=msk, other=0.0)
    s1j = tl.load(part_ptr + 2 * plane + offs, mask=msk, other=0.0)
    s2j = tl.load(part_ptr + 3 * plane + offs, mask=msk, other=0.0)
    s3j = tl.load(part_ptr + 4 * plane + offs, mask=msk, other=0.0)
    mu = tl.max(mj, axis=1)
    mu = tl.where(mu > float("-inf"), mu, 0.0)
    dj = mj - mu[:, None]
    aj = tl.exp2(dj)
    adj = tl.where(aj > 0, aj * dj, 0.0)
    s0 = tl.sum(aj * s0j, axis=1)
    s1 = tl.sum(aj * s1j + adj * s0j, axis=1)
    s2 = tl.sum(aj * aj * s2j, axis=1)
    s3 = tl.sum(aj * aj * s3j + aj * adj * s2j, axis=1)
    lab = tl.load(lab_ptr + rows, mask=rok, other=0)
    zk = tl.zeros([BR], dtype=tl.float32)
    for k0 in range(0, H, BKM):
        kk = k0 + tl.arange(0, BKM)
        km = rok[:, None] & (kk[None, :] < H)
        hv = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + kk[None, :], mask=km, other=0.0)
        wv = tl.load(w_ptr + lab.to(tl.int64)[:, None] * stride_w + kk[None, :], mask=km, other=0.0)
        zk += tl.sum(hv.to(tl.float32) * wv.to(tl.float32), axis=1)
    log_s0 = tl.log(s0)
    lse = 0.6931471805599453 * mu + log_s0  # ln 2 * mu
    dbar = s1 / s0
    tl.store(out_ptr + rows, lse, mask=rok)
    tl.store(out_ptr + N + rows, zk - lse, mask=rok)
    tl.store(out_ptr + 2 * N + rows, log_s0 - 0.6931471805599453 * dbar, mask=rok)
    tl.store(out_ptr + 3 * N + rows, 0.6931471805599453 * (s3 - s2 * dbar) / (s0 * s0), mask=rok)
    tl.store(out_ptr + 4 * N + rows, 0.6931471805599453 * mu, mask=rok)  # the row's max logit (what the floor mode computes)


# ------------------------------------------------------------------------------------------------- host


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def ftz_ok() -> bool:
    """The inline-asm exponential runs compiled on a GPU only (the interpreter has no inline asm)."""
    return DEV == "cuda" and not interpreting()


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4


class Probe:
    """One configuration's launches: ``probe(h, w, labels, floor)`` -> fp32 [5, N] (lse, logp, H, E_p[S], max z).

    The launch plan (tiles per chunk, chunks, row blocks per group) comes from :meth:`plan` (or ``split`` /
    ``group`` given here: the defaults, one wave at the compiled occupancy in the plain row order)."""

    def __init__(self, cfg, ftz: bool, split: int = 0, ws_override: int | None = None, group: int = 0):
        self.cfg = cfg
        sched, self.bm, self.bv, self.bk, self.warps, self.stages = cfg
        self.desc, self.ws, self.flat = SCHEDULES[sched]
        if ws_override is not None:
            self.ws = ws_override
        self.ftz = ftz
        self.split = split  # 0: auto (one wave at the compiled occupancy)
        self.group = group  # row blocks per group; 0: all (the plain row order)
        self.kernel = None  # the compiled stream kernel of the last full-mode launch
        self.occ = None

    def group_rows(self, n: int, hd: int, elt: int, order: str, group_mb: float = 16.0) -> int:
        """Row blocks per group for ``order``: 'row' (all: plain row order), 'g<k>' (k), 'group' (as many as keep
        the group's h blocks within ``group_mb`` MiB); the groups are then evened out (ceil(rb / #groups))."""
        rb = triton.cdiv(n, self.bm)
        if order == "row":
            return rb
        if order == "group":
            gmax = int(group_mb * 2**20 // (self.bm * hd * elt))
        elif order.startswith("g") and order[1:].isdigit():
            gmax = int(order[1:])
        else:
            raise ValueError(f"unknown program order {order!r} (row, group, g<k>)")
        gmax = max(1, min(gmax, rb))
        return triton.cdiv(rb, triton.cdiv(rb, gmax))

    def plan(self, n: int, v: int, hd: int = 0, elt: int = 2, chunks: str | int = "auto", order: str = "row",
             group_mb: float = 16.0) -> tuple[int, int, int]:
        """(tiles per chunk, chunks, row blocks per group) for N = n, V = v.  ``chunks``: 'auto' (the programs fill
        one wave at the compiled occupancy), 'wave' (one wave spans one group: ceil(wave / group); 'auto' in the
        row order) or a number (clipped to the tile count; fewer when the tiles split unevenly)."""
        nvt = triton.cdiv(v, self.bv)
        rb = triton.cdiv(n, self.bm)
        g = self.group_rows(n, hd, elt, order, group_mb) if order != "row" else rb
        wave = max(1, self.occ or 1) * sm_count()
        tok = str(chunks)
        if tok == "auto" or (tok == "wave" and g >= rb):
            s = max(1, wave // rb)
        elif tok == "wave":
            s = triton.cdiv(wave, g)
        else:
            s = int(tok)
        s = max(1, min(s, nvt))
        tpc = triton.cdiv(nvt, s)
        s = triton.cdiv(nvt, tpc)
        if s == 1 or g >= rb:  # one chunk: every order is the row order
            g = rb
        return tpc, s, g

    def chunks(self, n: int, v: int) -> tuple[int, int]:
        """(tiles per chunk, chunks) for N = n, V = v with this probe's ``split``."""
        tpc, s, _ = self.plan(n, v, chunks=self.split if self.split > 0 else "auto")
        return tpc, s

    def launch(self, h, w, part, tpc: int, s: int, g: int, floor: bool = False):
        """The stream kernel alone (part: fp32 [5, s, N]); returns the compiled kernel (None when interpreting)."""
        n, hd = h.shape
        v = w.shape[0]
        if self.desc:
            hd_, wd_ = TensorDescriptor.from_tensor(h, [self.bm, self.bk]), TensorDescriptor.from_tensor(w, [self.bv, self.bk])
        else:
            hd_ = wd_ = None
        return _stream_kernel[(triton.cdiv(n, self.bm) * s,)](
            h, w, hd_, wd_, part, n, v, hd, h.stride(0), w.stride(0), tpc, g, LOG2E,
            BM=self.bm, BV=self.bv, BK=self.bk, STAGES=self.stages, DESC=bool(self.desc), WS=bool(self.ws),
            FLAT=bool(self.flat), FLOOR=bool(floor), FTZ=self.ftz, EVEN_K=hd % self.bk == 0,
            num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip

    def __call__(self, h, w, labels, floor: bool = False, tpc_s: tuple[int, ...] | None = None):
        """tpc_s: (tiles per chunk, chunks[, row blocks per group]); default from ``split`` and ``group``."""
        n, hd = h.shape
        v = w.shape[0]
        if tpc_s is None:
            tpc_s = self.chunks(n, v)
        tpc, s = tpc_s[:2]
        g = tpc_s[2] if len(tpc_s) > 2 else (self.group or triton.cdiv(n, self.bm))
        part = torch.empty((5, s, n), device=h.device, dtype=torch.float32)
        out = torch.empty((5, n), device=h.device, dtype=torch.float32)
        k = self.launch(h, w, part, tpc, s, g, floor)
        if not floor and self.kernel is None and k is not None and not interpreting():
            self.kernel = k
        _merge_kernel[(triton.cdiv(n, 32),)](part, h, w, labels, out, n, hd, h.stride(0), w.stride(0), s, BR=32,
                                             SP=max(2, triton.next_power_of_2(s)), BKM=128, num_warps=4)
        return out


def kernel_info(k, requested_warps: int) -> dict:
    """Registers, spills, shared memory, total warps, occupancy and warp-specialisation markers of a compiled kernel."""
    info = {"regs": getattr(k, "n_regs", -1), "spills": getattr(k, "n_spills", -1),
            "smem": int(getattr(k.metadata, "shared", 0)), "warps_total": int(k.metadata.num_warps)}  # fmt: skip
    ttgir, ptx = k.asm.get("ttgir", ""), k.asm.get("ptx", "")
    # a warp-specialised kernel has a ttg.warp_specialize op with partitions (the tt.warp_specialize loop
    # attribute alone is only the request; "ttng.warp_group_dot" is every wgmma, not a marker)
    marks = [m for m in ("ttg.warp_specialize", "async_task", "nvws.", "ttg.partition", "ttg.total-num-warps")
             if m in ttgir]
    if "setmaxnreg" in ptx:
        marks.append("setmaxnreg")
    if info["warps_total"] > requested_warps:
        marks.append(f"warps {requested_warps}->{info['warps_total']}")
    info["ws_marks"] = ",".join(marks)
    info["wgmma"] = "wgmma" in ptx
    info["occ"] = occupancy(k, 32 * info["warps_total"], info)
    return info


def occupancy(k, block: int, info: dict) -> int:
    """Programs per SM: cuOccupancyMaxActiveBlocksPerMultiprocessor, else an estimate from registers and shared memory."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        nb = ctypes.c_int(0)
        rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(nb), ctypes.c_void_p(k.function),
                                                             ctypes.c_int(block), ctypes.c_size_t(info["smem"]))
        if rc == 0 and nb.value > 0:
            return int(nb.value)
    except Exception:
        pass
    regs = max(1, info["regs"]) * block
    return max(1, min(65536 // regs, 232448 // max(1, info["smem"] + 1024), 2048 // block))


def reference_rows(h, w, labels, idx):
    """float64 reference of rows idx: dict logp, entropy, s_expected, zmax (the max logit)."""
    try:
        sys.path.insert(0, str(ROOT / "tests"))
        from reference import reference_token_stats

        z = h[idx].double() @ w.double().T
        r = reference_token_stats(z, labels[idx], 1.0)
        return {"logp": r["logp"], "entropy": r["entropy"], "s_expected": r["s_expected"], "zmax": z.max(-1).values}
    except ImportError:  # the same formulas, recomputed here
        z = h[idx].double() @ w.double().T
        logq = torch.log_softmax(z, dim=-1)
        p = logq.exp()
        ent = -(p * logq).sum(-1)
        return {"logp": logq.gather(-1, labels[idx, None])[:, 0], "entropy": ent,
                "s_expected": (p * p * (ent[:, None] + logq)).sum(-1), "zmax": z.max(-1).values}  # fmt: skip


def floor_error(out, ref, idx) -> float:
    """max |max logit of the floor mode - float64| (the floor's one statistic)."""
    e = (out[4][idx].double().cpu() - ref["zmax"].cpu()).abs().max().item()
    return e if math.isfinite(e) else float("nan")


def max_errors(out, ref, idx) -> tuple[float, float, float]:
    """max |probe - float64| of logp, H, E_p[S] (out: [5, N] lse, logp, H, E, max z)."""
    errs = []
    for row, key in ((1, "logp"), (2, "entropy"), (3, "s_expected")):
        e = (out[row][idx].double().cpu() - ref[key].cpu()).abs().max().item()
        errs.append(e if math.isfinite(e) else float("nan"))
    return tuple(errs)


def inputs(n: int, hd: int, v: int, dtype, device, seed: int = 0):
    """h ~ N(0, 1), W ~ N(0, 1/H) * 4 (peaked rows), random labels."""
    g = torch.Generator(device=device).manual_seed(seed + n + hd + v)
    h = torch.randn(n, hd, device=device, generator=g).to(dtype)
    w = (torch.randn(v, hd, device=device, generator=g) * (4.0 / hd**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    return h, w, labels


# ------------------------------------------------------------------------------------------------ smoke


def smoke() -> int:
    """One tiny shape (N=32, H=64, V=512) and one with row/column tails and several chunks, every schedule."""
    dev = "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"
    import numpy as np

    np.seterr(all="ignore")  # the interpreter's numpy: the floor mode's log(0) and 0 * inf are expected
    # the interpreter does not emulate a bf16 tl.dot (numpy has no bf16): fp16 there
    dtype = torch.float16 if dev == "cpu" else torch.bfloat16
    print(f"smoke on {dev} ({'Triton interpreter' if interpreting() else 'compiled'}), {dtype}, Triton "
          f"{triton.__version__}, torch {torch.__version__}")  # fmt: skip
    if interpreting():
        print("note: the interpreter runs tl.range as a plain Python range: warp_specialize, flatten and num_stages "
              "are accepted and ignored there, so 'tma-ws' runs the plain loop in this mode")  # fmt: skip
    bad = 0
    # (N, H, V, chunks, row blocks per group, schedules): the last two run the grouped program order (groups of 2
    # row blocks of 16 rows; N=40: 3 row blocks, the last group has one) on the flattened schedule
    cases = ((32, 64, 512, 0, 0, tuple(SCHEDULES)), (40, 64, 500, 3, 0, tuple(SCHEDULES)),
             (40, 64, 500, 3, 2, ("tma-flat", "ptr")), (64, 64, 500, 4, 2, ("tma-flat",)))
    for n, hd, v, split, group, scheds in cases:
        h, w, labels = inputs(n, hd, v, dtype, dev)
        idx = torch.arange(n)  # every row: a program-order slip leaves some row block unwritten
        ref = reference_rows(h, w, labels, idx)
        for sched in scheds:
            cfg = (sched, 16, 64, 16, 4, 2)
            t0 = time.monotonic()
            note = ""
            try:
                probe = Probe(cfg, ftz=dev == "cuda", split=split or 2, group=group)
                try:
                    out = probe(h, w, labels)
                except Exception as exc:  # warp_specialize / descriptors unsupported here: the plain loop
                    if not probe.ws:
                        raise
                    note = f" (warp_specialize failed: {type(exc).__name__}; fell back to the plain tl.range)"
                    probe = Probe(cfg, ftz=dev == "cuda", split=split or 2, ws_override=0, group=group)
                    out = probe(h, w, labels)
                floor = probe(h, w, labels, floor=True)
                errs = max_errors(out, ref, idx)
                ferr = floor_error(floor, ref, idx)
                ok = all(math.isfinite(e) and e < ERR_MAX for e in (*errs, ferr))
                tpc, s = probe.chunks(n, v)
                bad += not ok
                grp = f" groups of {group} row blocks" if group else ""
                print(f"  N={n} H={hd} V={v} {cfg_name(cfg):24s} chunks {s} x {tpc} tiles{grp}: err logp {errs[0]:.1e} "
                      f"H {errs[1]:.1e} E_p[S] {errs[2]:.1e} {'ok' if ok else 'WRONG'}; floor: err max z {ferr:.1e}"
                      f"{note} [{time.monotonic() - t0:.1f} s]", flush=True)  # fmt: skip
            except Exception as exc:
                bad += 1
                print(f"  N={n} H={hd} V={v} {cfg_name(cfg)}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print("smoke:", "ok" if not bad else f"{bad} failures")
    return 1 if bad else 0


# -------------------------------------------------------------------------------------- child: compile


def compile_child(spec: str) -> int:
    """Compile (and run once, on a tiny shape with the benchmark's specialisation) one configuration; print JSON."""
    d = json.loads(spec)
    cfg, floor = tuple(d["cfg"]), d["floor"]
    dtype = DTYPES[d.get("dtype", "bf16")]
    res = {"cfg": list(cfg), "floor": floor, "dtype": d.get("dtype", "bf16"), "ok": False}
    t0 = time.monotonic()
    try:
        h, w, labels = inputs(512, 128, 1024, dtype, DEV)
        probe = Probe(cfg, ftz=ftz_ok(), split=2, group=2)  # the grouped order, checked on a tiny shape too
        n, hd = h.shape
        v = w.shape[0]
        tpc, s = probe.chunks(n, v)
        part = torch.empty((5, s, n), device=DEV, dtype=torch.float32)
        k = probe.launch(h, w, part, tpc, s, 2, floor)
        if DEV == "cuda":
            torch.cuda.synchronize()
        res.update(kernel_info(k, probe.warps))
        if not floor:
            idx = torch.linspace(0, n - 1, 8, device=DEV).long()
            res["tiny_errs"] = max_errors(probe(h, w, labels), reference_rows(h, w, labels, idx), idx)
        out_dir = os.environ.get("OUT")
        if probe.ws and not floor and out_dir and k is not None and d.get("ttgir", True):  # warp-specialised TTGIR
            Path(out_dir, f"{cfg[0]}_{probe.bm}x{probe.bv}_w{probe.warps}.ttgir").write_text(k.asm.get("ttgir", ""))
        res["ok"] = True
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
    res["compile_s"] = round(time.monotonic() - t0, 1)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def compile_all(cfgs, budget_end: float, jobs: int, log, meanwhile=None, dtypes=("bf16",)) -> dict:
    """Compile every (config, floor, dtype) in child processes, ``jobs`` at a time (``meanwhile()`` runs here in the
    meantime); -> {(cfg, floor, dtype): result}."""
    results = {}

    def one(cfg, floor, dt):
        if time.monotonic() > budget_end:
            return {"ok": False, "error": "not compiled: budget spent"}
        spec = json.dumps({"cfg": list(cfg), "floor": floor, "dtype": dt, "ttgir": dt == dtypes[0]})
        try:
            p = subprocess.run([sys.executable, __file__, "--_compile", spec], capture_output=True, text=True,
                               timeout=max(30.0, min(120.0, budget_end - time.monotonic() + 30)))
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": "compile timed out"}
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"ok": False, "error": f"child exited {p.returncode} (crash?): {' | '.join(tail)[-500:]}"}

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as ex:
        futs = {ex.submit(one, cfg, floor, dt): (cfg, floor, dt) for dt in dtypes for cfg in cfgs
                for floor in (False, True)}
        if meanwhile is not None:
            meanwhile()
        for fut in concurrent.futures.as_completed(futs):
            cfg, floor, dt = futs[fut]
            r = fut.result()
            results[(cfg, floor, dt)] = r
            what = f"{cfg_name(cfg)} {dt}{' floor' if floor else ''}"
            if r.get("ok"):
                log(f"compiled {what:35s} {r.get('compile_s', 0):5.1f} s: regs {r['regs']} spills {r['spills']} "
                    f"smem {r['smem']} warps {r['warps_total']} occ {r['occ']} wgmma {r['wgmma']} "
                    f"ws-marks [{r['ws_marks']}] tiny errs {r.get('tiny_errs', '-')}")  # fmt: skip
            else:
                log(f"FAILED   {what:35s}: {r.get('error')}")
    return results


# ------------------------------------------------------------------------------------------------ bench


def parse_shapes(args) -> list[tuple[int, int, int, str]]:
    """(H, N, V, dtype) from ``--shapes`` tokens 'H:N[:V[:dtype]]' (V default --v, dtype bf16 or fp16), else the
    product of --h and --n (V = --v, bf16)."""
    if not args.shapes:
        return [(hd, n, args.v, "bf16") for hd in args.h for n in args.n]
    out = []
    for tok in args.shapes:
        parts = tok.split(":")
        if len(parts) < 2 or len(parts) > 4:
            raise SystemExit(f"--shapes: bad token {tok!r} (H:N[:V[:dtype]])")
        dt = parts[3] if len(parts) > 3 and parts[3] else "bf16"
        if dt not in DTYPES:
            raise SystemExit(f"--shapes: dtype {dt!r} not in {sorted(DTYPES)}")
        out.append((int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) > 2 and parts[2] else args.v, dt))
    return out


BASE_CFG = ("tma-flat", 128, 256, 64, 8, 3)  # the first run's best schedule: 'base' = it, chunks auto, row order


def run_log(out_dir: str | None):
    """``log(msg, echo=True)``: print ``msg`` (unless ``echo`` is False) and append it to ``$OUT/fused_ws_probe.log``
    when ``out_dir`` is set (flushed at every line: a run cut off at its limit keeps what it logged)."""
    fh = open(Path(out_dir, "fused_ws_probe.log"), "w") if out_dir else None

    def log(msg: str, echo: bool = True) -> None:
        if echo:
            print(msg, flush=True)
        if fh:
            fh.write(msg + "\n")
            fh.flush()

    return log


def median_ms(fn, rep_ms: int) -> float:
    """``triton.testing.do_bench``'s median time of ``fn`` in ms (25 ms warm-up, ``rep_ms`` of repeats)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def bench(args) -> int:
    import entropy_discriminator as ed

    t_start = time.monotonic()
    budget_end = t_start + args.budget_s
    out_dir = os.environ.get("OUT")
    log = run_log(out_dir)

    card = torch.cuda.get_device_name()
    cap = torch.cuda.get_device_capability()
    sms = sm_count()
    log(f"{card} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, Triton {triton.__version__}, {sms} SMs; "
        f"budget {args.budget_s:.0f} s")  # fmt: skip
    if args.configs:
        cfgs = [c for i, c in enumerate(CONFIGS) if str(i) in args.configs or c[0] in args.configs]
    else:
        cfgs = [CONFIGS[i] for i in DEFAULT_CONFIGS]
    if cap[0] < 9:
        cfgs = [c for c in cfgs if not SCHEDULES[c[0]][0]]
        log("pre-Hopper GPU: TMA schedules skipped")
    shapes = parse_shapes(args)
    dtypes = tuple(dict.fromkeys(dt for *_, dt in shapes))
    chunk_toks = [t for t in args.chunks.split(",") if t]
    orders = [o for o in args.orders.split(",") if o]
    log(f"configs: {', '.join(cfg_name(c) for c in cfgs)}; chunks {','.join(chunk_toks)}; orders {','.join(orders)} "
        f"(group: h blocks of a group within {args.group_mb:g} MiB); floor timed for the "
        f"{args.floor_top or 'all'} fastest plans per shape; shapes "
        f"{' '.join(f'{hd}:{n}:{v}:{dt}' for hd, n, v, dt in shapes)}")  # fmt: skip

    def warm_public() -> None:  # the public call's kernels compile here, not inside the first shape's share
        t = time.monotonic()
        for hd, dt in sorted({(hd, dt) for hd, _, _, dt in shapes}):
            h, w, labels = inputs(256, hd, 1024, DTYPES[dt], DEV)
            ed.token_stats_from_hidden(h, w, labels)
        torch.cuda.synchronize()
        log(f"public call warmed up for (H, dtype) in {sorted({(hd, dt) for hd, _, _, dt in shapes})}: "
            f"{time.monotonic() - t:.0f} s")  # fmt: skip

    compiled = compile_all(cfgs, budget_end, args.jobs, log, meanwhile=warm_public, dtypes=dtypes)
    log(f"compile phase: {time.monotonic() - t_start:.0f} s")

    def ms(fn) -> float:
        return median_ms(fn, args.rep_ms)

    # a shape's share of the budget: proportional to an estimate of one plan's cost there (a check and do_bench's
    # ~8 runs of about cuBLAS's time at ~650 TFLOP/s, at least 0.2 s)
    weights = [0.2 + 9 * 2 * n * hd * v / 6.5e14 for hd, n, v, _ in shapes]
    rows, summary = [], []
    csv_path = Path(args.csv) if args.csv else (Path(out_dir, "fused_ws_probe.csv") if out_dir else None)
    cols = ("card", "dtype", "H", "V", "N", "config", "chunk_spec", "order", "group_rb", "status", "chunks",
            "tiles_per_chunk", "programs", "waves", "occ", "regs", "spills", "smem", "warps_total", "probe_ms",
            "floor_ms", "cublas_ms", "public_ms", "probe_over_cublas", "floor_over_cublas", "public_over_cublas",
            "err_logp", "err_H", "err_Ep", "err_floor_zmax", "public_err_max")  # fmt: skip
    fh = open(csv_path, "w", newline="") if csv_path else None
    writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore") if fh else None
    if writer:
        writer.writeheader()
    for si, (hd, n, v, dt) in enumerate(shapes):
        now = time.monotonic()
        if now > budget_end:
            log(f"budget of {args.budget_s:.0f} s spent: skipping H={hd} N={n} V={v} {dt}")
            summary.append(((hd, n, v, dt), None))
            continue
        shape_end = now + (budget_end - now) * weights[si] / sum(weights[si:])
        torch.cuda.empty_cache()
        h, w, labels = inputs(n, hd, v, DTYPES[dt], DEV)
        idx = torch.linspace(0, n - 1, 8, device=DEV).long()
        ref = reference_rows(h, w, labels, idx)
        cublas = [ms(lambda: h @ w.T)]
        pub_fn = lambda: ed.token_stats_from_hidden(h, w, labels)  # noqa: E731
        ps = pub_fn()
        pub_err = max(float((getattr(ps, k)[idx].double() - ref[k]).abs().max()) for k in ("logp", "entropy", "s_expected"))
        public = [ms(pub_fn)]
        log(f"H={hd} N={n} V={v} {dt}: share {shape_end - now:.0f} s; cuBLAS {cublas[0]:.3f} ms, public "
            f"{public[0]:.3f} ms")  # fmt: skip
        shape_rows, plans, probes = [], [], {}
        for cfg in cfgs:  # the launch plans: configs x orders x chunk counts, duplicate launches dropped
            base = {"card": card, "dtype": dt, "H": hd, "V": v, "N": n, "config": cfg_name(cfg)}
            cf = compiled.get((cfg, False, dt), {})
            if not cf.get("ok"):
                shape_rows.append({**base, "status": "compile failed"})
                continue
            probe = probes[cfg] = Probe(cfg, ftz=ftz_ok())
            probe.occ = cf["occ"]
            for order in orders:
                for tok in chunk_toks:
                    try:
                        plan = probe.plan(n, v, hd, h.element_size(), tok, order, args.group_mb)
                    except ValueError as exc:
                        log(f"  {cfg_name(cfg)} {order} {tok}: {exc}")
                        continue
                    if all((p[0], p[4]) != (cfg, plan) for p in plans):
                        plans.append((cfg, tok, order, cf, plan))
        for pi, (cfg, tok, order, cf, plan) in enumerate(plans):
            tpc, s, g = plan
            rb = triton.cdiv(n, cfg[1])
            progs = rb * s
            base = {"card": card, "dtype": dt, "H": hd, "V": v, "N": n, "config": cfg_name(cfg), "chunk_spec": tok,
                    "order": "row" if g >= rb else order, "group_rb": g, "chunks": s, "tiles_per_chunk": tpc,
                    "programs": progs, "waves": progs / (cf["occ"] * sms), "occ": cf["occ"], "regs": cf["regs"],
                    "spills": cf["spills"], "smem": cf["smem"], "warps_total": cf["warps_total"], "_cfg": cfg,
                    "_plan": plan}  # fmt: skip
            if pi and time.monotonic() > shape_end:
                shape_rows.append({**base, "status": "skipped (budget)"})
                continue
            what = f"{cfg_name(cfg)} S={s:<2d} {base['order']}{'' if g >= rb else f'(G={g})'}"
            try:
                probe = probes[cfg]
                out = probe(h, w, labels, tpc_s=plan)
                errs = max_errors(out, ref, idx)
                ok = all(math.isfinite(e) and e < ERR_MAX for e in errs)
                t_probe = ms(lambda: probe(h, w, labels, tpc_s=plan))
                row = {**base, "status": "ok" if ok else "WRONG", "probe_ms": t_probe, "floor_ms": math.nan,
                       "err_logp": errs[0], "err_H": errs[1], "err_Ep": errs[2], "err_floor_zmax": math.nan}
                log(f"  H={hd} N={n} {dt} {what:44s} ({progs} programs, {base['waves']:.2f} waves): probe "
                    f"{t_probe:.3f} ms ({t_probe / cublas[0]:.3f}x); errs {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e} "
                    f"{row['status']}")  # fmt: skip
                shape_rows.append(row)
            except Exception as exc:  # never fatal
                log(f"  H={hd} N={n} {dt} {what}: {type(exc).__name__}: {str(exc)[:300]}")
                shape_rows.append({**base, "status": f"error {type(exc).__name__}"})
        # the floor (running max only) of the fastest correct plans (all of them with --floor-top 0)
        timed = sorted((r for r in shape_rows if r.get("status") == "ok"), key=lambda r: r["probe_ms"])
        for fi, r in enumerate(timed[: args.floor_top] if args.floor_top > 0 else timed):
            if time.monotonic() > (budget_end if fi == 0 else shape_end):
                break
            if not compiled.get((r["_cfg"], True, dt), {}).get("ok"):
                continue
            try:
                probe = probes[r["_cfg"]]
                plan = r["_plan"]
                ferr = floor_error(probe(h, w, labels, floor=True, tpc_s=plan), ref, idx)
                t_floor = ms(lambda: probe(h, w, labels, floor=True, tpc_s=plan))
                r.update(floor_ms=t_floor, err_floor_zmax=ferr)
                log(f"  H={hd} N={n} {dt} floor of {r['config']} S={r['chunks']} {r['order']} G={r['group_rb']}: "
                    f"{t_floor:.3f} ms (probe {r['probe_ms']:.3f} ms), err max z {ferr:.1e}")  # fmt: skip
            except Exception as exc:
                log(f"  H={hd} N={n} {dt} floor of {r['config']}: {type(exc).__name__}: {str(exc)[:300]}")
        public.append(ms(pub_fn))
        cublas.append(ms(lambda: h @ w.T))
        cb, pb = sum(cublas) / 2, sum(public) / 2
        log(f"H={hd} N={n} V={v} {dt}: cuBLAS {cublas[0]:.3f} / {cublas[1]:.3f} ms, public {public[0]:.3f} / "
            f"{public[1]:.3f} ms ({pb / cb:.3f}x cuBLAS), public max err {pub_err:.1e}")  # fmt: skip
        for r in shape_rows:
            r.update(cublas_ms=cb, public_ms=pb, public_over_cublas=pb / cb, public_err_max=pub_err)
            if "probe_ms" in r:
                r.update(probe_over_cublas=r["probe_ms"] / cb, floor_over_cublas=r["floor_ms"] / cb)
            if writer:
                writer.writerow({k: (f"{x:.5g}" if isinstance(x, float) else x) for k, x in r.items()})
        if fh:
            fh.flush()
        rows.extend(shape_rows)
        good = [r for r in shape_rows if r.get("status") == "ok"]
        summary.append(((hd, n, v, dt), {
            "best": min(good, key=lambda r: r["probe_ms"]) if good else None,
            "floor": min((r for r in good if math.isfinite(r["floor_ms"])), key=lambda r: r["floor_ms"], default=None),
            "base": next((r for r in good if r["_cfg"] == BASE_CFG and r["chunk_spec"] == "auto"
                          and r["order"] == "row"), None),
            "public": pb / cb, "bad": sum(r.get("status", "") not in ("ok", "skipped (budget)") for r in shape_rows),
            "timed": len(good)}))  # fmt: skip
        del h, w, labels, ps

    # ---- every plan (log file only: the CSV has the same), then the summary per shape
    log("", echo=False)
    log(f"{'H':>5s} {'N':>6s} {'dt':4s} {'config':27s} {'S':>3s} {'order':5s} {'G':>4s} {'probe':>8s} {'floor':>8s} "
        f"{'pr/cuB':>6s} {'fl/cuB':>6s} {'err logp':>8s} {'err H':>7s} {'err E':>7s}", echo=False)  # fmt: skip
    for r in rows:
        if "probe_ms" not in r:
            log(f"{r['H']:5d} {r['N']:6d} {r['dtype']:4s} {r['config']:27s} {r.get('chunks', '-')!s:>3s} "
                f"{r.get('order', '-'):5s} {r.get('group_rb', '-')!s:>4s} {r['status']}", echo=False)  # fmt: skip
            continue
        log(f"{r['H']:5d} {r['N']:6d} {r['dtype']:4s} {r['config']:27s} {r['chunks']:3d} {r['order']:5s} "
            f"{r['group_rb']:4d} {r['probe_ms']:8.3f} {r['floor_ms']:8.3f} {r['probe_over_cublas']:6.3f} "
            f"{r['floor_over_cublas']:6.3f} {r['err_logp']:8.1e} {r['err_H']:7.1e} {r['err_Ep']:7.1e}"
            f"{'' if r['status'] == 'ok' else ' ' + r['status']}", echo=False)  # fmt: skip
    log("")
    log("summary per shape: the fastest correct plan (config, chunks S, order, G = row blocks per group), its time "
        "/ cuBLAS, its floor / cuBLAS, the best floor measured, 'base' = tma-flat 128x256x64 w8 s3 chunks auto row "
        "order (the first run's schedule), the public call; cuBLAS = mean of the times before and after")
    log(f"{'H':>5s} {'N':>6s} {'V':>6s} {'dt':4s} {'best config':27s} {'S':>3s} {'order':5s} {'G':>4s} {'pr/cuB':>6s} "
        f"{'fl/cuB':>6s} {'bestfl':>6s} {'base':>6s} {'pu/cuB':>6s} {'<=1.031':7s} {'plans':>5s} {'bad':>3s}")  # fmt: skip
    reached = measured = 0
    for (hd, n, v, dt), sm in summary:
        if sm is None or sm["best"] is None:
            log(f"{hd:5d} {n:6d} {v:6d} {dt:4s} {'(skipped: budget)' if sm is None else '(no correct plan)'}")
            continue
        b, f, bs = sm["best"], sm["floor"], sm["base"]
        hit = b["probe_over_cublas"] <= 1.031
        measured += 1
        reached += hit
        log(f"{hd:5d} {n:6d} {v:6d} {dt:4s} {b['config']:27s} {b['chunks']:3d} {b['order']:5s} {b['group_rb']:4d} "
            f"{b['probe_over_cublas']:6.3f} {b['floor_over_cublas']:6.3f} "
            f"{f['floor_over_cublas'] if f else math.nan:6.3f} {bs['probe_over_cublas'] if bs else math.nan:6.3f} "
            f"{sm['public']:6.3f} {'yes' if hit else 'no':7s} {sm['timed']:5d} {sm['bad']:3d}")  # fmt: skip
    log(f"shapes at <= 1.031x cuBLAS time: {reached} of {measured} measured ({len(summary)} requested)")
    log(f"total {time.monotonic() - t_start:.0f} s")
    if fh:
        fh.close()
    return 0


# ------------------------------------------------------------------------------------------------ confirm


def parse_plans(args) -> list[dict]:
    """The plans to confirm: each CSV shape's fastest correct row (``--confirm``) and/or ``--plans`` tokens
    'H:N:V:dtype:cfg:S:G' (cfg an index into CONFIGS, S chunks, G row blocks per group; G >= N/BM: row order)."""
    plans = []
    if args.confirm:
        import lzma

        opener = lzma.open if str(args.confirm).endswith(".xz") else open
        with opener(args.confirm, "rt", newline="") as fh:
            best = {}
            for r in csv.DictReader(fh):
                if r["status"] != "ok":
                    continue
                key = (int(r["H"]), int(r["N"]), int(r["V"]), r["dtype"])
                if key not in best or float(r["probe_over_cublas"]) < float(best[key]["probe_over_cublas"]):
                    best[key] = r
        names = {cfg_name(c): c for c in CONFIGS}
        for (hd, n, v, dt), r in best.items():
            plans.append({"H": hd, "N": n, "V": v, "dtype": dt, "cfg": names[r["config"]], "S": int(r["chunks"]),
                          "G": int(r["group_rb"]), "prev": float(r["probe_over_cublas"]), "role": "best"})
    for tok in args.plans.split(",") if args.plans else []:
        p = tok.split(":")
        if len(p) != 7 or p[3] not in DTYPES:
            raise SystemExit(f"--plans: bad token {tok!r} (H:N:V:dtype:cfg:S:G)")
        plans.append({"H": int(p[0]), "N": int(p[1]), "V": int(p[2]), "dtype": p[3], "cfg": CONFIGS[int(p[4])],
                      "S": int(p[5]), "G": int(p[6]), "prev": math.nan, "role": "given"})
    return plans


def near_plans(pl: dict, k: int) -> list[dict]:
    """Up to k plans next to ``pl``: half and twice the group, 1.5x and 0.75x the chunks (distinct, valid)."""
    rb = triton.cdiv(pl["N"], pl["cfg"][1])
    nvt = triton.cdiv(pl["V"], pl["cfg"][2])
    s, g = pl["S"], min(pl["G"], rb)
    cands = [(s, max(1, g // 2)), (s, min(rb, 2 * g)), (min(nvt, max(s + 1, round(s * 1.5))), g),
             (max(2, min(s - 1, round(s * 0.75))), g)]
    out, seen = [], {(s, g)}
    for cs, cg in cands:
        if (cs, cg) not in seen:
            seen.add((cs, cg))
            out.append({**pl, "S": cs, "G": cg, "prev": math.nan, "role": "near"})
    return out[:k]


def confirm(args) -> int:
    """Each plan and cuBLAS ``h @ W.T`` timed alternately ``--repeats`` times (do_bench medians), the public call
    twice; per shape: median probe / median cuBLAS, min-max of the paired ratios, public / cuBLAS."""
    import entropy_discriminator as ed

    t_start = time.monotonic()
    budget_end = t_start + args.budget_s
    out_dir = os.environ.get("OUT")
    log = run_log(out_dir)

    def ms(fn) -> float:
        return median_ms(fn, args.rep_ms)

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    card = torch.cuda.get_device_name()
    plans = parse_plans(args)
    shapes = list(dict.fromkeys((p["H"], p["N"], p["V"], p["dtype"]) for p in plans))
    reps = args.repeats
    log(f"{card}, torch {torch.__version__}, Triton {triton.__version__}; confirm {len(plans)} plans over "
        f"{len(shapes)} shapes: {reps} alternations of probe and cuBLAS (do_bench median, rep {args.rep_ms} ms), "
        f"public x2; near plans: {args.near} for shapes above {HIT:.3f}x; budget {args.budget_s:.0f} s")  # fmt: skip
    cols = ("card", "dtype", "H", "V", "N", "role", "config", "chunks", "tiles_per_chunk", "group_rb", "order",
            "prev_ratio", "status", "err_logp", "err_H", "err_Ep", "public_err_max",
            *[f"probe_ms_{i}" for i in range(reps)], *[f"cublas_ms_{i}" for i in range(reps)], "public_ms_0",
            "public_ms_1", "probe_med", "cublas_med", "public_med", "ratio_med", "ratio_min", "ratio_max",
            "public_over_cublas")  # fmt: skip
    csv_path = Path(args.csv) if args.csv else (Path(out_dir, "fused_ws_probe.csv") if out_dir else None)
    fh = open(csv_path, "w", newline="") if csv_path else None
    writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore") if fh else None
    if writer:
        writer.writeheader()
    ftz = ftz_ok()
    summary = []
    for si, shape in enumerate(shapes):
        hd, n, v, dt = shape
        if time.monotonic() > budget_end:
            log(f"budget spent: skipping H={hd} N={n} V={v} {dt}")
            summary.append((shape, None, None))
            continue
        torch.cuda.empty_cache()
        h, w, labels = inputs(n, hd, v, DTYPES[dt], DEV)
        idx = torch.linspace(0, n - 1, 8, device=DEV).long()
        ref = reference_rows(h, w, labels, idx)
        pub_fn = lambda: ed.token_stats_from_hidden(h, w, labels)  # noqa: E731
        ps = pub_fn()
        pub_err = max(float((getattr(ps, k)[idx].double() - ref[k]).abs().max()) for k in ("logp", "entropy", "s_expected"))
        cub_fn = lambda: h @ w.T  # noqa: E731
        todo = [p for p in plans if (p["H"], p["N"], p["V"], p["dtype"]) == shape]
        done = []
        while todo:
            pl = todo.pop(0)
            cfg = pl["cfg"]
            rb = triton.cdiv(n, cfg[1])
            nvt = triton.cdiv(v, cfg[2])
            s = max(1, min(pl["S"], nvt))
            tpc = triton.cdiv(nvt, s)
            s = triton.cdiv(nvt, tpc)
            g = rb if s == 1 else max(1, min(pl["G"], rb))
            what = f"{cfg_name(cfg)} S={s} {'row' if g >= rb else f'group G={g}'}"
            row = {"card": card, "dtype": dt, "H": hd, "V": v, "N": n, "role": pl["role"], "config": cfg_name(cfg),
                   "chunks": s, "tiles_per_chunk": tpc, "group_rb": g, "order": "row" if g >= rb else "group",
                   "prev_ratio": pl["prev"], "public_err_max": pub_err}  # fmt: skip
            try:
                probe = Probe(cfg, ftz=ftz)
                plan = (tpc, s, g)
                errs = max_errors(probe(h, w, labels, tpc_s=plan), ref, idx)
                ok = all(math.isfinite(e) and e < ERR_MAX for e in errs)
                pr, cb, pu = [], [], []
                for i in range(reps):
                    if i in (0, reps - 1):
                        pu.append(ms(pub_fn))
                    pr.append(ms(lambda: probe(h, w, labels, tpc_s=plan)))
                    cb.append(ms(cub_fn))
                ratios = [a / b for a, b in zip(pr, cb)]
                row.update(status="ok" if ok else "WRONG", err_logp=errs[0], err_H=errs[1], err_Ep=errs[2],
                           probe_med=med(pr), cublas_med=med(cb), public_med=sum(pu) / len(pu),
                           ratio_med=med(pr) / med(cb), ratio_min=min(ratios), ratio_max=max(ratios),
                           public_over_cublas=sum(pu) / len(pu) / med(cb),
                           **{f"probe_ms_{i}": x for i, x in enumerate(pr)},
                           **{f"cublas_ms_{i}": x for i, x in enumerate(cb)},
                           **{f"public_ms_{i}": x for i, x in enumerate(pu)})  # fmt: skip
                log(f"  H={hd} N={n} {dt} {pl['role']:5s} {what:42s}: probe {row['probe_med']:.3f} ms, cuBLAS "
                    f"{row['cublas_med']:.3f} ms, ratio {row['ratio_med']:.3f} [{row['ratio_min']:.3f}-"
                    f"{row['ratio_max']:.3f}] (prev {pl['prev']:.3f}), public {row['public_over_cublas']:.3f}x; "
                    f"errs {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e} {row['status']}")  # fmt: skip
            except Exception as exc:  # never fatal
                row["status"] = f"error {type(exc).__name__}"
                log(f"  H={hd} N={n} {dt} {what}: {type(exc).__name__}: {str(exc)[:300]}")
            if writer:
                writer.writerow({k: (f"{x:.5g}" if isinstance(x, float) else x) for k, x in row.items()})
                fh.flush()
            done.append(row)
            # a missed shape (before or now) gets nearby plans while the budget keeps ~8 s per shape still to come
            if (pl["role"] == "best" and args.near > 0 and row["status"] == "ok"
                    and max(pl["prev"], row["ratio_med"]) > HIT
                    and budget_end - time.monotonic() > 8 * (len(shapes) - si - 1) + 12 * args.near):
                todo.extend(near_plans({**pl, "S": s, "G": g}, args.near))
        good = [r for r in done if r.get("status") == "ok"]
        first = next((r for r in good if r["role"] in ("best", "given")), None)
        summary.append((shape, first, min(good, key=lambda r: r["ratio_med"]) if good else None))
        del h, w, labels, ps

    log("")
    log(f"confirm per shape ({reps} alternations): the CSV's best plan (prev = its one-shot ratio), median probe / "
        f"median cuBLAS, min-max of the paired ratios, public / cuBLAS; 'best' = the best confirmed plan incl. nearby")
    log(f"{'H':>5s} {'N':>6s} {'dt':4s} {'S':>3s} {'G':>4s} {'prev':>6s} {'ratio':>6s} {'min-max':>13s} {'pu/cuB':>6s} "
        f"{'cuB ms':>7s} | {'best S':>6s} {'G':>4s} {'ratio':>6s} {'min-max':>13s} {'<=1.031':7s}")  # fmt: skip
    hit1 = hitb = measured = 0
    for (hd, n, v, dt), f, b in summary:
        if f is None and b is None:
            log(f"{hd:5d} {n:6d} {dt:4s} (skipped or failed)")
            continue
        f = f or b
        measured += 1
        hit1 += f["ratio_med"] <= HIT
        hitb += b["ratio_med"] <= HIT
        log(f"{hd:5d} {n:6d} {dt:4s} {f['chunks']:3d} {f['group_rb']:4d} {f['prev_ratio']:6.3f} {f['ratio_med']:6.3f} "
            f"{f['ratio_min']:6.3f}-{f['ratio_max']:6.3f} {f['public_over_cublas']:6.3f} {f['cublas_med']:7.3f} | "
            f"{b['chunks']:6d} {b['group_rb']:4d} {b['ratio_med']:6.3f} {b['ratio_min']:6.3f}-{b['ratio_max']:6.3f} "
            f"{'yes' if b['ratio_med'] <= HIT else 'no':7s}")  # fmt: skip
    log(f"shapes with median ratio <= {HIT:.3f}: {hit1} of {measured} (the CSV's plan), {hitb} of {measured} "
        f"(best confirmed plan incl. nearby)")
    log(f"total {time.monotonic() - t_start:.0f} s")
    if fh:
        fh.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new configuration after this many "
                   "seconds (compile phase included; each shape gets an even share of what is left)")
    p.add_argument("--smoke", action="store_true", help="one tiny shape (N=32, H=64, V=512) and a tail shape through "
                   "every schedule against float64 (CPU with TRITON_INTERPRET=1, or a GPU)")
    p.add_argument("--h", type=int, nargs="+", default=[896, 1536, 2048])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--shapes", nargs="*", default=None, help="'H:N[:V[:dtype]]' tokens (V default --v, dtype bf16 "
                   "or fp16), run in this order; default: --h x --n, bf16")
    p.add_argument("--configs", nargs="*", default=None, help="indices into CONFIGS or schedule names (default: "
                   "DEFAULT_CONFIGS, the tma-flat tiles 128x256 w8, 128x128 w4, 256x128 w8)")
    p.add_argument("--chunks", default="auto", help="comma-separated vocabulary chunk counts per row block to sweep: "
                   "'auto' (fill one wave at the compiled occupancy), 'wave' (grouped order: one wave = one group), "
                   "or numbers, e.g. auto,2,4,8,wave")
    p.add_argument("--orders", default="row", help="comma-separated program orders to sweep: 'row' (all row blocks "
                   "of a chunk together), 'group' (groups of row blocks whose h blocks fit --group-mb), 'g<k>'")
    p.add_argument("--group-mb", type=float, default=16.0, help="L2 room for a group's h blocks (MiB), 'group' order")
    p.add_argument("--floor-top", type=int, default=0, help="time the floor of the K fastest plans per shape only "
                   "(0: every plan)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench rep per timing (ms)")
    p.add_argument("--jobs", type=int, default=8, help="compile children at a time")
    p.add_argument("--csv", default=None, help="CSV path (default $OUT/fused_ws_probe.csv when OUT is set)")
    p.add_argument("--confirm", default=None, help="confirm mode: a probe CSV (.xz read too); each shape's fastest "
                   "correct plan is timed against cuBLAS --repeats times, alternately")
    p.add_argument("--plans", default=None, help="confirm mode: comma-separated 'H:N:V:dtype:cfg:S:G' plans (cfg an "
                   "index into CONFIGS, S chunks, G row blocks per group)")
    p.add_argument("--repeats", type=int, default=5, help="confirm mode: alternations of probe and cuBLAS")
    p.add_argument("--near", type=int, default=0, help="confirm mode: nearby plans (group /2 x2, chunks x1.5 x0.75) "
                   "tried for shapes above 1.031x cuBLAS")
    p.add_argument("--_compile", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if torch is None or triton is None:
        print("fused_ws_probe needs torch and triton", file=sys.stderr)
        return 2
    if args._compile:
        return compile_child(args._compile)
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        print("no CUDA device: only --smoke (with TRITON_INTERPRET=1) runs here", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    if args.confirm or args.plans:
        return confirm(args)
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
