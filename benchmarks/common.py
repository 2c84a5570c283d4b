"""Timing, memory and error helpers shared by the benchmark commands (CUDA; ``sync``, ``timed`` and
``free_memory`` also work on the CPU)."""

from __future__ import annotations

import contextlib
import csv
import gc
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # float64 references live in tests/reference.py

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    """One benchmark measurement (one method on one shape)."""

    bench: str
    card: str
    dtype: str
    n: int
    v: int
    h: int
    method: str
    ms: float = math.nan
    rate: float = math.nan  # TB/s of logits read (stats) or TFLOP/s (fused)
    rate_unit: str = ""
    extra_mib: float = math.nan
    err_logp: float = math.nan
    err_entropy: float = math.nan
    err_s_expected: float = math.nan
    note: str = ""
    extra: dict = field(default_factory=dict)


# Multiprocessors the run is restricted to (``fewer_sms``), None for the whole card.
_SMS: int | None = None


def card_name() -> str:
    """The GPU's marketing name as torch reports it (every CSV row carries it), with ``" @ K SMs"``
    appended while :func:`fewer_sms` restricts the run, so that such rows never pass for the card's."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return name if _SMS is None else f"{name} @ {_SMS} SMs"


@contextlib.contextmanager
def fewer_sms(sms: int | None) -> Iterator[None]:
    """Run the block on ``sms`` of the card's multiprocessors (a CUDA green context; None: all).

    With fewer multiprocessors the same memory serves more bytes per SM-cycle: an H100 on 92 of its
    132 SMs has an H200's ratio of bandwidth to compute (3.35 TB/s / 92 ~ 4.8 TB/s / 132), which
    shows how a loop that is at the read floor on the whole card fares where it must issue fewer
    instructions per byte.  A proxy, never an H200 figure: the card name in every row says so.
    """
    global _SMS
    if sms is None:
        yield
        return
    from torch.cuda.green_contexts import GreenContext

    total = torch.cuda.get_device_properties(0).multi_processor_count
    if not 0 < sms <= total:
        raise ValueError(f"--sms must be in [1, {total}] on this card, got {sms}")
    ctx = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
    ctx.set_context()
    _SMS = sms
    try:
        yield
    finally:
        _SMS = None
        ctx.pop_context()


def card_dir(name: str | None = None) -> str:
    """Folder of a card's results: ``h100``, ``h200``, else the name in lower case, ``_`` for the rest."""
    name = (name or card_name()).lower()
    for short in ("h100", "h200", "a100", "b200"):
        if short in name:
            return short
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def synced(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` followed by a synchronisation of the stream current when this is called (CUDA): the
    floor of any call that waits for its result on the host, when ``fn`` is ``torch.sum``."""
    stream = torch.cuda.current_stream()

    def run():
        out = fn()
        stream.synchronize()
        return out

    return run


def kept(fn: Callable[[], object], results: list) -> Callable[[], None]:
    """``fn`` whose result stays referenced in ``results`` after the call (as a caller that uses it
    keeps it), so that freeing its tensors is not timed; the references are dropped every 64 calls."""

    def run():
        if len(results) >= 64:
            results.clear()
        results.append(fn())

    return run


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Microseconds of wall time per call over ``calls`` back-to-back calls (one sync at the end):
    the host's cost of a call when the GPU keeps up (a call that synchronises pays its GPU time too)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def sync() -> None:
    """Wait for the GPU when there is one (the step benchmarks also run on the CPU with ``--smoke``)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[..., object], *args: object, **kwargs: object) -> tuple[object, float]:
    """``(fn(*args, **kwargs), seconds)``, wall time with the GPU synchronised before and after."""
    import time

    sync()
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    sync()
    return out, time.perf_counter() - t


#: Columns of ``benchmarks/results/step_cost.csv``: per card, framework and set-up, the adapter's own time per step
#: over the stock framework's step (``python -m benchmarks trl-step``, ``benchmarks.verl_step``,
#: ``benchmarks.openrlhf_step``: ``--step-cost FILE``).
STEP_COST_FIELDS = ("card", "framework", "setup", "adapter_share")


def step_cost_card(name: str) -> str:
    """A card's name as ``step_cost.csv`` spells it (``torch.cuda.get_device_name()`` with ``_`` for spaces)."""
    return name.replace(" ", "_")


def step_cost_pair(card: str, framework: str, setup: str, *, adapter_s: float, calibration_s: float,
                   stock_s: float, every: int, share: float) -> list[dict]:
    """The two ``step_cost.csv`` rows of one set-up: the adapter's own time per step over ``stock_s`` with the law
    calibration's after-update pass spread over the ``every`` batches it serves (``calibration_s``: the pass's time
    / ``every``; set-up ``SETUP/calibrate_every=N,calibrate_share=S``, the defaults) and without it
    (``SETUP/calibrate_every=0``)."""
    calibrated = f"calibrate_every={every},calibrate_share={share:g}"
    return [{"card": card, "framework": framework, "setup": f"{setup}/{calibrated}",
             "adapter_share": (adapter_s + calibration_s) / stock_s},
            {"card": card, "framework": framework, "setup": f"{setup}/calibrate_every=0",
             "adapter_share": adapter_s / stock_s}]


def write_step_cost(path: Path, shares: list[dict]) -> None:
    """Write ``shares`` into ``path`` (columns :data:`STEP_COST_FIELDS`), keeping its rows of other cards,
    frameworks and set-up groups: the rows whose card, framework and set-up group (the set-up up to its first
    ``/``, e.g. ``bf16_fsdp``) are those of a row in ``shares`` are replaced, so that a run of some arms or groups
    keeps the file's rows of the others."""

    def group(r: dict) -> tuple[str, str, str]:
        return r["card"], r["framework"], r["setup"].split("/", 1)[0]

    keep: list[dict] = []
    if path.exists():
        with open(path, newline="") as f:
            new = {group(r) for r in shares}
            keep = [r for r in csv.DictReader(f) if group(r) not in new]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(STEP_COST_FIELDS))
        writer.writeheader()
        writer.writerows(keep + shares)


def print_step_cost(shares: list[dict], path: Path, missing: str) -> None:
    """Print the step-cost rows just written to ``path`` as a table (``missing``: why none were written)."""
    if not shares:
        print(f"step cost: not written ({missing})")
        return
    print(f"step cost ({path}):\n| card | framework | setup | adapter_share |\n|---|---|---|---|")
    for r in shares:
        print(f"| {r['card']} | {r['framework']} | {r['setup']} | {r['adapter_share']:.4f} |")


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def bench_ms(fn: Callable[[], object], rep_ms: int = 200, warmup_ms: int = 50) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench, CUDA events, L2 flushed per call)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def paired_rounds(fns: dict[str, Callable[[], object]], rounds: int = 3, rep_ms: int = 200, warmup_ms: int = 25,
                  after: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Each function's :func:`bench_ms` median once per round, the rounds in alternating order (forward, then
    reversed): the card's clock drifts under long GEMM runs, and the alternation keeps the drift out of the ratios.
    ``after`` (if given) runs after each median.  Returns name -> the rounds' medians (ms)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            times[k].append(bench_ms(fns[k], rep_ms, warmup_ms))
            if after is not None:
                after()
    return times


def round_ratios(times: dict[str, list[float]], base: str) -> str:
    """``name mean (min-max)`` of each function's rounds (:func:`paired_rounds`) over the mean of ``base``'s, for
    every name but ``base``, comma-separated."""
    ref = sum(times[base]) / len(times[base])
    return ", ".join(f"{k} {sum(x) / len(x) / ref:.3f} ({min(x) / ref:.3f}-{max(x) / ref:.3f})"
                     for k, x in times.items() if k != base)  # fmt: skip


def extra_peak_mib(fn: Callable[[], object]) -> tuple[float, object]:
    """Peak device memory allocated by one call of ``fn`` above what was live before it, in MiB."""
    free_memory()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20, out


def fits(bytes_needed: float, margin: float = 0.9) -> bool:
    """Whether ``bytes_needed`` more bytes fit in the free device memory."""
    free, _ = torch.cuda.mem_get_info()
    return bytes_needed < margin * free


def write_csv(rows: list[Row], name: str) -> Path:
    """Append the rows to benchmarks/results/<card>/<name>.csv (header written when the file is new).

    ``BENCH_RESULTS`` overrides the folder (then no card sub-folder is added).
    """
    out_dir = Path(os.environ["BENCH_RESULTS"]) if "BENCH_RESULTS" in os.environ else RESULTS / card_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.csv"
    new = not path.exists()
    with path.open("a", newline="") as fh:
        cols = [k for k in asdict(rows[0]) if k != "extra"] if rows else []
        w = csv.DictWriter(fh, fieldnames=cols)
        if new:
            w.writeheader()
        for r in rows:
            d = asdict(r)
            d.pop("extra")
            w.writerow(d)
    return path


def print_ratios(rows: list[Row], pairs: list[tuple[str, str, object]], title: str) -> None:
    """One line per shape: ``a / b`` time ratios of the named methods (same card, same run), and
    whether each meets its target (a number, a dict by N, or None: no target)."""
    shapes: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        shapes.setdefault((r.card, r.dtype, r.n, r.v, r.h), {})[r.method] = r
    print(f"\n{title}")
    for (card, dtype, n, v, h), m in shapes.items():
        parts = []
        for a, b, target in pairs:
            if a in m and b in m and m[a].ms == m[a].ms and m[b].ms == m[b].ms:
                ratio = m[a].ms / m[b].ms
                target = target.get(n) if isinstance(target, dict) else target
                mark = "" if target is None else (" ok" if ratio <= target else f" MISSES <= {target}")
                parts.append(f"{a} / {b} = {ratio:.3f}{mark}")
        if parts:
            print(f"  [{card}] {dtype} N={n} V={v}" + (f" H={h}" if h else "") + ": " + "; ".join(parts))


def print_table(rows: list[Row], floor_method: str | None = None) -> None:
    """One table per shape: time, rate, extra memory, errors, and the ratio to the floor."""
    shapes: dict[tuple, list[Row]] = {}
    for r in rows:
        shapes.setdefault((r.dtype, r.n, r.v, r.h), []).append(r)
    for (dtype, n, v, h), rs in shapes.items():
        floor = next((r.ms for r in rs if r.method == floor_method), math.nan)
        hdr = f"\n[{rs[0].card}] {rs[0].bench} dtype={dtype} N={n} V={v}" + (f" H={h}" if h else "")
        print(hdr)
        print(f"{'method':34s} {'ms':>9s} {'rate':>12s} {'floor/t':>8s} {'extraMiB':>9s} {'|dlogp|':>9s} {'|dH|':>9s} {'|dE|':>9s}  note")
        for r in rs:
            ratio = floor / r.ms if r.ms == r.ms and floor == floor else math.nan
            print(
                f"{r.method:34s} {r.ms:9.4f} {r.rate:8.3f} {r.rate_unit:3s} {ratio:8.3f} {r.extra_mib:9.1f} "
                f"{r.err_logp:9.2e} {r.err_entropy:9.2e} {r.err_s_expected:9.2e}  {r.note}"
            )
