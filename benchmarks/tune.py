"""``python -m benchmarks.tune [stats] [fused]``: the configuration sweeps behind the defaults.

stats: N=256, V=151936 bf16 (the small-batch target).  Floors: ``torch.sum`` and the pure-read
kernel of :mod:`.floors` over a grid of program counts; then one-pass kernel configurations
(block, warps, stages, split).  Every method is timed two ways: ``do_bench`` (its L2 flush leaves
dirty lines, as in the rest of the benchmarks) and ``cold`` (:class:`.floors.ColdTimer`, clean cold
L2).  fused: N=16384, H=3584, V=152064, cuBLAS against fused configurations (pointer and
streaming TMA kernels).  Rows go to ``<BENCH_RESULTS>/tune_{stats,fused}.csv``.
"""

from __future__ import annotations

import sys

import torch

from .common import Row, bench_ms, card_name, free_memory, write_csv

STATS_CONFIGS = [  # block, num_warps, stages, split
    (1024, 2, 4, 3), (1024, 2, 4, 4), (1024, 2, 4, 8), (1024, 4, 4, 4),
    (2048, 4, 4, 2), (2048, 4, 4, 4), (2048, 4, 6, 4),
]  # fmt: skip
READ_CONFIGS = [(528, 4096, 4, 4), (2112, 2048, 4, 4)]
FUSED_CONFIGS = {
    "ptr default": {"stream": 0},
    "ptr g16": {"stream": 0, "group_m": 16},
    "ptr s4": {"stream": 0, "stages": 4},
    "ptr 256x128": {"stream": 0, "bm": 256, "bn": 128},
    "ptr 128x128 w4 s4": {"stream": 0, "bn": 128, "num_warps": 4, "stages": 4},
    "stream flat s3": {},
    "stream flat s4": {"stages": 4},
    "stream noflat s3": {"flatten": 0},
    "stream flat s3 unbranched": {"branch": 0},
    "stream flat s3 row order": {"group_rows": 2**20},
    "stream flat s3 chunks 8": {"chunks": 8},
    "stream 128x128 w4 s3": {"bn": 128, "num_warps": 4},
}


def _err(out, ref) -> tuple[float, float, float]:
    return tuple(float((out[i].double() - ref[k]).abs().max()) for i, k in ((0, "logp"), (1, "entropy"), (3, "s_expected")))


def stats(rep_ms: int = 100) -> list[Row]:
    from reference import reference_token_stats

    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    from .floors import ColdTimer, read_sum

    n, v, card = 256, 151936, card_name()
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    lab = torch.randint(0, v, (n,), device="cuda", generator=gen)
    rows = torch.linspace(0, n - 1, 64, device="cuda").long()
    ref = reference_token_stats(x[rows], lab[rows], 1.0)
    gb = n * v * 2 / 1e9
    cold = ColdTimer()
    out: list[Row] = []

    def add(name, fn, errs=(float("nan"),) * 3):
        fn()
        torch.cuda.synchronize()
        a, b = bench_ms(fn, rep_ms), cold(fn)
        out.append(Row("tune_stats", card, "bf16", n, v, 0, name, a, gb / a, "TB/s", float("nan"), *errs, note=f"cold_ms={b:.5f}"))
        print(f"{name:40s} do_bench {a * 1e3:7.1f} us  cold {b * 1e3:7.1f} us  errs {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}", flush=True)

    import time

    kern = lambda: token_stats_triton(x, lab, 1.0, -100)  # noqa: E731
    res = kern()
    add("stats[default] first", kern, _err([t[rows] for t in res[:4]], ref))
    add("stats[default] second", kern, _err([t[rows] for t in res[:4]], ref))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        kern()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"host time per call of the default (launch path, no sync): {(t1 - t0) / 200 * 1e6:.1f} us", flush=True)
    add("torch.sum", lambda: torch.sum(x))
    for p, blk, st, w in READ_CONFIGS:
        add(f"read_sum[p={p},b={blk},s={st},w={w}]", lambda p=p, blk=blk, st=st, w=w: read_sum(x, p, blk, st, w))
    for blk, w, st, sp in STATS_CONFIGS:
        cfg = {"block": blk, "num_warps": w, "stages": st, "split": sp}
        try:
            res = token_stats_triton(x, lab, 1.0, -100, config=cfg)
            errs = _err([t[rows] for t in res[:4]], ref)
            add(f"stats[b={blk},w={w},s={st},split={sp}]", lambda cfg=cfg: token_stats_triton(x, lab, 1.0, -100, config=cfg), errs)
        except Exception as exc:  # a configuration that does not compile is reported, not fatal
            print(f"stats {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    res = token_stats_triton(x, lab, 1.0, -100)
    add("stats[default]", lambda: token_stats_triton(x, lab, 1.0, -100), _err([t[rows] for t in res[:4]], ref))
    return out


def fused(rep_ms: int = 250) -> list[Row]:
    from reference import reference_token_stats

    from entropy_discriminator.kernels.triton_fused import DEFAULT_CONFIG, token_stats_fused_triton

    n, h, v, card = 16384, 3584, 152064, card_name()
    free_memory()
    gen = torch.Generator(device="cuda").manual_seed(n + h + v)
    hid = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=gen) * (4.0 / h**0.5)).to(torch.bfloat16)
    lab = torch.randint(0, v, (n,), device="cuda", generator=gen)
    rows = torch.linspace(0, n - 1, 16, device="cuda").long()
    ref = reference_token_stats(hid[rows].double() @ w.double().T, lab[rows], 1.0)
    tflop = 2.0 * n * h * v / 1e12
    out: list[Row] = []
    ms = bench_ms(lambda: hid @ w.T, rep_ms)
    out.append(Row("tune_fused", card, "bf16", n, v, h, "cublas_matmul_only", ms, tflop / ms * 1e3, "TF/s"))
    print(f"{'cublas':28s} {ms:8.3f} ms {tflop / ms * 1e3:6.1f} TF/s", flush=True)
    base = None
    for name, c in FUSED_CONFIGS.items():
        cfg = {**DEFAULT_CONFIG, **c}
        try:
            res = token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config=cfg)
            torch.cuda.synchronize()
            errs = _err([t[rows] for t in res[:4]], ref)
            if base is None:
                base = res
            same = max(float((a - b).abs().max()) for a, b in zip(res[:4], base[:4]))
            ms = bench_ms(lambda cfg=cfg: token_stats_fused_triton(hid, w, lab, None, 1.0, -100, config=cfg), rep_ms)
            out.append(Row("tune_fused", card, "bf16", n, v, h, name, ms, tflop / ms * 1e3, "TF/s", float("nan"), *errs, note=f"maxdiff_vs_default={same:.2e}"))
            print(f"{name:28s} {ms:8.3f} ms {tflop / ms * 1e3:6.1f} TF/s errs {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e} vs default {same:.1e}", flush=True)
            del res
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return out


def main(argv: list[str]) -> int:
    what = argv or ["stats", "fused"]
    p = torch.cuda.get_device_properties(0)
    import triton

    print(f"card {card_name()} SMs {p.multi_processor_count} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if "stats" in what:
        write_csv(stats(), "tune_stats")
    if "fused" in what:
        write_csv(fused(), "tune_fused")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
