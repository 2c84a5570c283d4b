"""``python -m benchmarks fused``: statistics straight from LM-head inputs (hidden [N, H], weight [V, H]).

Methods: what users call, ``ed.token_stats_from_hidden(hidden, weight, labels)`` (validation
included: one host synchronisation), cuBLAS ``hidden @ weight.T`` alone (bf16 logits, the matmul
everyone pays), that matmul followed by the one-pass kernel (logits materialised), the fused Triton
kernel (logits tiles stay on chip) with all four moments and with only the two that logp and H need
(the cost of sum p^2 and E_p[S]), and the library's chunked torch path (fp32 matmul) at small N.
Rate is effective TFLOP/s = 2 N H V / time.  A ratio line (public / kernel, target <= 1.03) closes
the run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .common import Row, bench_ms, card_name, extra_peak_mib, fits, free_memory, print_ratios, print_table, write_csv

# (H, V) of Qwen2.5-3B, Qwen2.5-7B, Llama-3-8B heads.
SHAPES = ((2048, 151936), (3584, 152064), (4096, 128256))
TEMPERATURE = 1.0


def _errors(out, hidden, weight, labels, rows) -> tuple[float, float, float]:
    from reference import reference_token_stats

    logits = hidden[rows].double() @ weight.double().T
    ref = reference_token_stats(logits, labels[rows], TEMPERATURE)
    return tuple(float((out[i][rows].double() - ref[k]).abs().max()) for i, k in enumerate(("logp", "entropy", "s_expected")))


PUBLIC = "token_stats_from_hidden"
KERNEL = "fused_triton"


def methods(n: int, configs: dict[str, dict], kernel_only: bool = False, only: list[str] | None = None) -> dict[str, Callable]:
    from entropy_discriminator.hidden import token_stats_from_hidden
    from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    def matmul_only(h, w, lab):
        return h @ w.T

    def matmul_then_kernel(h, w, lab):
        out = token_stats_triton(h @ w.T, lab, TEMPERATURE, -100)
        return out.logp, out.entropy, out.s_expected

    def fused(cfg):
        def run(h, w, lab):
            out = token_stats_fused_triton(h, w, lab, None, TEMPERATURE, -100, config=cfg)
            return out.logp, out.entropy, out.s_expected

        return run

    def public(h, w, lab):
        s = token_stats_from_hidden(h, w, lab, temperature=TEMPERATURE)
        return s.logp, s.entropy, s.s_expected

    def torch_chunked(h, w, lab):
        s = token_stats_from_hidden(h, w, lab, impl="torch")
        return s.logp, s.entropy, s.s_expected

    out = {"cublas_matmul_only": matmul_only}
    if not kernel_only:
        out[PUBLIC] = public
        out["matmul+triton_kernel"] = matmul_then_kernel
    for name, cfg in configs.items():
        out[name] = fused(cfg)
    if n <= 4096 and not kernel_only:
        out["library_torch_chunked(fp32 mm)"] = torch_chunked
    if only:
        out = {k: f for k, f in out.items() if k in only or k == "cublas_matmul_only" or k.startswith("fused[")}
    return out


def run_shape(
    n: int, h: int, v: int, configs: dict[str, dict], rep_ms: int, kernel_only: bool = False, only: list[str] | None = None
) -> list[Row]:
    card = card_name()
    free_memory()
    gen = torch.Generator(device="cuda").manual_seed(n + h + v)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * (4.0 / h**0.5)).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    rows = torch.linspace(0, n - 1, min(n, 32), device="cuda").long()
    tflop = 2.0 * n * h * v / 1e12
    results = []
    for name, fn in methods(n, configs, kernel_only, only).items():
        if name.startswith("matmul") and not fits(n * v * 2 * 1.2):
            results.append(Row("fused", card, "bf16", n, v, h, name, note="skipped: logits would not fit"))
            continue
        try:
            mib, out = extra_peak_mib(lambda: fn(hidden, weight, labels))
            errs = _errors(out, hidden, weight, labels, rows) if isinstance(out, tuple) else (float("nan"),) * 3
            del out
            ms = bench_ms(lambda: fn(hidden, weight, labels), rep_ms)
            results.append(Row("fused", card, "bf16", n, v, h, name, ms, tflop / (ms / 1e3), "TF/s", mib, *errs))
        except torch.OutOfMemoryError:
            results.append(Row("fused", card, "bf16", n, v, h, name, note="out of memory"))
        free_memory()
    return results


def main(args) -> list[Row]:
    from entropy_discriminator.kernels.triton_fused import DEFAULT_CONFIG

    # the kernel's own choice (triton_fused.DEFAULT_CONFIG, the plan of triton_fused.stream_plan), and the same
    # with two moments
    configs: dict[str, dict] = {KERNEL: {}, "fused_triton(logp+H only)": {"moments": 2}}
    for spec in args.kernel_config or []:  # e.g. bm=128,bn=128,bk=64,num_warps=8,stages=4
        cfg = {k: int(val) for k, val in (kv.split("=") for kv in spec.split(","))}
        configs[f"fused[{spec}]"] = {**DEFAULT_CONFIG, **cfg}
    rows: list[Row] = []
    for n in args.n:
        for h, v in SHAPES:
            if args.h and h not in args.h:
                continue
            rs = run_shape(n, h, v, configs, args.rep_ms, args.kernel_only, args.methods)
            print_table(rs, floor_method="cublas_matmul_only")
            write_csv(rs, args.csv or "fused")
            rows += rs
    return rows


def summary(rows: list[Row]) -> None:
    print_ratios(
        rows,
        [(PUBLIC, KERNEL, 1.03), (KERNEL, "cublas_matmul_only", None)],
        "ratios (same card, same run; target: token_stats_from_hidden / fused kernel <= 1.03)",
    )
    by_shape: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_shape.setdefault((r.card, r.n, r.h, r.v), {})[r.method] = r
    print("\nsummary (same card, same run): fused kernel TFLOP/s and the cost of the sum p^2 / E_p[S] moments")
    for (card, n, h, v), m in by_shape.items():
        f, f2, mm = m.get(KERNEL), m.get("fused_triton(logp+H only)"), m.get("cublas_matmul_only")
        if not f:
            continue
        line = f"  [{card}] N={n} H={h} V={v}: fused {f.ms:.2f} ms = {f.rate:.0f} TFLOP/s"
        if f2:
            line += f"; logp+H only {f2.ms:.2f} ms (moments add {f.ms / f2.ms - 1:+.1%})"
        if mm:
            line += f"; cuBLAS matmul alone {mm.rate:.0f} TFLOP/s"
        line += f"; err logp {f.err_logp:.1e} H {f.err_entropy:.1e} E {f.err_s_expected:.1e}; extra {f.extra_mib:.0f} MiB"
        print(line)
