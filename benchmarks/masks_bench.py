"""``python -m benchmarks masks``: the public mask and monitor calls, as a training step makes them.

For 16k / 256k / 1M tokens (sequences of 1024 tokens, 95% valid, per-sequence advantages, fresh
random float32 scores) it times ``clip_b_mask`` (reference defaults), ``clip_v_mask`` (defaults:
mu 8.5, max_frac 1e-4), ``clip_v_mask`` with the cap in force (mu 1, so far more than 1e-4 of the
tokens violate and the top-k runs), ``EntropyMonitor.from_stats`` (every metric: percentiles,
means, clip metrics, covariance, predicted change), and ``float(x.sum())`` over the scores (one
reduction and one host synchronisation: the floor of any call that returns Python numbers).

After a one-second warm-up of every call, times are medians of CUDA-event timings with the L2
cache flushed before each call (``triton.testing.do_bench``, as in common.py); ``syncs`` counts the host synchronisations of one
call (``torch.cuda.set_sync_debug_mode``).  Every GPU result is checked against the same call on
the CPU copy of the inputs (keep-masks, counts and percentiles identical, float metrics to 1e-9);
the command fails if one differs.  CSV: ``benchmarks/results/<card>/masks.csv``.
"""

from __future__ import annotations

import csv
import math
import os
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import entropy_discriminator as ed

from .common import RESULTS, bench_ms, card_name

SIZES = (16384, 262144, 1048576)
SEQ = 1024


def inputs(n: int, device: torch.device, seed: int = 0) -> dict:
    """One batch of ``n`` tokens: TokenStats-like fields, per-sequence advantages and ratios."""
    g = torch.Generator().manual_seed(seed + n)
    shape = (n // SEQ, SEQ)
    entropy = torch.rand(shape, generator=g) * 3
    s_star = torch.randn(shape, generator=g) ** 3 * 0.05  # heavy tails: Clip_B clips some
    s_centered = torch.randn(shape, generator=g) * 0.05  # none beyond 8.5 sigma: the default Clip_V is uncapped
    valid = torch.rand(shape, generator=g) < 0.95
    stats = ed.TokenStats(
        logp=-torch.rand(shape, generator=g) * 5,
        entropy=entropy,
        s_star=s_star,
        s_expected=s_star - s_centered,
        s_centered=s_centered,
        valid=valid,
    )
    stats = ed.TokenStats(**{k: getattr(stats, k).to(device) for k in stats.__dataclass_fields__})
    adv = torch.randn(shape[0], generator=g).to(device)
    ratio = (1 + 0.1 * torch.rand(shape, generator=g)).to(device)
    return {"stats": stats, "adv": adv, "ratio": ratio}


def calls(batch: dict) -> dict[str, Callable[[], object]]:
    """The public calls timed, each returning what the check compares."""
    st, adv, ratio = batch["stats"], batch["adv"], batch["ratio"]
    mon = ed.EntropyMonitor()
    mask_v = ed.clip_v_mask(st.s_centered, adv, st.valid)
    return {
        "clip_b_mask": lambda: ed.clip_b_mask(st.s_star, adv, st.valid),
        "clip_v_mask": lambda: ed.clip_v_mask(st.s_centered, adv, st.valid),
        "clip_v_mask_capped": lambda: ed.clip_v_mask(st.s_centered, adv, st.valid, mu_low=1.0),
        "monitor.from_stats": lambda: mon.from_stats(st, advantages=adv, mask=mask_v, ratio=ratio, lr=1e-3),
        "float(sum) floor": lambda: float(st.s_star.sum()),
    }


def warm_up(batch_calls: dict[str, Callable[[], object]], seconds: float = 1.0) -> None:
    """Run every call for about ``seconds``: lazy initialisation, clocks and caches settle before timing."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for fn in batch_calls.values():
            fn()
    torch.cuda.synchronize()


def count_syncs(fn: Callable[[], object]) -> int:
    """Host synchronisations of one call of ``fn``."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def same(gpu: object, cpu: object) -> bool:
    """GPU and CPU results agree: masks and counts exactly, floats to 1e-9 relative."""
    if isinstance(gpu, ed.MaskResult):
        ints = ("n_valid", "n_valid_pos", "n_valid_neg", "n_clipped", "n_clipped_pos", "n_clipped_neg", "capped")
        floats = ("center", "std", "lower", "upper")
        return (
            torch.equal(gpu.keep.cpu(), cpu.keep)
            and all(getattr(gpu, f) == getattr(cpu, f) for f in ints)
            and all(close(getattr(gpu, f), getattr(cpu, f)) for f in floats)
        )
    if isinstance(gpu, dict):
        exact = re.compile(r"/p[\d.]+$|tokens/|n_clipped|capped")
        return gpu.keys() == cpu.keys() and all(
            gpu[k] == cpu[k] if exact.search(k) else close(gpu[k], cpu[k]) for k in gpu
        )
    return close(float(gpu), float(cpu), rel=1e-5)  # float32 sums in another order


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b), 1e-300) or (math.isnan(a) and math.isnan(b))


def main(args) -> list[dict]:
    device = torch.device("cuda")
    card = card_name()
    rows = []
    warm_up(calls(inputs(min(args.n), device)))
    for n in args.n:
        gpu, cpu = calls(inputs(n, device)), calls(inputs(n, torch.device("cpu")))
        for method, fn in gpu.items():
            ok = same(fn(), cpu[method]())
            rows.append({
                "card": card, "n_tokens": n, "method": method, "ms": bench_ms(fn, rep_ms=args.rep_ms),
                "syncs": count_syncs(fn), "equal_to_cpu": ok,
            })
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> int:
    """Print the table, write the CSV; non-zero if a GPU result differed from the CPU's."""
    print(f"\n[{rows[0]['card']}] public calls, median ms (CUDA events, L2 flushed)")
    sizes = sorted({r["n_tokens"] for r in rows})
    print(f"{'method':22s}" + "".join(f"{n:>12d}" for n in sizes) + f"{'syncs':>8s}  equal to CPU")
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = {r["n_tokens"]: r for r in rows if r["method"] == method}
        print(f"{method:22s}" + "".join(f"{rs[n]['ms']:12.4f}" for n in sizes)
              + f"{max(r['syncs'] for r in rs.values()):8d}  {all(r['equal_to_cpu'] for r in rs.values())}")
    folder = Path(os.environ.get("BENCH_RESULTS", RESULTS)) / card_folder(rows[0]["card"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "masks.csv"
    new = not path.exists()
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)
    print(f"\nCSV: {path}")
    bad = [f"{r['method']} @ {r['n_tokens']}" for r in rows if not r["equal_to_cpu"]]
    if bad:
        print("GPU result differs from the CPU's:", ", ".join(bad))
    return 1 if bad else 0


def card_folder(card: str) -> str:
    """``h100`` / ``h200`` for those cards (the existing results folders), else a slug of the name."""
    for short in ("H100", "H200"):
        if short in card:
            return short.lower()
    return re.sub(r"[^a-z0-9]+", "_", card.lower()).strip("_")
