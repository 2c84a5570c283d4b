"""Command line: ``entropy-discriminator demo [--quick | --paper] [--device cpu|cuda|auto] [--out DIR] ...``.

Also ``python -m entropy_discriminator demo``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _positive_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``entropy-discriminator`` argument parser (subcommand ``demo``)."""
    parser = argparse.ArgumentParser(
        prog="entropy-discriminator",
        description="Principled entropy control for RL fine-tuning of LLMs (Clip_B / Clip_V and entropy-dynamics metrics).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="GRPO on an embedded addition task: vanilla vs + Clip_B vs + Clip_V (CPU, a few minutes)",
        description=(
            "Warm up a small transformer on noisy n-digit addition, then run strict on-policy GRPO in three arms with "
            "the same seed (vanilla, + Clip_B, + Clip_V); print a table (final entropy, reward, Avg@k, Pass@k, clip "
            "fraction, agreement of the Corollary 4 entropy-change prediction with the realised one) and write a CSV "
            "of every step and a PNG plot.  --paper runs the small-scale reproduction of the paper's experiments "
            "(meant for a GPU) and writes figures and a markdown report."
        ),
    )
    mode = demo.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny sizes, under a minute on a 2-core CPU (CI)")
    mode.add_argument("--paper", action="store_true", help="the paper-reproduction suite (GPU recommended)")
    demo.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when available)")
    demo.add_argument("--out", type=Path, default=None, help="output folder (default: demo_out, or demo_out/paper)")
    demo.add_argument("--seed", type=int, default=0, help="random seed shared by every arm (default 0)")
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps per arm (default: the preset's)")
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest for tiny models)")
    demo.add_argument("--mu-b", type=_positive_float, default=2.5, help="Clip_B lower bound in batch stds (default 2.5)")
    demo.add_argument("--mu-v", type=_positive_float, default=2.5, help="Clip_V lower bound in batch stds (default 2.5)")
    demo.add_argument(
        "--max-frac-v", type=_positive_float, default=None,
        help="cap on Clip_V's clipped share (default none; the reference's 1e-4 clips at most one token per demo batch)",
    )
    demo.add_argument("--seeds", type=int, default=None, help="--paper: seeds per arm for Table 1 (default: preset)")
    demo.add_argument("--jobs", type=int, default=None, help="--paper: parallel worker processes (default: preset)")
    demo.add_argument("--size", choices=("gpu", "cpu-small"), default="gpu", help="--paper: sizes (cpu-small for a smoke run)")
    demo.add_argument(
        "--render-only", action="store_true", help="--paper: redraw figures and report.md from the results saved in --out"
    )
    _add_compare_parser(sub)
    return parser


def _add_compare_parser(sub: argparse._SubParsersAction) -> None:
    """``compare``: Clip_B / Clip_V against the peer entropy controls on signed-sum Countdown (issue 12)."""
    cmp = sub.add_parser(
        "compare",
        help="Clip_B / Clip_V vs GRPO, PPO and peer entropy controls on signed-sum Countdown, several paired seeds",
        description=(
            "Warm up one small transformer per seed on signed-sum Countdown, then run every arm from it (GRPO, + Clip_B "
            "at mu 2.5 and a tuned mu, + Clip_V, Clip-Cov, KL-Cov, forking tokens, rewarding the unlikely, entropy bonus; "
            "PPO with GAE: vanilla, + Clip_B, + Clip_V) and write tables (mean and 95%% CI over seeds, paired "
            "differences) as markdown and CSV, and plots of Pass@K and entropy."
        ),
    )
    cmp.add_argument("--preset", choices=("smoke", "gpu"), default="smoke",
                     help="smoke: seconds on a 2-core CPU (CI); gpu: the full comparison on a 16-core GPU machine")
    cmp.add_argument("--out", type=Path, default=Path("compare_out"), help="output folder (default compare_out)")
    cmp.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu: tiny models, many processes)")
    cmp.add_argument("--jobs", type=int, default=1, help="parallel worker processes (default 1)")
    cmp.add_argument("--seeds", type=int, default=None, help="seeds per arm, >= 2 (default: the preset's)")
    cmp.add_argument("--steps", type=int, default=None, help="RL steps per arm (default: the preset's)")
    cmp.add_argument("--arms", default=None, help="comma-separated arm names (default: all; baselines must be included)")
    cmp.add_argument("--render-only", action="store_true", help="rebuild results.json and the report from the runs saved in --out")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``entropy-discriminator``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        try:
            if args.paper:
                from .demo.paper import PaperOptions, run_paper

                run_paper(
                    PaperOptions(
                        out=args.out or Path("demo_out/paper"), device=args.device, seed=args.seed, size=args.size,
                        seeds=args.seeds, jobs=args.jobs, steps=args.steps, render_only=args.render_only,
                    )
                )
            else:
                from .demo.runner import DemoOptions, run_demo

                run_demo(
                    DemoOptions(
                        out=args.out or Path("demo_out"), quick=args.quick, device=args.device, seed=args.seed,
                        steps=args.steps, threads=args.threads, mu_b=args.mu_b, mu_v=args.mu_v,
                        max_frac_v=args.max_frac_v,
                    )
                )
        except ValueError as exc:
            print(f"entropy-discriminator demo: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "compare":
        from .demo.compare import CompareOptions, run_compare

        try:
            run_compare(
                CompareOptions(
                    out=args.out, preset=args.preset, device=args.device, jobs=args.jobs, seeds=args.seeds,
                    steps=args.steps, arms=tuple(args.arms.split(",")) if args.arms else None,
                    render_only=args.render_only,
                )
            )
        except ValueError as exc:
            print(f"entropy-discriminator compare: error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
