"""One-off probe (run as ``python -m benchmarks._h3584_probe`` from the repository root, copied here): at H 3584, the
persistent per-tile kernel (the default there) against the streaming kernel, 3 alternating rounds of medians."""
import torch

from benchmarks.common import bench_ms
from benchmarks.fused_vs_cublas import _inputs
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton

for n, dt in [(4096, torch.bfloat16), (16384, torch.bfloat16), (65536, torch.bfloat16), (16384, torch.float16)]:
    hid, w, lab = _inputs(n, 3584, 152064, dt)
    fns = {"cublas": lambda: hid @ w.T,
           "persistent": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100),
           "stream": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config={"stream": 1})}
    res = {k: [] for k in fns}
    rep = max(300, int(8 * bench_ms(fns["cublas"], 25, 5)))
    for rnd in range(3):
        for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            res[k].append(bench_ms(fns[k], rep, 30))
    cb = sum(res["cublas"]) / 3
    text = ", ".join(f"{k} {sum(v) / 3 / cb:.3f} ({min(v) / cb:.3f}-{max(v) / cb:.3f})" for k, v in res.items())
    print(f"H=3584 N={n} {dt}: {text}", flush=True)
    del hid, w, lab
