"""One-off probe (run from the repository root as ``python benchmarks/results/h200/plans_2026-11-30/deferred_row.py``):
why ``fused-vs-cublas``'s bf16 H 3584 N 16384 row reads the deferred call 1.10x cuBLAS and the waiting call 1.00x
(in three runs).  The benchmark's own row timing twice, then paired rounds of the kernel, the public call with each
check and cuBLAS, then the profiler's GPU kernel times for 6 deferred and 6 waiting calls."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import paired_rounds  # noqa: E402
from benchmarks.fused_vs_cublas import _inputs, _timed_row  # noqa: E402
from entropy_discriminator import raise_deferred  # noqa: E402
from entropy_discriminator.hidden import token_stats_from_hidden  # noqa: E402
from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton  # noqa: E402

for dt in (torch.bfloat16, torch.float16):
    hid, w, lab = _inputs(16384, 3584, 152064, dt)
    token_stats_from_hidden(hid, w, lab)
    for _ in range(2):
        t = _timed_row(hid, w, lab)
        print(f"{dt} _timed_row: " + ", ".join(f"{k} {v / t['cublas_ms']:.3f}" for k, v in t.items()), flush=True)
    fns = {"cublas": lambda: hid @ w.T, "kernel": lambda: token_stats_fused_triton(hid, w, lab, None, 1.0, -100),
           "unchecked": lambda: token_stats_from_hidden(hid, w, lab, check=False),
           "deferred": lambda: token_stats_from_hidden(hid, w, lab, check="deferred"),
           "waiting": lambda: token_stats_from_hidden(hid, w, lab)}
    res = paired_rounds(fns, 4, 300, 25)
    raise_deferred()
    cb = sum(res["cublas"]) / 4
    print(f"{dt} rounds: " + ", ".join(f"{k} {sum(x) / 4 / cb:.3f} ({min(x) / cb:.3f}-{max(x) / cb:.3f})"
                                      for k, x in res.items()), flush=True)
    for check in ("deferred", True):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                token_stats_from_hidden(hid, w, lab, check=check)
            torch.cuda.synchronize()
        raise_deferred()
        print(f"{dt} check={check}:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
    del hid, w, lab
