"""One-off probe (run from the repository root as
``python benchmarks/results/h200/slices_2026-11-30/slices_probe.py [N ...]``): the streaming kernel's default
launches (:func:`entropy_discriminator.kernels.triton_fused.stream_slices`) against the one launch of
``stream_plan`` they replace (``rows_per_launch=N``, loops flattened), beside cuBLAS's matmul alone, on every head
shape (of the given N, default all three) where the two differ.  Each variant's log p is checked against the one
launch's; 3 alternating rounds (:func:`benchmarks.common.paired_rounds`); ratios are time / cuBLAS, the rounds'
mean and "(min-max)".  Calls 1-3 ran the versions of this script (and of the kernel) committed with their
records (README.md)."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, HEADS, _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

NS = [int(a) for a in sys.argv[1:]] or [4096, 16384, 65536]
print(f"card: {card_name()}, torch {torch.__version__}", flush=True)
for dname in ("bf16", "fp16"):
    for h, v in HEADS:
        for n in NS:
            slices = triton_fused.stream_slices(n, v, h, 2, 128, 256, 132)
            if slices == ((n, *triton_fused.stream_plan(n, v, h, 2, 128, 256, 132)),):
                continue
            free_memory()
            hid, w, lab = _inputs(n, h, v, DTYPES[dname])

            def call(**kw):
                return triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100, **kw)

            fns = {"cublas": lambda: hid @ w.T, "one launch": lambda: call(rows_per_launch=n), "default": call}
            err = float((fns["default"]().logp - fns["one launch"]().logp).abs().max())
            assert err < 1e-4, err
            res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
            print(f"{dname} H={h} N={n} launches {[(r // 128, *p) for r, *p in slices]}: cublas "
                  f"{sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}", flush=True)
            del hid, w, lab, fns
