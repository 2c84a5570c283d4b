"""One-off probe (run from the repository root as ``python benchmarks/results/h200/plans_2026-11-29/plan_probe.py``):
launch plans whose programs fill the whole wave (S chunks x G row blocks = 132 on an H200) against the default
choice, at the shapes that missed 0.97x cuBLAS; 3 alternating rounds of medians of at least 300 ms each."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms  # noqa: E402
from benchmarks.fused_vs_cublas import _inputs  # noqa: E402
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton  # noqa: E402

PLANS = {  # (H, V): the variants timed beside cuBLAS and the default
    (3584, 152064): {"stream": {"stream": 1}, "s11 g12": {"stream": 1, "chunks": 11, "group_rows": 12},
                     "s6 g22": {"stream": 1, "chunks": 6, "group_rows": 22}},
    (2048, 151936): {"s11 g12": {"chunks": 11, "group_rows": 12}, "s6 g22": {"chunks": 6, "group_rows": 22}},
    (1536, 151936): {"s11 g12": {"chunks": 11, "group_rows": 12}, "s12 g11": {"chunks": 12, "group_rows": 11}},
}
SHAPES = [(3584, 16384, torch.bfloat16), (3584, 65536, torch.bfloat16), (3584, 16384, torch.float16),
          (3584, 65536, torch.float16), (2048, 65536, torch.bfloat16), (2048, 65536, torch.float16),
          (1536, 16384, torch.bfloat16), (1536, 16384, torch.float16)]
for h, n, dt in SHAPES:
    v = 152064 if h == 3584 else 151936
    hid, w, lab = _inputs(n, h, v, dt)
    fns = {"cublas": lambda: hid @ w.T, "default": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100)}
    for name, cfg in PLANS[(h, v)].items():
        fns[name] = lambda cfg=cfg: token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config=cfg)
    res = {k: [] for k in fns}
    rep = max(300, int(8 * bench_ms(fns["cublas"], 25, 5)))
    for rnd in range(3):
        for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            res[k].append(bench_ms(fns[k], rep, 30))
    cb = sum(res["cublas"]) / 3
    text = ", ".join(f"{k} {sum(x) / 3 / cb:.3f} ({min(x) / cb:.3f}-{max(x) / cb:.3f})" for k, x in res.items())
    print(f"H={h} N={n} {str(dt)[6:]}: {text}", flush=True)
    del hid, w, lab
