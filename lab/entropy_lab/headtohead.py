"""The head-to-head of issue 21: a warm start that has learned signed-sum Countdown, RL arms with every peer
hyperparameter exposed, and checkpoint evaluation at several temperatures on disjoint held-out prompt sets.

The RL step is :func:`entropy_lab.compare.run_arm`'s (verl-style: sample ``prompts_per_step x
group_size`` responses at temperature 1 with the current policy, advantages once, ``minibatches`` shuffled optimiser
steps with PPO's clipped surrogate, token-mean, grad-norm 1), generalised so that every setting the tuning stage varies
is a field of :class:`Arm` (learning rate, PPO clip ratios, Clip_V's cap, forking tokens' rho, Clip-Cov's bounds,
KL-Cov's coefficient, the rank penalty) and so that the policy is evaluated at fixed checkpoints during RL.

Evaluation (:func:`evaluate_at`): ``samples`` samples of each prompt of a fixed prompt set at temperature ``T``;
``avg`` = mean correctness (Avg@K for every K), ``pass@K`` = mean over prompts of the unbiased estimator
``1 - C(n - c, K) / C(n, K)`` (:func:`~entropy_lab.countdown.pass_at_k`).  The sampling stream of a
checkpoint evaluation depends on (seed, checkpoint index, temperature) only, so the arms of a seed share it (paired).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from .compare import (
    ESTIMATORS,
    LOSSES,
    SHAPINGS,
    CompareConfig,
    Control,
    ValueModel,
    policy_update,
    rollout,
    value_update,
)
from entropy_discriminator import EntropyDiscConfig, EntropyAutopilot, token_stats
from .countdown import CountdownTask, pass_at_k
from entropy_discriminator.demo.model import TinyGPT

MASKS = ("none", "clip_b", "clip_v", "forking", "autopilot")
#: Pass@K reported at every evaluation.
EVAL_KS = (1, 4, 16, 64)


@dataclass(frozen=True)
class HeadConfig(CompareConfig):
    """:class:`~entropy_lab.compare.CompareConfig` plus the task's target distribution
    (:class:`~entropy_lab.countdown.CountdownTask` ``targets``: ``coef`` or ``uniform``)."""

    targets: str = "coef"

    def task(self) -> CountdownTask:
        return CountdownTask(n_numbers=self.n_numbers, targets=self.targets)


@dataclass(frozen=True)
class Arm:
    """One RL arm with every hyperparameter the tuning stage may vary.

    ``family`` groups the settings tuned against each other (one family = one row of the comparison);
    ``baseline`` names the family its paired differences are taken against (``grpo`` or ``ppo``).
    ``clip_low`` / ``clip_high``: PPO ratio clip ``[1 - clip_low, 1 + clip_high]``; ``cap``: Clip_V's ``max_frac``
    (``None``: no cap); ``cov_ratio`` / ``cov_lb`` / ``cov_ub``: Clip-Cov's token ratio and covariance bounds, or
    KL-Cov's ratio with ``kl_coef``; ``rho``: forking tokens' kept share; ``rank_penalty``: rewarding the unlikely.

    ``mask="autopilot"``: the core :class:`~entropy_discriminator.EntropyAutopilot` toward ``target_entropy``
    (``"hold"`` or nats/token) with the core's defaults for everything else (cap 0.05, sides ``negative``), stepped
    once per RL step on the old policy's statistics of the whole batch with the loop's advantages and ``eta = lr``;
    its keep-mask is applied to every mini-batch like Clip_B's.

    ``adaptive_entropy``: the entropy bonus with TRL's adaptive coefficient (Skywork-OR1, ``use_adaptive_entropy``):
    ``entropy_coef`` is the initial coefficient, see :class:`AdaptiveEntropyCoef` for the rule and
    ``entropy_target`` / ``entropy_coef_delta`` / ``entropy_coef_min`` / ``entropy_coef_max``.
    """

    name: str
    family: str
    estimator: str = "grpo"
    loss: str = "ppo_clip"
    mask: str = "none"
    mu: float = 2.5
    cap: float | None = None
    rho: float = 0.2
    shaping: str = "none"
    rank_penalty: float = 0.25
    entropy_coef: float = 0.0
    cov_ratio: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    kl_coef: float = 1.0
    lr: float = 1e-3
    clip_low: float = 0.2
    clip_high: float = 0.2
    baseline: str = "grpo"
    target_entropy: float | str = "hold"
    adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0

    def __post_init__(self) -> None:
        for label, allowed in (("estimator", ESTIMATORS), ("loss", LOSSES), ("mask", MASKS), ("shaping", SHAPINGS)):
            if getattr(self, label) not in allowed:
                raise ValueError(f"arm {self.name}: {label} must be one of {allowed}, got {getattr(self, label)!r}")
        if self.loss != "ppo_clip" and self.mask != "none":
            raise ValueError(f"arm {self.name}: a keep-mask needs loss 'ppo_clip', got {self.loss!r}")
        if not (0 < self.cov_ratio <= 1 and 0 < self.rho <= 1 and self.lr > 0):
            raise ValueError(f"arm {self.name}: cov_ratio and rho must be in (0, 1], lr > 0")
        if self.cap is not None and not 0 < self.cap <= 1:
            raise ValueError(f"arm {self.name}: cap must be None or in (0, 1], got {self.cap}")
        if self.baseline not in ESTIMATORS:
            raise ValueError(f"arm {self.name}: baseline must be one of {ESTIMATORS}, got {self.baseline!r}")
        if self.mask == "autopilot":
            self.autopilot_config()
        if self.adaptive_entropy:
            AdaptiveEntropyCoef.of(self)

    def autopilot_config(self) -> EntropyDiscConfig:
        """The autopilot arm's settings as the core checks them (everything but ``target_entropy`` the core's
        default)."""
        return EntropyDiscConfig(method="autopilot", target_entropy=self.target_entropy)


@dataclass
class AdaptiveEntropyCoef:
    """TRL's adaptive entropy-bonus coefficient (``use_adaptive_entropy``, TRL 1.16's semantics, one optimiser step
    = one mini-batch here).

    The bonus ``-coef * mean H`` is added to a step's loss with :meth:`applied`: the coefficient ``coef`` if the
    entropy measured at the previous optimiser step is ``<= target``, else 0 (before the first measurement the
    measured entropy is ``+inf``, so the first step never applies it).  After each optimiser step, :meth:`update`
    with that step's mean token entropy (of the policy before the step, the entropy the bonus was computed from):
    ``coef + delta`` if it is ``<= target`` else ``coef - delta``, clamped to ``[lo, hi]``; it becomes the
    measured entropy of the next step.
    """

    coef: float
    target: float
    delta: float = 0.005
    lo: float = 0.0
    hi: float = 1.0
    last_entropy: float = math.inf

    def __post_init__(self) -> None:
        for name in ("coef", "target", "delta", "lo", "hi"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"adaptive entropy: {name} must be finite, got {getattr(self, name)}")
        if not (self.delta >= 0 and self.lo <= self.hi):
            raise ValueError(f"adaptive entropy: need delta >= 0 and min <= max, got {self.delta}, [{self.lo}, {self.hi}]")

    @classmethod
    def of(cls, arm: Arm) -> AdaptiveEntropyCoef:
        """The controller of an arm with ``adaptive_entropy``: ``entropy_coef`` is the initial coefficient."""
        return cls(arm.entropy_coef, arm.entropy_target, arm.entropy_coef_delta, arm.entropy_coef_min, arm.entropy_coef_max)

    def applied(self) -> float:
        """The coefficient of the next optimiser step's bonus."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimiser step whose tokens had mean entropy ``entropy``."""
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.hi)
        else:
            self.coef = max(self.coef - self.delta, self.lo)
        self.last_entropy = entropy


