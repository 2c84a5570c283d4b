"""One-pass Triton kernel for the per-token vocabulary statistics (design: docs/performance.md; the algebra:
:mod:`._reduce`).

A program streams its row (for small N one slice of it: split-V) in blocks of BLOCK logits with lazy rescaling into
per-lane accumulators; bf16 rows may be read as int32 words of two logits (PACKED).  Row faults are counted in a
per-stream workspace that every launch leaves zeroed; the program finishing the call's last row moves the counters
into ``errors`` and, when asked, into pinned host memory (:mod:`._host_report`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import interpreting, is_available
from ._host_report import NO_FAULTS, HostReport, host_report, return_report, spare_report
from ._launch import DirectLauncher
from ._reduce import (D_FLOOR, ERR_WORDS, ERR_WORDS_C, LOG2E, count_row, exp2, max_nan, merge_partials, rescale,
                      row_faults, store_stats)

__all__ = ["KernelStats", "token_stats_triton", "is_available", "choose_config", "HostReport", "host_report", "NO_FAULTS",
           "spare_report", "return_report"]

SPLIT_TARGET = 4  # programs per multiprocessor below which rows are split (split-V)
TAU = 8.0  # lazy-rescale slack in base-2 units: e <= 2^8, e^2 <= 2^16, sums stay far from overflow
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INTERPRETING = interpreting()


@triton.jit
def _rebase(bm, c, m, mx, s0, s1, s2, s3, TAU: tl.constexpr):
    """Take a block's NaN-propagating raw max ``bm`` into the row max ``mx``; move m and the sums to ``bm * c`` when
    that exceeds m by more than TAU (never for NaN).  Returns (m, mx, mu, s0..s3), mu the finite reference."""
    mx = max_nan(mx, bm)
    bm2 = bm * c
    if bm2 > m + TAU:
        s0, s1, s2, s3 = rescale(s0, s1, s2, s3, m, bm2)
        m = bm2
    mu = tl.where(m > float("-inf"), m, 0.0)
    return m, mx, mu, s0, s1, s2, s3


@triton.jit
def _fold(x, c, mu, s0, s1, s2, s3, FTZ: tl.constexpr):
    """Add the logits x (fp32) against the reference mu into the four accumulators."""
    d = tl.maximum(x * c - mu, -D_FLOOR)
    e = exp2(d, FTZ)
    e2 = e * e
    return s0 + e, s1 + e * d, s2 + e2, s3 + e2 * d


@triton.jit
def _update(x, c, m, mx, s0, s1, s2, s3, TAU: tl.constexpr, FTZ: tl.constexpr):
    """Fold one block of raw logits x (fp32) into the running state of one row."""
    m, mx, mu, s0, s1, s2, s3 = _rebase(tl.reduce(x, 0, max_nan), c, m, mx, s0, s1, s2, s3, TAU)
    s0, s1, s2, s3 = _fold(x, c, mu, s0, s1, s2, s3, FTZ)
    return m, mx, s0, s1, s2, s3


@triton.jit
def _max_bf16x2(a, b):
    """NaN-propagating max of two pairs of bf16 packed in int32 words (one ``max.NaN.bf16x2``)."""
    return tl.inline_asm_elementwise("max.NaN.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _halves(w):
    """The two bf16 of each int32 word as fp32 (exact): element 2j is the low half, 2j+1 the high."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _update_packed(w, c, m, mx, s0, s1, s2, s3, TAU: tl.constexpr, FTZ: tl.constexpr, ASM: tl.constexpr):
    """:func:`_update` for int32 words of two bf16 logits (BLOCK // 2 lanes): the block max on the packed pairs
    (ASM False, for the interpreter: on the fp32 halves)."""
    lo, hi = _halves(w)
    if ASM:
        wm_lo, wm_hi = _halves(tl.reduce(w, 0, _max_bf16x2))
        bm = max_nan(wm_lo, wm_hi)
    else:
        bm = max_nan(tl.reduce(lo, 0, max_nan), tl.reduce(hi, 0, max_nan))
    m, mx, mu, s0, s1, s2, s3 = _rebase(bm, c, m, mx, s0, s1, s2, s3, TAU)
    s0, s1, s2, s3 = _fold(lo, c, mu, s0, s1, s2, s3, FTZ)
    s0, s1, s2, s3 = _fold(hi, c, mu, s0, s1, s2, s3, FTZ)
    return m, mx, s0, s1, s2, s3


