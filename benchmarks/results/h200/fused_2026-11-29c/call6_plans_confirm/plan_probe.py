"""One-off probe (run as ``python -m benchmarks._plan_confirm`` from the repository root, copied here): launch plans of
the streaming kernel against cuBLAS, 3 alternating rounds of 300 ms medians."""
import torch

from benchmarks.common import bench_ms
from benchmarks.fused_vs_cublas import _inputs
from entropy_discriminator.kernels.triton_fused import stream_plan, token_stats_fused_triton

PLANS = {"current": {}, "s3 g44": {"chunks": 3, "group_rows": 44}, "s4 g33": {"chunks": 4, "group_rows": 33},
         "s6 g22": {"chunks": 6, "group_rows": 22}}
for h, n in [(1536, 16384), (2048, 16384), (1536, 65536), (2048, 65536), (896, 65536)]:
    hid, w, lab = _inputs(n, h, 151936, torch.bfloat16)
    fns = {"cublas": lambda: hid @ w.T}
    for name, cfg in PLANS.items():
        fns[name] = lambda cfg=cfg: token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config=cfg)
    res = {k: [] for k in fns}
    for rnd in range(3):
        for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            res[k].append(bench_ms(fns[k], 300, 30))
    cb = sum(res["cublas"]) / 3
    text = ", ".join(f"{k} {sum(v) / 3 / cb:.3f} ({min(v) / cb:.3f}-{max(v) / cb:.3f})" for k, v in res.items())
    print(f"H={h} N={n} plan {stream_plan(n, 151936, h, 2, 128, 256, 132)}: {text}", flush=True)
    del hid, w, lab
