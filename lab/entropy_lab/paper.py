"""``entropy-discriminator demo --paper``: the paper's entropy-dynamics experiments at small scale.

Runs (one warm-up shared by all, then strict on-policy GRPO; worker processes share the GPU):

* Table 1: GRPO, + Clip_B, + Clip_V, ``seeds`` seeds each (with the linearised network prediction);
* Figure 1: the eight S*-sign arms (update only / mask only tokens with S* > 0 or S* < 0, in positive
  or in negative samples), seed 0;
* Figure 2: Clip_B and Clip_V at several mu, seed 0;
* Figures 3 and 5 and the network half of the reviewers' question come from the Table 1 runs' per-step
  records; the tabular half is :func:`~entropy_discriminator.demo.theory.tabular_check` at several step sizes.

Writes ``paper_steps.csv`` (every step of every run) and ``paper_results.json``, then renders the figures
and ``report.md`` (:func:`render_paper`; needs matplotlib for the figures, and can be rerun on the saved
results with ``--render-only``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from entropy_discriminator import TokenStats
from entropy_discriminator.demo.model import TinyGPT
from entropy_discriminator.demo.report import TextProgress, prepare_output_folder, write_csv
from entropy_discriminator.demo.runner import WARMUP_TARGET, resolve_device, torch_threads
from entropy_discriminator.demo.theory import tabular_check, tabular_start
from entropy_discriminator.demo.train import ArmResult, ArmSpec, TrainConfig, evaluate, run_arm, warm_up

from .records import has_records

SIZES: dict[str, dict[str, object]] = {
    "gpu": {
        "cfg": TrainConfig(
            n_digits=4, d_model=128, n_layers=3, n_heads=4, warmup_steps=1500, warmup_batch=256, warmup_lr=1e-3,
            grpo_steps=300, prompts_per_step=64, group_size=8, lr=1e-4, eval_prompts=500, eval_k=16,
        ),
        "seeds": 5, "jobs": 8, "mus": (1.0, 1.5, 2.0, 3.0),
    },
    "cpu-small": {
        "cfg": TrainConfig(
            n_digits=3, d_model=48, n_layers=2, n_heads=4, warmup_steps=600, warmup_batch=64, warmup_lr=3e-3,
            grpo_steps=30, prompts_per_step=8, group_size=8, lr=1e-3, eval_prompts=64, eval_k=4,
        ),
        "seeds": 2, "jobs": 1, "mus": (1.0, 2.0),
    },
}
MU_TABLE = 2.5  # Clip_B's reference mu; used for both methods in Table 1 (see the report for Clip_V's 8.5)
TABULAR_STEPS = (0.01, 0.05, 0.2, 1.0)


@dataclass(frozen=True)
class PaperOptions:
    """What ``demo --paper`` runs: output folder, device, first seed, size preset and overrides."""

    out: Path = Path("demo_out/paper")
    device: str = "auto"
    seed: int = 0
    size: str = "gpu"
    seeds: int | None = None
    jobs: int | None = None
    steps: int | None = None
    render_only: bool = False


@dataclass(frozen=True)
class SignArm(ArmSpec):
    """A Figure 1 arm of :func:`~entropy_discriminator.demo.train.run_arm`: vanilla GRPO whose keep-mask (``action``
    ``only``) keeps just, or (``mask``) drops just, the tokens of ``sample_sign`` samples (``pos``: A > 0, ``neg``:
    A < 0) whose ``S*`` has sign ``s_sign``."""

    action: str = "only"
    sample_sign: str = "pos"
    s_sign: str = "pos"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.action not in ("only", "mask"):
            raise ValueError(f"action must be one of ('only', 'mask'), got {self.action!r}")
        for label in ("sample_sign", "s_sign"):
            if getattr(self, label) not in ("pos", "neg"):
                raise ValueError(f"{label} must be 'pos' or 'neg', got {getattr(self, label)!r}")

    def keep(self, stats: TokenStats, adv: torch.Tensor) -> torch.Tensor:
        """Keep-mask [B, T] bool from ``stats.s_star`` [B, T] and per-sequence ``adv`` [B]."""
        a, s_star = adv[:, None], stats.s_star
        in_samples = (a > 0) if self.sample_sign == "pos" else (a < 0)
        selected = in_samples & ((s_star > 0) if self.s_sign == "pos" else (s_star < 0))
        return selected if self.action == "only" else ~selected


def sign_arms() -> list[SignArm]:
    """Figure 1's eight arms, named ``{only|mask} S*{>0|<0} in {pos|neg}``."""
    return [
        SignArm(f"{action} S*{'>0' if s == 'pos' else '<0'} in {side}", action=action, sample_sign=side, s_sign=s)
        for action in ("only", "mask")
        for side in ("pos", "neg")
        for s in ("pos", "neg")
    ]


def _job(payload: tuple[str, dict[str, torch.Tensor], TrainConfig, ArmSpec, int, str]) -> tuple[str, ArmResult]:
    group, state, cfg, arm, seed, device = payload
    with torch_threads(1):
        return group, run_arm(state, cfg, arm, seed=seed, device=torch.device(device))