# Workspace (int32 words, one buffer per device and stream, zero between launches): words 0-1 one int64, finished
# rows plus (<< 32) bad rows; words 2-3 (split-V) finished programs plus (<< 32) flagged ones (_slice_flag); then
# the ERR_WORDS error counters; then (split-V) one arrival counter per row.
WS_PROGS = tl.constexpr(2)
WS_ERR = tl.constexpr(4)
WS_ROWS = tl.constexpr(4 + ERR_WORDS)


@triton.jit
def _publish(host_ptr, seq, counts, any_bad):
    """The host words ``(seq << 32) | count`` per counter, then ``(seq << 32) | any_bad`` (write-through stores)."""
    tag = seq.to(tl.int64) << 32
    tl.store(host_ptr + tl.arange(0, ERR_WORDS_C), tag | counts.to(tl.int64), cache_modifier=".wt")
    tl.store(host_ptr + ERR_WORDS_C, tag | any_bad.to(tl.int64), cache_modifier=".wt")


@triton.jit
def _slice_flag(valid, in_range, mx, mx_scaled):
    """Split-V: whether this slice may make its row bad (no flag in any slice: no bad row)."""
    bad_label, nan_inf, masked, overflow = row_faults(valid, in_range, mx, mx_scaled)
    return bad_label | nan_inf | masked | overflow


@triton.jit
def _early_publish(ws_ptr, N, flag, host_ptr, seq, SPLIT: tl.constexpr):
    """Split-V, after the streaming loop: count the program finished (and flagged); the last of a call without
    flags publishes the clean answer at once, before the merges."""
    progs_ptr = (ws_ptr + WS_PROGS).to(tl.pointer_type(tl.int64))
    inc = 1 + (flag.to(tl.int64) << 32)
    now = tl.atomic_add(progs_ptr, inc, sem="relaxed", scope="gpu") + inc
    if now == N * SPLIT:  # every program in (N * SPLIT < 2**31: split-V is for small N), none flagged
        _publish(host_ptr, seq, tl.zeros([ERR_WORDS_C], dtype=tl.int32), tl.zeros([], dtype=tl.int1))


@triton.jit
def _finish_row(ws_ptr, N, bad, err_ptr, host_ptr, seq, REPORT: tl.constexpr, SPLIT: tl.constexpr, COUNTERS: tl.constexpr):
    """Once per row: count it finished (and bad).  The program finishing the N-th row resets the workspace words
    and writes the counters to ``err_ptr`` (COUNTERS) and the host (REPORT) unless :func:`_early_publish` did."""
    tl.debug_barrier()  # this row's counter increments come before its arrival
    done_ptr = ws_ptr.to(tl.pointer_type(tl.int64))
    inc = 1 + (bad.to(tl.int64) << 32)
    now = tl.atomic_add(done_ptr, inc, sem="acq_rel", scope="gpu") + inc
    if (now & 0xFFFFFFFF) == N:
        tl.store(done_ptr, 0)
        w = tl.arange(0, ERR_WORDS_C)
        if (now >> 32) == 0:
            e = tl.zeros([ERR_WORDS_C], dtype=tl.int32)
        else:
            e = tl.atomic_xchg(ws_ptr + WS_ERR + w, tl.zeros([ERR_WORDS_C], dtype=tl.int32), sem="acq_rel", scope="gpu")
        if COUNTERS:
            tl.store(err_ptr + w, e)
        if REPORT:
            late = True  # one program per row: only here is the answer published
            if SPLIT > 1:  # _early_publish published a call without flags; reset its count
                progs_ptr = (ws_ptr + WS_PROGS).to(tl.pointer_type(tl.int64))
                late = (tl.atomic_xchg(progs_ptr, tl.zeros([], dtype=tl.int64), sem="acq_rel", scope="gpu") >> 32) != 0
            if late:
                _publish(host_ptr, seq, e, (now >> 32) != 0)


