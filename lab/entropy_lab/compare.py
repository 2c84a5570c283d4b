"""``entropy-discriminator compare``: Clip_B / Clip_V against the peer entropy controls on signed-sum Countdown.

Per seed: one supervised warm-up (:func:`entropy_lab.rl.warm_up`), shared by every arm (paired design: the arms of a
seed start from the same weights and see the same training prompts).  Per (seed, arm): ``rl_steps`` steps of the RL
loop (:func:`entropy_lab.rl.rl_steps`, verl-style; PPO's clipped surrogate at eps = 0.2 unless the arm replaces the
loss with Clip-Cov or KL-Cov), recording around every mini-batch step the realised change of the mean entropy of its
tokens next to Corollary 4's prediction; then the held-out evaluation: ``eval_samples`` samples of each of
``eval_prompts`` held-out problems at temperature 1 give Avg@K (mean correctness) and the unbiased Pass@K.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from entropy_discriminator.demo.model import TinyGPT

from .compare_metrics import EVAL_KS, dh_correlation
from .compare_report import plots_available, write_report
from .countdown import pass_at_k
from .records import has_records, read_records_text
from .rl import MASKS, Arm, RLConfig, rl_steps, warm_up

#: The keep-masks of a comparison arm (the autopilot is the head-to-head's, :mod:`entropy_lab.protocol`).
CONTROL_MASKS = tuple(m for m in MASKS if m != "autopilot")


@dataclass(frozen=True)
class CompareArm:
    """One arm: an advantage ``estimator``, a policy ``loss``, a keep-``mask``, a reward ``shaping`` and an entropy
    bonus ``entropy_coef``; ``cov_ratio`` overrides Clip-Cov's / KL-Cov's published token ratio (:data:`PEERS`);
    ``baseline`` names the arm its paired differences are taken against."""

    name: str
    estimator: str = "grpo"
    loss: str = "ppo_clip"
    mask: str = "none"
    mu: float = 2.5
    shaping: str = "none"
    entropy_coef: float = 0.0
    cov_ratio: float | None = None
    baseline: str = "grpo"

    def __post_init__(self) -> None:
        if self.mask not in CONTROL_MASKS:
            raise ValueError(f"arm {self.name}: mask must be one of {CONTROL_MASKS}, got {self.mask!r}")
        if self.cov_ratio is not None and self.loss == "ppo_clip":
            raise ValueError(f"arm {self.name}: cov_ratio needs loss clip_cov or kl_cov")
        self.arm()  # the loop's checks of the rest

    def arm(self, lr: float = 1e-3, clip_eps: float = 0.2) -> Arm:
        """The arm in the RL loop's terms (:class:`entropy_lab.rl.Arm`): the peers' settings of :data:`PEERS`
        (``cov_ratio`` if given), Adam at ``lr``, PPO's ratio clip ``[1 - clip_eps, 1 + clip_eps]``."""
        cov_ratio = PEERS["clip_cov_ratio" if self.loss == "clip_cov" else "kl_cov_ratio"]
        return Arm(
            name=self.name, family=self.name, estimator=self.estimator, loss=self.loss, mask=self.mask, mu=self.mu,
            rho=PEERS["rho"], shaping=self.shaping, rank_penalty=PEERS["rank_penalty"], entropy_coef=self.entropy_coef,
            cov_ratio=cov_ratio if self.cov_ratio is None else self.cov_ratio, cov_lb=PEERS["clip_cov_lb"],
            cov_ub=PEERS["clip_cov_ub"], kl_coef=PEERS["ppo_kl_coef"], lr=lr, clip_low=clip_eps, clip_high=clip_eps,
            baseline=self.baseline,
        )


#: Peer hyperparameters: Clip-Cov / KL-Cov as Cui et al.'s 7B recipe in verl, forking tokens rho = 0.2 (Wang et al.),
#: rank penalty 0.25 (He et al.'s release), entropy bonus 0.01.
PEERS = {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 2e-3, "ppo_kl_coef": 1.0,
         "rho": 0.2, "rank_penalty": 0.25, "entropy_coef": 0.01}


