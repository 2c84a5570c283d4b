"""One-off probe (run from the repository root as ``python benchmarks/results/h200/gluon_2026-11-30/n4096_probe.py``):
where the Gluon path loses time at N 4096.  (1) The label logits' kernel (``triton_fused._label_kernel``, launched
before the Gluon kernel) alone, under row blocks BM, K steps BK and warps; (2) at N 4096 (row order, 32 row blocks x
4 chunks = 128 of 132 SMs) the default plan against 33 chunks (1056 programs: 8 whole waves), beside cuBLAS, 3
alternating rounds; ratios are time / cuBLAS."""
import sys

import torch
import triton

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402

print(f"card: {card_name()}, torch {torch.__version__}", flush=True)
V = 151936
for h in (896, 2048):
    for n in (4096, 16384):
        free_memory()
        hid, w, lab = _inputs(n, h, V, DTYPES["fp16"])
        want = None
        line = []
        for bm, bk, nw in ((128, 64, 4), (32, 128, 4), (16, 256, 4), (8, 512, 4), (8, 1024, 4), (16, 1024, 8)):
            yk = torch.full((n,), float("nan"), device="cuda")

            def run(bm=bm, bk=bk, nw=nw, yk=yk):
                triton_fused._label_kernel[(triton.cdiv(n, bm),)](
                    hid, w, hid, lab, yk, n, V, h, hid.stride(0), w.stride(0), 1.4426950408889634, 0.0, 1.0,
                    HAS_BIAS=False, ROUND=0, T_ROUND=False, BM=bm, BK=bk, num_warps=nw)
            run()
            want = yk.clone() if want is None else want
            assert float((yk - want).abs().max()) < 1e-3, (bm, bk)
            line.append(f"BM {bm} BK {bk} w{nw} {1000 * bench_ms(run, 100, 10):.1f} us")
        print(f"label kernel fp16 H={h} N={n}: " + ", ".join(line), flush=True)
        del hid, w, lab
for h, dname in ((896, "fp16"), (896, "bf16"), (1536, "fp16"), (2048, "bf16")):
    free_memory()
    n = 4096
    hid, w, lab = _inputs(n, h, V, DTYPES[dname])

    def call(**kw):
        return triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100, **kw)

    fns = {"cublas": lambda: hid @ w.T, "gluon": call, "gluon chunks 33": lambda: call(config={"chunks": 33}),
           "stream": lambda: call(config={"gluon": 0})}
    ref = call().logp
    for name, fn in list(fns.items())[2:]:
        assert float((fn().logp - ref).abs().max()) < 1e-4, name
    res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25)
    print(f"{dname} H={h} N={n}: cublas {sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}", flush=True)
    del hid, w, lab, fns
