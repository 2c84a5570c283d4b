"""The launcher: strip ``--entropy_disc.*`` flags, hand everything else to ``openrlhf.cli.train_ppo_ray``.

``python -m entropy_discriminator.adapters.openrlhf [train_ppo_ray flags] [--entropy_disc.* flags]``

The stock CLI rejects unknown flags, so the launcher removes its own (anywhere on the line, as
``--entropy_disc.x v`` or ``--entropy_disc.x=v``), then runs the CLI module as ``__main__`` with
the remaining arguments unchanged. While it runs:

* ``openrlhf.utils.config.hierarchize`` (which the CLI calls right after parsing, before any Ray
  worker exists) is wrapped so that the parsed arguments are checked against the entropy_disc
  settings (:func:`~._checks.check_training_args`); a combination that cannot be served exactly
  stops the launch with a message naming the settings;
* ``ray.init`` is wrapped so that the runtime environment OpenRLHF passes gains
  ``worker_process_setup_hook`` (which patches every Ray worker) and the settings in
  ``env_vars``; OpenRLHF's own ``env_vars`` are kept;
* right after ``ray.init``, before any placement group, the GPUs each model group of the launch asks
  for (:func:`gpu_demands`) are compared with the GPUs Ray sees: a group that asks for more than the
  whole cluster has would wait forever (OpenRLHF's ``--*.num_gpus_per_node`` default to 8). On a
  Ray instance this launch started, the launch stops naming the settings; on a cluster it joined
  (which an autoscaler may grow) it says so on stderr and goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from entropy_discriminator import EntropyDiscConfig
from entropy_discriminator.autopilot import DEFAULT_GAIN, DEFAULT_MAX_STEP, DEFAULT_SMOOTHING
from entropy_discriminator.config import DEFAULT_CALIBRATE_EVERY, DEFAULT_CALIBRATE_SHARE
from entropy_discriminator.config import METHODS
from entropy_discriminator.masks import CAP_RULES, MASK_MODES, SIDES
from entropy_discriminator.stats import IMPLS

from ._checks import UnsupportedConfigurationError, check_training_args
from ._patch import check_openrlhf_version, check_served, runtime_env

PREFIX = "--entropy_disc."
CLI_MODULE = "openrlhf.cli.train_ppo_ray"
_SWITCHES = ("--entropy_disc.no_metrics", "--entropy_disc.realised", "--entropy_disc.help")


def _float_or_inf(text: str) -> float:
    value = float(text)
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}")
    return value


def _max_frac(text: str) -> float | str | None:
    if text in ("auto", "none", "None"):
        return None if text.lower() == "none" else "auto"
    return float(text)


def build_parser() -> argparse.ArgumentParser:
    """The launcher's own flags (all under ``--entropy_disc.``)."""
    p = argparse.ArgumentParser(
        prog="python -m entropy_discriminator.adapters.openrlhf",
        description="OpenRLHF train_ppo_ray with Clip_B / Clip_V and entropy_disc/* metrics. Every flag "
        "not listed here goes to openrlhf.cli.train_ppo_ray unchanged.",
        allow_abbrev=False,
        add_help=False,
    )
    g = p.add_argument_group("entropy_disc")
    g.add_argument("--entropy_disc.help", dest="help", action="store_true", help="show this help and exit")
    g.add_argument("--entropy_disc.method", dest="method", choices=METHODS, default="none",
                   help="none (metrics only, default), clip_b (mask on S*), clip_v (mask on S_c) or autopilot "
                   "(drop the fewest tokens that hold the entropy at a target; docs/autopilot.md)")
    g.add_argument("--entropy_disc.mu_low", dest="mu_low", type=_float_or_inf, default=None,
                   help="lower bound in batch stds (default 2.5 for clip_b and clip_v)")
    g.add_argument("--entropy_disc.mu_high", dest="mu_high", type=_float_or_inf, default=math.inf,
                   help="upper bound in batch stds (default inf: one-sided)")
    g.add_argument("--entropy_disc.sides", dest="sides", choices=SIDES, default="negative",
                   help="advantage sign whose tokens may be clipped (default negative)")
    g.add_argument("--entropy_disc.max_frac", dest="max_frac", type=_max_frac, default="auto",
                   help="cap on the clipped share: auto (none for clip_b/clip_v, 0.05 for autopilot), none, or a number in [0, 1]")
    g.add_argument("--entropy_disc.cap_rule", dest="cap_rule", choices=CAP_RULES, default="share",
                   help="share: at most floor(max_frac * n) tokens (default); reference: at least one token "
                   "when over the bound (Trinity-RFT's max(int(max_frac * n), 1))")
    g.add_argument("--entropy_disc.mask_mode", dest="mask_mode", choices=MASK_MODES, default="zero_pg",
                   help="zero_pg: clipped tokens lose their PPO term, normaliser unchanged (default); "
                   "drop_token: they leave action_mask (normaliser, KL and entropy terms too)")
    g.add_argument("--entropy_disc.chunk_size", dest="chunk_size", type=int, default=None,
                   help="rows per chunk of the statistics pass (default: core's choice)")
    g.add_argument("--entropy_disc.impl", dest="impl", choices=IMPLS, default="auto",
                   help="statistics kernel: auto (Triton on CUDA when available), torch or triton")
    g.add_argument("--entropy_disc.target_entropy", dest="target_entropy", default="hold",
                   help="autopilot: hold (the first batch's entropy, default) or a target in nats/token")
    g.add_argument("--entropy_disc.decay_steps", dest="decay_steps", default=None,
                   help="autopilot: ramp the target from the starting entropy over this many steps")
    g.add_argument("--entropy_disc.gain", dest="gain", default=str(DEFAULT_GAIN),
                   help=f"autopilot: feedback gain in (0, 1] (default {DEFAULT_GAIN})")
    g.add_argument("--entropy_disc.max_step", dest="max_step", default=str(DEFAULT_MAX_STEP),
                   help=f"autopilot: largest desired entropy change per step, nats/token (default {DEFAULT_MAX_STEP})")
    g.add_argument("--entropy_disc.eta", dest="eta", default=None,
                   help="autopilot: step size of the law dH ~ -eta Cov(A, S_c) (default: --actor.adam.lr)")
    g.add_argument("--entropy_disc.form", dest="form", choices=("cov", "mean"), default="cov",
                   help="autopilot: cov (Corollaries 4 / 4.1, default) or mean (eq. 23)")
    g.add_argument("--entropy_disc.smoothing", dest="smoothing", default=str(DEFAULT_SMOOTHING),
                   help=f"autopilot: weight of the new batch's entropy in the smoothed reading, (0, 1] (default {DEFAULT_SMOOTHING})")
    g.add_argument("--entropy_disc.calibrate_every", dest="calibrate_every", default=str(DEFAULT_CALIBRATE_EVERY),
                   help="every this many rounds, one no-grad pass after the update measures the round's realised entropy "
                   f"change and calibrates delta_entropy/predicted in nats; 0: off (default {DEFAULT_CALIBRATE_EVERY})")
    g.add_argument("--entropy_disc.calibrate_share", dest="calibrate_share", default=str(DEFAULT_CALIBRATE_SHARE),
                   help="share of a calibration round's samples that its after-update pass reads, in (0, 1]: on each "
                   "rank ceil(share x its samples), spread evenly over its buffer from the first; 1: all "
                   f"(default {DEFAULT_CALIBRATE_SHARE})")
    g.add_argument("--entropy_disc.no_metrics", dest="log_metrics", action="store_false",
                   help="do not add entropy_disc/* metrics to OpenRLHF's logs")
    g.add_argument("--entropy_disc.realised", dest="realised", action="store_true",
                   help="after each update, a second no-grad pass over the round's samples logs "
                   "entropy_disc/delta_entropy/realised (on a calibration round: the calibration pass, over its "
                   "calibrate_share of them)")
    return p


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(ours, rest)``: the ``--entropy_disc.*`` tokens (with their values) and everything else, in order.

    A flag takes the next token as its value unless it is a switch or written ``--flag=value``.
    """
    ours: list[str] = []
    rest: list[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        token = argv[i]
        if token.startswith(PREFIX):
            ours.append(token)
            if "=" not in token and token not in _SWITCHES:
                if i + 1 >= len(argv):
                    raise SystemExit(f"error: {token} expects a value")
                ours.append(argv[i + 1])
                i += 1
        else:
            rest.append(token)
        i += 1
    return ours, rest


def parse(argv: Sequence[str]) -> tuple[EntropyDiscConfig, bool, list[str]]:
    """``(config, realised, openrlhf_argv)`` from a full command line; bad values exit with a message
    naming the flag (argparse) or the config field (``ValueError``)."""
    ours, rest = split_argv(argv)
    parser = build_parser()
    ns = parser.parse_args(ours)
    if ns.help:
        parser.print_help()
        raise SystemExit(0)
    fields = {k: v for k, v in vars(ns).items() if k not in ("help", "realised")}
    try:
        config = EntropyDiscConfig.from_mapping(fields)  # parses the autopilot's strings, naming the field
        check_served(config)
    except ValueError as exc:
        parser.error(str(exc))
    return config, ns.realised, rest


def gpu_demands(args: Any) -> list[tuple[str, int]]:
    """``(settings, GPUs)`` of each model group ``train_ppo_ray`` will create from ``args`` (OpenRLHF's
    hierarchical arguments, as its ``train`` reads them): the actor always, the reference model when
    ``--algo.kl.init_coef > 0``, the critic when ``--critic.model_name_or_path`` is set, the reward model when
    ``--reward.remote_url`` is not, and the vLLM engines (``num_engines * tensor_parallel_size``).  Each group
    places ``num_nodes * num_gpus_per_node`` actors of one GPU (or bundles of one GPU, when colocated), so no
    group can start on fewer GPUs than that."""

    def group(role: str) -> tuple[str, int]:
        node = getattr(args, role)
        return (f"--{role}.num_nodes {node.num_nodes} x --{role}.num_gpus_per_node {node.num_gpus_per_node}",
                int(node.num_nodes) * int(node.num_gpus_per_node))

    demands = [group("actor")]
    if float(args.algo.kl.init_coef) > 0:
        demands.append(group("ref"))
    if args.critic.model_name_or_path:
        demands.append(group("critic"))
    if not args.reward.remote_url:
        demands.append(group("reward"))
    engines = args.vllm.num_engines or 0
    if engines > 0:
        demands.append((f"--vllm.num_engines {engines} x --vllm.tensor_parallel_size {args.vllm.tensor_parallel_size}",
                        int(engines) * int(args.vllm.tensor_parallel_size)))
    return demands


def check_gpus(args: Any) -> None:
    """After ``ray.init``: each of :func:`gpu_demands` against the GPUs of the Ray cluster.  ``SystemExit``
    naming the settings when this process started the Ray instance (its resources are final); a message on
    stderr when it joined a cluster (an autoscaler may add GPUs)."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0.0)
    short = [f"{setting} asks for {need} GPU(s)" for setting, need in gpu_demands(args) if need > gpus]
    if not short:
        return
    message = (f"{'; '.join(short)}, but Ray sees {gpus:g} GPU(s): that group would wait for them forever. Set "
               "the --*.num_nodes / --*.num_gpus_per_node of each model group to what the machine has")
    node = getattr(ray._private.worker, "_global_node", None)
    if getattr(node, "head", False):  # this process started the Ray instance
        ray.shutdown()
        raise SystemExit(f"error: {message}")
    print(f"entropy-discriminator: warning: {message} (or let the cluster's autoscaler add them)", file=sys.stderr)


