"""One-off probe (run from the repository root as
``python benchmarks/results/h200/rounding_2026-11-30/rounding_probe.py``): the fused head's kernels with the logits
rounding the adapters ask for (``token_stats_from_hidden(..., logits_dtype=..., temperature_in_logits_dtype=...)``;
TRL's default is the model's 16-bit dtype without the rounded temperature), the Gluon kernel against the streaming
Triton kernel on the same call (``config={"gluon": 0}``), beside cuBLAS's ``F.linear(hidden, W)`` (calls 3 and 4
wrote it ``hidden @ W.T``), Qwen2.5's vocabulary.  log p of both kernels is checked against each other.  3
alternating rounds; ratios are time / cuBLAS, mean (min-max).  Arguments: the logits dtypes to run (default: every
variant), e.g. ``bf16`` for the bf16-rounded ones, ``none`` for the unrounded; ``bias``: with a bias (N(0, 0.25) in
the inputs' dtype; cuBLAS then ``F.linear(hidden, W, b)``); ``H:N`` (any number): these shapes instead of the four
(../packed_2026-11-30/ call 3)."""
import sys

import torch
import triton

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

VARIANTS = (("bf16", None, False), ("bf16", "bf16", False), ("bf16", "bf16", True), ("fp16", "fp16", False),
            ("fp16", "fp16", True))
BIAS = "bias" in sys.argv[1:]
SHAPES = [tuple(int(x) for x in a.split(":")) for a in sys.argv[1:] if ":" in a]
ONLY = [a for a in sys.argv[1:] if a != "bias" and ":" not in a]
if ONLY:
    VARIANTS = tuple(v for v in VARIANTS if (v[1] or "none") in ONLY)
print(f"card: {card_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
for h, n in SHAPES or ((896, 16384), (1536, 8192), (2048, 8192), (2048, 4096)):
    for dname, lname, t_round in VARIANTS:
        free_memory()
        hid, w, lab = _inputs(n, h, 151936, DTYPES[dname])
        ldt = None if lname is None else DTYPES[lname]
        b = (torch.randn(151936, device=w.device) * 0.5).to(w.dtype) if BIAS else None

        def call(cfg=None):
            return triton_fused.token_stats_fused_triton(hid, w, lab, b, 0.7, -100, config=cfg, logits_dtype=ldt,
                                                         temperature_in_logits_dtype=t_round)

        fns = {"cublas": lambda: torch.nn.functional.linear(hid, w, b), "gluon": call,
               "stream": lambda: call({"gluon": 0})}
        diff = float((fns["gluon"]().logp - fns["stream"]().logp).abs().max())
        assert diff < 1e-4, diff
        res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
        print(f"{dname} H={h} N={n} logits={lname} t_round={int(t_round)}{' bias' * BIAS}: "
              f"cublas {sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}", flush=True)
        del hid, w, lab, b, fns