def warm_up_checkpoints(
    cfg: CompareConfig, seed: int, at_steps: tuple[int, ...], on_step: Callable[[int, dict[str, torch.Tensor]], None]
) -> dict[str, torch.Tensor]:
    """:func:`entropy_lab.compare.warm_up` (the same random streams, so the same weights for the same
    ``cfg`` and ``seed``) that also calls ``on_step(step, state)`` after each step in ``at_steps``; runs
    ``cfg.warmup_steps`` steps and returns the final CPU state dict."""
    task = cfg.task()
    torch.manual_seed(seed)
    model = TinyGPT(cfg.model_config())
    gen = torch.Generator().manual_seed(seed + 7919)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.warmup_lr)
    for step in range(1, cfg.warmup_steps + 1):
        x, t = task.sample(cfg.warmup_batch, gen, split="train")
        seq = torch.cat([task.prompts(x, t), task.warmup_targets(x, t, cfg.warmup_noise, gen)], dim=1)
        logits = model.response_logits(seq, task.prompt_len)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), seq[:, task.prompt_len :].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step in at_steps:
            on_step(step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def heldout_sets(task: CountdownTask, n_test: int, n_val: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Disjoint test and validation prompt sets from the held-out split: test = the first ``n_test`` held-out problems
    of generator seed 12345 (the compare harness's evaluation prompts when ``n_test = 200``); validation = the first
    ``n_val`` held-out problems of generator seed 54321 that are not in the test set (and not repeated)."""
    test = task.sample(n_test, torch.Generator().manual_seed(12345), split="eval")
    seen = {tuple(r) for r in torch.cat([test[0], test[1][:, None]], 1).tolist()}
    gen = torch.Generator().manual_seed(54321)
    xs: list[torch.Tensor] = []
    ts: list[torch.Tensor] = []
    while len(xs) < n_val:
        x, t = task.sample(n_val, gen, split="eval")
        for xi, ti in zip(x, t):
            key = (*xi.tolist(), int(ti))
            if key not in seen and len(xs) < n_val:
                seen.add(key)
                xs.append(xi)
                ts.append(ti)
    return test, (torch.stack(xs), torch.stack(ts))


@torch.no_grad()
def evaluate_at(
    model: TinyGPT,
    task: CountdownTask,
    prompts: tuple[torch.Tensor, torch.Tensor],
    *,
    samples: int,
    temperature: float,
    stream: int,
    chunk: int = 256,
) -> dict[str, object]:
    """``samples`` samples per prompt at ``temperature`` (sampling generator seeded with ``stream``).

    Returns ``avg`` = ``sum_p c_p / (P n)``, ``pass`` = ``{K: mean_p (1 - C(n - c_p, K) / C(n, K))}`` for K in
    :data:`EVAL_KS` up to ``samples``, and ``correct`` = the counts ``c_p``.  ``chunk`` rows are sampled at a time
    (small chunks run faster on one CPU core); the draws depend on ``chunk``, so it is fixed for a whole study.
    """
    x, t = prompts
    gen = torch.Generator().manual_seed(stream)
    rows = task.prompts(x, t).repeat_interleave(samples, 0)
    xr, tr = x.repeat_interleave(samples, 0), t.repeat_interleave(samples, 0)
    ok = []
    for start in range(0, len(rows), chunk):
        seq = model.generate(rows[start : start + chunk], task.response_len, temperature=temperature, generator=gen)
        ok.append(task.rewards(xr[start : start + chunk], tr[start : start + chunk], seq[:, task.prompt_len :]))
    correct = torch.cat(ok).view(-1, samples).sum(1).to(torch.int64)
    return {
        "avg": float(correct.double().mean() / samples),
        "pass": {k: float(pass_at_k(samples, correct, k).mean()) for k in EVAL_KS if k <= samples},
        "correct": correct.tolist(),
    }


def eval_stream(seed: int, checkpoint: int, temperature: float) -> int:
    """Sampling seed of one checkpoint evaluation: shared by every arm of ``seed`` (common random numbers)."""
    return 10_000 + 1_000 * seed + 10 * checkpoint + int(round(temperature * 10))


@dataclass
class ArmTrace:
    """One (arm, seed) run: per-step training records and the evaluations at each checkpoint."""

    arm: str
    family: str
    seed: int
    records: list[dict[str, float]] = field(default_factory=list)
    checkpoints: list[dict[str, object]] = field(default_factory=list)
    seconds: float = 0.0


def run_arm_checkpoints(
    state: dict[str, torch.Tensor],
    cfg: CompareConfig,
    arm: Arm,
    seed: int,
    checkpoints: tuple[int, ...],
    on_checkpoint: Callable[[int, TinyGPT], dict[str, object]],
) -> ArmTrace:
    """RL from ``state`` for ``max(checkpoints)`` steps; after each step count in ``checkpoints`` (0 = the start)
    records ``on_checkpoint(step, model)`` with ``step`` added.  Training prompts and the rollout sampling stream
    depend on ``seed`` only (paired across arms).  ``control_frac`` is the share of response tokens whose PG term the
    arm's control removed (Clip_B / Clip_V clipped, the autopilot dropped, forking tokens' dropped low-entropy tokens,
    Clip-Cov detached, KL-Cov penalised), mean over the mini-batches of a step.

    The autopilot arm's records add ``autopilot_*`` (the controller's measured and target entropy, its desired and
    predicted change, its dropped share); the adaptive-bonus arm's add ``entropy_coef_applied`` (mean over the step's
    mini-batches of the coefficient applied) and ``entropy_coef`` (the coefficient after the step)."""
    task = cfg.task()
    mcfg = cfg.model_config()
    torch.manual_seed(seed)
    model = TinyGPT(mcfg)
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=arm.lr)
    critic = vopt = None
    if arm.estimator == "ppo":
        critic = ValueModel(mcfg, state)
        vopt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr)
    prompt_gen = torch.Generator().manual_seed(seed)
    sample_gen = torch.Generator().manual_seed(seed + 1)
    g, p_len = cfg.group_size, task.prompt_len
    out = ArmTrace(arm=arm.name, family=arm.family, seed=seed)
    control = Control(
        loss=arm.loss, mask=arm.mask, mu=arm.mu, cap=arm.cap, rho=arm.rho, clip_low=arm.clip_low, clip_high=arm.clip_high,
        cov_ratio=arm.cov_ratio, cov_lb=arm.cov_lb, cov_ub=arm.cov_ub, kl_coef=arm.kl_coef, entropy_coef=arm.entropy_coef,
    )
    pilot: EntropyAutopilot | None = arm.autopilot_config().build_autopilot() if arm.mask == "autopilot" else None
    adaptive = AdaptiveEntropyCoef.of(arm) if arm.adaptive_entropy else None
    t0 = time.perf_counter()
    if 0 in checkpoints:
        out.checkpoints.append({"step": 0, **on_checkpoint(0, model)})
    for step in range(1, max(checkpoints) + 1):
        x, t = task.sample(cfg.prompts_per_step, prompt_gen, split="train")
        ro = rollout(model, critic, task, x, t, g, sample_gen, arm.shaping, arm.rank_penalty, torch.device("cpu"))
        seq, resp, rewards, old_lp, adv, returns = ro.seq, ro.resp, ro.rewards, ro.old_lp, ro.adv, ro.returns
        valid = torch.ones_like(resp, dtype=torch.bool)
        sums = {"entropy": 0.0, "control_frac": 0.0, "ppo_clip_frac": 0.0}
        extra: dict[str, float] = {}
        keep_all = None
        if pilot is not None:  # once per RL step, on the old policy's statistics of the whole batch
            res = pilot.from_stats(token_stats(ro.old_logits, resp), adv, lr=arm.lr)
            keep_all = res.keep
            extra = {"autopilot_entropy": res.entropy, "autopilot_target_entropy": res.target_entropy,
                     "autopilot_target_dh": res.target_dh, "autopilot_predicted_dh": res.predicted_dh_after,
                     "autopilot_dropped_frac": res.dropped_frac}
        if adaptive is not None:
            extra["entropy_coef_applied"] = 0.0
        for idx in torch.randperm(len(seq), generator=sample_gen).chunk(cfg.minibatches):
            s_mb, r_mb, a_mb, v_mb = seq[idx], resp[idx], adv[idx], valid[idx]
            ctl = control if adaptive is None else replace(control, entropy_coef=adaptive.applied())
            km = None if keep_all is None else keep_all[idx]
            upd = policy_update(model, opt, s_mb, r_mb, a_mb, v_mb, old_lp[idx], p_len, ctl, sample_gen, keep_mask=km)
            if adaptive is not None:
                extra["entropy_coef_applied"] += ctl.entropy_coef / cfg.minibatches
                adaptive.update(float(upd.stats.entropy.double()[v_mb].mean()))
            sums["entropy"] += float(upd.stats.entropy.double().mean()) / cfg.minibatches
            sums["control_frac"] += float((~upd.keep & v_mb).double().mean()) / cfg.minibatches
            sums["ppo_clip_frac"] += float((upd.ppo_clipped & v_mb).double().mean()) / cfg.minibatches
            if critic is not None and vopt is not None:
                value_update(critic, vopt, s_mb, p_len, returns[idx])
        if adaptive is not None:
            extra["entropy_coef"] = adaptive.coef
        out.records.append({"step": step, "reward": float(rewards.mean()), **sums, **extra})
        if step in checkpoints:
            out.checkpoints.append({"step": step, **on_checkpoint(step, model)})
    out.seconds = time.perf_counter() - t0
    return out


__all__ = [
    "EVAL_KS",
    "AdaptiveEntropyCoef",
    "Arm",
    "HeadConfig",
    "ArmTrace",
    "eval_stream",
    "evaluate_at",
    "heldout_sets",
    "run_arm_checkpoints",
    "warm_up_checkpoints",
]
