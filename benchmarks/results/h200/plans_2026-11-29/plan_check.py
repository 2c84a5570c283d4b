"""One-off check (run from the repository root as ``python benchmarks/results/h200/plans_2026-11-29/plan_check.py``):
the new default plan at hidden sizes outside the Qwen2.5 set that its rule changes (H 4096: 11 x 12 programs, was
8 x 16; H 8192: 22 x 6, was 16 x 8) against the old plan forced by config; 3 alternating rounds of medians."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms  # noqa: E402
from benchmarks.fused_vs_cublas import _inputs  # noqa: E402
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton  # noqa: E402

OLD = {4096: {"chunks": 8, "group_rows": 16}, 8192: {"chunks": 16, "group_rows": 8}}
for h, v, n in [(4096, 128256, 16384), (4096, 128256, 65536), (8192, 152064, 16384)]:
    hid, w, lab = _inputs(n, h, v, torch.bfloat16)
    fns = {"cublas": lambda: hid @ w.T, "new": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100),
           "old": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config=OLD[h])}
    res = {k: [] for k in fns}
    rep = max(300, int(8 * bench_ms(fns["cublas"], 25, 5)))
    for rnd in range(3):
        for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            res[k].append(bench_ms(fns[k], rep, 30))
    cb = sum(res["cublas"]) / 3
    text = ", ".join(f"{k} {sum(x) / 3 / cb:.3f} ({min(x) / cb:.3f}-{max(x) / cb:.3f})" for k, x in res.items())
    print(f"H={h} V={v} N={n} bf16: {text}", flush=True)
    del hid, w, lab
