"""``python -m benchmarks stats``: the public call and its kernel against the read floor and the
ways people compute the statistics today.

For each shape (bf16/fp16/fp32 logits [N, V], fresh random data, every label valid) it times what users
call, ``ed.token_stats(logits, labels)`` (validation included: one host synchronisation per call),
``ed.token_stats(..., check="deferred")`` (the same validation without the wait: its faults are raised by a later
call or ``ed.raise_deferred()``, called after each timing) and ``ed.token_stats(..., check=False)`` (none), the internal kernel ``token_stats_triton`` alone,
``torch.sum`` over the same tensor (the measured read floor), ``torch.sum`` followed by a stream
synchronisation (the floor of any call that waits for its result, as the checked call does; not
with ``--kernel-only``), and unless ``--methods`` narrows
the list: naive eager, token-chunked eager, torch.compile of the naive math, the framework-style
chunked path and the library's chunked torch path.  Rate is the effective bandwidth
N*V*bytes / time.  Errors are max |.| over 64 spread rows against the float64 reference of
tests/reference.py.  The note column gives the host time per call (200 back-to-back calls).
A ratio table (public / torch.sum, public / kernel) closes the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import baselines
from .common import (
    Row,
    bench_ms,
    card_name,
    extra_peak_mib,
    fits,
    free_memory,
    host_us,
    print_ratios,
    print_table,
    synced,
    write_csv,
)

N_ALL = (256, 4096, 16384, 65536)
V_ALL = (128256, 151936, 152064, 256000)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TEMPERATURE = 1.0
# Methods whose memory grows with N x V in fp32 are skipped when they would not fit.
_FP32_COPIES = {"naive_eager": 5.0, "torch_compile": 1.5}


def _errors(method_out, logits, labels, rows) -> tuple[float, float, float]:
    from reference import reference_token_stats

    ref = reference_token_stats(logits[rows], labels[rows], TEMPERATURE)
    logp, ent, s_exp = (t[rows].double() for t in method_out)
    return tuple(float((a - ref[k]).abs().max()) for a, k in ((logp, "logp"), (ent, "entropy"), (s_exp, "s_expected")))


PUBLIC = "token_stats"
PUBLIC_NOCHECK = "token_stats(check=False)"
PUBLIC_DEFERRED = 'token_stats(check="deferred")'
KERNEL = "triton_kernel"
FLOOR = "torch.sum (floor)"
# torch.sum followed by a stream synchronisation: the floor of any call that waits for its result on
# the host (as the checked public call does), timed in every run so that a host slower than usual shows.
FLOOR_SYNC = "torch.sum+sync"
# The targets for the public call: time / torch.sum by N (V = 151936, bf16).
TARGETS = {16384: 1.05, 256: 1.3}
# ... and for a checked call that does not wait (check="deferred") at N = 2048.
TARGETS_DEFERRED = {2048: 1.1}


def _kernel(config: dict | None) -> Callable:
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    def run(logits, labels, temperature):
        out = token_stats_triton(logits, labels, temperature, -100, config=config)
        return out.logp, out.entropy, out.s_expected

    return run


def _public(check: bool | str) -> Callable:
    import entropy_discriminator as ed

    def run(logits, labels, temperature):
        s = ed.token_stats(logits, labels, temperature=temperature, check=check)
        return s.logp, s.entropy, s.s_expected

    return run


def _library_torch(logits, labels, temperature):
    import entropy_discriminator as ed

    s = ed.token_stats(logits, labels, temperature=temperature, impl="torch")
    return s.logp, s.entropy, s.s_expected


def methods(kernel_configs: dict[str, dict | None], compile_ok: bool, kernel_only: bool, only: list[str] | None = None) -> dict:
    out: dict[str, Callable] = {}
    if not kernel_only:
        out[PUBLIC] = _public(True)
        out[PUBLIC_DEFERRED] = _public("deferred")
        out[PUBLIC_NOCHECK] = _public(False)
        out["naive_eager"] = baselines.naive_eager
        out["token_chunked_eager"] = baselines.token_chunked_eager
        out["framework_chunked"] = baselines.framework_style
        out["library_torch_chunked"] = _library_torch
    if compile_ok and not kernel_only:
        out["torch_compile"] = torch.compile(baselines.naive_eager, dynamic=False)
    for name, cfg in kernel_configs.items():
        out[name] = _kernel(cfg)
    if only:
        out = {k: f for k, f in out.items() if k in only or k.startswith("triton[")}
    return out


def run_shape(
    n: int, v: int, dtype_name: str, kernel_configs: dict, compile_ok: bool, rep_ms: int, kernel_only: bool = False,
    only: list[str] | None = None,
) -> list[Row]:
    try:
        return _run_shape(n, v, dtype_name, kernel_configs, compile_ok, rep_ms, kernel_only, only)
    except torch.OutOfMemoryError:
        free_memory()
        return [Row("stats", card_name(), dtype_name, n, v, 0, "all", note="out of memory preparing the input")]


def _run_shape(
    n: int, v: int, dtype_name: str, kernel_configs: dict, compile_ok: bool, rep_ms: int, kernel_only: bool,
    only: list[str] | None,
) -> list[Row]:
    dtype = DTYPES[dtype_name]
    card = card_name()
    elem = torch.finfo(dtype).bits // 8
    if not fits(n * v * elem * 1.05):
        return [Row("stats", card, dtype_name, n, v, 0, "all", note="input does not fit")]
    free_memory()
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + v)
    logits = torch.empty(n, v, device="cuda", dtype=dtype)
    for i in range(0, n, 2048):  # fill in slices: no full-size fp32 temporary
        logits[i : i + 2048] = torch.randn(min(2048, n - i), v, device="cuda", generator=gen).mul_(3)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    rows = torch.linspace(0, n - 1, min(n, 64), device="cuda").long()
    gbytes = n * v * elem / 1e9
    results = []
    floor_ms = bench_ms(lambda: torch.sum(logits), rep_ms)
    results.append(Row("stats", card, dtype_name, n, v, 0, FLOOR, floor_ms, gbytes / floor_ms, "TB/s"))
    if not kernel_only:
        sync_ms = bench_ms(synced(lambda: torch.sum(logits)), rep_ms)
        results.append(Row("stats", card, dtype_name, n, v, 0, FLOOR_SYNC, sync_ms, gbytes / sync_ms, "TB/s"))
    for name, fn in methods(kernel_configs, compile_ok, kernel_only, only).items():
        copies = _FP32_COPIES.get(name, 0.0)
        if copies and not fits(copies * n * v * 4):
            results.append(Row("stats", card, dtype_name, n, v, 0, name, note="skipped: would not fit in memory"))
            continue
        try:
            mib, out = extra_peak_mib(lambda: fn(logits, labels, TEMPERATURE))
            errs = _errors(out, logits, labels, rows)
            del out
            ms = bench_ms(lambda: fn(logits, labels, TEMPERATURE), rep_ms)
            note = ""
            if name in (PUBLIC, PUBLIC_DEFERRED, PUBLIC_NOCHECK, KERNEL):
                note = f"host {host_us(lambda: fn(logits, labels, TEMPERATURE)):.1f} us/call"
            if name == PUBLIC_DEFERRED:
                import entropy_discriminator as ed

                ed.raise_deferred()  # every deferred check of the timing read back (the inputs hold no fault)
            results.append(Row("stats", card, dtype_name, n, v, 0, name, ms, gbytes / ms, "TB/s", mib, *errs, note=note))
        except torch.OutOfMemoryError:
            results.append(Row("stats", card, dtype_name, n, v, 0, name, note="out of memory"))
        free_memory()
    del logits
    free_memory()
    return results


def main(args) -> list[Row]:
    from entropy_discriminator.kernels import triton_stats

    configs: dict[str, dict | None] = {KERNEL: None}
    for spec in args.kernel_config or []:  # e.g. block=4096,num_warps=8,stages=2,split=1
        cfg = dict(kv.split("=") for kv in spec.split(","))
        cfg = {k: int(val) for k, val in cfg.items()}
        configs[f"triton[{spec}]"] = cfg
    rows: list[Row] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for dtype_name in args.dtypes:
        for n in args.n:
            for v in args.v:
                base = triton_stats.choose_config(n, v, DTYPES[dtype_name], sms)
                shape_cfgs = {k: ({**base, **c} if c else None) for k, c in configs.items()}
                compile_ok = (n, v) in {tuple(map(int, s.split("x"))) for s in args.compile_shapes}
                rs = run_shape(n, v, dtype_name, shape_cfgs, compile_ok, args.rep_ms, args.kernel_only, args.methods)
                print_table(rs, floor_method=FLOOR)
                write_csv(rs, args.csv or "stats")
                rows += rs
    return rows


def summary(rows: list[Row]) -> None:
    """The issue's ratios per shape (public call / torch.sum against its target, public / kernel),
    then kernel time, fraction of torch.sum bandwidth and speedups over the baselines."""
    print_ratios(
        rows,
        [(PUBLIC, FLOOR, TARGETS), (PUBLIC_DEFERRED, FLOOR, TARGETS_DEFERRED), (PUBLIC_NOCHECK, FLOOR, None), (KERNEL, FLOOR, None), (PUBLIC, KERNEL, None),
         (FLOOR_SYNC, FLOOR, None)],  # fmt: skip
        "ratios (same card, same run; targets for bf16, V=151936: public / torch.sum <= 1.05 at N=16384, <= 1.3 at N=256;"
        " deferred check / torch.sum <= 1.1 at N=2048)",
    )
    by_shape: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_shape.setdefault((r.card, r.dtype, r.n, r.v), {})[r.method] = r
    print("\nsummary (same card, same run): kernel time, fraction of torch.sum bandwidth, speedups")
    for (card, dt, n, v), m in by_shape.items():
        k = m.get(KERNEL)
        if not k or math.isnan(k.ms):
            continue
        f = m.get(FLOOR)
        parts = [f"[{card}] {dt} N={n} V={v}: {k.ms * 1e3:.1f} us"]
        if f:
            parts.append(f"{f.ms / k.ms:.1%} of torch.sum bw")
        for b in ("naive_eager", "torch_compile", "framework_chunked"):
            if b in m and not math.isnan(m[b].ms):
                parts.append(f"{m[b].ms / k.ms:.1f}x vs {b}")
        parts.append(f"extra {k.extra_mib:.2f} MiB (budget {(64 * n) / 2**20 + 1:.2f})")
        parts.append(f"err logp {k.err_logp:.1e} H {k.err_entropy:.1e} E {k.err_s_expected:.1e}")
        print("  " + "; ".join(parts))
