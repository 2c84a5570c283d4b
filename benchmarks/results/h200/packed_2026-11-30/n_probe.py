"""One-off probe (run from the repository root as ``python benchmarks/results/h200/packed_2026-11-30/n_probe.py``):
why rounding the logits to bf16 costs the Gluon kernel more at small N.  H 896, Qwen2.5's vocabulary, T = 0.7, bf16
inputs; for N in 4096 ... 65536 the kernel call (``token_stats_fused_triton``) unrounded and bf16-rounded, with the
extra programs of row-order plans (as the library runs) and, where the plan takes them, without
(``row_order_extras`` patched to None), beside cuBLAS's ``F.linear(hidden, W)``.  3 alternating rounds; ratios are
time / cuBLAS, mean (min-max)."""
import sys

import torch
import triton

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

extras = triton_fused.row_order_extras
print(f"card: {card_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for n in (4096, 8192, 16384, 32768, 65536):
    free_memory()
    hid, w, lab = _inputs(n, 896, 151936, torch.bfloat16)

    def call(ldt, with_extras=True):
        triton_fused.row_order_extras = extras if with_extras else (lambda *a, **k: None)
        try:
            return triton_fused.token_stats_fused_triton(hid, w, lab, None, 0.7, -100, logits_dtype=ldt)
        finally:
            triton_fused.row_order_extras = extras

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    slices = triton_fused.stream_slices(n, 151936, 896, 2, 128, 256, sms)
    plan = extras(n, 151936, 128, 256, sms, *slices[0][1:]) if len(slices) == 1 else None
    fns = {"cublas": lambda: torch.nn.functional.linear(hid, w), "none": lambda: call(None),
           "bf16": lambda: call(torch.bfloat16)}
    if plan:
        fns.update({"none_noextra": lambda: call(None, False), "bf16_noextra": lambda: call(torch.bfloat16, False)})
    res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
    print(f"H=896 N={n} slices={slices} extras={plan}: cublas {sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}",
          flush=True)
    del hid, w, lab, fns
