"""Benchmarks of the per-token statistics (CUDA).

    python -m benchmarks stats   # ed.token_stats and its kernel vs torch.sum / eager / torch.compile / framework style
    python -m benchmarks fused   # ed.token_stats_from_hidden and its kernel vs cuBLAS matmul (+ kernel), TFLOP/s
    python -m benchmarks masks   # clip_b_mask / clip_v_mask / EntropyMonitor.from_stats at 16k-1M tokens
    python -m benchmarks fused-vs-cublas --out benchmarks/results/fused_vs_cublas.csv
                                 # the public fused call vs cuBLAS matmul alone and the unfused pair, Qwen2.5 heads
    python -m benchmarks fused-vs-cublas --sweep --out DIR
                                 # every fused-kernel variant on the same shapes; DIR/sweep.csv, DIR/best.csv
    python -m benchmarks trl-step --step-cost benchmarks/results/step_cost.csv
                                 # the TRL adapter's share of a real GRPO step (TRL 1.16, Qwen2.5-0.5B shapes)

Tables are printed per shape, then the ratios of the public call to the floor and to its kernel,
and appended to benchmarks/results/<card>/<name>.csv (card: h100, h200, ...; BENCH_RESULTS
overrides the folder); every row names the card it ran on.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="bench", required=True)
    s = sub.add_parser("stats", allow_abbrev=False, help="one-pass kernel over materialised logits")
    s.add_argument("--n", type=int, nargs="+", default=[256, 4096, 16384, 65536])
    s.add_argument("--v", type=int, nargs="+", default=[128256, 151936, 152064, 256000])
    s.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"])
    s.add_argument("--compile-shapes", nargs="*", default=["16384x151936", "256x151936"], help="NxV shapes that also time torch.compile (each compiles anew)")
    f = sub.add_parser("fused", allow_abbrev=False, help="fused LM-head kernel from hidden states")
    f.add_argument("--n", type=int, nargs="+", default=[16384])
    f.add_argument("--h", type=int, nargs="*", default=[], help="restrict to these hidden sizes (2048, 3584, 4096)")
    from . import fused_vs_cublas

    fused_vs_cublas.add_command(sub)
    t = sub.add_parser("trl-step", add_help=False, allow_abbrev=False, help="the TRL adapter's cost in real GRPO steps (benchmarks/trl_step.py)")
    t.add_argument("args", nargs=argparse.REMAINDER, help="arguments of benchmarks/trl_step.py (--help there)")
    m = sub.add_parser("masks", allow_abbrev=False, help="the public mask and monitor calls")
    m.add_argument("--n", type=int, nargs="+", default=[16384, 262144, 1048576], help="tokens per batch (multiples of 1024)")
    m.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition budget per measurement")
    for q in (s, f):
        q.add_argument("--kernel-config", action="append", help="extra kernel config to time, k=v,k=v (repeatable)")
        q.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition budget per measurement")
        q.add_argument("--kernel-only", action="store_true", help="time only the kernels and the floor (config sweeps)")
        q.add_argument("--csv", default=None, help="CSV name under benchmarks/results/<card>/ (default: the bench name)")
        q.add_argument("--methods", nargs="+", default=None, help="time only these methods (and the floor, and --kernel-config ones)")
        q.add_argument(
            "--sms", type=int, default=None,
            help="run on this many of the card's multiprocessors (a CUDA green context): more bandwidth per SM, "
            "e.g. an H100 on 88-96 SMs as a proxy for an H200; rows name the restriction",
        )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trl-step"]:  # its own arguments (it also runs on the CPU: --tiny --device cpu)
        from . import trl_step

        trl_step.main(argv[1:])
        return 0
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA device (run them through the device tool)", file=sys.stderr)
        return 2
    if args.bench == "fused-vs-cublas":
        from . import fused_vs_cublas

        return fused_vs_cublas.main(args)
    if args.bench == "masks":
        from . import masks_bench

        return masks_bench.summary(masks_bench.main(args))
    if args.bench == "stats":
        from . import stats_bench as mod
    else:
        from . import fused_bench as mod
    from .common import fewer_sms

    with fewer_sms(args.sms):
        rows = mod.main(args)
        mod.summary(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
