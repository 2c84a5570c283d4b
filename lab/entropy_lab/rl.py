"""The one RL loop of every experiment of the research harness (``compare``, the head-to-head protocol, the law
evaluation's rollouts), on a :class:`~entropy_discriminator.demo.model.TinyGPT` policy warmed up by the library
demo's :func:`~entropy_discriminator.demo.train.warm_up` (:func:`warm_up` here: from a seed to a state dict).

One RL step (:func:`rl_steps`), verl-style: sample ``prompts_per_step x group_size`` responses at temperature 1 with
the current policy (the old policy), compute advantages once (GRPO: group-normalised rewards, optionally reshaped by
rewarding the unlikely; PPO: GAE with a value model, gamma = lambda = 1, whitened), then ``minibatches`` optimiser
steps on shuffled mini-batches (:func:`policy_update`: PPO's clipped surrogate, eps = the arm's clip ratios,
token-mean, unless the arm replaces the loss with Clip-Cov or KL-Cov; grad-norm 1), each followed by a critic step
for PPO.  Controls act per mini-batch on the current policy's token statistics (Clip_B / Clip_V keep-masks and
forking tokens zero the PG loss of dropped tokens, mode ``zero_pg``); the entropy autopilot once per step on the old
policy's statistics of the whole batch.  With ``measure_dh``, around every mini-batch step the realised change of
the mean entropy of its tokens is recorded next to Corollary 4's prediction ``-Cov_B(A_eff, r S_c)`` (``A_eff`` =
advantage times the arm's and PPO's keep).  Training prompts depend on the seed only (stream ``seed``; sampling
stream ``seed + 1``), so the arms of a seed are paired.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from entropy_discriminator import (
    EntropyAutopilot,
    EntropyDiscConfig,
    TokenStats,
    apply_keep_mask,
    batch_entropy_change,
    clip_b_mask,
    clip_v_mask,
    fixed_share_mask,
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
from entropy_discriminator.demo.model import ModelConfig, TinyGPT
from entropy_discriminator.demo.train import LoopConfig, group_advantages
from entropy_discriminator.demo.train import warm_up as supervised_warm_up
from entropy_discriminator.law_scale import LawScale, cheap_change

from .countdown import CountdownTask

ESTIMATORS = ("grpo", "ppo")
LOSSES = ("ppo_clip", "clip_cov", "kl_cov")
MASKS = ("none", "clip_b", "clip_v", "forking", "autopilot", "fixed_share")
#: Masks computed once per RL step on the old policy's statistics of the whole batch (not per mini-batch).
BATCH_MASKS = ("autopilot", "fixed_share")
SHAPINGS = ("none", "unlikely")
CPU = torch.device("cpu")
#: The controller whose candidate order (``sides``, ``form``) the fixed-share arm uses: the autopilot arm's defaults.
FIXED_SHARE_ORDER = EntropyDiscConfig(method="autopilot").build_autopilot()


@dataclass(frozen=True)
class RLConfig(LoopConfig):
    """:class:`~entropy_discriminator.demo.train.LoopConfig` on signed-sum Countdown (``n_numbers`` numbers) with the
    loop's settings: ``minibatches`` optimiser steps per RL step, the critic's ``critic_lr``."""

    n_numbers: int = 5
    minibatches: int = 2
    critic_lr: float = 3e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.minibatches < 1:
            raise ValueError(f"minibatches must be >= 1, got {self.minibatches}")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ValueError("minibatches must divide prompts_per_step * group_size")

    def task(self) -> CountdownTask:
        return CountdownTask(n_numbers=self.n_numbers)


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
    its keep-mask is applied to every mini-batch like Clip_B's.  ``calibrate_every`` (autopilot only): 0 leaves
    the cheap score uncalibrated (``kappa = 1``; under Adam it is orders of magnitude too small and the controller
    sits at its cap); k > 0 calibrates it as the adapters do (:class:`~entropy_discriminator.law_scale.LawScale`
    bound to the controller): on the 1st, (k+1)-th, ... RL step, the pair (the whole batch's cheap prediction
    ``-lr Cov_B(A, S_c)`` before the mask, the realised change of the batch's mean token entropy over the step's
    mini-batch updates, read by one no-grad forward of the same tokens).  ``mask="fixed_share"``: the autopilot's
    control without its feedback: the core :func:`~entropy_discriminator.fixed_share_mask` drops the ``share`` of the tokens
    the autopilot would drop first to raise the entropy (its defaults: sides ``negative``, the cheap score), stepped
    and applied the same way.

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
    share: float = 0.05
    adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    calibrate_every: int = 0

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
        if type(self.calibrate_every) is not int or self.calibrate_every < 0:
            raise ValueError(f"arm {self.name}: calibrate_every must be an int >= 0, got {self.calibrate_every!r}")
        if self.calibrate_every and self.mask != "autopilot":
            raise ValueError(f"arm {self.name}: calibrate_every is the autopilot's, got mask {self.mask!r}")
        if not 0 < self.share <= 1:
            raise ValueError(f"arm {self.name}: share must be in (0, 1], got {self.share}")
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
    arm: Arm,
    generator: torch.Generator,
    keep_mask: torch.Tensor | None = None,
) -> Update:
    """One optimiser step of the policy on a mini-batch (``seq`` [B, P+T], ``resp``/``adv``/``valid``/``old_lp``
    [B, T]): loss ``mean(pg) (+ entropy bonus)`` with ``pg`` the ``arm``'s per-token policy-gradient loss (PPO's
    clipped surrogate with Clip_B / Clip_V / forking tokens' keep-mask applied as ``zero_pg``, or Clip-Cov / KL-Cov),
    gradient norm clipped to 1; of the ``arm`` only its loss, keep-mask and their settings are read.  ``generator``
    drives Clip-Cov's random token choice.  ``keep_mask`` ([B, T] bool): the keep-mask of a control computed outside
    the mini-batch (``mask`` in :data:`BATCH_MASKS`: the entropy autopilot's or the fixed share's, stepped once per
    batch), applied like Clip_B's; required exactly for those masks."""
    if (arm.mask in BATCH_MASKS) != (keep_mask is not None):
        raise ValueError(f"keep_mask is given exactly for arm.mask in {BATCH_MASKS}")
    logits = model.response_logits(seq, p_len).float()
    logq = torch.log_softmax(logits, -1)
    lp = logq.gather(-1, resp[..., None])[..., 0]
    stats = token_stats(logits.detach(), resp)
    keep = torch.ones_like(valid)
    if arm.mask == "clip_b":
        keep = clip_b_mask(stats.s_star, adv, valid, mu_low=arm.mu).keep
    elif arm.mask == "clip_v":
        keep = clip_v_mask(stats.s_centered, adv, valid, mu_low=arm.mu, max_frac=arm.cap).keep
    elif arm.mask == "forking":
        keep = high_entropy_mask(stats.entropy, valid, rho=arm.rho)
    elif arm.mask in BATCH_MASKS:
        keep = keep_mask
    if arm.loss == "clip_cov":
        res = clip_cov_losses(lp, old_lp, adv, valid, clip_ratio_low=arm.clip_low, clip_ratio_high=arm.clip_high,
                              clip_cov_ratio=arm.cov_ratio, clip_cov_lb=arm.cov_lb, clip_cov_ub=arm.cov_ub,
                              generator=generator)
        pg, ppo_clipped, keep = res.pg_losses, res.ppo_clipped, ~res.selected
    elif arm.loss == "kl_cov":
        res = kl_cov_losses(lp, old_lp, adv, valid, kl_cov_ratio=arm.cov_ratio, ppo_kl_coef=arm.kl_coef)
        pg, ppo_clipped, keep = res.pg_losses, res.ppo_clipped, ~res.selected
    else:
        pg, ppo_clipped = ppo_clip_losses(lp, old_lp, adv, clip_ratio_low=arm.clip_low, clip_ratio_high=arm.clip_high)
        pg, _ = apply_keep_mask(pg, keep, valid.float())
    loss = pg.mean()
    if arm.entropy_coef:
        loss = loss + entropy_bonus(-(logq.exp() * logq).sum(-1), valid, coef=arm.entropy_coef)
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