def default_arms(tuned_mu_b: float) -> tuple[CompareArm, ...]:
    """The thirteen arms of the paired comparison in docs/reproduction/compare (Clip_B twice: mu = 2.5 and
    ``tuned_mu_b``)."""
    return (
        CompareArm("grpo"),
        CompareArm("grpo+clip_b", mask="clip_b", mu=2.5),
        CompareArm(f"grpo+clip_b(mu={tuned_mu_b:g})", mask="clip_b", mu=tuned_mu_b),
        CompareArm("grpo+clip_v", mask="clip_v", mu=2.5),
        CompareArm("clip_cov", loss="clip_cov"),
        CompareArm("kl_cov", loss="kl_cov"),
        CompareArm("forking_tokens", mask="forking"),
        CompareArm("unlikely", shaping="unlikely"),
        CompareArm("entropy_bonus", entropy_coef=PEERS["entropy_coef"]),
        CompareArm("ppo", estimator="ppo", baseline="ppo"),
        CompareArm("ppo+clip_b", estimator="ppo", mask="clip_b", mu=2.5, baseline="ppo"),
        CompareArm("ppo+clip_v", estimator="ppo", mask="clip_v", mu=2.5, baseline="ppo"),
    )


def sensitivity_arms() -> tuple[CompareArm, ...]:
    """Peers pushed harder than published, for a fairer match with the tuned Clip_B (chosen by ``--arms``):
    Clip-Cov / KL-Cov on 2% of the tokens (about Clip_B mu = 1.5's clipped share), entropy bonus 0.05."""
    return (
        CompareArm("clip_cov(ratio=0.02)", loss="clip_cov", cov_ratio=0.02),
        CompareArm("kl_cov(ratio=0.02)", loss="kl_cov", cov_ratio=0.02),
        CompareArm("entropy_bonus(c=0.05)", entropy_coef=0.05),
    )


