"""One-off probe (run from the repository root as ``python benchmarks/results/h200/rounding_2026-11-30/bias_probe.py``):
the Gluon kernel's variant with a bias, fp16 logits rounding and the temperature rounded in fp16
(``token_stats_from_hidden(..., bias=b, logits_dtype=torch.float16, temperature_in_logits_dtype=True)``: the one
that spills, ``python tests/gluon_compile.py 1 2 1 1``) against the streaming Triton kernel on the same call
(``config={"gluon": 0}``), beside cuBLAS's ``hidden @ W.T + b``; the bf16 form of the same call (no spills) for
reference.  log p of both kernels is checked against each other.  3 alternating rounds; ratios are time / cuBLAS,
mean (min-max)."""
import sys

import torch
import triton

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

print(f"card: {card_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for h, n, v, dname in ((2560, 4096, 51200, "fp16"), (2560, 16384, 51200, "fp16"), (2048, 8192, 151936, "fp16"),
                       (896, 16384, 151936, "fp16"), (2048, 8192, 151936, "bf16"), (896, 16384, 151936, "bf16")):
    free_memory()
    dtype = DTYPES[dname]
    hid, w, lab = _inputs(n, h, v, dtype)
    b = (torch.randn(v, device=w.device) * 0.5).to(dtype)

    def call(cfg=None):
        return triton_fused.token_stats_fused_triton(hid, w, lab, b, 0.7, -100, config=cfg, logits_dtype=dtype,
                                                     temperature_in_logits_dtype=True)

    fns = {"cublas": lambda: hid @ w.T + b, "gluon": call, "stream": lambda: call({"gluon": 0})}
    diff = float((fns["gluon"]().logp - fns["stream"]().logp).abs().max())
    print(f"  max |log p gluon - stream| {diff:.2e}")
    assert diff < 1e-4
    res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
    print(f"{dname} H={h} N={n} V={v} bias, rounded T: cublas {sum(res['cublas']) / 3:.3f} ms; "
          f"{round_ratios(res, 'cublas')}", flush=True)
    del hid, w, lab, b, fns