def warm_up(
    cfg: LoopConfig,
    seed: int,
    device: torch.device = CPU,
    at_steps: tuple[int, ...] = (),
    on_step: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The warm start of seed ``seed``: a :class:`TinyGPT` initialised after ``torch.manual_seed(seed)``, trained by
    :func:`entropy_discriminator.demo.train.warm_up` for ``cfg.warmup_steps`` steps; ``on_step(step, state)`` (a copy
    of the state dict) after each step in ``at_steps``.  Returns the final state dict, on the CPU."""

    def checkpoint(step: int, _total: int, _info: str) -> None:  # the demo's warm-up calls it after each step
        if on_step is not None and step in at_steps:
            on_step(step, {k: v.detach().clone() for k, v in model.state_dict().items()})

    torch.manual_seed(seed)
    model = TinyGPT(cfg.model_config()).to(device)
    supervised_warm_up(model, cfg, seed=seed, device=device, progress=checkpoint)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _entropy_change(model: TinyGPT, upd: Update, seq: torch.Tensor, resp: torch.Tensor, adv: torch.Tensor,
                    valid: torch.Tensor, old_lp: torch.Tensor, p_len: int) -> tuple[float, float]:
    """(predicted, realised) change of a mini-batch's mean token entropy over the step just taken: Corollary 4's
    ``-Cov_B(A_eff, r S_c)`` (:func:`~entropy_discriminator.batch_entropy_change`, ``A_eff = A * keep * ~ppo_clipped``,
    ``r`` the step's importance ratio) and the policy's mean entropy on the same tokens after minus before."""
    ratio = torch.exp(upd.lp - old_lp).double()
    a_eff = adv.double() * (upd.keep & ~upd.ppo_clipped)
    pred = batch_entropy_change(a_eff, upd.stats.s_centered, valid, lr=1.0, ratio=ratio)
    with torch.no_grad():
        after = token_stats(model.response_logits(seq, p_len).float(), resp)
    return pred, float((after.entropy - upd.stats.entropy).double().mean())


#: What :func:`rl_steps` yields: the step (0: before the first), the policy, the step's record (None at step 0) and
#: the (predicted, realised) entropy change of each of its mini-batch steps (empty unless ``measure_dh``).
Step = tuple[int, TinyGPT, "dict[str, float] | None", "list[tuple[float, float]]"]


def rl_steps(
    state: dict[str, torch.Tensor],
    cfg: RLConfig,
    arm: Arm,
    seed: int,
    steps: int,
    *,
    device: torch.device = CPU,
    measure_dh: bool = False,
) -> Iterator[Step]:
    """RL from the warmed-up ``state`` for ``steps`` steps (see the module docstring), as a generator: first
    ``(0, model, None, [])``, then after each step ``(step, model, record, dh)``; the caller evaluates the policy
    where it wants (between two steps the generator waits).

    ``record``: ``reward`` (mean of the step's samples), and means over its mini-batches of ``entropy`` (the policy's
    mean token entropy before each), ``control_frac`` (share of response tokens whose PG term the arm's control
    removed: Clip_B / Clip_V clipped, the autopilot dropped, forking tokens' dropped low-entropy tokens, Clip-Cov
    detached, KL-Cov penalised), ``ppo_clip_frac`` and ``value_loss`` (0 without a critic).  The autopilot arm adds
    ``autopilot_*`` (the controller's measured and target entropy, its desired and predicted change, its dropped
    share, its scale ``autopilot_scale``; on a calibration step also ``autopilot_cheap_dh``,
    ``autopilot_realised_dh`` and ``autopilot_scale_skipped``); the fixed-share arm ``fixed_share_predicted_dh``
    (the cheap score's prediction after the drop, eta = lr); the adaptive-bonus arm adds ``entropy_coef_applied``
    (mean over the step's mini-batches of the coefficient applied) and ``entropy_coef`` (the coefficient after the
    step)."""
    task = cfg.task()
    mcfg = cfg.model_config()
    torch.manual_seed(seed)
    model = TinyGPT(mcfg).to(device)
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=arm.lr)
    critic = vopt = None
    if arm.estimator == "ppo":
        critic = ValueModel(mcfg, state).to(device)
        vopt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr)
    prompt_gen = torch.Generator().manual_seed(seed)
    sample_gen = torch.Generator().manual_seed(seed + 1)
    g, p_len, n_mb = cfg.group_size, task.prompt_len, cfg.minibatches
    pilot: EntropyAutopilot | None = arm.autopilot_config().build_autopilot() if arm.mask == "autopilot" else None
    law_scale = LawScale(arm.calibrate_every)
    law_scale.bind(pilot)
    adaptive = AdaptiveEntropyCoef.of(arm) if arm.adaptive_entropy else None
    yield 0, model, None, []
    for step in range(1, steps + 1):
        x, t = task.sample(cfg.prompts_per_step, prompt_gen, split="train")
        ro = rollout(model, critic, task, x, t, g, sample_gen, arm.shaping, arm.rank_penalty, device)
        valid = torch.ones_like(ro.resp, dtype=torch.bool)
        rec = {"reward": float(ro.rewards.mean()), "entropy": 0.0, "control_frac": 0.0, "ppo_clip_frac": 0.0,
               "value_loss": 0.0}
        dh: list[tuple[float, float]] = []
        keep_all = cheap = None
        # the batch controls step once per RL step, on the old policy's statistics of the whole batch
        before = token_stats(ro.old_logits, ro.resp) if arm.mask in BATCH_MASKS else None
        if pilot is not None:
            res = pilot.from_stats(before, ro.adv, lr=arm.lr)
            keep_all = res.keep
            rec.update(autopilot_entropy=res.entropy, autopilot_target_entropy=res.target_entropy,
                       autopilot_target_dh=res.target_dh, autopilot_predicted_dh=res.predicted_dh_after,
                       autopilot_dropped_frac=res.dropped_frac)
            if law_scale.tick():
                cheap = cheap_change(ro.adv, before.s_centered, before.valid, eta=arm.lr)
        elif arm.mask == "fixed_share":  # the autopilot's order and defaults, a constant share
            res = fixed_share_mask(before.s_centered, ro.adv, before.valid, share=arm.share, lr=arm.lr,
                                   sides=FIXED_SHARE_ORDER.sides, form=FIXED_SHARE_ORDER.form)
            keep_all = res.keep
            rec["fixed_share_predicted_dh"] = res.predicted_dh_after
        if adaptive is not None:
            rec["entropy_coef_applied"] = 0.0
        for idx in torch.randperm(len(ro.seq), generator=sample_gen).chunk(n_mb):
            idx = idx.to(device)
            s_mb, r_mb, a_mb, v_mb, lp_mb = ro.seq[idx], ro.resp[idx], ro.adv[idx], valid[idx], ro.old_lp[idx]
            ctl = arm if adaptive is None else replace(arm, entropy_coef=adaptive.applied())
            km = None if keep_all is None else keep_all[idx]
            upd = policy_update(model, opt, s_mb, r_mb, a_mb, v_mb, lp_mb, p_len, ctl, sample_gen, keep_mask=km)
            if measure_dh:
                dh.append(_entropy_change(model, upd, s_mb, r_mb, a_mb, v_mb, lp_mb, p_len))
            if adaptive is not None:
                rec["entropy_coef_applied"] += ctl.entropy_coef / n_mb
                adaptive.update(float(upd.stats.entropy.double()[v_mb].mean()))
            rec["entropy"] += float(upd.stats.entropy.double().mean()) / n_mb
            rec["control_frac"] += float((~upd.keep & v_mb).double().mean()) / n_mb
            rec["ppo_clip_frac"] += float((upd.ppo_clipped & v_mb).double().mean()) / n_mb
            if critic is not None and vopt is not None:
                rec["value_loss"] += value_update(critic, vopt, s_mb, p_len, ro.returns[idx]) / n_mb
        if adaptive is not None:
            rec["entropy_coef"] = adaptive.coef
        if cheap is not None:  # a calibration step: the same tokens after the updates
            with torch.no_grad():
                after = token_stats(model.response_logits(ro.seq, p_len).float(), ro.resp)
            realised = float((after.entropy - before.entropy).double()[before.valid].mean())
            rec.update(autopilot_cheap_dh=cheap, autopilot_realised_dh=realised,
                       autopilot_scale_skipped=float(not law_scale.feed(cheap, realised)))
        if pilot is not None:
            rec["autopilot_scale"] = pilot.calibration.scale
        yield step, model, rec, dh
