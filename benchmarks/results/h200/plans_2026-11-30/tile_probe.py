"""One-off probe (run from the repository root as ``python benchmarks/results/h200/plans_2026-11-30/tile_probe.py``):
K steps and pipelining of the streaming kernel at the hidden sizes that still miss 0.97x cuBLAS (H 896-2048):
128-deep K steps in 2 stages (H 896: 7 steps a tile instead of 14), 4 stages of 64, and the V and K loops not
flattened, against the default (64 deep, 3 stages, flattened).  Every variant's log p is checked against the
default's first; 3 alternating rounds (:func:`benchmarks.common.paired_rounds`)."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, free_memory, paired_rounds  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton  # noqa: E402

ROUNDS = 3
VARIANTS = {"bk128 s2": {"bk": 128, "stages": 2}, "s4": {"stages": 4}, "noflat": {"flatten": 0}}
SHAPES = [(896, 16384), (896, 65536), (1536, 16384), (1536, 65536), (2048, 65536)]
for dname in ("fp16", "bf16"):
    for h, n in SHAPES:
        free_memory()
        hid, w, lab = _inputs(n, h, 151936, DTYPES[dname])
        fns = {"cublas": lambda: hid @ w.T, "default": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100)}
        ref = fns["default"]().logp
        for name, cfg in VARIANTS.items():
            fn = lambda cfg=cfg: token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config=cfg)  # noqa: E731
            try:
                err = float((fn().logp - ref).abs().max())
            except Exception as exc:  # a variant that does not compile (shared memory) is reported, not timed
                print(f"{dname} H={h} N={n}: {name} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            assert err < 1e-4, (name, err)
            fns[name] = fn
        res = paired_rounds(fns, ROUNDS, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
        cb = sum(res["cublas"]) / ROUNDS
        text = ", ".join(f"{k} {sum(x) / ROUNDS / cb:.3f} ({min(x) / cb:.3f}-{max(x) / cb:.3f})"
                         for k, x in res.items() if k != "cublas")
        print(f"{dname} H={h} N={n}: cublas {cb:.3f} ms; {text}", flush=True)
        del hid, w, lab, fns
