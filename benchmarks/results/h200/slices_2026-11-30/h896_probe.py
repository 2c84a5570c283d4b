"""One-off probe (run from the repository root as ``python benchmarks/results/h200/slices_2026-11-30/h896_probe.py``):
at H 896, N 16384 and 65536 (the head that still misses 0.97x cuBLAS at N 16384), the body and tail of other
chunk counts S (groups of W = 132 / S row blocks, each one wave; the tail planned alone), all unflattened, against
the default launches (``stream_slices``: S 2) and the one launch of ``stream_plan``, beside cuBLAS.  A body and
tail are timed as the two calls the public path makes (``rows_per_launch`` slices of one plan each).  Each
variant's log p is checked against the default's; 3 alternating rounds; ratios are time / cuBLAS."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

H, V = 896, 151936
print(f"card: {card_name()}, torch {torch.__version__}", flush=True)
for dname in ("bf16", "fp16"):
    for n in (16384, 65536):
        free_memory()
        hid, w, lab = _inputs(n, H, V, DTYPES[dname])

        def call(rows=slice(None), **kw):
            return triton_fused.token_stats_fused_triton(hid[rows], w, lab[rows], None, 1.0, -100, **kw)

        def split(s: int):
            body = n // 128 // (132 // s) * (132 // s) * 128
            cfg = {"chunks": s, "group_rows": 132 // s, "flatten": 0}

            def run():
                return call(slice(0, body), config=cfg), call(slice(body, None), config={"flatten": 0})
            return run

        fns = {"cublas": lambda: hid @ w.T, "one launch": lambda: call(rows_per_launch=n), "default": call}
        fns.update({f"S{s} W{132 // s}": split(s) for s in (3, 4, 6)})
        ref = call().logp
        for name, fn in list(fns.items())[2:]:
            out = fn()
            got = out.logp if hasattr(out, "logp") else torch.cat([o.logp for o in out])
            assert float((got - ref).abs().max()) < 1e-4, name
        res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
        print(f"{dname} H={H} N={n}: cublas {sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}",
              flush=True)
        del hid, w, lab, fns
