"""Warm-up (supervised) and strict on-policy GRPO for the demo, with the core's statistics and masks."""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import (EntropyDiscConfig, EntropyMonitor, TokenStats, apply_keep_mask, batch_entropy_change, clip_b_mask,
                clip_v_mask, law, token_stats)
from .model import ModelConfig, TinyGPT
from .task import AdditionTask

ARM_METHODS = ("none", "clip_b", "clip_v", "autopilot")


@dataclass(frozen=True)
class ArmSpec:
    """One training arm, on negative-advantage tokens.  ``method``: ``none`` (vanilla GRPO), ``clip_b`` or ``clip_v``
    (the core masks at ``mu_low``, cap ``max_frac``) or ``autopilot`` (:class:`~entropy_discriminator.EntropyAutopilot`
    toward ``target_entropy``, cap ``max_frac`` or None for its default, on the law's terms for the arm's Adam)."""

    name: str
    method: str = "none"
    mu_low: float = 2.5
    max_frac: float | None = None
    target_entropy: str | float = "hold"

    def __post_init__(self) -> None:
        if self.method not in ARM_METHODS:
            raise ValueError(f"method must be one of {ARM_METHODS}, got {self.method!r}")
        if self.method in ("clip_b", "clip_v"):  # the core's rules for mu_low and max_frac
            EntropyDiscConfig(method=self.method, mu_low=self.mu_low, max_frac=self.max_frac)
        if self.method == "autopilot":
            self.autopilot_config()

    def autopilot_config(self) -> EntropyDiscConfig:
        """The arm's autopilot settings as the core checks them."""
        return EntropyDiscConfig(method="autopilot", target_entropy=self.target_entropy,
                                 max_frac="auto" if self.max_frac is None else self.max_frac)

    def keep(self, stats: TokenStats, adv: torch.Tensor) -> torch.Tensor:
        """Keep-mask [B, T] bool of an arm without a core mask: every token (the lab's Figure 1 arms override it)."""
        return torch.ones_like(stats.valid)


@dataclass(frozen=True)
class LoopConfig(ABC):
    """What every experiment's loop shares (the demo's :class:`TrainConfig`, the lab's configurations): the policy's
    size, :func:`warm_up`'s settings and the RL batch (``prompts_per_step`` x ``group_size`` samples, Adam at ``lr``).
    Abstract: a subclass names its task (:meth:`task`)."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    warmup_steps: int = 600
    warmup_batch: int = 128
    warmup_lr: float = 3e-3
    warmup_noise: float = 0.3
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-3

    def __post_init__(self) -> None:
        for name, low in (("warmup_steps", 0), ("warmup_batch", 1), ("prompts_per_step", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO needs a group), got {self.group_size}")

    @abstractmethod
    def task(self) -> AdditionTask:
        """The task, with :class:`AdditionTask`'s sizes and methods."""

    def model_config(self) -> ModelConfig:
        """:class:`ModelConfig` sized for the task: its vocabulary, ``max_len = prompt_len + response_len``."""
        t = self.task()
        return ModelConfig(t.vocab_size, t.prompt_len + t.response_len, self.d_model, self.n_layers, self.n_heads)


@dataclass(frozen=True)
class TrainConfig(LoopConfig):
    """The demo's run: :class:`LoopConfig` on ``n_digits`` addition, ``grpo_steps`` GRPO steps sampled at
    ``temperature`` (:func:`run_arm`; ``linearised`` adds ``pred_lin_dH``) and :func:`evaluate`'s settings."""

    n_digits: int = 3
    grpo_steps: int = 200
    temperature: float = 1.0
    eval_prompts: int = 200
    eval_k: int = 8
    eval_temperature: float = 0.7
    linearised: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("grpo_steps", 0), ("eval_k", 0), ("eval_prompts", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not (self.temperature > 0 and self.eval_temperature >= 0):
            raise ValueError("temperature must be > 0 and eval_temperature >= 0")

    def task(self) -> AdditionTask:
        """The :class:`AdditionTask` of ``n_digits`` digits."""
        return AdditionTask(n_digits=self.n_digits)


#: ``progress(done, total, info)``: ``info`` a string, or a function returning one (called only when it is shown).
Progress = Callable[[int, int, str | Callable[[], str]], None]


def warm_up(model: TinyGPT, cfg: LoopConfig, *, seed: int, device: torch.device, progress: Progress | None = None,
            target_avg: float | None = None, max_steps: int | None = None) -> dict[str, float]:
    """Supervised warm-up on the task's noisy ``warmup_targets``, the one warm-up of every experiment: mean
    cross-entropy over the response tokens, Adam at ``warmup_lr``, gradient norm clipped at 1, ``cfg.warmup_steps``
    steps; ``progress(step, total, info)`` after each (1-based).  With ``target_avg`` (a :class:`TrainConfig` only) it goes
    on in blocks of a quarter of that until held-out Avg@k reaches it or ``max_steps`` are done.  Returns
    ``{"steps", "loss"}``."""
    if target_avg is not None and not isinstance(cfg, TrainConfig):
        raise ValueError(f"target_avg needs a TrainConfig (the demo's evaluation), got a {type(cfg).__name__}")
    task = cfg.task()
    gen = torch.Generator().manual_seed(seed + 7919)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.warmup_lr)
    limit = max(cfg.warmup_steps, max_steps or 0) if target_avg is not None else cfg.warmup_steps
    block = max(1, cfg.warmup_steps // 4)
    loss = torch.tensor(float("nan"))
    step = 0
    while step < limit:
        if step >= cfg.warmup_steps and (step - cfg.warmup_steps) % block == 0:
            if evaluate(model, cfg, seed=seed, device=device)["avg_at_k"] >= float(target_avg or 0.0):
                break
        problem = task.sample(cfg.warmup_batch, gen, split="train")
        seq = torch.cat([task.prompts(*problem), task.warmup_targets(*problem, cfg.warmup_noise, gen)], dim=1).to(device)
        logits = model.response_logits(seq, task.prompt_len)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), seq[:, task.prompt_len :].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if progress is not None:
            progress(step, limit if step > cfg.warmup_steps else cfg.warmup_steps, lambda: f"loss {loss.item():.3f}")
    return {"steps": float(step), "loss": float(loss.item())}


