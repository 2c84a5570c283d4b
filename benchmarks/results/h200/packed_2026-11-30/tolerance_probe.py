"""One-off probe (run from the repository root as
``python benchmarks/results/h200/packed_2026-11-30/tolerance_probe.py``): the two inputs on which
``test_fused_kernel_rounds_bf16_logits_on_gpu``'s hypothesis draws found a logp error just above the test's 3e-5
floor.  For each: the max error against the float64 reference of the Gluon and the streaming kernel (without a bias
the public path is the Gluon kernel, with one the streaming kernel), whether the two agree to the bit, the torch
path's error, and the largest |logit| (one fp32 ulp of |logit| log2(e) in the kernels' base-2 units, times ln 2)."""
import math
import sys

import numpy as np
import torch

sys.path.insert(0, "tests")
import entropy_discriminator as ed  # noqa: E402
from entropy_discriminator.kernels import triton_fused  # noqa: E402
from rounding_reference import exact_problem, rounded_reference  # noqa: E402

for seed, n, h, v, scale, neg_inf, bias in ((0, 7, 896, 129, 4.0, False, False), (0, 35, 896, 682, 4.0, True, True)):
    hid, w, b, labels = exact_problem(seed, n, h, v, torch.bfloat16, scale, neg_inf)
    b = b if bias else None
    ref = rounded_reference(hid, w, b, labels, 1.0, torch.bfloat16, False)
    bc = None if b is None else b.cuda()
    outs = {name: triton_fused.token_stats_fused_triton(hid.cuda(), w.cuda(), labels.cuda(), bc, 1.0, -100,
                                                        config=cfg, logits_dtype=torch.bfloat16)
            for name, cfg in (("gluon", None), ("stream", {"gluon": 0}))}
    naive = ed.token_stats_from_hidden(hid.cuda(), w.cuda(), labels.cuda(), bias=bc, impl="torch",
                                       logits_dtype=torch.bfloat16)
    logits = hid.double() @ w.double().T + (0.0 if b is None else b.double())
    top = float(logits[torch.isfinite(logits)].abs().max())
    ulp = float(np.spacing(np.float32(top * math.log2(math.e)))) * math.log(2)
    print(f"n={n} v={v} bias={bias}: max |L| {top}, one fp32 ulp there {ulp:.3e} nats", flush=True)
    for f in ("logp", "entropy", "s_expected"):
        errs = {k: float((getattr(o, f).double().cpu() - ref[f]).abs().max()) for k, o in outs.items()}
        same = torch.equal(getattr(outs["gluon"], f), getattr(outs["stream"], f))
        naive_err = float((getattr(naive, f).double().cpu() - ref[f]).abs().max())
        print(f"  {f}: gluon {errs['gluon']:.3e}, stream {errs['stream']:.3e} (bitwise same: {same}), "
              f"torch {naive_err:.3e}", flush=True)
