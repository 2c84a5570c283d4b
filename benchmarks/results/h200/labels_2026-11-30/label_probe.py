"""One-off probe (run from the repository root as ``python benchmarks/results/h200/labels_2026-11-30/label_probe.py``)
at H >= 3072, where the public call runs the streaming Triton kernel:

- "old": the streaming kernel as it was at commit 79f500d (``old_triton_fused.py`` beside this file, loaded as a
  module of the package; ``xz -dk old_triton_fused.py.xz`` first), its chunk-0 programs forming their rows' label logits in 128 x 64 blocks (255 registers,
  52 B of spill stores at bf16: ``python -m benchmarks.fused_compile`` then);
- "new": the library's streaming kernel, the label logits from ``_label_kernel`` launched first (185 registers, no
  spills);
- "gluon": the library's warp-specialised Gluon kernel, its H bound lifted for the probe (``_gluon_ok`` patched);
- "labels": ``_label_kernel`` alone.

Each is ``token_stats_fused_triton`` (no check), against cuBLAS ``hidden @ weight.T``; log p of every variant is
checked against the old kernel's.  3 alternating rounds (``benchmarks.common.paired_rounds``); ratios are time /
cuBLAS, mean (min-max) over the rounds."""
import importlib.util
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

spec = importlib.util.spec_from_file_location("entropy_discriminator.kernels._old_fused",
                                              Path(__file__).with_name("old_triton_fused.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

print(f"card: {card_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for h, v, n, dname in ((3584, 152064, 16384, "bf16"), (3584, 152064, 16384, "fp16"), (3584, 152064, 4096, "bf16"),
                       (3584, 152064, 65536, "bf16"), (5120, 152064, 16384, "bf16"), (2048, 151936, 16384, "bf16")):
    free_memory()
    hid, w, lab = _inputs(n, h, v, DTYPES[dname])

    def gluon():
        real = triton_fused._gluon_ok
        triton_fused._gluon_ok = lambda hidden, config: not (config or {})
        try:
            return triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100)
        finally:
            triton_fused._gluon_ok = real

    yk = torch.empty(n, device="cuda")

    def labels():
        c = triton_fused.LOG2E
        triton_fused._label_kernel[(triton.cdiv(n, triton_fused._LABEL_BM),)](
            hid, w, hid, lab, yk, n, v, h, hid.stride(0), w.stride(0), c, 0.0, 1.0, HAS_BIAS=False, ROUND=0,
            T_ROUND=False, BM=triton_fused._LABEL_BM, BK=triton_fused._LABEL_BK, num_warps=4)

    fns = {"cublas": lambda: hid @ w.T,
           "old": lambda: old.token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config={"gluon": 0}),
           "new": lambda: triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config={"gluon": 0}),
           "gluon": gluon, "labels": labels}
    ref = fns["old"]()
    for name in ("new", "gluon"):
        got = fns[name]()
        err = float((got.logp - ref.logp).abs().max())
        print(f"  {name}: max |log p - old's| {err:.2e}, entropy {float((got.entropy - ref.entropy).abs().max()):.2e}")
        assert err < 1e-3, name
    res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
    print(f"{dname} H={h} N={n}: cublas {sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}", flush=True)
    del hid, w, lab, fns
