"""The commands that read what a run logged: ``suggest-mu`` (docs/choosing-mu.md) and ``plot``.

Each ``add_<name>(commands)`` adds its parser to ``entropy-discriminator``'s subparsers; bad input (a missing file,
not a batch or a metrics log, a target share out of range) is a usage error before any work.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .plot import format_summary, plot_run, summarise_run
from .recipe import METHODS, load_batch, mu_for_share
from .runlog import read_run, series

#: The target share ``suggest-mu`` aims at unless told (docs/choosing-mu.md: where the masks acted in our runs).
DEFAULT_TARGET_SHARE = 0.02


def _share(text: str) -> float:
    """argparse type: a share in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}")
    return value


def _existing_file(text: str) -> Path:
    """argparse type: a file that exists."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return path


def add_suggest_mu(commands: argparse._SubParsersAction) -> None:
    """``suggest-mu``: the mu that clips a target share of a saved batch, or how much a run's mu clipped."""
    parser = commands.add_parser(
        "suggest-mu", allow_abbrev=False,
        help="the Clip_B / Clip_V mu that clips a target share of a saved batch's tokens (docs/choosing-mu.md)",
        description=(
            "With --batch (a file written by entropy_discriminator.recipe.save_batch, e.g. examples/custom_loop.py "
            "--save-batch): the mu_low with which clip_b_mask / clip_v_mask clip the share of the batch's valid tokens "
            "nearest --target-share, checked with the mask functions themselves.  With --run (a TRL trainer_state.json, "
            "verl's file or console log, or JSON lines of metrics): the clipped share the run's mu gave, step by step, "
            "and whether to lower or raise mu to reach --target-share."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--batch", type=_existing_file, help="a batch saved by save_batch (torch file)")
    source.add_argument("--run", dest="run_log", metavar="LOG", type=_existing_file, help="a run's metrics log")
    parser.add_argument("--target-share", type=_share, default=DEFAULT_TARGET_SHARE,
                        help=f"wanted share of clipped tokens among the valid ones, in (0, 1) (default {DEFAULT_TARGET_SHARE})")
    parser.add_argument("--method", choices=("clip_b", "clip_v", "both"), default="both",
                        help="the mask to choose mu for (default both)")
    parser.add_argument("--sides", choices=("negative", "positive", "both"), default="negative",
                        help="advantage sign whose tokens may be clipped, as the masks' sides (default negative)")
    parser.set_defaults(run=lambda args: _run_suggest_mu(args, parser))


def _run_suggest_mu(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.run_log is not None:
        return _suggest_from_run(args, parser)
    try:
        batch = load_batch(args.batch)
    except Exception as exc:  # torch.load raises many types on a file that is not a torch file
        parser.error(f"argument --batch: {exc}")
    methods = list(METHODS) if args.method == "both" else [args.method]
    print(f"batch {args.batch}: target share {args.target_share:g}, sides {args.sides}")
    for method in methods:
        try:
            found = mu_for_share(batch[METHODS[method]], batch["advantages"], batch["valid"],
                                 target_share=args.target_share, method=method, sides=args.sides)
        except ValueError as exc:
            parser.error(f"{method}: {exc}")
        print(f"{method}: mu_low {found.mu:g} clips {found.n_clipped} of {found.n_valid} valid tokens "
              f"(share {found.share:.4f}; mu 0 would clip {found.max_share:.4f})")
    return 0


def _suggest_from_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        rows = read_run(args.run_log)
    except ValueError as exc:
        parser.error(f"argument --run: {exc}")
    _, frac = series(rows, "clip/frac")
    if not frac:
        parser.error(f"argument --run: {args.run_log} logs no entropy_disc/clip/frac (the run used no mask)")
    summary = summarise_run(rows)
    median = summary["clip_frac_median"]
    print(f"run {args.run_log}: {len(frac)} steps; clipped share mean {summary['clip_frac_mean']:.4f}, median {median:.4f}, "
          f"{summary['steps_clipping_none']:.0f} step(s) clipped none")
    low, high = args.target_share / 2, args.target_share * 2
    verdict = ("lower mu: the run clipped less than half the target share" if median < low else
               "raise mu: the run clipped more than twice the target share" if median > high else
               "keep mu: the run's median share is within a factor 2 of the target")
    print(f"target share {args.target_share:g}: {verdict}.  For the exact mu, save one batch and run "
          f"suggest-mu --batch (docs/choosing-mu.md)")
    return 0


def add_plot(commands: argparse._SubParsersAction) -> None:
    """``plot``: a run's logged entropy, clipped share and predicted vs realised entropy change."""
    parser = commands.add_parser(
        "plot", allow_abbrev=False,
        help="plot a run's logged entropy_disc/* metrics (TRL trainer_state.json, verl log, JSON lines)",
        description=(
            "Read a run's entropy_disc/* metrics (a TRL trainer_state.json or --summary_json, verl's file logger "
            "JSON lines or console log, or JSON lines of metrics such as examples/custom_loop.py --log-jsonl), print "
            "a summary and write a PNG: token entropy, clipped share, and predicted vs realised entropy change when "
            "both are logged."
        ),
    )
    parser.add_argument("log", type=_existing_file, help="the run's metrics log")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: <log>.png beside the log)")
    parser.set_defaults(run=lambda args: _run_plot(args, parser))


def _run_plot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        rows = read_run(args.log)
    except ValueError as exc:
        parser.error(f"argument log: {exc}")
    out = args.out if args.out is not None else args.log.with_suffix(".png")
    if not out.parent.is_dir():
        parser.error(f"argument --out: no folder {str(out.parent)!r}")
    print(format_summary(summarise_run(rows)))
    try:
        print(f"wrote {plot_run(rows, out, title=args.log.name)}")
    except ImportError as exc:
        print(f"no figure written: {exc}")
    return 0
