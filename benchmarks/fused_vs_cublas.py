"""``python -m benchmarks fused-vs-cublas``: the fused hidden -> statistics call against cuBLAS.

For each Qwen2.5 LM-head shape (H, V) of :data:`HEADS`, each N of ``--n`` and each dtype of
``--dtypes`` (hidden [N, H] ~ N(0, 1), weight [V, H] ~ N(0, 16 / H), random labels), three times
(``triton.testing.do_bench`` medians, same card, same run):

- ``fused_ms``: what users call with the check that does not wait,
  ``token_stats_from_hidden(hidden, weight, labels, check="deferred")`` (``ed.raise_deferred()`` after the timing);
- ``fused_wait_ms``: the default call, whose check waits for the kernel (one host synchronisation per call: the
  host's work for the next call is then not overlapped with the GPU's);
- ``cublas_ms``: cuBLAS ``hidden @ weight.T`` alone (16-bit logits written, no statistics);
- ``unfused_ms``: that matmul, then the one-pass statistics kernel over the logits;

each the median of three medians taken in alternating order (:func:`_timed_row`).  ``--rounded``: the fused call
with ``logits_dtype`` = the inputs' dtype, the logits a framework's 16-bit head forms (what the TRL adapter asks
for on 16-bit models), so that it computes what the unfused pair does (whose matmul writes 16-bit logits); default
``--out`` ``benchmarks/results/fused_vs_cublas_rounded.csv``.

Writes ``--out`` (CSV ``card,H,V,N,dtype,fused_ms,cublas_ms,unfused_ms,fused_wait_ms``) and prints the ratios:
fused / cuBLAS (target <= 1 / 0.97) and fused / unfused (target <= 1), and the waiting call's / cuBLAS.

``--sweep``: instead of the public call, time the fused kernel under each variant of :data:`SWEEP`
beside cuBLAS and the unfused pair (errors against a float64 reference on 8 rows checked for
each), write ``sweep.csv`` and ``best.csv`` into the folder ``--out`` and print the fastest correct
variant per shape (the variants: the streaming kernel's launch plan, program order, tiles and
pipelining around ``kernels/triton_fused.DEFAULT_CONFIG`` and ``stream_plan``, and the per-tile
pointer kernel).  ``--budget-s`` stops starting new shapes after that many seconds.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from pathlib import Path

import torch

from .common import bench_ms, card_name, free_memory, paired_rounds

# (H, V) of the Qwen2.5 0.5B, 1.5B, 3B, 7B and 14B heads.
HEADS = ((896, 151936), (1536, 151936), (2048, 151936), (3584, 152064), (5120, 152064))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = ("card", "H", "V", "N", "dtype", "fused_ms", "cublas_ms", "unfused_ms", "fused_wait_ms")
TARGET_CUBLAS = 1 / 0.97

# Candidate kernel variants timed by --sweep: name -> overrides of triton_fused.DEFAULT_CONFIG (the
# streaming Triton kernel: a full config sets its keys), or None for the configuration the public
# call runs (below H 3072 on sm_90 the Gluon kernel, else the streaming kernel; plan from
# triton_fused.stream_plan).  "chunks k" forces k vocabulary chunks (the plan's program order
# kept), "row order" one group of every row block, "L2 x MiB" the plan's budget for a group's
# hidden blocks; "per-tile" is the pointer kernel.  A
# name starting with "floor" is a timing floor (statistics meaningless), never picked as best.
SWEEP: dict[str, dict | None] = {
    "current": None,
    "unbranched": {"branch": 0},
    "branched": {"branch": 1},
    "s3 g44": {"chunks": 3, "group_rows": 44, "stream": 1},  # a group of programs that fills 132 SMs exactly
    "s4 g33": {"chunks": 4, "group_rows": 33, "stream": 1},
    "s6 g22": {"chunks": 6, "group_rows": 22, "stream": 1},
    "chunks 4": {"chunks": 4, "stream": 1},
    "chunks 8": {"chunks": 8, "stream": 1},
    "chunks 12": {"chunks": 12, "stream": 1},
    "row order": {"group_rows": 2**20, "stream": 1},
    "L2 8 MiB": {"group_mib": 8, "stream": 1},
    "L2 32 MiB": {"group_mib": 32, "stream": 1},
    "s4": {"stages": 4},
    "noflat": {"flatten": 0},
    "128x128 w4": {"bn": 128, "num_warps": 4},
    "per-tile": {"stream": 0},
    "floor": {"moments": 0},
}
ERR_MAX = 2e-3  # max |error| of logp, H, E_p[S] against float64 for a variant to count as correct


def _inputs(n: int, h: int, v: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(n + h + v)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * (4.0 / h**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    return hidden, weight, labels


def _reference(hidden, weight, labels, rows: int = 8, rounded: bool = False) -> tuple[torch.Tensor, dict]:
    """The float64 statistics of ``rows`` rows spread over the batch (``rounded``: of the logits rounded to the
    inputs' dtype): (row indices, reference)."""
    from reference import reference_token_stats

    idx = torch.linspace(0, hidden.shape[0] - 1, rows, device=hidden.device).long()
    logits = hidden[idx].double() @ weight.double().T
    return idx, reference_token_stats(logits.to(hidden.dtype).double() if rounded else logits, labels[idx], 1.0)


def _max_errors(out, ref: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> tuple[float, float, float]:
    """max |out - float64 reference| of logp, H and E_p[S] on the rows of ``ref`` (:func:`_reference`)."""
    idx, r = ref
    got = (out.logp, out.entropy, out.s_expected)
    return tuple(float((g[idx].double() - r[k]).abs().max()) for g, k in zip(got, ("logp", "entropy", "s_expected")))


def _timed_row(hidden, weight, labels, kw: dict) -> dict[str, float]:
    """fused / cuBLAS / unfused milliseconds (``kw``: the fused call's keyword arguments): each the median of three
    do_bench medians taken in alternating order (:func:`.common.paired_rounds`: the card's clock drifts under long
    GEMM runs, and the alternation keeps the drift out of the ratios; the median of the rounds keeps out one slow
    round: on an H200 at H 3584 N 16384, the first such row timing on new inputs read the deferred call 1.10-1.12x
    cuBLAS, a second 0.96-0.97x)."""
    from entropy_discriminator import raise_deferred
    from entropy_discriminator.hidden import token_stats_from_hidden
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    fns = {
        "cublas_ms": lambda: hidden @ weight.T,
        "fused_ms": lambda: token_stats_from_hidden(hidden, weight, labels, check="deferred", **kw),
        "unfused_ms": lambda: token_stats_triton(hidden @ weight.T, labels, 1.0, -100),
        "fused_wait_ms": lambda: token_stats_from_hidden(hidden, weight, labels, **kw),
    }
    # each median over 100 ms, or over about 8 calls where a call takes longer than 12 ms (N = 65536: 50-150 ms)
    rep_ms = max(100, int(8 * bench_ms(fns["cublas_ms"], 25, 5)))
    # after each median: the deferred checks of the timing (the inputs hold no fault)
    times = paired_rounds(fns, 3, rep_ms, 25, after=raise_deferred)
    return {k: statistics.median(t) for k, t in times.items()}


def run(heads, ns: list[int], dtypes: list[str], out: Path, rounded: bool = False) -> list[dict]:
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
                    kw = {"logits_dtype": hidden.dtype} if rounded else {}
                    errs = _max_errors(token_stats_from_hidden(hidden, weight, labels, **kw),
                                       _reference(hidden, weight, labels, rounded=rounded))
                    t = _timed_row(hidden, weight, labels, kw)
                    row = dict(card=card, H=h, V=v, N=n, dtype=dname, **{k: round(x, 4) for k, x in t.items()})
                    w.writerow(row)
                    fh.flush()
                    rows.append(row)
                    fused, cublas, unfused = t["fused_ms"], t["cublas_ms"], t["unfused_ms"]
                    print(f"[{card}] {dname} H={h} V={v} N={n}: fused {fused:.3f} ms, cuBLAS {cublas:.3f}, unfused "
                          f"{unfused:.3f}; fused/cuBLAS {fused / cublas:.3f}, fused/unfused {fused / unfused:.3f}, "
                          f"waiting call/cuBLAS {t['fused_wait_ms'] / cublas:.3f}; "
                          f"err logp {errs[0]:.1e} H {errs[1]:.1e} E {errs[2]:.1e}", flush=True)  # fmt: skip
                    del hidden, weight, labels
    return rows


def summary(rows: list[dict]) -> None:
    """The table of ratios (same card, same run) and how many rows meet each target."""
    print(f"\n{'card':24s} {'dtype':5s} {'H':>5s} {'N':>6s} {'fused/cuBLAS':>13s} {'fused/unfused':>14s} "
          f"{'waiting/cuBLAS':>15s}")
    ok_c = ok_u = 0
    for r in rows:
        rc, ru = r["fused_ms"] / r["cublas_ms"], r["fused_ms"] / r["unfused_ms"]
        ok_c += rc <= TARGET_CUBLAS
        ok_u += ru <= 1.0
        print(f"{r['card']:24s} {r['dtype']:5s} {r['H']:5d} {r['N']:6d} {rc:13.3f}{'' if rc <= TARGET_CUBLAS else ' *'} "
              f"{ru:14.3f}{'' if ru <= 1.0 else ' *'} {r['fused_wait_ms'] / r['cublas_ms']:15.3f}")  # fmt: skip
    print(f"rows at >= 0.97x cuBLAS: {ok_c}/{len(rows)}; rows not slower than the unfused pair: {ok_u}/{len(rows)}"
          " (* misses)")  # fmt: skip


SWEEP_COLUMNS = ("card", "H", "V", "N", "dtype", "method", "ms", "over_cublas", "over_unfused", "err_logp",
                 "err_entropy", "err_s_expected", "config")
BEST_COLUMNS = ("card", "H", "V", "N", "dtype", "best", "best_ms", "cublas_ms", "unfused_ms", "current_ms",
                "best_over_cublas", "best_over_unfused", "current_over_cublas", "config")


def sweep(heads, ns: list[int], dtypes: list[str], out_dir: Path, names: list[str] | None, rep_ms: int,
          warmup_ms: int, budget_s: float) -> list[dict]:  # fmt: skip
    """Time every variant of :data:`SWEEP` (or ``names``) on every shape beside cuBLAS and the unfused pair.

    Per shape (smallest N first, so that a run cut by ``budget_s`` loses the largest shapes): cuBLAS
    ``hidden @ weight.T``, the unfused pair, each variant (its errors against float64 on 8 rows
    checked first), and cuBLAS again; ``cublas_ms`` is the mean of the two cuBLAS readings (the
    card's clock drifts under long GEMM runs).  Writes ``out_dir/sweep.csv`` (one row per method and
    shape) and ``out_dir/best.csv`` (per shape the fastest correct variant, not a floor), and returns
    the best rows.
    """
    from entropy_discriminator.kernels.triton_fused import DEFAULT_CONFIG, token_stats_fused_triton
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    unknown = sorted(set(names or ()) - set(SWEEP))
    if unknown:
        raise ValueError(f"--configs: unknown variants {unknown}; known: {list(SWEEP)}")
    variants = {k: c for k, c in SWEEP.items() if not names or k in names}
    card, t0, best_rows = card_name(), time.monotonic(), []
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "sweep.csv").open("w", newline="") as fs, (out_dir / "best.csv").open("w", newline="") as fb:
        ws, wb = csv.DictWriter(fs, fieldnames=SWEEP_COLUMNS), csv.DictWriter(fb, fieldnames=BEST_COLUMNS)
        ws.writeheader()
        wb.writeheader()
        for n in ns:
            for h, v in heads:
                for dname in dtypes:
                    if time.monotonic() - t0 > budget_s:
                        print(f"budget of {budget_s:.0f} s spent: skipping N={n} H={h} {dname}", flush=True)
                        continue
                    free_memory()
                    hidden, weight, labels = _inputs(n, h, v, DTYPES[dname])
                    ref = _reference(hidden, weight, labels)
                    base = dict(card=card, H=h, V=v, N=n, dtype=dname)
                    cublas = [bench_ms(lambda: hidden @ weight.T, rep_ms, warmup_ms)]
                    unfused = bench_ms(lambda: token_stats_triton(hidden @ weight.T, labels, 1.0, -100), rep_ms, warmup_ms)
                    times: dict[str, tuple[float, tuple, dict]] = {}
                    for name, over in variants.items():
                        # the public call's own choice for "current" (the Gluon kernel below H 3072 on sm_90); a
                        # variant's full config asks for the streaming Triton kernel (its keys set)
                        cfg = {**DEFAULT_CONFIG, **over} if over is not None else {}
                        call = lambda cfg=cfg: token_stats_fused_triton(hidden, weight, labels, None, 1.0, -100, config=cfg)  # noqa: E731
                        try:
                            errs = _max_errors(call(), ref)
                            times[name] = (bench_ms(call, rep_ms, warmup_ms), errs, cfg)
                        except Exception as exc:  # a variant that does not compile or fit is reported, not fatal
                            print(f"  {dname} H={h} N={n} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    cublas.append(bench_ms(lambda: hidden @ weight.T, rep_ms, warmup_ms))
                    cb = sum(cublas) / 2
                    print(f"{dname} H={h} N={n}: cuBLAS {cublas[0]:.3f} / {cublas[1]:.3f} ms, unfused {unfused:.3f} "
                          f"({unfused / cb:.3f}x cuBLAS)", flush=True)  # fmt: skip
                    ws.writerow({**base, "method": "cublas", "ms": round(cb, 4), "over_cublas": 1.0,
                                 "over_unfused": round(cb / unfused, 4)})  # fmt: skip
                    ws.writerow({**base, "method": "unfused", "ms": round(unfused, 4), "over_cublas": round(unfused / cb, 4),
                                 "over_unfused": 1.0})  # fmt: skip
                    for name, (ms, errs, cfg) in times.items():
                        ok = max(errs) < ERR_MAX
                        ws.writerow({**base, "method": name, "ms": round(ms, 4), "over_cublas": round(ms / cb, 4),
                                     "over_unfused": round(ms / unfused, 4), "err_logp": f"{errs[0]:.2e}",
                                     "err_entropy": f"{errs[1]:.2e}", "err_s_expected": f"{errs[2]:.2e}",
                                     "config": _config_text(cfg)})  # fmt: skip
                        print(f"  {name:28s} {ms:9.3f} ms  /cuBLAS {ms / cb:.3f}  /unfused {ms / unfused:.3f}  "
                              f"errs {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}"
                              f"{'' if ok or name.startswith('floor') else ' WRONG'}", flush=True)  # fmt: skip
                    fs.flush()
                    eligible = {k: t for k, t in times.items() if not k.startswith("floor") and max(t[1]) < ERR_MAX}
                    if eligible:
                        name = min(eligible, key=lambda k: eligible[k][0])
                        ms, cfg = eligible[name][0], eligible[name][2]
                        cur = times.get("current", (math.nan,))[0]
                        row = {**base, "best": name, "best_ms": round(ms, 4), "cublas_ms": round(cb, 4),
                               "unfused_ms": round(unfused, 4), "current_ms": round(cur, 4),
                               "best_over_cublas": round(ms / cb, 4), "best_over_unfused": round(ms / unfused, 4),
                               "current_over_cublas": round(cur / cb, 4), "config": _config_text(cfg)}  # fmt: skip
                        wb.writerow(row)
                        fb.flush()
                        best_rows.append(row)
                    del hidden, weight, labels, ref
    print(f"sweep: {time.monotonic() - t0:.0f} s", flush=True)
    return best_rows


def _config_text(cfg: dict) -> str:
    """The configuration's keys that differ from DEFAULT_CONFIG, as ``k=v`` joined by spaces."""
    from entropy_discriminator.kernels.triton_fused import DEFAULT_CONFIG

    return " ".join(f"{k}={v}" for k, v in cfg.items() if DEFAULT_CONFIG.get(k) != v) or "default"


def best_summary(rows: list[dict]) -> None:
    """The per-shape winners and how many shapes meet each target (best variant against cuBLAS
    alone and against the unfused pair), and which variant wins how often."""
    print(f"\n{'dtype':5s} {'H':>5s} {'N':>6s} {'best':28s} {'/cuBLAS':>8s} {'/unfused':>9s} {'current/cuBLAS':>15s}")
    ok_c = ok_u = 0
    wins: dict[str, int] = {}
    for r in rows:
        rc, ru = r["best_over_cublas"], r["best_over_unfused"]
        ok_c += rc <= TARGET_CUBLAS
        ok_u += ru <= 1.0
        wins[r["best"]] = wins.get(r["best"], 0) + 1
        print(f"{r['dtype']:5s} {r['H']:5d} {r['N']:6d} {r['best']:28s} {rc:8.3f}{'' if rc <= TARGET_CUBLAS else '*'} "
              f"{ru:9.3f}{'' if ru <= 1.0 else '*'} {r['current_over_cublas']:15.3f}")  # fmt: skip
    print(f"best variant at >= 0.97x cuBLAS: {ok_c}/{len(rows)}; not slower than the unfused pair: {ok_u}/{len(rows)}"
          f" (* misses); wins: {dict(sorted(wins.items(), key=lambda kv: -kv[1]))}")  # fmt: skip


def add_command(sub) -> None:
    p = sub.add_parser("fused-vs-cublas", allow_abbrev=False, help="fused hidden -> statistics vs cuBLAS matmul alone and the unfused pair")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--h", type=int, nargs="*", default=[], help="restrict to these hidden sizes")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--out", default=None, help="CSV path (default benchmarks/results/fused_vs_cublas.csv); with "
                   "--sweep a folder for sweep.csv and best.csv (default benchmarks/results/fused_sweep)")
    p.add_argument("--rounded", action="store_true", help="the fused call with the logits rounded to the inputs' "
                   "dtype (logits_dtype), as the unfused pair's matmul writes them")
    p.add_argument("--sweep", action="store_true", help="time the kernel variants of SWEEP instead")
    p.add_argument("--configs", nargs="*", default=None, help="with --sweep: only these SWEEP names")
    p.add_argument("--rep-ms", type=int, default=60, help="with --sweep: do_bench rep (ms) per timing")
    p.add_argument("--warmup-ms", type=int, default=15, help="with --sweep: do_bench warm-up (ms) per timing")
    p.add_argument("--budget-s", type=float, default=440.0, help="with --sweep: start no new shape after this")


def main(args: argparse.Namespace) -> int:
    heads = [hv for hv in HEADS if not args.h or hv[0] in args.h]
    if args.sweep:
        out = Path(args.out or "benchmarks/results/fused_sweep")
        best_summary(sweep(heads, args.n, args.dtypes, out, args.configs, args.rep_ms, args.warmup_ms, args.budget_s))
    else:
        default = f"benchmarks/results/fused_vs_cublas{'_rounded' * args.rounded}.csv"
        summary(run(heads, args.n, args.dtypes, Path(args.out or default), args.rounded))
    return 0
