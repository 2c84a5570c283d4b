"""One-off probe (run from the repository root as ``python benchmarks/results/h200/labels_2026-11-30/overlap_probe.py``):
where the Gluon path's time goes below H 3072, mostly at N 4096 (row order: 32 row blocks x 4 chunks = 128 programs,
4 of 132 SMs idle), and whether the label logits' kernel can hide behind the main kernel.

(1) A torch.profiler trace of the public call ``token_stats_from_hidden(..., check="deferred")`` beside cuBLAS: each
GPU kernel's mean time.  (2) Hand-built launch sequences of the library's own kernels, the plan of
``stream_slices`` (as ``token_stats_fused_triton`` builds it), timed against cuBLAS and the library call in 3
alternating rounds (ratios: time / cuBLAS):

- "lib": ``token_stats_fused_triton`` (label kernel, Gluon kernel, merge, in that order on one stream);
- "side": the Gluon kernel first, the label kernel on a second stream behind it, the merge after both;
- "floor": the Gluon kernel and the merge alone (the label logits computed once, outside the timing).

log p of "side" is checked against the library's."""
import sys

import numpy as np
import torch
import triton

sys.path.insert(0, ".")
from benchmarks.common import bench_ms, card_name, free_memory, paired_rounds, round_ratios  # noqa: E402
from benchmarks.fused_vs_cublas import DTYPES, _inputs  # noqa: E402
from entropy_discriminator import raise_deferred  # noqa: E402
from entropy_discriminator.hidden import token_stats_from_hidden  # noqa: E402
from entropy_discriminator.kernels import gluon_fused, triton_fused  # noqa: E402
from entropy_discriminator.kernels._reduce import ERR_WORDS, LOG2E, merge_block, merge_kernel  # noqa: E402

print(f"card: {card_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
SIDE = torch.cuda.Stream()
C_LO = LOG2E - float(np.float32(LOG2E))  # as token_stats_fused_triton passes them at T = 1


def sequence(hid, w, lab, label: str, yk_fixed=None):
    """KernelStats-like (out [5, N], valid, errors) of the library's kernels launched by hand; ``label``: "serial",
    "side" or "none" (``yk_fixed`` used)."""
    n, h = hid.shape
    v = w.shape[0]
    ws = gluon_fused.WS_CONFIG
    bm, bn = 2 * ws["bmw"], ws["bn"]
    out = torch.empty((5, n), device="cuda")
    valid = torch.empty(n, device="cuda", dtype=torch.bool)
    errors = torch.zeros(ERR_WORDS, device="cuda", dtype=torch.int32)
    c = LOG2E
    r0 = 0
    for rows, tpc, s, g in triton_fused.stream_slices(n, v, h, hid.element_size(), bm, bn, 132):
        r1 = r0 + rows
        part = torch.empty((6, rows, s), device="cuda")
        yk = torch.empty(rows, device="cuda") if yk_fixed is None else yk_fixed[r0:r1]

        def labels_now():
            triton_fused._label_kernel[(triton.cdiv(rows, triton_fused._LABEL_BM),)](
                hid[r0:r1], w, hid, lab[r0:r1], yk, rows, v, h, hid.stride(0), w.stride(0), c, C_LO, 1.0,
                HAS_BIAS=False, ROUND=0, T_ROUND=False, BM=triton_fused._LABEL_BM, BK=triton_fused._LABEL_BK,
                num_warps=4)

        if label == "serial":
            labels_now()
        before = torch.cuda.Event()
        before.record()
        gluon_fused.ws_kernel[(triton.cdiv(rows, bm) * s,)](
            *gluon_fused.ws_descriptors(hid[r0:r1], w), hid, part, rows, v, h, tpc, g, 0, c, C_LO, 1.0, HAS_BIAS=False,
            ROUND=0, T_ROUND=False, BMW=ws["bmw"], BN=bn, BK=ws["bk"], STAGES=ws["stages"], LAG=ws["lag"],
            CONSUMER_REGS=ws["consumer_regs"], PRODUCER_REGS=ws["producer_regs"], num_warps=4, maxnreg=ws["maxnreg"])
        if label == "side":
            SIDE.wait_event(before)
            with torch.cuda.stream(SIDE):
                labels_now()
            done = torch.cuda.Event()
            done.record(SIDE)
            torch.cuda.current_stream().wait_event(done)
        merge_kernel[(rows,)](part, yk, lab[r0:r1], out[:, r0:], valid[r0:], errors, rows, n, s, v, -100,
                              PB=merge_block(s), num_warps=4 if s >= 128 else 1)
        r0 = r1
    return out, valid, errors


for h, n, dname in ((896, 4096, "fp16"), (896, 4096, "bf16"), (1536, 4096, "fp16"), (2048, 4096, "bf16"),
                    (896, 16384, "bf16"), (2048, 16384, "bf16")):
    free_memory()
    hid, w, lab = _inputs(n, h, 151936 if h < 3072 else 152064, DTYPES[dname])
    lib = triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100)
    for how in ("side", "serial"):
        diff = float((sequence(hid, w, lab, how)[0][0] - lib.logp).abs().max())
        print(f"  {how}: max |log p - the library's| {diff:.2e}")
        assert diff < 1e-5, how
    yk_fixed = torch.empty(n, device="cuda")
    triton_fused._label_kernel[(triton.cdiv(n, 8),)](hid, w, hid, lab, yk_fixed, n, w.shape[0], h, hid.stride(0),
                                                     w.stride(0), LOG2E, C_LO, 1.0, HAS_BIAS=False, ROUND=0,
                                                     T_ROUND=False, BM=8, BK=512, num_warps=4)  # fmt: skip
    if h == 896 and n == 4096:
        from torch.profiler import ProfilerActivity, profile

        for _ in range(3):
            token_stats_from_hidden(hid, w, lab, check="deferred")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                token_stats_from_hidden(hid, w, lab, check="deferred")
                hid @ w.T
            torch.cuda.synchronize()
        raise_deferred()
        print(f"{dname} H={h} N={n} profile (20 public calls, 20 cuBLAS):")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    fns = {"cublas": lambda: hid @ w.T,
           "public": lambda: token_stats_from_hidden(hid, w, lab, check="deferred"),
           "lib": lambda: triton_fused.token_stats_fused_triton(hid, w, lab, None, 1.0, -100),
           "serial": lambda: sequence(hid, w, lab, "serial"),
           "side": lambda: sequence(hid, w, lab, "side"),
           "floor": lambda: sequence(hid, w, lab, "none", yk_fixed)}
    res = paired_rounds(fns, 3, max(200, int(8 * bench_ms(fns["cublas"], 25, 5))), 25, after=raise_deferred)
    print(f"{dname} H={h} N={n}: cublas {sum(res['cublas']) / 3:.3f} ms; {round_ratios(res, 'cublas')}", flush=True)
    del hid, w, lab, fns
