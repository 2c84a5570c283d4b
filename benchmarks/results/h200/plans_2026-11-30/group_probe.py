"""One-off probe (run from the repository root as ``python benchmarks/results/h200/plans_2026-11-30/group_probe.py``):
at H 3584 and 5120, which of the chunk count S and the group size G moved ``wave_probe.py``'s H 3584 N 16384 row
(33 chunks x 16 row blocks 1.005-1.010x cuBLAS, the default 11 x 12 1.039-1.042x).  "sS gG": S chunks, G row
blocks per group; 3 alternating rounds (:func:`benchmarks.common.paired_rounds`)."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, free_memory, paired_rounds  # noqa: E402
from benchmarks.fused_vs_cublas import _inputs  # noqa: E402
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton  # noqa: E402

ROUNDS = 3
VARIANTS = {3584: ((11, 16), (11, 18), (33, 12), (33, 16), (33, 18), (22, 12), (22, 18)),
            5120: ((11, 16), (33, 12), (33, 16), (22, 12), (22, 6))}
for dt in (torch.bfloat16, torch.float16):
    for h in (3584, 5120):
        for n in (16384, 65536):
            if dt == torch.float16 and n == 65536:
                continue
            free_memory()
            hid, w, lab = _inputs(n, h, 152064, dt)
            fns = {"cublas": lambda: hid @ w.T, "default": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100)}
            for s, g in VARIANTS[h]:
                cfg = {"chunks": s, "group_rows": g}
                fns[f"s{s} g{g}"] = lambda cfg=cfg: token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config=cfg)
            res = paired_rounds(fns, ROUNDS, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
            cb = sum(res["cublas"]) / ROUNDS
            text = ", ".join(f"{k} {sum(x) / ROUNDS / cb:.3f} ({min(x) / cb:.3f}-{max(x) / cb:.3f})"
                             for k, x in res.items() if k != "cublas")
            print(f"{str(dt)[6:]} H={h} N={n}: cublas {cb:.3f} ms; {text}", flush=True)
            del hid, w, lab, fns