@torch.no_grad()
def evaluate(model: TinyGPT, cfg: TrainConfig, *, seed: int, device: torch.device) -> dict[str, float]:
    """Avg@k (mean correctness of ``k`` samples per held-out prompt) and Pass@k (share of prompts with a correct
    sample among ``k``) at ``eval_temperature``, on ``eval_prompts`` held-out problems; sampling seeded by ``seed``."""
    task = cfg.task()
    gen = torch.Generator().manual_seed(10_000 + seed)
    a, b = task.sample(cfg.eval_prompts, torch.Generator().manual_seed(12345), split="eval")
    k = cfg.eval_k
    prompts = task.prompts(a, b).repeat_interleave(k, 0).to(device)
    seq = model.generate(prompts, task.response_len, temperature=cfg.eval_temperature, generator=gen)
    ok = task.rewards(a.repeat_interleave(k), b.repeat_interleave(k), seq[:, task.prompt_len :].cpu()).view(-1, k)
    return {"avg_at_k": float(ok.mean()), "pass_at_k": float((ok.sum(1) > 0).float().mean())}


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO advantages [N]: ``(R - mean_g R) / (std_g R + 1e-6)`` within each group of ``group_size``
    consecutive samples (unbiased std, as verl and TRL); all-equal groups get ``A = 0``."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)


@dataclass
class ArmResult:
    """Per-step records (one dict per GRPO step) and the final evaluation of one arm."""

    arm: str
    seed: int
    records: list[dict[str, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)


def _law_terms(model: TinyGPT, opt: torch.optim.Optimizer, seq: torch.Tensor, resp: torch.Tensor, adv: torch.Tensor,
               valid: torch.Tensor, cfg: TrainConfig, prompt_len: int) -> dict[str, object]:
    """The autopilot's inputs from the law for Adam (:func:`entropy_discriminator.law.token_terms`): the per-token
    terms of ``sum_t -A_t log p_t / N`` and the carry, Adam's preconditioner set by this step's unmasked gradient."""
    named = dict(model.named_parameters())

    def fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (seq[:, :-1],))[:, prompt_len - 1 :].float()

    params = list(named.values())
    logits = fn(named)  # one forward for both gradients
    weights = (adv[:, None] * valid / valid.sum().clamp_min(1)).double()
    logp = torch.log_softmax(logits / cfg.temperature, -1).gather(-1, resp[..., None])[..., 0]
    grads = torch.autograd.grad(-(weights.float() * logp).sum(), params, retain_graph=True)
    grads_h = torch.autograd.grad(law.batch_mean_entropy(logits, valid, temperature=cfg.temperature), params)
    res = law.token_terms(opt, named, fn, resp, weights, valid, temperature=cfg.temperature, grads=grads,
                          entropy_grads=grads_h)
    return {"terms": res.terms, "carry": res.carry}


#: The per-step record's columns read from the monitor's metrics, in record order.
_MONITOR_COLUMNS = {"entropy": "entropy/mean", "entropy_p10": "entropy/p10", "entropy_p50": "entropy/p50",
                    "entropy_p90": "entropy/p90", "s_star_mean": "s_star/mean", "s_star_std": "s_star/std",
                    "s_c_mean": "s_centered/mean", "s_c_std": "s_centered/std"}