@triton.jit(do_not_specialize=["seq"])
def _stats_kernel(x_ptr, inner, stride_outer, stride_inner, lab_ptr, V, chunk, c, ignore_index, out_ptr, valid_ptr,
                  part_ptr, ws_ptr, N, err_ptr, host_ptr, seq, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
                  BLOCK: tl.constexpr, TAU: tl.constexpr, STAGES: tl.constexpr, FTZ: tl.constexpr, REPORT: tl.constexpr,
                  PACKED: tl.constexpr, COUNTERS: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    r = row.to(tl.int64)
    label = tl.load(lab_ptr + row)
    valid = label != ignore_index
    in_range = (label >= 0) & (label < V)
    outer = r // inner
    row_ptr = x_ptr + outer * stride_outer + (r - outer * inner) * stride_inner
    # the label's logit, loaded before the loop: its latency stays off the path from the last block to the call's end
    xk = tl.load(row_ptr + label, mask=valid & in_range, other=float("nan")).to(tl.float32)
    start = sp * chunk
    n = tl.where(valid, tl.minimum(V - start, chunk), 0)
    n_full = n // BLOCK
    p = row_ptr + start
    m = float("-inf")
    mx = float("-inf")
    rem = n - n_full * BLOCK
    if PACKED > 0:  # bf16, V even, rows 4-byte aligned: two logits per int32 word (2: PTX block max)
        HALF: tl.constexpr = BLOCK // 2
        wp = p.to(tl.pointer_type(tl.int32))
        offs = tl.arange(0, HALF)
        s0 = tl.zeros([HALF], dtype=tl.float32)
        s1 = tl.zeros([HALF], dtype=tl.float32)
        s2 = tl.zeros([HALF], dtype=tl.float32)
        s3 = tl.zeros([HALF], dtype=tl.float32)
        for i in tl.range(0, n_full, num_stages=STAGES):
            w = tl.load(wp + i * HALF + offs)
            m, mx, s0, s1, s2, s3 = _update_packed(w, c, m, mx, s0, s1, s2, s3, TAU, FTZ, PACKED == 2)
        if rem > 0:  # rem is even; masked words are a pair of -inf (0xFF80FF80)
            w = tl.load(wp + n_full * HALF + offs, mask=offs < rem // 2, other=-8323200)
            m, mx, s0, s1, s2, s3 = _update_packed(w, c, m, mx, s0, s1, s2, s3, TAU, FTZ, PACKED == 2)
    else:
        offs = tl.arange(0, BLOCK)
        s0 = tl.zeros([BLOCK], dtype=tl.float32)
        s1 = tl.zeros([BLOCK], dtype=tl.float32)
        s2 = tl.zeros([BLOCK], dtype=tl.float32)
        s3 = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.range(0, n_full, num_stages=STAGES):
            x = tl.load(p + i * BLOCK + offs).to(tl.float32)
            m, mx, s0, s1, s2, s3 = _update(x, c, m, mx, s0, s1, s2, s3, TAU, FTZ)
        if rem > 0:
            x = tl.load(p + n_full * BLOCK + offs, mask=offs < rem, other=float("-inf")).to(tl.float32)
            m, mx, s0, s1, s2, s3 = _update(x, c, m, mx, s0, s1, s2, s3, TAU, FTZ)
    if SPLIT > 1:
        if REPORT:  # before the sums are reduced: the host may be released by this program
            _early_publish(ws_ptr, N, _slice_flag(valid, in_range, mx, mx * c), host_ptr, seq, SPLIT)
    t0 = tl.sum(s0, axis=0)
    t1 = tl.sum(s1, axis=0)
    t2 = tl.sum(s2, axis=0)
    t3 = tl.sum(s3, axis=0)
    if SPLIT == 1:
        bad = count_row(ws_ptr + WS_ERR, valid, in_range, mx, mx * c)
        _finish_row(ws_ptr, N, bad, err_ptr, host_ptr, seq, REPORT, SPLIT, COUNTERS)
        mu = tl.where(m > float("-inf"), m, 0.0)
        store_stats(r, N, valid, bad, mu, t0, t1, t2, t3, xk * c, out_ptr, valid_ptr)
    else:
        # Split-V: publish this slice's partials; the row's last program to arrive merges them in slice order
        stride_f = tl.cast(N, tl.int64) * SPLIT
        base = part_ptr + r * SPLIT
        tl.store(base + sp, m)
        tl.store(base + stride_f + sp, t0)
        tl.store(base + 2 * stride_f + sp, t1)
        tl.store(base + 3 * stride_f + sp, t2)
        tl.store(base + 4 * stride_f + sp, t3)
        tl.store(base + 5 * stride_f + sp, mx)
        tl.debug_barrier()
        arrived = tl.atomic_add(ws_ptr + WS_ROWS + row, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.store(ws_ptr + WS_ROWS + row, 0)  # reset: the next launch on this stream reuses it
            j = tl.arange(0, SPLIT_P2)
            msk = j < SPLIT
            mj = tl.load(base + j, mask=msk, other=float("-inf"), cache_modifier=".cg")
            u0j = tl.load(base + stride_f + j, mask=msk, other=0.0, cache_modifier=".cg")
            u1j = tl.load(base + 2 * stride_f + j, mask=msk, other=0.0, cache_modifier=".cg")
            u2j = tl.load(base + 3 * stride_f + j, mask=msk, other=0.0, cache_modifier=".cg")
            u3j = tl.load(base + 4 * stride_f + j, mask=msk, other=0.0, cache_modifier=".cg")
            mxj = tl.load(base + 5 * stride_f + j, mask=msk, other=float("-inf"), cache_modifier=".cg")
            mx_row = tl.reduce(mxj, 0, max_nan)
            bad = count_row(ws_ptr + WS_ERR, valid, in_range, mx_row, mx_row * c)
            _finish_row(ws_ptr, N, bad, err_ptr, host_ptr, seq, REPORT, SPLIT, COUNTERS)
            mu, u0, u1, u2, u3 = merge_partials(mj, u0j, u1j, u2j, u3j)
            store_stats(r, N, valid, bad, mu, u0, u1, u2, u3, xk * c, out_ptr, valid_ptr)


class KernelStats(NamedTuple):
    """Five fp32 statistics and ``valid`` of the labels' shape; ``errors`` (None when no counters were asked for):
    int32 [ERR_WORDS] counts of rows with a label outside [0, V), a NaN or +inf logit, every logit -inf, and finite
    logits that overflow fp32 once scaled (a bad row's statistics are NaN)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    s_star: torch.Tensor
    s_expected: torch.Tensor
    s_centered: torch.Tensor
    valid: torch.Tensor
    errors: torch.Tensor | None


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


# (block, num_warps, stages) by logits dtype, chosen on an H100 on 132 and 88 SMs (benchmarks/RESULTS.md)
_LOOP_DEFAULTS = {torch.bfloat16: (1024, 1, 4), torch.float16: (512, 1, 8), torch.float32: (2048, 4, 3)}


def choose_config(n_rows: int, vocab: int, dtype: torch.dtype, num_sms: int) -> dict:
    """Block size, warps, pipelining depth and split-V factor for an [n_rows, vocab] problem: the loop of
    :data:`_LOOP_DEFAULTS` (one warp for 16-bit logits: no cross-warp max reduction); split-V by the power of two
    that reaches SPLIT_TARGET programs per SM, each slice >= 2 blocks.  A ``config`` may also set ``packed`` (0: no
    PACKED loop) and ``ftz`` (benchmarks)."""
    block, num_warps, stages = _LOOP_DEFAULTS[dtype]
    block = min(block, max(128, triton.next_power_of_2(vocab)))
    split = 1
    target = SPLIT_TARGET * num_sms
    if n_rows < target:
        max_split = max(1, vocab // (2 * block))
        split = max(1, min(max_split, triton.next_power_of_2(-(-target // max(n_rows, 1)))))
    return {"block": block, "num_warps": num_warps, "stages": stages, "split": split}


def _row_layout(shape: tuple, strides: tuple) -> tuple[int, int, int] | None:
    """``(inner, stride_outer, stride_inner)`` placing flat row r of ``x[..., V]`` at ``(r // inner) * stride_outer +
    (r % inner) * stride_inner``, or None when the leading dimensions do not fold into two such levels."""
    dims = [(n, st) for n, st in zip(shape[:-1], strides[:-1]) if n != 1]
    folded: list[list[int]] = []
    for n, st in dims:
        if folded and folded[-1][1] == n * st:
            folded[-1] = [folded[-1][0] * n, st]
        else:
            folded.append([n, st])
    if len(folded) > 2:
        return None
    (_, stride_outer), (inner, stride_inner) = [[1, 0]] * (2 - len(folded)) + folded
    return inner, stride_outer, stride_inner


def token_stats_triton(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, ignore_index: int, *, config: dict | None = None,
    report: HostReport | None = None, counters: bool = True,
) -> KernelStats:
    """One-pass statistics of every row of ``logits`` [..., V] (bf16/fp16/fp32, CUDA).

    With z = logits/T (fp32), p = softmax(z), k = labels (integer, ``logits.shape[:-1]``) returns
    :class:`KernelStats`: fp32 log p_k, H = -sum p log p, S* = p_k (H + log p_k), E_p[S] = H sum p^2 + sum p^2 log p
    (:mod:`._reduce`), S_c = S* - E_p[S] and ``valid = labels != ignore_index``, each of ``labels.shape``; and the
    int32 error counters, without a host synchronisation (``report`` gets them too, for its ``wait()``;
    ``counters=False``: ``errors`` is None).  Ignored rows are not read and give 0.  Leading dimensions that fold
    into two strided levels (e.g. ``[B, T+1, V][:, :-1]``) are read in place, others one launch per leading index; a
    non-contiguous last dimension is copied.  ``config`` overrides :func:`choose_config`.  Deterministic.
    """
    if logits.dim() < 1:
        raise ValueError(f"logits must have shape [..., V], got shape {tuple(logits.shape)}")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits dtype must be bf16, fp16 or fp32, got {logits.dtype}")
    dev = logits.device
    if dev.type != "cuda" and not _INTERPRETING:
        raise ValueError(f"logits must be a CUDA tensor, got device {dev}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must have shape {tuple(logits.shape[:-1])}, got shape {tuple(labels.shape)}")
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    plan = _plan(logits.shape, logits.stride(), logits.dtype, dev, tuple(sorted(config.items())) if config else None)
    n_rows = plan.n_rows
    # host time matters at small N: a cached plan, no views or memset before the launch, one direct launch
    out = torch.empty((5, *labels.shape), device=dev, dtype=torch.float32)  # rows of the flat [5, n_rows]
    valid = torch.empty(labels.shape, device=dev, dtype=torch.bool)
    errors = torch.empty(ERR_WORDS, device=dev, dtype=torch.int32) if counters else None
    result = KernelStats(*out.unbind(0), valid, errors)
    if n_rows == 0:
        if errors is not None:
            errors.zero_()
        return result
    flat_labels = labels if labels.is_contiguous() else labels.reshape(-1)  # read as flat [n_rows]
    if flat_labels.dtype not in (torch.int32, torch.int64):
        flat_labels = flat_labels.to(torch.int64)
    switch = dev.type == "cuda" and dev.index != torch.cuda.current_device()
    with torch.cuda.device(dev) if switch else contextlib.nullcontext():
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # CUDA graph capture: the graph's own buffers, never the per-stream ones eager calls keep using
            ws = torch.zeros(plan.ws_words, device=dev, dtype=torch.int32)
            part = torch.empty(plan.part_words, device=dev) if plan.split > 1 else ws
        else:
            stream = (dev.index, torch._C._cuda_getCurrentRawStream(dev.index)) if dev.type == "cuda" else None
            ws = _stream_buffer("ws", dev, stream, plan.ws_words, torch.int32)
            part = _stream_buffer("part", dev, stream, plan.part_words, torch.float32) if plan.split > 1 else ws
        seq, host = (report.arm(dev), report.words) if report is not None else (0, ws)
        args = (LOG2E / float(temperature), int(ignore_index), plan, part, ws, errors, host, seq)
        try:
            if plan.layout is not None:
                _launch(logits, plan.layout, flat_labels, n_rows, out, valid, n_rows, *args)
            else:  # leading dimensions that do not fold: one launch per leading index
                flat_labels, flat_out, flat_valid = flat_labels.reshape(-1), out.view(5, -1), valid.view(-1)
                per = n_rows // logits.shape[0]
                for i in range(logits.shape[0]):
                    rows = slice(i * per, (i + 1) * per)
                    sub = logits[i]
                    layout = _row_layout(sub.shape, sub.stride())
                    if layout is None:
                        sub = sub.reshape(-1, plan.vocab)
                        layout = _row_layout(sub.shape, sub.stride())
                    _launch(sub, layout, flat_labels[rows], per, flat_out[:, rows], flat_valid[rows], n_rows, *args)
        except BaseException:
            if report is not None:
                report.busy = False
            raise
    return result


class _Plan(NamedTuple):
    """What a launch needs that depends only on the logits' shape, strides, dtype and device."""

    n_rows: int
    vocab: int
    layout: tuple[int, int, int] | None  # see _row_layout; None: one launch per leading index
    split: int
    chunk: int
    ws_words: int  # int32 workspace words: errors, finished rows, per-row arrivals (split-V)
    part_words: int  # fp32 split-V partials (6 per row and slice)
    num_warps: int
    packed: int  # PACKED of rows that allow it (bf16, V even; the launch checks strides and alignment)
    consts: dict  # (REPORT, PACKED, COUNTERS) -> (name, value) of the compile-time arguments in signature order


@functools.lru_cache(maxsize=1024)
def _plan(shape: torch.Size, strides: tuple, dtype: torch.dtype, dev: torch.device, config: tuple | None) -> _Plan:
    vocab = shape[-1]
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    n_rows = math.prod(shape[:-1])
    cfg = dict(config) if config else choose_config(n_rows, vocab, dtype, _num_sms(dev))
    nblocks = -(-vocab // cfg["block"])  # slices of whole blocks, at most cfg["split"] of them, none empty
    chunk = -(-nblocks // max(1, min(cfg["split"], nblocks))) * cfg["block"]
    split = -(-vocab // chunk)
    layout = _row_layout(shape, strides)
    consts = (("SPLIT", split), ("SPLIT_P2", 1 << (split - 1).bit_length()), ("BLOCK", cfg["block"]), ("TAU", TAU))
    consts += (("STAGES", cfg["stages"]), ("FTZ", bool(cfg.get("ftz", 1)) and not _INTERPRETING))
    ws_words = 4 + ERR_WORDS + (n_rows if split > 1 else 0)
    parts = 6 * n_rows * split if split > 1 else 0
    packed = cfg.get("packed", 1 if _INTERPRETING else 2) if dtype == torch.bfloat16 and vocab % 2 == 0 else 0
    table = {(rep, mode, cnt): consts + (("REPORT", rep), ("PACKED", mode), ("COUNTERS", cnt))
             for rep in (False, True) for mode in {0, packed} for cnt in (False, True)}
    return _Plan(n_rows, vocab, layout, split, chunk, ws_words, parts, cfg["num_warps"], packed, table)


# Per (device, stream) buffers: the workspace and the split-V partials.  Launches on one stream are ordered, so a
# buffer is never used by two launches at once.
_BUFFERS: dict[tuple, torch.Tensor] = {}
_BUFFERS_LOCK = threading.Lock()


def _stream_buffer(kind: str, dev: torch.device, stream: tuple | None, words: int, dtype: torch.dtype) -> torch.Tensor:
    """This stream's (``stream``: (device index, raw handle), None in the interpreter) ``kind`` buffer of at least
    ``words`` elements, ``"ws"`` zeros or ``"part"`` uninitialised, at least doubled when it grows."""
    key = (kind, *stream) if stream is not None else (kind, str(dev), threading.get_ident())
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < words:
        with _BUFFERS_LOCK:
            size = max(words, 2 * buf.numel() if buf is not None else (1024 if kind == "ws" else 0))
            buf = _BUFFERS[key] = (torch.zeros if kind == "ws" else torch.empty)(size, device=dev, dtype=dtype)
    return buf


# Runtime parameters of _stats_kernel by kind (pointer, int, float), in order.
_KINDS = "piiipiifippppippi"
_LAUNCHER = DirectLauncher(_stats_kernel, _KINDS)


def _launch(x, layout, labels, rows, out, valid, n_out, c, ignore_index, plan, part, ws, errors, host, seq) -> None:
    """One direct launch over ``rows`` rows of ``x`` (``layout``: :func:`_row_layout`; ``labels``, ``out`` and
    ``valid`` start at the first of them) on the current device."""
    inner, stride_outer, stride_inner = layout
    args = (x, inner, stride_outer, stride_inner, labels, plan.vocab, plan.chunk, c, ignore_index, out, valid, part, ws,
            n_out, errors if errors is not None else ws, host, seq)  # fmt: skip
    # two bf16 per int32 word: the rows' starts (and so every block) must be 4-byte aligned
    packed = plan.packed if not (x.data_ptr() & 3 or stride_outer & 1 or stride_inner & 1) else 0
    consts = plan.consts[seq != 0, packed, errors is not None]  # COUNTERS: the call wants device counters
    _LAUNCHER.launch((rows, plan.split, 1), args, consts, plan.num_warps, x.device.index or 0)