@contextlib.contextmanager
def ray_init_with(extra_env: Callable[[dict | None], dict], after: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Within the block, ``ray.init(..., runtime_env=X)`` receives ``extra_env(X)`` instead, and ``after()``
    runs once it returns."""
    import ray

    original = ray.init

    def init(*args, **kwargs):
        kwargs["runtime_env"] = extra_env(kwargs.get("runtime_env"))
        context = original(*args, **kwargs)
        after()
        return context

    ray.init = init
    try:
        yield
    finally:
        ray.init = original


@contextlib.contextmanager
def arguments_checked(config: EntropyDiscConfig) -> Iterator[list[Any]]:
    """Within the block, OpenRLHF's ``hierarchize(args)`` checks the arguments it returns against
    ``config`` and exits (``SystemExit`` with the message) on a combination that is refused.  Yields the
    list into which the checked arguments go (the object ``train_ppo_ray`` goes on to read)."""
    from openrlhf.utils import config as openrlhf_config

    original = openrlhf_config.hierarchize
    seen: list[Any] = []

    def hierarchize(*args, **kwargs):
        parsed = original(*args, **kwargs)
        try:
            check_training_args(parsed, config)
        except UnsupportedConfigurationError as exc:
            raise SystemExit(f"error: {exc}") from None
        seen.append(parsed)
        return parsed

    openrlhf_config.hierarchize = hierarchize
    try:
        yield seen
    finally:
        openrlhf_config.hierarchize = original


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``openrlhf.cli.train_ppo_ray`` with the patch in every Ray worker (see module doc)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config, realised, rest = parse(argv)
    check_openrlhf_version()
    saved_argv = sys.argv
    sys.argv = [CLI_MODULE, *rest]
    try:
        with arguments_checked(config) as seen, ray_init_with(
            lambda env: runtime_env(config, realised=realised, base=env),
            after=lambda: check_gpus(seen[-1]) if seen else None,
        ):
            runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