def run_arm(state: dict[str, torch.Tensor], cfg: TrainConfig, arm: ArmSpec, *, seed: int, device: torch.device,
            progress: Progress | None = None) -> ArmResult:
    """Strict on-policy GRPO from the warmed-up ``state`` for ``cfg.grpo_steps`` steps.  A step: ``P`` prompts x
    ``G`` samples at ``temperature``, exact-match reward, :func:`group_advantages`, the arm's keep-mask, loss
    ``sum_t keep_t (-A_t log p_t) / N`` over the ``N`` valid tokens and one Adam step; its record holds the realised
    ``dH`` of the same tokens (``real_dH``) and Corollary 4's ``-Cov_B(A * keep, S_c)`` per unit step (``pred_dH``).
    Every arm with the same ``seed`` sees the same prompts and sampling stream (they diverge only by their updates)."""
    task = cfg.task()
    torch.manual_seed(seed)
    model = TinyGPT(cfg.model_config()).to(device)
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(seed)
    monitor = EntropyMonitor(prefix="", percentiles=(10, 50, 90))
    pilot = arm.autopilot_config().build_autopilot() if arm.method == "autopilot" else None
    out = ArmResult(arm=arm.name, seed=seed)
    g, p_len = cfg.group_size, task.prompt_len
    t0 = time.perf_counter()
    for step in range(cfg.grpo_steps):
        a, b = task.sample(cfg.prompts_per_step, gen, split="train")
        prompts = task.prompts(a, b).repeat_interleave(g, 0).to(device)
        seq = model.generate(prompts, task.response_len, temperature=cfg.temperature, generator=gen)
        resp = seq[:, p_len:]
        rewards = task.rewards(a.repeat_interleave(g), b.repeat_interleave(g), resp.cpu()).to(device)
        adv = group_advantages(rewards, g)

        logits = model.response_logits(seq, p_len)
        stats = token_stats(logits.detach(), resp, temperature=cfg.temperature)
        valid = stats.valid
        mask = None
        if arm.method in ("clip_b", "clip_v"):
            clip, score = (clip_b_mask, stats.s_star) if arm.method == "clip_b" else (clip_v_mask, stats.s_centered)
            mask = clip(score, adv, valid, mu_low=arm.mu_low, max_frac=arm.max_frac)
        elif pilot is not None:
            mask = pilot.from_stats(stats, adv, **_law_terms(model, opt, seq, resp, adv, valid, cfg, p_len)).mask
        keep = arm.keep(stats, adv) if mask is None else mask.keep

        metrics = monitor.from_stats(stats, advantages=adv, mask=mask, lr=1.0)
        pred = batch_entropy_change(adv[:, None].double() * keep, stats.s_centered, valid, lr=1.0, form="cov")
        a_sc = adv[:, None].double() * stats.s_centered.double() * valid
        n_valid = max(float(valid.sum()), 1.0)

        if cfg.linearised:  # the gradient of the batch-mean entropy, for the linearised prediction
            h_bar = law.batch_mean_entropy(model.response_logits(seq, p_len), valid, temperature=cfg.temperature)
            grads = torch.autograd.grad(h_bar, list(model.parameters()))
            before = [p_.detach().clone() for p_ in model.parameters()]

        logp = torch.log_softmax(logits.float() / cfg.temperature, -1).gather(-1, resp[..., None])[..., 0]
        pg_losses, loss_mask = apply_keep_mask(-adv[:, None] * logp, keep, valid.float(), mode="zero_pg")
        loss = (pg_losses * loss_mask).sum() / loss_mask.sum().clamp_min(1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        with torch.no_grad():
            after = token_stats(model.response_logits(seq, p_len), resp, temperature=cfg.temperature)
        rec = {"step": step, "reward": float(rewards.mean()), **{k: metrics[m] for k, m in _MONITOR_COLUMNS.items()},
               "clip_frac": 1.0 - float((keep & valid).sum()) / n_valid,
               "cov_adv_sc": metrics.get("cov/adv_s_centered", 0.0),
               "neg_cov_pos_part": -float(a_sc[adv > 0].sum()) / n_valid,
               "neg_cov_neg_part": -float(a_sc[adv < 0].sum()) / n_valid, "pred_dH": pred,
               "real_dH": monitor.realised(stats.entropy, after.entropy, valid)["delta_entropy/realised"],
               "loss": float(loss.detach())}
        if cfg.linearised:
            moves = zip(grads, model.parameters(), before)
            rec["pred_lin_dH"] = float(sum((gr * (p_.detach() - b_)).sum() for gr, p_, b_ in moves))
        out.records.append(rec)
        if progress is not None:
            progress(step + 1, cfg.grpo_steps, f"H {rec['entropy']:.3f} R {rec['reward']:.2f} clip {rec['clip_frac']:.3f}")
    out.final = evaluate(model, cfg, seed=seed, device=device)
    out.final["seconds"] = time.perf_counter() - t0
    return out


def pearson(x: list[float], y: list[float]) -> float:
    """Pearson correlation of two equal-length sequences (nan when either is constant or shorter than 3)."""
    if len(x) != len(y):
        raise ValueError(f"x and y must have equal length, got {len(x)} and {len(y)}")
    if len(x) < 3:
        return math.nan
    return float(torch.corrcoef(torch.tensor([x, y], dtype=torch.float64))[0, 1])


def sign_agreement(x: list[float], y: list[float]) -> float:
    """Share of pairs where ``x`` and ``y`` have the same sign (pairs with a zero skipped; nan if none)."""
    pairs = [(u, v) for u, v in zip(x, y) if u != 0 and v != 0]
    return sum((u > 0) == (v > 0) for u, v in pairs) / len(pairs) if pairs else math.nan
