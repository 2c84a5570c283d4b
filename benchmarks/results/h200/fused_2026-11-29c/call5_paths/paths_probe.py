"""One-off probe (run as ``python -m benchmarks._defer_probe`` from the repository root, copied here): the public
call's paths against cuBLAS at N = 65536, each the mean of 3 alternating do_bench medians of 300 ms."""
import torch
from benchmarks.common import bench_ms
from benchmarks.fused_vs_cublas import _inputs
from entropy_discriminator import raise_deferred
from entropy_discriminator.hidden import token_stats_from_hidden
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton

for h, n, dt in [(1536, 65536, torch.bfloat16), (2048, 65536, torch.bfloat16), (1536, 16384, torch.bfloat16)]:
    hid, w, lab = _inputs(n, h, 151936, dt)

    def synced(fn):
        def g():
            fn()
            torch.cuda.synchronize()
        return g
    fns = {"cublas": lambda: hid @ w.T,
           "deferred": lambda: token_stats_from_hidden(hid, w, lab, check="deferred"),
           "nocheck": lambda: token_stats_from_hidden(hid, w, lab, check=False),
           "waiting": lambda: token_stats_from_hidden(hid, w, lab),
           "kernel": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100),
           "kernel+sync": synced(lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100)),
           "cublas+sync": synced(lambda: hid @ w.T)}
    res = {k: [] for k in fns}
    for rep in range(3):
        for k in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
            res[k].append(bench_ms(fns[k], 300, 30))
            raise_deferred()
    cb = sum(res["cublas"]) / 3
    text = ", ".join(f"{k} {sum(v) / 3 / cb:.3f} ({min(v) / cb:.3f}-{max(v) / cb:.3f})" for k, v in res.items())
    print(f"H={h} N={n}: {text}", flush=True)
    del hid, w, lab
