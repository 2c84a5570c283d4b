"""One-off probe (run from the repository root as ``python benchmarks/results/h200/plans_2026-11-30/wave_probe.py``):
launch plans whose program count is a whole number of waves against the default plan, on the 30 shapes of
``python -m benchmarks fused-vs-cublas``.

With N a power of two the default plans launch 0.97 x a whole number of waves of 132 programs (128 of 132 SMs
busy in the last one, or in the only one): rb row blocks x S chunks is a multiple of 132 only when 33 divides S.
V = 151936 / 152064 is 594 tiles of 256 = 33 chunks of 18.  "s33 gG": 33 chunks, G row blocks per group.
3 alternating rounds (:func:`benchmarks.common.paired_rounds`), medians of at least 200 ms or 8 cuBLAS calls."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, free_memory, paired_rounds  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, HEADS, _inputs  # noqa: E402
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton  # noqa: E402

ROUNDS = 3
for dname in sys.argv[1:] or list(DTYPES):
    for h, v in HEADS:
        for n in (4096, 16384, 65536):
            free_memory()
            hid, w, lab = _inputs(n, h, v, DTYPES[dname])
            fns = {"cublas": lambda: hid @ w.T, "default": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100)}
            for g in (4, 8, 16):
                cfg = {"chunks": 33, "group_rows": g}
                fns[f"s33 g{g}"] = lambda cfg=cfg: token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config=cfg)
            ref = fns["default"]().logp
            for k in ("s33 g4",):  # the forced plan computes the same statistics
                got = fns[k]().logp
                assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5), (k, (got - ref).abs().max())
            res = paired_rounds(fns, ROUNDS, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
            cb = sum(res["cublas"]) / ROUNDS
            text = ", ".join(f"{k} {sum(x) / ROUNDS / cb:.3f} ({min(x) / cb:.3f}-{max(x) / cb:.3f})"
                             for k, x in res.items() if k != "cublas")
            print(f"{dname} H={h} N={n}: cublas {cb:.3f} ms; {text}", flush=True)
            del hid, w, lab, fns
