"""One-off check (run from the repository root as ``python benchmarks/results/h200/plans_2026-11-29/paths_check.py``):
at H 3584, N 16384, where the public benchmark's deferred call read 1.07-1.10x cuBLAS but its waiting call
1.04-1.06x, the kernel alone, the waiting call and the deferred call against cuBLAS, 3 alternating rounds of
medians of at least 300 ms."""
import sys

import torch

sys.path.insert(0, ".")
import entropy_discriminator as ed  # noqa: E402
from benchmarks.common import bench_ms  # noqa: E402
from benchmarks.fused_vs_cublas import _inputs  # noqa: E402
from entropy_discriminator.hidden import token_stats_from_hidden  # noqa: E402
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton  # noqa: E402

for dt in (torch.bfloat16, torch.float16):
    hid, w, lab = _inputs(16384, 3584, 152064, dt)
    fns = {"cublas": lambda: hid @ w.T, "kernel": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100),
           "waiting": lambda: token_stats_from_hidden(hid, w, lab),
           "deferred": lambda: token_stats_from_hidden(hid, w, lab, check="deferred")}
    res = {k: [] for k in fns}
    rep = max(300, int(8 * bench_ms(fns["cublas"], 25, 5)))
    for rnd in range(3):
        for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            res[k].append(bench_ms(fns[k], rep, 30))
            ed.raise_deferred()
    cb = sum(res["cublas"]) / 3
    text = ", ".join(f"{k} {sum(x) / 3 / cb:.3f} ({min(x) / cb:.3f}-{max(x) / cb:.3f})" for k, x in res.items())
    print(f"H=3584 N=16384 {str(dt)[6:]}: cublas {cb:.3f} ms; {text}", flush=True)
    del hid, w, lab