@dataclass(frozen=True)
class CompareConfig(RLConfig):
    """Sizes and rates of the comparison (one preset per machine): :class:`~entropy_lab.rl.RLConfig` (150 warm-up
    steps, 32 prompts per RL step), ``rl_steps`` RL steps with PPO's ratio clip ``clip_eps``, the evaluation
    (``eval_samples`` samples of each of ``eval_prompts`` held-out problems), the ``seeds``, the tuned Clip_B's
    ``tuned_mu_b`` and a record every ``log_every`` steps."""

    warmup_steps: int = 150
    prompts_per_step: int = 32
    rl_steps: int = 100
    clip_eps: float = 0.2
    eval_prompts: int = 200
    eval_samples: int = 64
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    tuned_mu_b: float = 1.5
    log_every: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rl_steps < 0:
            raise ValueError(f"rl_steps must be >= 0, got {self.rl_steps}")
        for name in ("eval_prompts", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_samples < max(EVAL_KS):
            raise ValueError(f"eval_samples must be >= {max(EVAL_KS)} (Pass@64), got {self.eval_samples}")
        if not self.seeds:
            raise ValueError("seeds must not be empty")


PRESETS = {
    # CI: well under a minute on 2 cores (2 seeds x 3 arms, tiny sizes)
    "smoke": CompareConfig(
        d_model=32, warmup_steps=30, warmup_batch=64, rl_steps=3, prompts_per_step=8, group_size=4,
        eval_prompts=16, eval_samples=64, seeds=(0, 1), log_every=1,
    ),
    # the comparison of docs/reproduction/compare/: 162 s with --jobs 16 on 16 CPU cores (tiny models run faster on
    # CPU cores than time-sliced on one GPU)
    "full": CompareConfig(),
}


@torch.no_grad()
def evaluate(model: TinyGPT, cfg: CompareConfig, seed: int, device: torch.device, chunk: int = 4096) -> dict[str, object]:
    """Held-out evaluation at temperature 1: ``eval_samples`` samples of each of ``eval_prompts`` fixed problems.

    Returns ``avg`` (mean correctness = Avg@K for every K), ``pass@K`` (unbiased, mean over prompts) for K in
    1..eval_samples, and ``correct`` (int counts per prompt).
    """
    task = cfg.task()
    x, t = task.sample(cfg.eval_prompts, torch.Generator().manual_seed(12345), split="eval")
    gen = torch.Generator().manual_seed(10_000 + seed)
    n = cfg.eval_samples
    prompts = task.prompts(x, t).repeat_interleave(n, 0)
    ok = []
    for start in range(0, len(prompts), chunk):
        seq = model.generate(prompts[start : start + chunk].to(device), task.response_len, temperature=1.0, generator=gen)
        xi = x.repeat_interleave(n, 0)[start : start + chunk]
        ti = t.repeat_interleave(n, 0)[start : start + chunk]
        ok.append(task.rewards(xi, ti, seq[:, task.prompt_len :]))
    correct = torch.cat(ok).view(-1, n).sum(1).to(torch.int64)
    out: dict[str, object] = {"avg": float(correct.double().mean() / n), "correct": correct.tolist()}
    out["pass"] = {k: float(pass_at_k(n, correct, k).mean()) for k in range(1, n + 1)}
    return out


@dataclass
class ArmRun:
    """Per-step records, (predicted, realised) entropy changes per mini-batch step, and the final evaluation."""

    arm: str
    seed: int
    records: list[dict[str, float]] = field(default_factory=list)
    dh_pairs: list[tuple[float, float]] = field(default_factory=list)
    final: dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0


def run_arm(state: dict[str, torch.Tensor], cfg: CompareConfig, arm: CompareArm, seed: int, device: torch.device) -> ArmRun:
    """``cfg.rl_steps`` steps of the RL loop (:func:`entropy_lab.rl.rl_steps`, with the entropy-change pairs) from the
    warmed-up ``state``; a record at every ``log_every``-th step (numbered from 0) and the last; then
    :func:`evaluate`.  Prompts depend on ``seed`` only (paired)."""
    out = ArmRun(arm=arm.name, seed=seed)
    t0 = time.perf_counter()
    for step, model, rec, dh in rl_steps(state, cfg, arm.arm(cfg.lr, cfg.clip_eps), seed, cfg.rl_steps, device=device,
                                         measure_dh=True):
        out.dh_pairs.extend(dh)
        if rec is not None and ((step - 1) % cfg.log_every == 0 or step == cfg.rl_steps):
            out.records.append({"step": step - 1, **rec})
    out.seconds = time.perf_counter() - t0
    out.final = evaluate(model, cfg, seed, device)
    return out


# ----------------------------------------------------------------------------------------------- orchestration


@dataclass(frozen=True)
class CompareOptions:
    """What ``entropy-discriminator compare`` runs."""

    out: Path = Path("compare_out")
    preset: str = "smoke"
    device: str = "cpu"
    jobs: int = 1
    seeds: int | None = None
    steps: int | None = None
    arms: tuple[str, ...] | None = None
    render_only: bool = False

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {self.preset!r}")
        if self.jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {self.jobs}")
        if self.seeds is not None and self.seeds < 2:
            raise ValueError(f"seeds must be >= 2 (intervals need two), got {self.seeds}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def config(self) -> CompareConfig:
        cfg = PRESETS[self.preset]
        if self.seeds is not None:
            cfg = replace(cfg, seeds=tuple(range(self.seeds)))
        if self.steps is not None:
            cfg = replace(cfg, rl_steps=self.steps)
        return cfg

    def arm_list(self) -> tuple[CompareArm, ...]:
        arms = default_arms(self.config().tuned_mu_b)
        if self.arms is None:
            return arms
        by_name = {a.name: a for a in (*arms, *sensitivity_arms())}
        unknown = [n for n in self.arms if n not in by_name]
        if unknown:
            raise ValueError(f"arms: unknown {unknown}; choose from {list(by_name)}")
        chosen = [by_name[n] for n in self.arms]
        missing = {a.baseline for a in chosen} - set(self.arms)
        if missing:
            raise ValueError(f"arms: the paired baselines {sorted(missing)} must be included")
        return tuple(chosen)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` as a device; ``ValueError`` when CUDA is asked for but absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def _warm_job(job: tuple[CompareConfig, int, str, str]) -> dict[str, object]:
    cfg, seed, device, path = job
    torch.set_num_threads(1)
    dev = resolve_device(device)
    t0 = time.perf_counter()
    state = warm_up(cfg, seed, dev)
    torch.save(state, path)
    model = TinyGPT(cfg.model_config()).to(dev)
    model.load_state_dict(state)
    return {"seed": seed, "seconds": time.perf_counter() - t0, "eval": evaluate(model, cfg, seed, dev)}


def _arm_job(job: tuple[CompareConfig, CompareArm, int, str, str]) -> dict[str, object]:
    cfg, arm, seed, device, path = job
    torch.set_num_threads(1)
    state = torch.load(path, weights_only=True)
    run = run_arm(state, cfg, arm, seed, resolve_device(device))
    return asdict(run)


def _pool_map(fn: Callable, jobs: list, n_proc: int, log: Callable[[str], None], sink: Callable[[dict], None]) -> list:
    """``fn`` over ``jobs`` in ``n_proc`` spawned processes (in order when 1); ``sink`` sees each result as it lands."""
    out = []
    t0 = time.perf_counter()
    if n_proc == 1:
        results = map(fn, jobs)
        pool = None
    else:
        pool = mp.get_context("spawn").Pool(min(n_proc, len(jobs)))
        results = pool.imap_unordered(fn, jobs)
    try:
        for i, r in enumerate(results):
            sink(r)
            out.append(r)
            log(f"  {i + 1}/{len(jobs)} done ({time.perf_counter() - t0:.0f} s)")
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return out


def run_compare(opts: CompareOptions, log: Callable[[str], None] = print) -> dict[str, object]:
    """Warm up every seed, run every (seed, arm), write ``results.json`` and the report under ``opts.out``.

    Every finished job is written at once (``warm/seed*.json``, ``runs/*.json``, next to ``meta.json``), so a run
    cut off keeps what it finished; ``render_only`` rebuilds ``results.json`` and the report from those files.
    """
    if not plots_available():
        log('compare: matplotlib is not installed, so no PNG plots are written (pip install -e ".[plot]")')
    if opts.render_only:
        return render(opts.out, log)
    cfg, arms = opts.config(), opts.arm_list()
    resolve_device(opts.device)
    opts.out.mkdir(parents=True, exist_ok=True)
    warm_dir = opts.out / "warm"
    warm_dir.mkdir(exist_ok=True)
    run_dir = opts.out / "runs"
    run_dir.mkdir(exist_ok=True)
    meta = {
        "preset": opts.preset, "device": opts.device, "jobs": opts.jobs, "config": asdict(cfg), "peers": PEERS,
        "arms": [asdict(a) for a in arms], "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    (opts.out / "meta.json").write_text(json.dumps(meta))
    t0 = time.perf_counter()
    log(f"compare: preset {opts.preset}, {len(cfg.seeds)} seeds x {len(arms)} arms, device {opts.device}, {opts.jobs} jobs")
    log("warm-up ...")
    _pool_map(
        _warm_job, [(cfg, s, opts.device, str(warm_dir / f"seed{s}.pt")) for s in cfg.seeds], opts.jobs, log,
        lambda r: (warm_dir / f"seed{r['seed']}.json").write_text(json.dumps(r)),
    )
    log("RL arms ...")
    jobs = [(cfg, a, s, opts.device, str(warm_dir / f"seed{s}.pt")) for s in cfg.seeds for a in arms]
    _pool_map(
        _arm_job, jobs, opts.jobs, log,
        lambda r: (run_dir / f"seed{r['seed']}_{r['arm']}.json".replace("/", "_")).write_text(json.dumps(r)),
    )
    meta["wall_seconds"] = time.perf_counter() - t0
    (opts.out / "meta.json").write_text(json.dumps(meta))
    return render(opts.out, log)


def check_saved_runs(out: Path) -> None:
    """Raise ``ValueError`` unless ``out`` holds a comparison to render (``meta.json`` or ``results.json``)."""
    if not (out / "meta.json").is_file() and not has_records(out / "results.json"):
        raise ValueError(f"{out} holds no meta.json or results.json to render (run the comparison first)")


def render(out: Path, log: Callable[[str], None] = print) -> dict[str, object]:
    """Assemble ``results.json`` from ``meta.json``, ``warm/*.json`` and ``runs/*.json`` under ``out`` (keeping only
    seeds whose warm-up finished; without ``runs/``, read the saved ``results.json``, plain or compressed) and write
    the report."""
    if not (out / "runs").is_dir() and has_records(out / "results.json"):
        results = json.loads(read_records_text(out / "results.json"))
    else:
        check_saved_runs(out)
        results = json.loads((out / "meta.json").read_text())
        warm = sorted((json.loads(p.read_text()) for p in (out / "warm").glob("seed*.json")), key=lambda r: r["seed"])
        seeds = {w["seed"] for w in warm}
        names = [a["name"] for a in results["arms"]]
        runs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
        runs = sorted((r for r in runs if r["seed"] in seeds), key=lambda r: (r["seed"], names.index(r["arm"])))
        results.update(warmup=warm, runs=runs)
        (out / "results.json").write_text(json.dumps(results))
    write_report(results, out)
    log(f"{len(results['runs'])} runs of {len(results['warmup'])} seeds; report in {out}")
    return results


__all__ = [
    "PRESETS",
    "check_saved_runs",
    "CompareArm",
    "CompareConfig",
    "CompareOptions",
    "default_arms",
    "dh_correlation",
    "evaluate",
    "render",
    "run_arm",
    "run_compare",
    "sensitivity_arms",
]
