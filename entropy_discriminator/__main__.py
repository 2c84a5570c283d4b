"""Command line ``entropy-discriminator <command>`` (also ``python -m entropy_discriminator <command>``).

Each command's parser (:class:`CommandParser`) has a ``run(args)`` default that checks what argparse cannot before any
work; usage errors exit with status 2.  ``compare`` and ``demo --paper`` import ``entropy_lab`` (``lab/``) when run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from . import EntropyDiscConfig, __version__
from .demo import runner
from .demo.report import prepare_output_folder
from .demo.runner import PRESETS, DemoOptions, resolve_device
from .run_commands import add_plot, add_suggest_mu


class CommandParser(argparse.ArgumentParser):
    """A command's parser: an unknown argument is reported with this command's usage (not the top-level one); options
    are matched whole, never by prefix (``--max-frac`` is not ``--max-frac-v``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer ``>= low`` (and ``<= high``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def _config_checked(field: str, method: str, parse: Callable[[str], Any] = float,
                    wanted: str = "a number") -> Callable[[str], Any]:
    """argparse type: ``parse(text)`` (else "must be ``wanted``") that :class:`EntropyDiscConfig` accepts as ``field``
    of ``method`` (the core's rule)."""

    def check(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        try:
            EntropyDiscConfig(method=method, **{field: value})
        except ValueError as exc:  # argparse names the option as typed: drop the config field's name
            raise argparse.ArgumentTypeError(str(exc).replace(f"entropy_disc.{field} ", "", 1)) from None
        return value

    return check


#: argparse type: ``hold`` or a target entropy in nats/token that :class:`EntropyDiscConfig` accepts.
_autopilot_target = _config_checked("target_entropy", "autopilot", lambda text: text if text == "hold" else float(text),
                                    "'hold' or a number (nats/token)")


def _folder(text: str) -> Path:
    """argparse type: an output folder; the empty string (which would mean the current folder) is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a folder, got {text!r}")
    return Path(text)


def _prepare_out(parser: argparse.ArgumentParser, out: Path, check_saved: Callable[[Path], None] | None) -> None:
    """``check_saved(out)`` (if given) and :func:`prepare_output_folder`; a usage error naming ``--out`` on failure."""
    try:
        if check_saved is not None:
            check_saved(out)
        prepare_output_folder(out)
    except ValueError as exc:
        parser.error(f"argument --out: {exc}")


def _lab(module: str, parser: argparse.ArgumentParser, what: str) -> ModuleType:
    """``entropy_lab.<module>``; a usage error saying how to install the lab when it is not installed."""
    try:
        return importlib.import_module(f"entropy_lab.{module}")
    except ModuleNotFoundError as exc:
        if exc.name != "entropy_lab":
            raise
        parser.error(f"{what} runs the research harness (package entropy_lab), which is not installed; install it from "
                     "a clone of the repository, after the library: pip install -e ./lab")


def _device(text: str) -> str:
    """argparse type: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` that this machine has."""
    try:
        resolve_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# --- demo -------------------------------------------------------------------------------------------

#: ``demo`` options (argparse dests, besides ``--out`` and ``--paper``; each defaults to None, the flags too) that apply
#: in each mode (plain or ``--quick``, ``--paper``, ``--paper --render-only``); given in another mode they are refused.
DEMO_APPLIES = {
    "demo": {"quick", "device", "seed", "steps", "threads", "mu_b", "mu_v", "max_frac_v", "autopilot"},
    "paper": {"device", "seed", "steps", "seeds", "jobs", "size"},
    "render": {"render_only"},  # it redraws saved results: only --out applies
}
DEMO_WHY_NOT = {"demo": "only applies with --paper", "paper": "does not apply with --paper",
                "render": "does not apply with --render-only (it redraws the saved results)"}
DEMO_DEFAULT_OUT = {"demo": Path("demo_out"), "paper": Path("demo_out/paper"), "render": Path("demo_out/paper")}


def _add_demo(commands: argparse._SubParsersAction) -> None:
    full, quick = PRESETS["full"], PRESETS["quick"]
    demo = commands.add_parser(
        "demo",
        help="GRPO on an embedded addition task: vanilla vs + Clip_B vs + Clip_V (CPU, about a minute on 2 cores)",
        description=(
            "Warm up a small transformer on noisy n-digit addition, then run strict on-policy GRPO in three arms with "
            "the same seed (vanilla, + Clip_B, + Clip_V); print a table (final entropy, reward, Avg@k, Pass@k, clip "
            "fraction, agreement of the Corollary 4 entropy-change prediction with the realised one) and write a CSV "
            "of every step and a PNG plot.  --paper runs the small-scale reproduction of the paper's experiments "
            "(meant for a GPU) and writes figures and a markdown report.  Every option is checked before any work."
        ),
    )
    mode = demo.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", default=None,
                      help="tiny sizes, under a minute on a 2-core CPU (CI)")
    mode.add_argument("--paper", action="store_true", help="the paper-reproduction suite (GPU recommended)")
    demo.add_argument("--device", type=_device, help="cpu, cuda, cuda:N or auto (default: cuda when available)")
    demo.add_argument("--out", type=_folder, help="output folder (default: demo_out, or demo_out/paper)")
    demo.add_argument("--seed", type=_int_in(0, 2**32 - 1), help="random seed shared by every arm, 0 to 2^32-1 (default 0)")
    demo.add_argument("--steps", type=_int_in(3), help=f"GRPO steps per arm, minimum 3 (default {full.grpo_steps}; "
                      f"--quick {quick.grpo_steps}; --paper: its size's)")
    demo.add_argument("--threads", type=_int_in(1), help="torch CPU threads, >= 1 (default 1 on CPU: fastest for tiny models)")
    demo.add_argument("--mu-b", type=_config_checked("mu_low", "clip_b"),
                      help=f"Clip_B lower bound in batch stds (default {DemoOptions.mu_b})")
    demo.add_argument("--mu-v", type=_config_checked("mu_low", "clip_v"),
                      help=f"Clip_V lower bound in batch stds (default {DemoOptions.mu_v})")
    demo.add_argument("--max-frac-v", type=_config_checked("max_frac", "clip_v"),
                      help="cap on Clip_V's clipped share, in [0, 1] (default none; 1e-4 clips nothing in a demo batch "
                           "of under 10,000 tokens)")
    demo.add_argument("--autopilot", type=_autopilot_target, metavar="TARGET",
                      help="add a fourth arm, + Autopilot (docs/autopilot.md): 'hold' keeps the starting entropy, a "
                           "number is a target entropy in nats/token (default: no autopilot arm)")
    demo.add_argument("--seeds", type=_int_in(2), help="--paper: seeds per arm for Table 1, >= 2 (default: its size's)")
    demo.add_argument("--jobs", type=_int_in(1), help="--paper: parallel worker processes, >= 1 (default: its size's)")
    demo.add_argument("--size", choices=("gpu", "cpu-small"), help="--paper: sizes (default gpu; cpu-small for a smoke run)")
    demo.add_argument("--render-only", action="store_true", default=None,
                      help="--paper: redraw figures and report.md from the results saved in --out")
    demo.set_defaults(run=lambda args: _run_demo(args, demo))


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check what argparse cannot (options of another mode, ``--out``), then run the demo or ``--paper``."""
    mode = ("render" if args.render_only else "paper") if args.paper else "demo"
    given = {dest for dest in set().union(*DEMO_APPLIES.values()) if getattr(args, dest) is not None}  # 0 is given
    for dest in sorted(given - DEMO_APPLIES[mode]):
        parser.error(f"argument --{dest.replace('_', '-')}: {DEMO_WHY_NOT[mode]}")
    out = args.out if args.out is not None else DEMO_DEFAULT_OUT[mode]
    cores = os.cpu_count()
    if args.threads is not None and cores is not None and args.threads > cores:
        print(f"warning: --threads {args.threads} is more than this machine's {cores} CPU cores; the demo runs slower "
              f"with more threads than cores (the default, 1, is fastest for its tiny models)", file=sys.stderr)
    paper = _lab("paper", parser, "--paper") if args.paper else None
    _prepare_out(parser, out, paper.check_saved_results if mode == "render" else None)
    options = {dest: getattr(args, dest) for dest in given}
    if paper is not None:
        paper.run_paper(paper.PaperOptions(out=out, **options))
    else:
        runner.run_demo(DemoOptions(out=out, **options))
    return 0


#: ``compare --preset`` choices: the names of ``entropy_lab.compare.PRESETS`` (tests/test_cli.py checks they agree),
#: written here so that ``compare --help`` works without the lab.
COMPARE_PRESETS = ("smoke", "full")


def _add_compare(commands: argparse._SubParsersAction) -> None:
    """``compare``: :mod:`entropy_lab.compare`, imported when it runs (its ``CompareOptions`` checks ``--arms``)."""
    compare = commands.add_parser(
        "compare",
        help="Clip_B / Clip_V vs GRPO, PPO and peer entropy controls on signed-sum Countdown, several paired seeds",
        description=(
            "Warm up one small transformer per seed on signed-sum Countdown, then run every arm from it (GRPO, + Clip_B "
            "at mu 2.5 and a tuned mu, + Clip_V, Clip-Cov, KL-Cov, forking tokens, rewarding the unlikely, entropy bonus; "
            "PPO with GAE: vanilla, + Clip_B, + Clip_V) and write tables (mean and 95% CI over seeds, paired "
            "differences) as markdown and CSV, and plots of Pass@K and entropy."
        ),
    )
    compare.add_argument("--preset", choices=COMPARE_PRESETS, default="smoke",
                         help="smoke (the default): every arm in seconds on a 2-core CPU (CI); full: the comparison of "
                              "docs/reproduction/compare, on CPU cores (162 s with --jobs 16 on 16 cores)")
    compare.add_argument("--out", type=_folder, default=Path("compare_out"), help="output folder (default compare_out)")
    compare.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu: tiny models, many processes)")
    compare.add_argument("--jobs", type=_int_in(1), default=1, help="parallel worker processes, minimum 1 (default 1)")
    compare.add_argument("--seeds", type=_int_in(2), help="seeds per arm, minimum 2 (default: the preset's)")
    compare.add_argument("--steps", type=_int_in(1), help="RL steps per arm, minimum 1 (default: the preset's)")
    compare.add_argument("--arms", help="comma-separated arm names (default: all; paired baselines must be included)")
    compare.add_argument("--render-only", action="store_true", help="rebuild results.json and the report from the runs saved in --out")
    compare.set_defaults(run=lambda args: _run_compare(args, compare))


def _run_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the arms, the device and ``--out`` before any work, then run the comparison."""
    lab = _lab("compare", parser, "compare")
    try:
        options = lab.CompareOptions(
            out=args.out, preset=args.preset, device=args.device, jobs=args.jobs, seeds=args.seeds,
            steps=args.steps, arms=tuple(args.arms.split(",")) if args.arms else None, render_only=args.render_only,
        )
        options.arm_list()
        lab.resolve_device(options.device)
    except (ValueError, RuntimeError) as exc:
        parser.error(str(exc))
    _prepare_out(parser, options.out, lab.check_saved_runs if options.render_only else None)
    lab.run_compare(options)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``entropy-discriminator`` argument parser: ``--version`` and one subparser per command."""
    parser = argparse.ArgumentParser(prog="entropy-discriminator", allow_abbrev=False, description=(
        "Principled entropy control for RL fine-tuning of LLMs (Clip_B / Clip_V and entropy-dynamics metrics)."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for add in (_add_demo, _add_compare, add_suggest_mu, add_plot):
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``entropy-discriminator``; returns the exit status (2: a usage error)."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except SystemExit as exc:  # argparse: --help and --version (0), usage errors (2)
        return exc.code if isinstance(exc.code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
