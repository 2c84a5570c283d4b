"""``python -m benchmarks fused-vs-cublas``: the fused hidden -> statistics call against cuBLAS.

For each Qwen2.5 LM-head shape (H, V) of :data:`HEADS`, each N of ``--n`` and each dtype of
``--dtypes`` (hidden [N, H] ~ N(0, 1), weight [V, H] ~ N(0, 16 / H), random labels), three times
(``triton.testing.do_bench`` medians, same card, same run):

- ``fused_ms``: what users call, ``token_stats_from_hidden(hidden, weight, labels)`` (the check on:
  one host synchronisation);
- ``cublas_ms``: cuBLAS ``hidden @ weight.T`` alone (16-bit logits written, no statistics);
- ``unfused_ms``: that matmul, then the one-pass statistics kernel over the logits;

each the mean of two medians taken in alternating order (:func:`_timed_row`).

Writes ``--out`` (CSV ``card,H,V,N,dtype,fused_ms,cublas_ms,unfused_ms``) and prints the ratios:
fused / cuBLAS (target <= 1 / 0.97) and fused / unfused (target <= 1).

``--sweep``: instead of the public call, time the fused kernel under each configuration of
:data:`SWEEP` (errors against a float64 reference on 8 rows checked for each), and print the
fastest per shape (the table behind ``kernels/triton_fused.SHAPE_CONFIGS``).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import torch

from .common import bench_ms, card_name, free_memory

# (H, V) of the Qwen2.5 0.5B, 1.5B, 3B, 7B and 14B heads.
HEADS = ((896, 151936), (1536, 151936), (2048, 151936), (3584, 152064), (5120, 152064))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = ("card", "H", "V", "N", "dtype", "fused_ms", "cublas_ms", "unfused_ms")
TARGET_CUBLAS = 1 / 0.97

# Candidate kernel configurations (overrides of triton_fused.DEFAULT_CONFIG) timed by --sweep.
SWEEP = {
    "128x256 w8 s3": {},
    "128x256 w8 s4": {"stages": 4},
    "128x256 w8 s3 noflat": {"flatten": 0},
    "128x256 w8 s3 ws": {"ws": 1},
    "128x256 w8 s3 g16": {"group_m": 16},
    "128x256 w8 s3 unbranched": {"branch": 0},
    "128x256 w8 s3 noflat unbranched": {"flatten": 0, "branch": 0},
    "256x128 w8 s3": {"bm": 256, "bn": 128},
    "128x128 w4 s3 x2": {"bn": 128, "num_warps": 4, "persistent": 2},
    "128x128 w4 s3 x2 noflat": {"bn": 128, "num_warps": 4, "persistent": 2, "flatten": 0},
    "128x128 w8 s3 x2 r128": {"bn": 128, "num_warps": 8, "persistent": 2, "maxnreg": 128},
    "64x256 w4 s2 x2": {"bm": 64, "num_warps": 4, "persistent": 2, "stages": 2},
    "128x128 w4 s2 x3 r168": {"bn": 128, "num_warps": 4, "persistent": 3, "stages": 2, "maxnreg": 168},
    "ptr 128x128 w4 s3": {"persistent": 0, "bn": 128, "num_warps": 4},
}


def _inputs(n: int, h: int, v: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(n + h + v)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * (4.0 / h**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    return hidden, weight, labels


def _max_errors(out, hidden, weight, labels) -> tuple[float, float, float]:
    """max |out - float64 reference| of logp, H and E_p[S] over 8 rows spread over the batch."""
    from reference import reference_token_stats

    rows = torch.linspace(0, hidden.shape[0] - 1, 8, device=hidden.device).long()
    ref = reference_token_stats(hidden[rows].double() @ weight.double().T, labels[rows], 1.0)
    got = (out.logp, out.entropy, out.s_expected)
    return tuple(float((g[rows].double() - ref[k]).abs().max()) for g, k in zip(got, ("logp", "entropy", "s_expected")))


def _baselines(hidden, weight, labels) -> tuple[float, float]:
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    cublas = bench_ms(lambda: hidden @ weight.T, 100, 25)
    unfused = bench_ms(lambda: token_stats_triton(hidden @ weight.T, labels, 1.0, -100), 100, 25)
    return cublas, unfused


def _timed_row(hidden, weight, labels) -> dict[str, float]:
    """fused / cuBLAS / unfused milliseconds: each the mean of two do_bench medians taken in the
    orders cuBLAS, fused, unfused and unfused, fused, cuBLAS (the card's clock drifts under long
    GEMM runs; the alternation keeps the drift out of the ratios)."""
    from entropy_discriminator.hidden import token_stats_from_hidden
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    fns = {
        "cublas_ms": lambda: hidden @ weight.T,
        "fused_ms": lambda: token_stats_from_hidden(hidden, weight, labels),
        "unfused_ms": lambda: token_stats_triton(hidden @ weight.T, labels, 1.0, -100),
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for order in (("cublas_ms", "fused_ms", "unfused_ms"), ("unfused_ms", "fused_ms", "cublas_ms")):
        for k in order:
            times[k].append(bench_ms(fns[k], 100, 25))
    return {k: sum(t) / len(t) for k, t in times.items()}


def run(heads, ns: list[int], dtypes: list[str], out: Path) -> list[dict]:
    from entropy_discriminator.hidden import token_stats_from_hidden

    card, rows = card_name(), []
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        for dname in dtypes:
            for h, v in heads:
                for n in ns:
                    free_memory()
                    hidden, weight, labels = _inputs(n, h, v, DTYPES[dname])
                    errs = _max_errors(token_stats_from_hidden(hidden, weight, labels), hidden, weight, labels)
                    t = _timed_row(hidden, weight, labels)
                    row = dict(card=card, H=h, V=v, N=n, dtype=dname, **{k: round(x, 4) for k, x in t.items()})
                    w.writerow(row)
                    fh.flush()
                    rows.append(row)
                    fused, cublas, unfused = t["fused_ms"], t["cublas_ms"], t["unfused_ms"]
                    print(f"[{card}] {dname} H={h} V={v} N={n}: fused {fused:.3f} ms, cuBLAS {cublas:.3f}, unfused "
                          f"{unfused:.3f}; fused/cuBLAS {fused / cublas:.3f}, fused/unfused {fused / unfused:.3f}; "
                          f"err logp {errs[0]:.1e} H {errs[1]:.1e} E {errs[2]:.1e}", flush=True)  # fmt: skip
                    del hidden, weight, labels
    return rows


def summary(rows: list[dict]) -> None:
    """The table of ratios (same card, same run) and how many rows meet each target."""
    print(f"\n{'card':24s} {'dtype':5s} {'H':>5s} {'N':>6s} {'fused/cuBLAS':>13s} {'fused/unfused':>14s}")
    ok_c = ok_u = 0
    for r in rows:
        rc, ru = r["fused_ms"] / r["cublas_ms"], r["fused_ms"] / r["unfused_ms"]
        ok_c += rc <= TARGET_CUBLAS
        ok_u += ru <= 1.0
        print(f"{r['card']:24s} {r['dtype']:5s} {r['H']:5d} {r['N']:6d} {rc:13.3f}{'' if rc <= TARGET_CUBLAS else ' *'} "
              f"{ru:14.3f}{'' if ru <= 1.0 else ' *'}")  # fmt: skip
    print(f"rows at >= 0.97x cuBLAS: {ok_c}/{len(rows)}; rows not slower than the unfused pair: {ok_u}/{len(rows)}"
          " (* misses)")  # fmt: skip


def sweep(heads, ns: list[int], dtypes: list[str], out: Path, names: list[str] | None) -> None:
    from entropy_discriminator.kernels.triton_fused import DEFAULT_CONFIG, token_stats_fused_triton

    card = card_name()
    configs = {k: c for k, c in SWEEP.items() if not names or k in names}
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["card", "H", "V", "N", "dtype", "method", "ms", "err_logp", "err_entropy", "err_s_expected"])
        for dname in dtypes:
            for h, v in heads:
                for n in ns:
                    free_memory()
                    hidden, weight, labels = _inputs(n, h, v, DTYPES[dname])
                    cublas, unfused = _baselines(hidden, weight, labels)
                    w.writerow([card, h, v, n, dname, "cublas", cublas, "", "", ""])
                    w.writerow([card, h, v, n, dname, "unfused", unfused, "", "", ""])
                    best = ("", math.inf)
                    for name, over in configs.items():
                        cfg = {**DEFAULT_CONFIG, **over}
                        try:
                            errs = _max_errors(
                                token_stats_fused_triton(hidden, weight, labels, None, 1.0, -100, config=cfg),
                                hidden, weight, labels,
                            )  # fmt: skip
                            ms = bench_ms(
                                lambda cfg=cfg: token_stats_fused_triton(hidden, weight, labels, None, 1.0, -100, config=cfg),
                                100, 25,
                            )  # fmt: skip
                        except Exception as exc:  # a configuration that does not compile or fit is reported
                            print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                            continue
                        ok = max(errs) < 2e-3
                        w.writerow([card, h, v, n, dname, name, ms, *errs])
                        fh.flush()
                        if ok and ms < best[1]:
                            best = (name, ms)
                        print(f"  {dname} H={h} N={n} {name:26s} {ms:8.3f} ms  /cuBLAS {ms / cublas:.3f}  "
                              f"/unfused {ms / unfused:.3f}  errs {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}"
                              f"{'' if ok else ' WRONG'}", flush=True)  # fmt: skip
                    print(f"BEST [{card}] {dname} H={h} N={n}: {best[0]} {best[1]:.3f} ms; cuBLAS {cublas:.3f}, "
                          f"unfused {unfused:.3f}: /cuBLAS {best[1] / cublas:.3f}, /unfused {best[1] / unfused:.3f}",
                          flush=True)  # fmt: skip
                    del hidden, weight, labels


def add_command(sub) -> None:
    p = sub.add_parser("fused-vs-cublas", allow_abbrev=False, help="fused hidden -> statistics vs cuBLAS matmul alone and the unfused pair")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--h", type=int, nargs="*", default=[], help="restrict to these hidden sizes")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--out", default="benchmarks/results/fused_vs_cublas.csv")
    p.add_argument("--sweep", action="store_true", help="time the kernel configurations of SWEEP instead")
    p.add_argument("--configs", nargs="*", default=None, help="with --sweep: only these SWEEP names")


def main(args: argparse.Namespace) -> int:
    heads = [hv for hv in HEADS if not args.h or hv[0] in args.h]
    if args.sweep:
        sweep(heads, args.n, args.dtypes, Path(args.out), args.configs)
    else:
        summary(run(heads, args.n, args.dtypes, Path(args.out)))
    return 0
