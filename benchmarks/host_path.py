"""``python -m benchmarks.host_path``: where the small-batch public call spends its time (CUDA).

bf16 logits [N, 151936], N = 256 by default (78 MB, the issue's small-batch shape; ``--n`` picks
another).  Each line gives the do_bench
median (CUDA events around the call, L2 flushed first; a call that synchronises is timed up to its
return) of two runs; the "hidden" median, timed the same way but with a ~0.3 ms GPU sleep between
the flush and the start event, so that the host's work before the launch is never timed (what
remains is GPU time plus, for a waiting call, its return to the host); the host time per call
over 300 back-to-back calls (which a call's GPU time bounds from below); and, for a call that does
not wait, its host time alone ("host only": the same 300 calls while a GPU sleep keeps the stream
busy, so no call waits for the GPU).  Rows: the floors of any
call that waits for its result on the host, in the same run: ``torch.sum`` and the pure-read
kernel of :mod:`.floors`, each alone and followed by ``stream.synchronize()``; the statistics
kernel alone, followed by a stream synchronisation, by the ``tolist()`` read of its device
counters (the earlier public call) and by the poll of the host words it writes
(``HostReport.wait``, what ``token_stats`` does); ``token_stats`` with and without ``check``, each
also with the direct launcher off (Triton's own ``kernel[grid](...)`` path, kernels/_launch.py),
the checked call with the wait's tight spin cut to 0.5 ms (then ``time.sleep(0)`` polls), and the checked
call and ``torch.sum`` + sync with their results kept referenced after the call (do_bench otherwise
frees a call's outputs before it records the end event: six tensors for ``token_stats``, one for
``torch.sum``).
Each row gives the median and the 10th-90th percentiles of each do_bench run; the first row is
do_bench's own L2 flush (the host time a call may spend before its launch without being timed).
Then a cProfile of 300 ``token_stats(check=False)`` calls (the host path before the launch).
"""

from __future__ import annotations

import cProfile
import pstats

import torch

from .common import card_name, host_us, kept, synced


def host_hidden_us(fn, flush: torch.Tensor, reps: int = 100) -> float:
    """Median us from a start event to the event recorded after ``fn`` returns, with the L2 flushed as
    do_bench flushes it and a ~0.3 ms GPU sleep between the flush and the start event: the host's work
    before ``fn``'s launch is hidden whatever its length, so what remains is the GPU time plus, for a
    call that waits, the wait's return to the host."""
    times = []
    for _ in range(reps + 5):
        flush.zero_()
        torch.cuda._sleep(500_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times = sorted(times[5:])
    return times[len(times) // 2]


def host_only_us(fn, calls: int = 300) -> float:
    """Host microseconds per call of a call that does not wait, while a long GPU sleep (~0.1 s)
    keeps the stream busy: no call can be slowed down by the GPU."""
    import time

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    import argparse

    import triton
    import triton.testing

    import entropy_discriminator as ed
    from entropy_discriminator.kernels import _host_report
    from entropy_discriminator.kernels._host_report import HostReport
    from entropy_discriminator.kernels.triton_stats import _LAUNCHER, token_stats_triton

    from .floors import read_sum

    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_path", allow_abbrev=False)
    parser.add_argument("--n", type=int, default=256, help="rows of the [N, 151936] bf16 logits")
    n, v = parser.parse_args().n, 151936
    x = (torch.randn(n, v, device="cuda") * 3).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda")
    report = HostReport(pinned=True)

    def kernel():
        return token_stats_triton(x, labels, 1.0, -100)

    def patched(obj, name, value, fn):
        """``fn`` run with ``obj.<name>`` set to ``value`` (restored after each call)."""

        def run():
            old = getattr(obj, name)
            setattr(obj, name, value)
            try:
                return fn()
            finally:
                setattr(obj, name, old)

        return run

    kept_results: list = []

    def kernel_host_words():
        token_stats_triton(x, labels, 1.0, -100, report=report)
        return report.wait()

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # what do_bench zeroes before each call
    # name: (call, whether it waits for its kernel: then no "host only" time, which needs a busy stream)
    cases = {
        "L2 flush (zero 256 MB)": (lambda: flush.zero_(), True),  # the timer's own step: no host-only time either
        "torch.sum": (lambda: torch.sum(x), False),
        "torch.sum+stream.sync": (synced(lambda: torch.sum(x)), True),
        "read_sum": (lambda: read_sum(x, 2112, 2048, 4, 4), False),
        "read_sum+stream.sync": (synced(lambda: read_sum(x, 2112, 2048, 4, 4)), True),
        "kernel": (kernel, False),
        "kernel+stream.sync": (synced(kernel), True),
        "kernel+tolist": (lambda: kernel().errors.tolist(), True),
        "kernel+host words": (kernel_host_words, True),
        "token_stats(check=False)": (lambda: ed.token_stats(x, labels, check=False), False),
        "token_stats": (lambda: ed.token_stats(x, labels), True),
        "check=False, Triton's launch": (patched(_LAUNCHER, "enabled", False, lambda: ed.token_stats(x, labels, check=False)), False),
        "token_stats, Triton's launch": (patched(_LAUNCHER, "enabled", False, lambda: ed.token_stats(x, labels)), True),
        "token_stats, spin 0.5 ms": (patched(_host_report, "SPIN_SECONDS", 5e-4, lambda: ed.token_stats(x, labels)), True),
        "token_stats, result kept": (kept(lambda: ed.token_stats(x, labels), kept_results), True),
        "torch.sum+sync, result kept": (kept(synced(lambda: torch.sum(x)), kept_results), True),
    }
    print(f"card {card_name()} torch {torch.__version__} triton {triton.__version__}; bf16 [{n}, {v}]", flush=True)
    print(f"{'':28s} do_bench median (p10-p90), twice; host-hidden median; host time per call over 300 calls, alone")
    for name, (fn, waits) in cases.items():
        runs = [sorted(triton.testing.do_bench(fn, warmup=50, rep=100, return_mode="all")) for _ in range(2)]
        med = "  ".join(f"{t[len(t) // 2] * 1e3:6.1f} ({t[len(t) // 10] * 1e3:5.1f}-{t[9 * len(t) // 10] * 1e3:5.1f})" for t in runs)
        hidden = host_hidden_us(fn, flush)
        only = "      -" if waits else f"{host_only_us(fn):7.1f}"
        host = f"host {host_us(fn, calls=300):7.1f} us/call, only {only}"
        print(f"{name:32s} {med} us   hidden {hidden:6.1f} us   {host}", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        ed.token_stats(x, labels, check=False)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()
