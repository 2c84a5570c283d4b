"""Read-floor measurements for small inputs (``python -m benchmarks tune`` uses them).

``read_sum`` is a pure-read Triton kernel: every program sums a contiguous chunk of the flat
tensor with 16-byte loads and writes one fp32 partial, so its time is what reading the bytes
costs on the card with a grid of ``programs`` and ``stages`` loads in flight; it is a second floor
beside ``torch.sum``.  ``ColdTimer`` times a call after an L2 flush that leaves no dirty lines, and with the
host's launch work hidden behind a GPU sleep (GPU time only):
``triton.testing.do_bench`` flushes the L2 by *writing* a 256 MB buffer, and the ~50 MB of dirty
lines it leaves are written back while the timed call reads, which a read of another buffer
before the start event avoids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _read_sum_kernel(x_ptr, out_ptr, numel, chunk, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * chunk
    n = tl.minimum(numel - start, chunk)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, n // BLOCK, num_stages=STAGES):
        acc += tl.load(x_ptr + start + i * BLOCK + offs).to(tl.float32)
    rem = n - (n // BLOCK) * BLOCK
    tail = tl.load(x_ptr + start + (n // BLOCK) * BLOCK + offs, mask=offs < rem, other=0.0)
    acc += tail.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_sum(x: torch.Tensor, programs: int, block: int = 4096, stages: int = 4, num_warps: int = 4) -> torch.Tensor:
    """fp32 [programs] partial sums of the flat contiguous ``x`` (any float dtype): one read of x."""
    flat = x.reshape(-1)
    numel = flat.numel()
    chunk = triton.cdiv(triton.cdiv(numel, programs), block) * block
    grid = triton.cdiv(numel, chunk)
    out = torch.empty(grid, device=x.device, dtype=torch.float32)
    _read_sum_kernel[(grid,)](flat, out, numel, chunk, BLOCK=block, STAGES=stages, num_warps=num_warps)
    return out


class ColdTimer:
    """Median time of ``fn`` from a cold, clean L2: flush by writing, then evict by reading."""

    def __init__(self, device: str = "cuda", mib: int = 256):
        self.flush = torch.empty(mib * 2**20 // 4, device=device, dtype=torch.int32)
        self.evict = torch.ones(mib * 2**20 // 4, device=device, dtype=torch.float32)
        self.sink = torch.empty((), device=device, dtype=torch.float32)

    def __call__(self, fn: Callable[[], object], reps: int = 100, warmup: int = 5) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time: the host enqueues fn meanwhile
            self.flush.zero_()
            torch.sum(self.evict, dim=0, out=self.sink)  # dirty lines written back before the start event
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in times)
        return float(ms[len(ms) // 2])
