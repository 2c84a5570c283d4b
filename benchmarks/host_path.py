"""``python -m benchmarks.host_path``: where the small-batch public call spends its time (CUDA).

bf16 logits [256, 151936] (78 MB, the issue's small-batch shape).  Each line gives the do_bench
median (CUDA events around the call, L2 flushed first; a call that synchronises is timed up to its
return) twice, and the host time per call over 300 back-to-back calls.  Rows: the floors of any
call that waits for its result on the host, in the same run: ``torch.sum`` and the pure-read
kernel of :mod:`.floors`, each alone and followed by ``stream.synchronize()``; the statistics
kernel alone, followed by a stream synchronisation, by the ``tolist()`` read of its device
counters (the earlier public call) and by the poll of the host words it writes
(``HostReport.wait``, what ``token_stats`` does); ``token_stats`` with and without ``check``.
Then a cProfile of 300 ``token_stats(check=False)`` calls (the host path before the launch).
"""

from __future__ import annotations

import cProfile
import pstats

import torch

from .common import card_name, host_us


def main() -> None:
    import triton
    import triton.testing

    import entropy_discriminator as ed
    from entropy_discriminator.kernels._host_report import HostReport
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    from .floors import read_sum

    n, v = 256, 151936
    x = (torch.randn(n, v, device="cuda") * 3).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda")
    report = HostReport(pinned=True)
    stream = torch.cuda.current_stream()

    def kernel():
        return token_stats_triton(x, labels, 1.0, -100)

    def synced(fn):
        def run():
            out = fn()
            stream.synchronize()
            return out

        return run

    def kernel_host_words():
        token_stats_triton(x, labels, 1.0, -100, report=report)
        return report.wait()

    cases = {
        "torch.sum": lambda: torch.sum(x),
        "torch.sum+stream.sync": synced(lambda: torch.sum(x)),
        "read_sum": lambda: read_sum(x, 2112, 2048, 4, 4),
        "read_sum+stream.sync": synced(lambda: read_sum(x, 2112, 2048, 4, 4)),
        "kernel": kernel,
        "kernel+stream.sync": synced(kernel),
        "kernel+tolist": lambda: kernel().errors.tolist(),
        "kernel+host words": kernel_host_words,
        "token_stats(check=False)": lambda: ed.token_stats(x, labels, check=False),
        "token_stats": lambda: ed.token_stats(x, labels),
    }
    print(f"card {card_name()} torch {torch.__version__} triton {triton.__version__}; bf16 [{n}, {v}]", flush=True)
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