def check_saved_results(out: Path) -> None:
    """Raise ``ValueError`` unless ``out`` holds the ``paper_results.json`` and ``paper_steps.csv`` of a run (each plain
    or compressed, :mod:`.records`)."""
    if not has_records(out / "paper_results.json") or not has_records(out / "paper_steps.csv"):
        raise ValueError(f"{out} holds no paper_results.json and paper_steps.csv to render (run --paper first)")


def run_paper(opts: PaperOptions) -> Path:
    """Run the suite (unless ``render_only``) and render; returns the report's path."""
    out = Path(opts.out)
    if opts.render_only:
        check_saved_results(out)
        return render_paper(prepare_output_folder(out))
    if opts.size not in SIZES:
        raise ValueError(f"--size must be one of {sorted(SIZES)}, got {opts.size!r}")
    preset = SIZES[opts.size]
    cfg: TrainConfig = preset["cfg"]  # type: ignore[assignment]
    if opts.steps is not None:
        if opts.steps < 3:
            raise ValueError(f"--steps must be >= 3, got {opts.steps}")
        cfg = replace(cfg, grpo_steps=opts.steps)
    n_seeds = opts.seeds if opts.seeds is not None else int(preset["seeds"])  # type: ignore[arg-type]
    jobs = opts.jobs if opts.jobs is not None else int(preset["jobs"])  # type: ignore[arg-type]
    if n_seeds < 2:
        raise ValueError(f"--seeds must be >= 2 for confidence intervals, got {n_seeds}")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    device = resolve_device(opts.device)
    prepare_output_folder(out)
    t0 = time.perf_counter()

    with torch_threads(1 if device.type == "cpu" else None):
        torch.manual_seed(opts.seed)
        model = TinyGPT(cfg.model_config()).to(device)
        warm = warm_up(model, cfg, seed=opts.seed, device=device, progress=TextProgress("warm-up (supervised)"),
                       target_avg=WARMUP_TARGET, max_steps=3 * cfg.warmup_steps)
        base_eval = evaluate(model, cfg, seed=opts.seed, device=device)
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        task = cfg.task()
        init, a, b = tabular_start(model, task, 64, seed=opts.seed, device=device)
        tabular = []
        for eta in TABULAR_STEPS:
            agr = tabular_check(task, init_logits=init, a=a, b=b, group_size=cfg.group_size, steps=100, step_size=eta,
                                seed=opts.seed)
            tabular.append({"step_size": eta, "corr": agr.corr, "slope": agr.slope, "sign": agr.sign,
                            "predicted": agr.predicted, "realised": agr.realised})

    mus = tuple(preset["mus"])  # type: ignore[arg-type]
    table_cfg = replace(cfg, linearised=True)
    payloads = []
    for seed in range(opts.seed, opts.seed + n_seeds):
        for arm in (ArmSpec("GRPO"), ArmSpec("GRPO+Clip_B", "clip_b", mu_low=MU_TABLE),
                    ArmSpec("GRPO+Clip_V", "clip_v", mu_low=MU_TABLE)):
            payloads.append(("table1", state, table_cfg, arm, seed, str(device)))
    for arm in sign_arms():
        payloads.append(("fig1", state, cfg, arm, opts.seed, str(device)))
    for method in ("clip_b", "clip_v"):
        for mu in mus:
            payloads.append(("fig2", state, cfg, ArmSpec(f"{method} mu={mu:g}", method, mu_low=mu), opts.seed, str(device)))

    bar = TextProgress(f"{len(payloads)} GRPO runs")
    results: list[tuple[str, ArmResult]] = []

    def done(item: tuple[str, ArmResult]) -> None:
        # rewritten after every run, so a run cut short still leaves the finished runs on disk
        results.append(item)
        rows = [{"group": g, "arm": r.arm, "seed": r.seed, **rec} for g, r in results for rec in r.records]
        write_csv(out / "paper_steps.csv", rows)
        bar(len(results), len(payloads), f"{item[0]}: {item[1].arm} (seed {item[1].seed})")

    if jobs == 1:
        for p in payloads:
            done(_job(p))
    else:
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            for fut in cf.as_completed([pool.submit(_job, p) for p in payloads]):
                done(fut.result())
    meta = {
        "config": asdict(cfg), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "seeds": n_seeds, "mus": list(mus), "mu_table": MU_TABLE,
        "base_eval": base_eval, "warmup": warm, "seconds": time.perf_counter() - t0, "tabular": tabular,
        "finals": [{"group": g, "arm": r.arm, "seed": r.seed, **r.final} for g, r in results],
    }
    (out / "paper_results.json").write_text(json.dumps(meta, indent=1))
    print(f"ran {len(payloads)} GRPO runs in {meta['seconds']:.0f}s on {meta['device']}", file=sys.stderr)
    return render_paper(out)


def render_paper(out: Path) -> Path:
    """Figures (with matplotlib) and ``report.md`` from ``paper_results.json`` and ``paper_steps.csv`` in ``out``."""
    from .paper_report import write_report

    return write_report(Path(out))
