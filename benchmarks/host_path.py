"""``python -m benchmarks.host_path``: where the small-batch public call spends its time (CUDA).

bf16 logits [256, 151936] (78 MB, the issue's small-batch shape).  Each line gives the do_bench
median (CUDA events around the call, L2 flushed first; a call that synchronises is timed up to its
return) twice, and the host time per call over 300 back-to-back calls.  Rows: torch.sum; the kernel
alone; the kernel followed by three ways of reading its error counters on the host (pageable
``tolist()``, as ``token_stats`` does; a non-blocking copy to pinned memory and an event; a stream
synchronisation without a read); ``token_stats`` with and without ``check``; the cost of a small
``torch.zeros`` and ``torch.empty``.  Then a cProfile of 300 ``token_stats(check=False)`` calls.
"""

from __future__ import annotations

import cProfile
import pstats

import torch

from .common import host_us


def main() -> None:
    import triton.testing

    import entropy_discriminator as ed
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    n, v = 256, 151936
    x = (torch.randn(n, v, device="cuda") * 3).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda")
    pinned = torch.empty(4, dtype=torch.int32, pin_memory=True)

    def kernel():
        return token_stats_triton(x, labels, 1.0, -100)

    def kernel_tolist():
        return kernel().errors.tolist()

    def kernel_pinned_event():
        pinned.copy_(kernel().errors, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return pinned.tolist()

    def kernel_stream_sync():
        out = kernel()
        torch.cuda.current_stream().synchronize()
        return out

    cases = {
        "torch.sum": lambda: torch.sum(x),
        "kernel": kernel,
        "kernel+tolist": kernel_tolist,
        "kernel+pinned+event": kernel_pinned_event,
        "kernel+stream.sync": kernel_stream_sync,
        "token_stats(check=False)": lambda: ed.token_stats(x, labels, check=False),
        "token_stats": lambda: ed.token_stats(x, labels),
        "torch.zeros(260)": lambda: torch.zeros(260, device="cuda", dtype=torch.int32),
        "torch.empty(5,256)": lambda: torch.empty((5, 256), device="cuda"),
    }
    for name, fn in cases.items():
        a, b = (triton.testing.do_bench(fn, warmup=50, rep=100, return_mode="median") for _ in range(2))
        print(f"{name:28s} do_bench {a * 1e3:7.1f} {b * 1e3:7.1f} us   host {host_us(fn, calls=300):7.1f} us/call", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        ed.token_stats(x, labels, check=False)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()
