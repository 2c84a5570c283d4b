"""One-off probe (run from the repository root as
``python benchmarks/results/h200/slices_2026-11-30/slices_probe.py [n4096]``): the streaming kernel's launches of
:func:`entropy_discriminator.kernels.triton_fused.stream_slices` (a body of whole-wave groups, then the remaining
row blocks planned alone) against the one launch of ``stream_plan`` they replace (``rows_per_launch=N``, loops
flattened), beside cuBLAS's matmul alone, on every head shape where the two differ; at N >= 16384 also the
slices with the V and K loops not flattened.  ``n4096``: at N 4096, H <= 2048 (one launch in both), the loops
flattened against not.  Each variant's log p is checked against the first's; 3 alternating rounds
(:func:`benchmarks.common.paired_rounds`); ratios are time / cuBLAS, the rounds' mean and "(min-max)"."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, HEADS, _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

N4096 = sys.argv[1:] == ["n4096"]
print(f"card: {card_name()}, torch {torch.__version__}", flush=True)
for dname in ("bf16", "fp16"):
    for h, v in HEADS:
        for n in (4096,) if N4096 else (4096, 16384, 65536):
            slices = triton_fused.stream_slices(n, v, h, 2, 128, 256, 132)
            if (h >= triton_fused.EXACT_WAVE_FROM_H) if N4096 else len(slices) == 1:
                continue
            free_memory()
            hid, w, lab = _inputs(n, h, v, DTYPES[dname])

            def call(**kw):
                return triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100, **kw)

            fns = {"cublas": lambda: hid @ w.T, "one launch": lambda: call(rows_per_launch=n, config={"flatten": 1})}
            if N4096:
                fns["one launch noflat"] = lambda: call(rows_per_launch=n, config={"flatten": 0})
            else:
                fns["slices"] = lambda: call(config={"flatten": 1})
            if n >= 16384:
                fns["slices noflat"] = lambda: call(config={"flatten": 0})
            ref = fns["one launch"]().logp
            for name in list(fns)[2:]:
                err = float((fns[name]().logp - ref).abs().max())
                assert err < 1e-4, (name, err)
            res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
            print(f"{dname} H={h} N={n} slices {[(r // 128, *p) for r, *p in slices]}: cublas "
                  f"{sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}", flush=True)
            del hid, w, lab, fns
