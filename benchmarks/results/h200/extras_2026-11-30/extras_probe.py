"""One-off probe (run from the repository root as ``python benchmarks/results/h200/extras_2026-11-30/extras_probe.py``):
the Gluon path at N 4096 (row order: 32 row blocks x 4 chunks of 149 tiles, 4 of 132 SMs idle) with its extra
programs (``triton_fused.row_order_extras``: 4 chunks of 144 tiles, and 4 programs that take the 18 tiles left for
8 row blocks each) against the same call without them (``row_order_extras`` patched to None), beside cuBLAS; also
N 2048 (8 chunks of 75 -> 72 tiles, 4 extras of 4 row blocks).  log p of both is checked against each other.
3 alternating rounds; ratios are time / cuBLAS, mean (min-max)."""
import sys

import torch
import triton

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

print(f"card: {card_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for h, n, dname in ((896, 4096, "fp16"), (896, 4096, "bf16"), (1536, 4096, "fp16"), (2048, 4096, "bf16"),
                    (896, 2048, "bf16")):
    free_memory()
    hid, w, lab = _inputs(n, h, 151936, DTYPES[dname])

    def without():
        real = triton_fused.row_order_extras
        triton_fused.row_order_extras = lambda *a: None
        try:
            return triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100)
        finally:
            triton_fused.row_order_extras = real

    fns = {"cublas": lambda: hid @ w.T,
           "extras": lambda: triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100),
           "without": without}
    diff = float((fns["extras"]().logp - fns["without"]().logp).abs().max())
    print(f"  max |log p extras - without| {diff:.2e}")
    assert diff < 1e-4
    res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
    print(f"{dname} H={h} N={n}: cublas {sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}", flush=True)
    del hid, w, lab, fns
