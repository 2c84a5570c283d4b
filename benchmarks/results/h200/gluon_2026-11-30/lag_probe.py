"""One-off probe (run from the repository root as ``python benchmarks/results/h200/gluon_2026-11-30/lag_probe.py``):
the public call's Gluon kernel (``kernels/gluon_fused.ws_kernel``: two consumer warp groups, the second LAG K steps
behind) with its default launches (``stream_slices``) and as one launch (``rows_per_launch=N``), against the
streaming Triton kernel (``gluon: 0``) and cuBLAS, below H 3072.  Each variant's log p is checked against the
streaming kernel's; 3 alternating rounds; ratios are time / cuBLAS."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator.kernels import gluon_fused, triton_fused  # noqa: E402

print(f"card: {card_name()}, torch {torch.__version__}", flush=True)
for h, n, dname in ((896, 4096, "fp16"), (896, 16384, "bf16"), (896, 16384, "fp16"), (896, 65536, "bf16"),
                    (1536, 16384, "bf16")):
    free_memory()
    hid, w, lab = _inputs(n, h, 151936, DTYPES[dname])

    def call(**kw):
        return triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100, **kw)

    def lag(k: int):
        def run():
            old = gluon_fused.WS_CONFIG["lag"]
            gluon_fused.WS_CONFIG["lag"] = k
            try:
                return call()
            finally:
                gluon_fused.WS_CONFIG["lag"] = old
        return run

    fns = {"cublas": lambda: hid @ w.T, "stream": lambda: call(config={"gluon": 0}), "gluon": call,
           "gluon one launch": lambda: call(rows_per_launch=n), "gluon lag 2": lag(2), "gluon lag 0": lag(0)}
    ref = fns["stream"]().logp
    for name, fn in list(fns.items())[2:]:
        assert float((fn().logp - ref).abs().max()) < 1e-4, name
    res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
    print(f"{dname} H={h} N={n}: cublas {sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}", flush=True)
    del hid, w, lab, fns
