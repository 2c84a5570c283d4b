"""``entropy-discriminator compare``: Clip_B / Clip_V against the peer entropy controls on signed-sum Countdown.

Per seed: one supervised warm-up (:func:`warm_up`), shared by every arm (paired design: the arms of a seed start
from the same weights and see the same training prompts).  Per (seed, arm): RL for ``rl_steps`` steps, then the
held-out evaluation: ``eval_samples`` samples of each of ``eval_prompts`` held-out problems at temperature 1 give
Avg@K (mean correctness) and the unbiased Pass@K.

One RL step, verl-style: sample ``prompts_per_step x group_size`` responses with the current policy (the old
policy), compute advantages once (GRPO: group-normalised rewards, or PPO: GAE with a value model, gamma = lambda =
1, whitened), then ``minibatches`` optimiser steps on shuffled mini-batches, each with PPO's clipped surrogate
(eps = 0.2, token-mean) unless the arm replaces the loss (Clip-Cov, KL-Cov).  Controls act per mini-batch on the
current policy's token statistics (Clip_B / Clip_V keep-masks and forking tokens zero the PG loss of dropped tokens,
mode ``zero_pg``).  Around every mini-batch step the realised change of the mean entropy of its tokens is recorded
next to Corollary 4's prediction ``-Cov_B(A_eff, r S_c)`` (``A_eff`` = advantage times the arm's and PPO's keep).
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
import torch.nn.functional as F
from torch import nn

from entropy_discriminator import (
    TokenStats,
    apply_keep_mask,
    batch_entropy_change,
    clip_b_mask,
    clip_v_mask,
    token_stats,
)
from entropy_discriminator.baselines import (
    clip_cov_losses,
    entropy_bonus,
    high_entropy_mask,
    kl_cov_losses,
    ppo_clip_losses,
    unlikeliness_scores,
)
from .countdown import VOCAB_SIZE, CountdownTask, pass_at_k
from entropy_discriminator.demo.model import ModelConfig, TinyGPT
from .compare_metrics import EVAL_KS, dh_correlation
from .compare_report import plots_available, write_report
from .records import has_records, read_records_text
from entropy_discriminator.demo.train import group_advantages

ESTIMATORS = ("grpo", "ppo")
LOSSES = ("ppo_clip", "clip_cov", "kl_cov")
CONTROL_MASKS = ("none", "clip_b", "clip_v", "forking")
SHAPINGS = ("none", "unlikely")


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
        for label, allowed in (("estimator", ESTIMATORS), ("loss", LOSSES), ("mask", CONTROL_MASKS), ("shaping", SHAPINGS)):
            if getattr(self, label) not in allowed:
                raise ValueError(f"{label} must be one of {allowed}, got {getattr(self, label)!r}")
        if self.loss != "ppo_clip" and self.mask != "none":
            raise ValueError(f"arm {self.name}: a keep-mask needs loss 'ppo_clip', got {self.loss!r}")
        if self.cov_ratio is not None and (self.loss == "ppo_clip" or not 0 < self.cov_ratio <= 1):
            raise ValueError(f"arm {self.name}: cov_ratio needs loss clip_cov or kl_cov and a value in (0, 1]")


#: Peer hyperparameters: Clip-Cov / KL-Cov as Cui et al.'s 7B recipe in verl, forking tokens rho = 0.2 (Wang et al.),
#: rank penalty 0.25 (He et al.'s release), entropy bonus 0.01.
PEERS = {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 2e-3, "ppo_kl_coef": 1.0,
         "rho": 0.2, "rank_penalty": 0.25, "entropy_coef": 0.01}


def default_arms(tuned_mu_b: float) -> tuple[CompareArm, ...]:
    """The thirteen arms of issue 12 (Clip_B twice: mu = 2.5 and ``tuned_mu_b``)."""
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
class CompareConfig:
    """Sizes and rates of the comparison (one preset per machine)."""

    n_numbers: int = 5
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    warmup_steps: int = 150
    warmup_batch: int = 128
    warmup_lr: float = 3e-3
    warmup_noise: float = 0.3
    rl_steps: int = 100
    prompts_per_step: int = 32
    group_size: int = 8
    minibatches: int = 2
    lr: float = 1e-3
    critic_lr: float = 3e-3
    clip_eps: float = 0.2
    eval_prompts: int = 200
    eval_samples: int = 64
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    tuned_mu_b: float = 1.5
    log_every: int = 5

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "rl_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("warmup_batch", "prompts_per_step", "minibatches", "eval_prompts", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO needs a group), got {self.group_size}")
        if self.eval_samples < max(EVAL_KS):
            raise ValueError(f"eval_samples must be >= {max(EVAL_KS)} (Pass@64), got {self.eval_samples}")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ValueError("minibatches must divide prompts_per_step * group_size")
        if not self.seeds:
            raise ValueError("seeds must not be empty")

    def task(self) -> CountdownTask:
        return CountdownTask(n_numbers=self.n_numbers)

    def model_config(self) -> ModelConfig:
        t = self.task()
        return ModelConfig(VOCAB_SIZE, t.prompt_len + t.response_len, self.d_model, self.n_layers, self.n_heads)


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


class ValueModel(nn.Module):
    """PPO's critic: a :class:`TinyGPT` trunk (initialised from the policy, as verl's critic from the base model) and a
    zero-initialised linear value head on its final hidden states; ``forward(seq, prompt_len) -> V [B, T]`` float32,
    ``V[:, t]`` the value of the state before response token ``t``."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.trunk = TinyGPT(cfg)
        self.trunk.load_state_dict(state)
        self.head = nn.Linear(cfg.d_model, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self._hidden: torch.Tensor | None = None
        self.trunk.ln_f.register_forward_hook(self._keep_hidden)

    def _keep_hidden(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self._hidden = out

    def forward(self, seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
        self.trunk(seq[:, :-1])
        assert self._hidden is not None
        return self.head(self._hidden[:, prompt_len - 1 :]).squeeze(-1)


def warm_up(cfg: CompareConfig, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Supervised warm-up (Adam, grad-norm 1, token cross-entropy) on :meth:`CountdownTask.warmup_targets`;
    returns the policy's state dict (on CPU)."""
    task = cfg.task()
    torch.manual_seed(seed)
    model = TinyGPT(cfg.model_config()).to(device)
    gen = torch.Generator().manual_seed(seed + 7919)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.warmup_lr)
    for _ in range(cfg.warmup_steps):
        x, t = task.sample(cfg.warmup_batch, gen, split="train")
        seq = torch.cat([task.prompts(x, t), task.warmup_targets(x, t, cfg.warmup_noise, gen)], dim=1).to(device)
        logits = model.response_logits(seq, task.prompt_len)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), seq[:, task.prompt_len :].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


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


def _gae_advantages(values: torch.Tensor, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with gamma = lambda = 1 and the reward on the last token: ``A_t = R - V_t``, returns ``R``; advantages
    whitened over the batch (verl's ``masked_whiten``: unbiased variance, eps 1e-8).  Shapes ``[B, T]``, ``[B]``."""
    returns = rewards[:, None].expand_as(values).to(values.dtype)
    adv = returns - values
    adv = (adv - adv.mean()) / torch.sqrt(adv.var() + 1e-8)
    return adv, returns


@dataclass
class Rollout:
    """One step's samples: ``seq`` [B·g, P+T] (prompts and responses), ``resp`` [B·g, T], ``rewards`` [B·g], the
    sampling policy's ``old_lp`` [B·g, T], the advantages ``adv`` [B·g, T], with a critic the value targets
    ``returns`` [B·g, T] (None without one), and the sampling policy's no-grad float32 ``old_logits`` [B·g, T, V]
    that ``old_lp`` was read from."""

    seq: torch.Tensor
    resp: torch.Tensor
    rewards: torch.Tensor
    old_lp: torch.Tensor
    adv: torch.Tensor
    returns: torch.Tensor | None
    old_logits: torch.Tensor


def rollout(
    model: TinyGPT,
    critic: ValueModel | None,
    task: CountdownTask,
    x: torch.Tensor,
    t: torch.Tensor,
    group_size: int,
    generator: torch.Generator,
    shaping: str,
    rank_penalty: float,
    device: torch.device,
) -> Rollout:
    """Samples ``group_size`` responses per prompt ``(x, t)`` at temperature 1 and scores them: with a critic, GAE
    advantages (:func:`_gae_advantages`); else group-normalised rewards (``shaping="unlikely"``: first reshaped by
    rewarding the unlikely with ``rank_penalty``), broadcast over the response tokens."""
    g, p_len = group_size, task.prompt_len
    seq = model.generate(task.prompts(x, t).repeat_interleave(g, 0).to(device), task.response_len,
                         temperature=1.0, generator=generator)
    resp = seq[:, p_len:]
    rewards = task.rewards(x.repeat_interleave(g, 0), t.repeat_interleave(g), resp).to(device)
    returns = None
    with torch.no_grad():
        old_logits = model.response_logits(seq, p_len).float()
        old_lp = torch.log_softmax(old_logits, -1).gather(-1, resp[..., None])[..., 0]
        if critic is not None:
            adv, returns = _gae_advantages(critic(seq, p_len), rewards)
        else:
            scores = rewards
            if shaping == "unlikely":
                scores = unlikeliness_scores(rewards, old_lp.mean(1), g, rank_penalty=rank_penalty)
            adv = group_advantages(scores, g)[:, None].expand_as(old_lp)
    return Rollout(seq, resp, rewards, old_lp, adv, returns, old_logits)


@dataclass(frozen=True)
class Control:
    """What one policy update needs of an arm: its policy ``loss`` (``ppo_clip`` | ``clip_cov`` | ``kl_cov``), its
    keep-``mask`` (``none`` | ``clip_b`` | ``clip_v`` | ``forking`` | ``autopilot``: a mask given to
    :func:`policy_update` as ``keep_mask``) and their settings: Clip_B / Clip_V bound ``mu`` and
    Clip_V cap ``cap`` (``max_frac``, None: none), forking tokens' kept share ``rho``, the PPO ratio clip
    ``[1 - clip_low, 1 + clip_high]``, Clip-Cov's ``cov_ratio`` / ``cov_lb`` / ``cov_ub`` (KL-Cov: ``cov_ratio`` and
    ``kl_coef``) and the entropy bonus ``entropy_coef``."""

    loss: str = "ppo_clip"
    mask: str = "none"
    mu: float = 2.5
    cap: float | None = None
    rho: float = 0.2
    clip_low: float = 0.2
    clip_high: float = 0.2
    cov_ratio: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    kl_coef: float = 1.0
    entropy_coef: float = 0.0


@dataclass
class Update:
    """One mini-batch step: the statistics and log-probs of the policy before it (detached), the keep-mask of the
    arm's control and PPO's clipped positions."""

    stats: TokenStats
    lp: torch.Tensor
    keep: torch.Tensor
    ppo_clipped: torch.Tensor


def policy_update(
    model: TinyGPT,
    opt: torch.optim.Optimizer,
    seq: torch.Tensor,
    resp: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    old_lp: torch.Tensor,
    p_len: int,
    control: Control,
    generator: torch.Generator,
    keep_mask: torch.Tensor | None = None,
) -> Update:
    """One optimiser step of the policy on a mini-batch (``seq`` [B, P+T], ``resp``/``adv``/``valid``/``old_lp``
    [B, T]): loss ``mean(pg) (+ entropy bonus)`` with ``pg`` the control's per-token policy-gradient loss (PPO's
    clipped surrogate with Clip_B / Clip_V / forking tokens' keep-mask applied as ``zero_pg``, or Clip-Cov / KL-Cov),
    gradient norm clipped to 1.  ``generator`` drives Clip-Cov's random token choice.  ``keep_mask`` ([B, T] bool):
    the keep-mask of a control computed outside the mini-batch (``mask="autopilot"``: the entropy autopilot's, stepped
    once per batch), applied like Clip_B's; required exactly for that mask."""
    if (control.mask == "autopilot") != (keep_mask is not None):
        raise ValueError("keep_mask is given exactly for control.mask == 'autopilot'")
    logits = model.response_logits(seq, p_len).float()
    logq = torch.log_softmax(logits, -1)
    lp = logq.gather(-1, resp[..., None])[..., 0]
    stats = token_stats(logits.detach(), resp)
    keep = torch.ones_like(valid)
    if control.mask == "clip_b":
        keep = clip_b_mask(stats.s_star, adv, valid, mu_low=control.mu).keep
    elif control.mask == "clip_v":
        keep = clip_v_mask(stats.s_centered, adv, valid, mu_low=control.mu, max_frac=control.cap).keep
    elif control.mask == "forking":
        keep = high_entropy_mask(stats.entropy, valid, rho=control.rho)
    elif control.mask == "autopilot":
        keep = keep_mask
    if control.loss == "clip_cov":
        res = clip_cov_losses(lp, old_lp, adv, valid, clip_ratio_low=control.clip_low, clip_ratio_high=control.clip_high,
                              clip_cov_ratio=control.cov_ratio, clip_cov_lb=control.cov_lb, clip_cov_ub=control.cov_ub,
                              generator=generator)
        pg, ppo_clipped, keep = res.pg_losses, res.ppo_clipped, ~res.selected
    elif control.loss == "kl_cov":
        res = kl_cov_losses(lp, old_lp, adv, valid, kl_cov_ratio=control.cov_ratio, ppo_kl_coef=control.kl_coef)
        pg, ppo_clipped, keep = res.pg_losses, res.ppo_clipped, ~res.selected
    else:
        pg, ppo_clipped = ppo_clip_losses(lp, old_lp, adv, clip_ratio_low=control.clip_low, clip_ratio_high=control.clip_high)
        pg, _ = apply_keep_mask(pg, keep, valid.float())
    loss = pg.mean()
    if control.entropy_coef:
        loss = loss + entropy_bonus(-(logq.exp() * logq).sum(-1), valid, coef=control.entropy_coef)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return Update(stats=stats, lp=lp.detach(), keep=keep, ppo_clipped=ppo_clipped)


def value_update(critic: ValueModel, vopt: torch.optim.Optimizer, seq: torch.Tensor, p_len: int, returns: torch.Tensor) -> float:
    """One optimiser step of the critic: ``0.5 · mean((V - returns)²)``, gradient norm clipped to 1; returns the loss."""
    vloss = 0.5 * ((critic(seq, p_len) - returns) ** 2).mean()
    vopt.zero_grad(set_to_none=True)
    vloss.backward()
    torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
    vopt.step()
    return float(vloss.detach())


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
    """RL from the warmed-up ``state`` (see the module docstring); prompts depend on ``seed`` only (paired)."""
    task = cfg.task()
    mcfg = cfg.model_config()
    torch.manual_seed(seed)
    model = TinyGPT(mcfg).to(device)
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    critic = vopt = None
    if arm.estimator == "ppo":
        critic = ValueModel(mcfg, state).to(device)
        vopt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr)
    prompt_gen = torch.Generator().manual_seed(seed)
    sample_gen = torch.Generator().manual_seed(seed + 1)
    g, p_len = cfg.group_size, task.prompt_len
    out = ArmRun(arm=arm.name, seed=seed)
    control = Control(
        loss=arm.loss, mask=arm.mask, mu=arm.mu, cap=None, rho=PEERS["rho"], clip_low=cfg.clip_eps, clip_high=cfg.clip_eps,
        cov_ratio=arm.cov_ratio or PEERS["clip_cov_ratio" if arm.loss == "clip_cov" else "kl_cov_ratio"],
        cov_lb=PEERS["clip_cov_lb"], cov_ub=PEERS["clip_cov_ub"], kl_coef=PEERS["ppo_kl_coef"], entropy_coef=arm.entropy_coef,
    )
    t0 = time.perf_counter()
    for step in range(cfg.rl_steps):
        x, t = task.sample(cfg.prompts_per_step, prompt_gen, split="train")
        ro = rollout(model, critic, task, x, t, g, sample_gen, arm.shaping, PEERS["rank_penalty"], device)
        seq, resp, rewards, old_lp, adv, returns = ro.seq, ro.resp, ro.rewards, ro.old_lp, ro.adv, ro.returns
        valid = torch.ones_like(resp, dtype=torch.bool)
        sums = {"entropy": 0.0, "control_frac": 0.0, "ppo_clip_frac": 0.0, "value_loss": 0.0}
        for idx in torch.randperm(len(seq), generator=sample_gen).chunk(cfg.minibatches):
            idx = idx.to(device)
            s_mb, r_mb, a_mb, v_mb = seq[idx], resp[idx], adv[idx], valid[idx]
            upd = policy_update(model, opt, s_mb, r_mb, a_mb, v_mb, old_lp[idx], p_len, control, sample_gen)
            ratio = torch.exp(upd.lp - old_lp[idx]).double()
            a_eff = a_mb.double() * (upd.keep & ~upd.ppo_clipped)
            pred = batch_entropy_change(a_eff, upd.stats.s_centered, v_mb, lr=1.0, ratio=ratio)
            with torch.no_grad():
                after = token_stats(model.response_logits(s_mb, p_len).float(), r_mb)
            out.dh_pairs.append((pred, float((after.entropy - upd.stats.entropy).double().mean())))
            sums["entropy"] += float(upd.stats.entropy.double().mean()) / cfg.minibatches
            sums["control_frac"] += float((~upd.keep & v_mb).double().mean()) / cfg.minibatches
            sums["ppo_clip_frac"] += float((upd.ppo_clipped & v_mb).double().mean()) / cfg.minibatches
            if critic is not None and vopt is not None:
                sums["value_loss"] += value_update(critic, vopt, s_mb, p_len, returns[idx]) / cfg.minibatches
        if step % cfg.log_every == 0 or step == cfg.rl_steps - 1:
            out.records.append({"step": step, "reward": float(rewards.mean()), **sums})
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
    "warm_up",
]
