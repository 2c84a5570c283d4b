"""``python -m entropy_lab.law_eval``: the entropy law on the same batch, and the autopilot that uses it.

Four set-ups, each trained with Adam (:data:`SETUPS`): the demo's addition task (``demo``), the plain-PyTorch loop
of ``examples/custom_loop.py`` (``custom``) and the two set-ups of the autopilot evaluation (``s1``, ``s2``:
signed-sum Countdown, 1,000- and 2,500-step warm-ups, GRPO lr 1e-4, PPO clip 0.2, 2 mini-batches per RL step,
gradient norm clipped at 1).  Every optimizer step records, on its own mini-batch (the same tokens before and after
the step):

* ``real_dH``: the realised change of the tokens' mean entropy;
* ``exact_dH``: ``∇θH_B · Δθ`` of the step taken (:func:`~entropy_discriminator.law.step_entropy_change`,
  after the backward and the clipping, before ``optimizer.step()``);
* plain GRPO runs also: ``exact2_dH``, that plus ``½ Δθᵀ∇²θH_B Δθ``
  (:func:`~entropy_discriminator.law.step_entropy_curvature`), and ``logit1_dH`` / ``logit2_dH``, the logits
  expanded to first / second order in the same ``Δθ`` and the entropy taken exactly
  (:func:`~entropy_discriminator.law.logit_step_entropy_change`), all before the step;
* ``token_dH``: the per-token path the autopilot uses, computed before the masked backward
  (:func:`~entropy_discriminator.law.token_terms` with Adam's preconditioner and the clipping factor of this step's
  unmasked gradient, one extra backward), summed over the kept tokens, plus its carry;
* ``cor4_dH``: Corollary 4's ``-lr Cov_B(A keep, r S_c)``; ``calibrated_dH``: the same times ``kappa`` of a
  :class:`~entropy_discriminator.law.Calibration` fed by the earlier steps' ``exact_dH`` (out of sample);
* seconds spent in each path and in the plain step (forward, backward, optimizer step).

``validate`` runs plain GRPO (no control); ``autopilot`` runs the :class:`~entropy_discriminator.EntropyAutopilot`
with the law's terms at a target above, at and below the start entropy; ``report`` writes the tables and figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.func import functional_call

from entropy_discriminator import EntropyAutopilot, apply_keep_mask, batch_entropy_change, law, token_stats
from entropy_discriminator.baselines import ppo_clip_losses
from entropy_discriminator.demo.train import TrainConfig, group_advantages, warm_up

from .records import load_jsonl

#: The set-ups: the demo task, the custom loop, the autopilot evaluation's S1 and S2.
SETUPS = ("demo", "custom", "s1", "s2")
#: ``protocol`` configurations of S1 and S2 (docs/reproduction/autopilot_eval/PREREGISTRATION.md).
HEAD_CONFIGS = {
    "s1": "d_model=64,n_layers=2,warmup_noise=0,targets=uniform,warmup_steps=1000",
    "s2": "d_model=64,n_layers=2,warmup_noise=0,targets=uniform,warmup_steps=2500",
}
#: Targets of the autopilot evaluation, relative to the start entropy ``H_0`` (nats/token).
TARGETS = {"above": 0.05, "at": 0.0, "below": -0.05}
#: The autopilot's settings in the evaluation (everything else its defaults).
AUTOPILOT_SETTINGS = dict(sides="both", max_frac=0.2, decay_steps=20)
#: The probe reading of autopilot runs (:func:`probe_reader`): every PROBE_EVERY RL steps (and on step 1), the mean
#: token entropy of PROBE_BATCHES fresh rollout batches of the current policy, from streams of their own.
PROBE_EVERY, PROBE_BATCHES = 5, 16
#: Offset of the probe's seeds from the run's, so that its prompt and sampling streams share nothing with training.
PROBE_SEED_OFFSET = 1_000_003


@dataclass
class Batch:
    """One RL step's data: sequences, responses, per-token advantages ``[B, T]`` and old log-probs; S1 / S2 batches
    also keep the rollout's response logits ``[B, T, V]`` (float32), which the probe reads."""

    seq: torch.Tensor
    resp: torch.Tensor
    adv: torch.Tensor
    old_lp: torch.Tensor
    logits: torch.Tensor | None = None


@dataclass
class Env:
    """A set-up ready to train: model, Adam, a batch sampler and how logits are read."""

    name: str
    model: torch.nn.Module
    lr: float
    minibatches: int
    grad_clip: float | None
    ppo_clip: float | None
    sample: Callable[[], Batch]
    logits: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]  # (params, seq) -> response logits
    generator: torch.Generator


def _custom_loop_module():
    """``examples/custom_loop.py`` of this checkout, imported by path (it is not part of the installed package)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "custom_loop.py"
    if not path.exists():
        raise FileNotFoundError(f"setup 'custom' needs {path} (a source checkout)")
    spec = importlib.util.spec_from_file_location("custom_loop", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_env(setup: str, seed: int, *, quick: bool = False) -> Env:
    """The set-up ``setup`` for ``seed``, warmed up as its own harness does (``quick``: tiny warm-ups, for tests)."""
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")
    torch.manual_seed(seed)
    if setup == "demo":
        cfg = TrainConfig(warmup_steps=20 if quick else 600)
        from entropy_discriminator.demo.model import TinyGPT

        model = TinyGPT(cfg.model_config())
        warm_up(model, cfg, seed=seed, device=torch.device("cpu"), target_avg=None if quick else 0.3,
                max_steps=None if quick else 2 * cfg.warmup_steps)
        task, gen = cfg.task(), torch.Generator().manual_seed(seed)
        g, p_len = cfg.group_size, task.prompt_len

        def sample() -> Batch:
            a, b = task.sample(cfg.prompts_per_step, gen, split="train")
            seq = model.generate(task.prompts(a, b).repeat_interleave(g, 0), task.response_len, temperature=1.0,
                                 generator=gen)
            resp = seq[:, p_len:]
            adv = group_advantages(task.rewards(a.repeat_interleave(g), b.repeat_interleave(g), resp), g)
            with torch.no_grad():
                return _batch(model_logits(dict(model.named_parameters()), seq), seq, resp, adv)

        def model_logits(params: dict[str, torch.Tensor], seq: torch.Tensor) -> torch.Tensor:
            return functional_call(model, params, (seq[:, :-1],))[:, p_len - 1 :].float()

        return Env(setup, model, cfg.lr, 1, None, None, sample, model_logits, gen)
    if setup == "custom":
        cl = _custom_loop_module()
        model = cl.TinyLM()
        gen = torch.Generator().manual_seed(seed)
        n_prompts, g = 16, 8

        def sample() -> Batch:
            prompts, answers = cl.make_prompts(n_prompts, gen)
            prompts, answers = prompts.repeat_interleave(g, 0), answers.repeat_interleave(g, 0)
            seq = cl.sample(model, prompts, gen, 1.0)
            resp = seq[:, cl.PROMPT_LEN :]
            adv = group_advantages((resp == answers).float().mean(1), g)
            with torch.no_grad():
                return _batch(model_logits(dict(model.named_parameters()), seq), seq, resp, adv)

        def model_logits(params: dict[str, torch.Tensor], seq: torch.Tensor) -> torch.Tensor:
            return functional_call(model, params, (seq[:, :-1],))[:, cl.PROMPT_LEN - 1 :]

        return Env(setup, model, 5e-4, 1, None, None, sample, model_logits, gen)
    return head_env(setup, HEAD_CONFIGS[setup], seed, quick=quick)


def head_env(name: str, config: str, seed: int, *, quick: bool = False, warm: Path | None = None) -> Env:
    """A ``protocol`` configuration ``config`` for ``seed``, warmed up as ``protocol`` does, or from the state dict
    saved at ``warm`` (a warm start of ``protocol``'s cache); GRPO lr 1e-4, its PPO clip and mini-batches, gradient
    norm clipped at 1."""
    from .rl import warm_up as warm_start
    from entropy_discriminator.demo.model import TinyGPT
    from .protocol import parse_config

    cfg = parse_config(config)
    if quick:
        cfg = replace(cfg, warmup_steps=20)
    state = warm_start(cfg, seed) if warm is None else torch.load(warm, weights_only=True)
    task = cfg.task()
    torch.manual_seed(seed)
    model = TinyGPT(cfg.model_config())
    model.load_state_dict(state)
    sample, sample_gen = _head_sampler(cfg, task, model, seed)
    p_len = task.prompt_len

    def model_logits(params: dict[str, torch.Tensor], seq: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (seq[:, :-1],))[:, p_len - 1 :].float()

    return Env(name, model, 1e-4, cfg.minibatches, 1.0, cfg.clip_eps, sample, model_logits, sample_gen)


def _batch(logits: torch.Tensor, seq: torch.Tensor, resp: torch.Tensor, adv: torch.Tensor) -> Batch:
    old_lp = torch.log_softmax(logits.detach(), -1).gather(-1, resp[..., None])[..., 0]
    return Batch(seq, resp, adv[:, None].expand(resp.shape).contiguous(), old_lp)


def run(env: Env, steps: int, *, pilot: EntropyAutopilot | None = None, tag: str = "", second_order: bool = False,
        probe: Callable[[], float] | None = None, probe_every: int = PROBE_EVERY) -> list[dict[str, float]]:
    """``steps`` RL steps of ``env`` (``minibatches`` optimizer steps each); one record per optimizer step.

    Loss per mini-batch: PPO's clipped surrogate (plain ``-A r`` without ``ppo_clip``), keep-mask as ``zero_pg``,
    token mean; gradient norm clipped at ``grad_clip``; Adam.  With ``pilot`` the autopilot steps once per
    optimizer step with the law's per-token terms of that mini-batch, and each record also holds
    ``autopilot_entropy_fixed``: the policy's mean token entropy, read with ``autopilot_entropy`` (before the step), on the fixed contexts of the first
    mini-batch (whose entropy before any step is the autopilot's ``H_0``).  ``second_order`` adds ``exact2_dH``,
    the first-order prediction plus :func:`~entropy_discriminator.law.step_entropy_curvature` of the same step.
    ``probe`` (autopilot runs): on RL step 1 and every ``probe_every``-th, called before the step's first update;
    its value (the policy's entropy read on batches of its own, :func:`probe_reader`) goes into that step's records
    as ``autopilot_entropy_probe``.  It must draw from no stream training uses, so that training is the same with
    and without it.
    """
    model = env.model
    params = dict(model.named_parameters())
    plist = list(params.values())
    opt = torch.optim.Adam(plist, lr=env.lr)
    cal = law.Calibration()
    clip_factor = 1.0
    records: list[dict[str, float]] = []
    fixed: torch.Tensor | None = None  # the first mini-batch's sequences (autopilot runs)
    for step in range(1, steps + 1):
        batch = env.sample()
        h_probe = probe() if probe is not None and (step == 1 or step % probe_every == 0) else None
        for mb, idx in enumerate(torch.randperm(len(batch.seq), generator=env.generator).chunk(env.minibatches)):
            seq, resp, adv, old_lp = batch.seq[idx], batch.resp[idx], batch.adv[idx], batch.old_lp[idx]
            valid = torch.ones_like(resp, dtype=torch.bool)
            n = float(valid.sum())
            t0 = time.perf_counter()
            logits = env.logits(params, seq)
            lp = torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]
            ratio = torch.exp(lp - old_lp)
            stats = token_stats(logits.detach(), resp)
            if env.ppo_clip is None:
                pg, clipped = -adv * ratio, torch.zeros_like(valid)
            else:
                pg, clipped = ppo_clip_losses(lp, old_lp, adv, clip_ratio_low=env.ppo_clip, clip_ratio_high=env.ppo_clip)
            t_fwd = time.perf_counter() - t0

            t0 = time.perf_counter()  # ∇θH_B through the training forward's graph: shared by both paths
            gh = torch.autograd.grad(law.batch_mean_entropy(logits, valid), plist, retain_graph=True, allow_unused=True)
            t_grad_h = time.perf_counter() - t0

            t0 = time.perf_counter()
            weights = (adv * ratio.detach() * ~clipped / n).double()  # ω_t: -∂L/∂log p_t of the token-mean loss
            # this step's unmasked gradient sets Adam's second moment and the clipping factor of the preconditioner
            grads = torch.autograd.grad((pg * valid).sum() / n, plist, retain_graph=True)
            if env.grad_clip is not None:
                norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
                clip_factor = min(1.0, env.grad_clip / (norm + 1e-6))
            terms = law.token_terms(opt, params, lambda p: env.logits(p, seq), resp, weights, valid,
                                    grads=grads, grad_scale=clip_factor, entropy_grads=gh)
            t_token = time.perf_counter() - t0

            res = None
            keep = valid
            if pilot is not None:
                fixed = seq if fixed is None else fixed
                with torch.no_grad():
                    h_fixed = float(token_stats(env.logits(params, fixed), fixed[:, -resp.shape[1]:]).entropy.double().mean())
                res = pilot.step(adv, s_centered=stats.s_centered, entropy=stats.entropy, valid=valid,
                                 terms=terms.terms, carry=terms.carry)
                keep = res.keep
            pg_kept, loss_mask = apply_keep_mask(pg, keep, valid.float())
            t0 = time.perf_counter()
            loss = (pg_kept * loss_mask).sum() / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if env.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(plist, env.grad_clip)
            t_bwd = time.perf_counter() - t0

            t0 = time.perf_counter()
            exact = law.step_entropy_change(opt, plist, gh)
            t_exact = time.perf_counter() - t0
            higher = _beyond_first_order(lambda p: env.logits(p, seq), params, law.optimizer_step_delta(opt, plist),
                                         valid, exact) if second_order else {}

            kept_w = (adv * keep).double()
            cor4 = batch_entropy_change(kept_w, stats.s_centered, valid, lr=env.lr, ratio=ratio.detach())
            kappa = cal.scale
            cal.update(cor4, exact)
            token_pred = terms.carry + float(terms.terms[keep].sum())

            t0 = time.perf_counter()
            opt.step()
            t_step = time.perf_counter() - t0
            with torch.no_grad():
                after = token_stats(env.logits(params, seq), resp)
            real = float(after.entropy.double()[valid].mean() - stats.entropy.double()[valid].mean())
            rec = {
                "setup": env.name, "tag": tag, "step": step, "mb": mb, "entropy": float(stats.entropy.double()[valid].mean()),
                "real_dH": real, "exact_dH": exact, "token_dH": token_pred, "carry_dH": terms.carry, "cor4_dH": cor4,
                "calibrated_dH": kappa * cor4, "kappa": kappa, "clip_factor": clip_factor, "dropped_frac": 1 - float(keep.sum()) / n,
                "sec_step": t_fwd + t_bwd + t_step, "sec_entropy_grad": t_grad_h, "sec_exact": t_exact, "sec_token": t_token,
                **higher,
            }  # fmt: skip
            if res is not None:
                rec.update(autopilot_entropy=res.entropy, autopilot_entropy_smoothed=res.entropy_smoothed,
                           autopilot_target_entropy=res.target_entropy, autopilot_target_dh=res.target_dh,
                           autopilot_predicted_dh=res.predicted_dh_after, autopilot_dropped_frac=res.dropped_frac,
                           autopilot_capped=float(res.mask.capped))
                rec["autopilot_entropy_fixed"] = h_fixed
                if h_probe is not None:
                    rec["autopilot_entropy_probe"] = h_probe
            records.append(rec)
    return records


def _beyond_first_order(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], params: dict[str, torch.Tensor],
                        delta: Sequence[torch.Tensor], valid: torch.Tensor, first: float) -> dict[str, float]:
    """The step's predictions beyond first order along ``delta``, each with its seconds: ``exact2_dH`` (``first`` +
    :func:`~entropy_discriminator.law.step_entropy_curvature`), ``logit1_dH`` / ``logit2_dH``
    (:func:`~entropy_discriminator.law.logit_step_entropy_change`, ``order`` 1 / 2)."""
    named_delta = dict(zip(params, delta))
    out: dict[str, float] = {}
    for key, sec, predict in (
        ("exact2_dH", "sec_second", lambda: first + law.step_entropy_curvature(fn, params, named_delta, valid)),
        ("logit1_dH", "sec_logit1", lambda: law.logit_step_entropy_change(fn, params, named_delta, valid, order=1)),
        ("logit2_dH", "sec_logit2", lambda: law.logit_step_entropy_change(fn, params, named_delta, valid, order=2)),
    ):
        t0 = time.perf_counter()
        out[key] = predict()
        out[sec] = time.perf_counter() - t0
    return out


def fit(pred: Sequence[float], real: Sequence[float]) -> dict[str, float]:
    """Least-squares slope of ``real`` on ``pred`` (with intercept), Pearson ``r``, and the count."""
    x = torch.tensor(pred, dtype=torch.float64)
    y = torch.tensor(real, dtype=torch.float64)
    xc, yc = x - x.mean(), y - y.mean()
    sxx, syy = float((xc * xc).sum()), float((yc * yc).sum())
    slope = float((xc * yc).sum()) / sxx if sxx > 0 else math.nan
    r = float((xc * yc).sum()) / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan
    return {"slope": slope, "r": r, "n": len(pred)}


def _warm(job: tuple[str, int, bool, str]) -> str:
    """Warm up one (setup, seed) on one thread and save its weights under ``folder``; returns the path."""
    setup, seed, quick, folder = job
    torch.set_num_threads(1)
    path = Path(folder) / f"{setup}_{seed}.pt"
    if not path.exists():
        t0 = time.perf_counter()
        env = make_env(setup, seed, quick=quick)
        torch.save(env.model.state_dict(), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        print(f"[{setup} seed {seed}] warm-up {time.perf_counter() - t0:.0f}s", flush=True)
    return str(path)


def _job(job: tuple[str, int, int, str, bool, str, str, int]) -> list[dict[str, float]]:
    """One (setup, seed, arm) from the seed's saved warm start: plain GRPO (``"validate"``) or an autopilot target
    (with :func:`probe_reader`'s reading of ``probe_batches`` batches, 0 none)."""
    setup, seed, steps, arm, quick, sink, folder, probe_batches = job
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    env = make_env(setup, seed, quick=True)  # the tiny warm-up is replaced by the saved one
    env.model.load_state_dict(torch.load(Path(folder) / f"{setup}_{seed}.pt", weights_only=True))
    env = _fresh_streams(env, setup, seed)
    probe = probe_reader(env, setup, seed, probe_batches) if arm != "validate" and probe_batches > 0 else None
    recs = run(env, steps, pilot=None if arm == "validate" else _pilot(arm), tag=arm, second_order=arm == "validate",
               probe=probe)
    for r in recs:
        r["seed"] = seed
    with open(sink, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    print(f"[{setup} seed {seed} {arm}] {steps} steps in {time.perf_counter() - t0:.0f}s", flush=True)
    return recs


def _pilot(arm: str) -> EntropyAutopilot:
    """The evaluation's autopilot for target ``arm`` (``above`` / ``at`` / ``below``); ``H_0`` is read on step 1."""
    if arm not in TARGETS:
        raise ValueError(f"arm must be 'validate' or one of {sorted(TARGETS)}, got {arm!r}")
    return _RelativeTarget(TARGETS[arm])


class _RelativeTarget(EntropyAutopilot):
    """An autopilot whose target is ``H_0 + offset`` (``H_0`` measured on its first batch), ramped over
    ``decay_steps``; ``offset = 0`` is ``"hold"``."""

    def __init__(self, offset: float) -> None:
        settings = dict(AUTOPILOT_SETTINGS)
        decay = settings.pop("decay_steps")
        super().__init__("hold", **settings)
        self.offset, self.ramp = offset, decay

    def target_entropy_at(self, step: int, h_start: float) -> float:
        return h_start + self.offset * min(step, self.ramp) / self.ramp


def _fresh_streams(env: Env, setup: str, seed: int) -> Env:
    """The same prompt and sampling streams for every arm of a seed (paired arms)."""
    if setup in ("s1", "s2"):
        return _reseeded_head(env, setup, seed)
    env.generator.manual_seed(seed)
    return env


def _reseeded_head(env: Env, setup: str, seed: int) -> Env:
    from .protocol import parse_config

    cfg = parse_config(HEAD_CONFIGS[setup])
    sample, sample_gen = _head_sampler(cfg, cfg.task(), env.model, seed)
    return replace(env, sample=sample, generator=sample_gen)


def probe_reader(env: Env, setup: str, seed: int, batches: int) -> Callable[[], float]:
    """A precise reading of the policy's on-policy entropy: the mean token entropy (nats) over the response tokens
    of ``batches`` fresh rollout batches of ``env.model``, each like a training batch (S1 / S2: same prompts per
    step, group size and temperature), from prompt and sampling streams seeded ``seed + PROBE_SEED_OFFSET`` (shared
    with nothing training draws from).  It estimates what one training batch's reading does, with about
    ``batches ** -0.5`` of its sampling noise."""
    if setup not in HEAD_CONFIGS:
        raise ValueError(f"the probe reads S1 / S2 set-ups, got {setup!r}")
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    from .protocol import parse_config

    cfg = parse_config(HEAD_CONFIGS[setup])
    sample, _ = _head_sampler(cfg, cfg.task(), env.model, seed + PROBE_SEED_OFFSET)

    def read() -> float:  # the rollout's own response logits: no second forward
        total, count = 0.0, 0
        for _ in range(batches):
            b = sample()
            h = token_stats(b.logits, b.resp).entropy.double()
            total, count = total + float(h.sum()), count + h.numel()
        return total / count

    return read


def _head_sampler(cfg, task, model: torch.nn.Module, seed: int) -> tuple[Callable[[], Batch], torch.Generator]:
    """A set-up's rollout batches from ``model`` (prompt stream seeded ``seed``, sampling stream ``seed + 1``) and
    the sampling generator."""
    from .rl import rollout

    prompt_gen, sample_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)

    def sample() -> Batch:
        x, t = task.sample(cfg.prompts_per_step, prompt_gen, split="train")
        ro = rollout(model, None, task, x, t, cfg.group_size, sample_gen, "none", 0.25, torch.device("cpu"))
        return Batch(ro.seq, ro.resp, ro.adv, ro.old_lp, ro.old_logits)

    return sample, sample_gen


def run_jobs(work: Sequence[tuple[str, int, str]], steps: int, out: Path, *, jobs: int, quick: bool = False,
             probe_batches: int = PROBE_BATCHES) -> list[dict[str, float]]:
    """Every ``(setup, seed, arm)`` of ``work``, ``jobs`` processes at a time: first each (setup, seed)'s warm-up
    (saved under ``out/warm``, reused when present), then the arms; records appended to ``out/runs.jsonl`` as each
    arm lands."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "warm").mkdir(exist_ok=True)
    sink = out / "runs.jsonl"
    warm = sorted({(s, seed, quick, str(out / "warm")) for s, seed, _ in work})
    runs = [(s, seed, steps, arm, quick, str(sink), str(out / "warm"), probe_batches) for s, seed, arm in work]
    if jobs <= 1:
        [_warm(w) for w in warm]
        results = [_job(w) for w in runs]
    else:
        with mp.get_context("spawn").Pool(min(jobs, len(runs))) as pool:
            pool.map(_warm, warm, chunksize=1)
            results = pool.map(_job, runs, chunksize=1)
    return [r for rs in results for r in rs]


# ------------------------------------------------------------------------------------------------ report


def law_table(records: Sequence[dict]) -> list[dict[str, object]]:
    """Per set-up: slope and r of each prediction against the realised same-batch change, and the seconds per
    optimizer step of each path; rows ``GRPO`` (plain GRPO, ``tag == "validate"``), ``autopilot`` (the autopilot
    runs, where tokens are dropped) and ``autopilot, from step 2`` (without each run's first optimizer step: Adam's
    first step, with no second moment yet, is sign-like, ``lr g / |g|``, and not additive over tokens)."""
    rows = []
    for setup in SETUPS:
        for runs, pick in (("GRPO", lambda r: r["tag"] == "validate"), ("autopilot", lambda r: r["tag"] in TARGETS),
                           ("autopilot, from step 2",
                            lambda r: r["tag"] in TARGETS and (r["step"], r["mb"]) != (1, 0))):
            recs = [r for r in records if r["setup"] == setup and pick(r)]
            if recs:
                rows.append(_law_row(setup, runs, recs))
    return rows


def _law_row(setup: str, runs: str, recs: Sequence[dict]) -> dict[str, object]:
    real = [r["real_dH"] for r in recs]
    row: dict[str, object] = {"setup": setup, "runs": runs, "steps": len(recs)}
    for key in ("exact_dH", "exact2_dH", "logit1_dH", "logit2_dH", "token_dH", "calibrated_dH", "cor4_dH"):
        pairs = [(r[key], y) for r, y in zip(recs, real) if key in r and not math.isnan(r[key])]
        f = fit(*zip(*pairs)) if len(pairs) > 2 else {"slope": math.nan, "r": math.nan}
        row[f"{key}_slope"], row[f"{key}_r"] = f["slope"], f["r"]
    for key in ("sec_step", "sec_entropy_grad", "sec_exact", "sec_second", "sec_logit1", "sec_logit2", "sec_token"):
        vals = [r[key] for r in recs if key in r and not math.isnan(r[key])]
        row[key] = statistics.mean(vals) if vals else math.nan
    ratios = [abs(r["real_dH"]) / abs(r["cor4_dH"]) for r in recs if r["cor4_dH"]]
    row["real_to_cor4_median"] = statistics.median(ratios) if ratios else math.nan
    return row


def autopilot_table(records: Sequence[dict], warm_share: float = 0.2) -> list[dict[str, object]]:
    """Per (set-up, target, seed): the median over RL steps after the first ``warm_share`` of
    ``|H - H*|`` (``H``: the RL step's measured entropy, mean of its mini-batches' ``autopilot_entropy``), the
    tolerance ``max(0.02, 0.05 H_0)``, the standard deviation of ``H - H*`` over those steps, the same median for
    the policy's entropy on the first mini-batch's fixed contexts (``autopilot_entropy_fixed``), the same median
    for the probe reading on the steps that have one (``autopilot_entropy_probe``, :func:`probe_reader`; nan
    without), and the share of acting steps (dropped share > 0) whose share is strictly below the cap."""
    cap = AUTOPILOT_SETTINGS["max_frac"]
    rows = []
    keys = sorted({(r["setup"], r["tag"], r["seed"]) for r in records if r["tag"] in TARGETS})
    for setup, tag, seed in keys:
        recs = [r for r in records if (r["setup"], r["tag"], r["seed"]) == (setup, tag, seed)]
        steps = sorted({r["step"] for r in recs})
        per_step = {s: [r for r in recs if r["step"] == s] for s in steps}
        h = {s: statistics.mean(r["autopilot_entropy"] for r in rs) for s, rs in per_step.items()}
        h_star = {s: statistics.mean(r["autopilot_target_entropy"] for r in rs) for s, rs in per_step.items()}
        after = [s for s in steps if s > warm_share * len(steps)]
        err = statistics.median(abs(h[s] - h_star[s]) for s in after)
        h_fixed = {s: statistics.mean(r["autopilot_entropy_fixed"] for r in rs) for s, rs in per_step.items()}
        err_fixed = statistics.median(abs(h_fixed[s] - h_star[s]) for s in after)
        noise = statistics.stdev(h[s] - h_star[s] for s in after)
        probed = [s for s in after if "autopilot_entropy_probe" in per_step[s][0]]
        err_probe = (statistics.median(abs(per_step[s][0]["autopilot_entropy_probe"] - h_star[s]) for s in probed)
                     if probed else math.nan)
        h0 = per_step[steps[0]][0]["autopilot_entropy"]
        acting = [r["autopilot_dropped_frac"] for r in recs if r["autopilot_dropped_frac"] > 0]
        inside = sum(0 < d < cap - 1e-12 and not r_capped for d, r_capped in
                     ((r["autopilot_dropped_frac"], r["autopilot_capped"]) for r in recs if r["autopilot_dropped_frac"] > 0))
        rows.append({"setup": setup, "target": tag, "seed": seed, "h0": h0, "target_final": h_star[steps[-1]],
                     "median_abs_err": err, "tolerance": max(0.02, 0.05 * h0), "ok_err": err <= max(0.02, 0.05 * h0),
                     "sd_err": noise, "median_abs_err_fixed": err_fixed, "ok_err_fixed": err_fixed <= max(0.02, 0.05 * h0),
                     "probe_steps": len(probed), "median_abs_err_probe": err_probe,
                     "ok_err_probe": err_probe <= max(0.02, 0.05 * h0),
                     "acting_steps": len(acting), "share_inside": inside / len(acting) if acting else math.nan,
                     "ok_share": bool(acting) and inside / len(acting) >= 0.5,
                     "mean_dropped": statistics.mean(r["autopilot_dropped_frac"] for r in recs)})
    return rows


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else (f"{v:.3g}" if abs(v) < 1e-2 and v else f"{v:.3f}")
    return str(v)


def markdown(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A markdown table of ``rows`` restricted to ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def report(records: Sequence[dict], out: Path) -> dict[str, object]:
    """``law.md`` (same-batch table), ``autopilot.md`` (per target), and with matplotlib ``law.png`` and
    ``autopilot_<setup>.png`` under ``out``; returns the two tables."""
    out.mkdir(parents=True, exist_ok=True)
    lt, at = law_table(records), autopilot_table(records)
    law_cols = ["setup", "runs", "steps", "exact_dH_slope", "exact_dH_r", "exact2_dH_slope", "exact2_dH_r", "logit1_dH_slope",
                "logit1_dH_r", "logit2_dH_slope", "logit2_dH_r", "token_dH_slope", "token_dH_r", "calibrated_dH_slope",
                "calibrated_dH_r", "cor4_dH_r", "real_to_cor4_median", "sec_step", "sec_entropy_grad", "sec_exact", "sec_second", "sec_logit1", "sec_logit2",
                "sec_token"]
    (out / "law.md").write_text(markdown(lt, law_cols) + "\n")
    ap_cols = ["setup", "target", "seed", "h0", "target_final", "median_abs_err", "tolerance", "ok_err", "sd_err",
               "median_abs_err_fixed", "ok_err_fixed", "probe_steps", "median_abs_err_probe", "ok_err_probe",
               "acting_steps", "share_inside", "ok_share", "mean_dropped"]
    (out / "autopilot.md").write_text(markdown(at, ap_cols) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"law": lt, "autopilot": at}
    setups = [s for s in SETUPS if any(r["setup"] == s and r["tag"] == "validate" for r in records)]
    if setups:
        kinds = (("exact_dH", "∇H·Δθ (first order)"), ("logit1_dH", "H(z + JΔθ) − H(z)"),
                 ("logit2_dH", "H(z + JΔθ + ½Δθᵀ∇²zΔθ) − H(z)"), ("token_dH", "per-token path"))
        fig, axes = plt.subplots(len(kinds), len(setups), figsize=(3.6 * len(setups), 3.2 * len(kinds)), squeeze=False)
        for j, setup in enumerate(setups):
            recs = [r for r in records if r["setup"] == setup and r["tag"] == "validate"]
            real = [r["real_dH"] for r in recs]
            for i, (key, label) in enumerate(kinds):
                ax = axes[i][j]
                pred = [r[key] for r in recs]
                ax.scatter(pred, real, s=3, linewidths=0)
                lim = max(max(map(abs, pred)), max(map(abs, real)))
                ax.plot([-lim, lim], [-lim, lim], "k--", lw=0.7)
                f = fit(pred, real)
                ax.set_title(f"{setup}: {label}\nslope {f['slope']:.2f}, r {f['r']:.3f}", fontsize=8)
                ax.set_xlabel("predicted ΔH (nats)", fontsize=7)
                ax.set_ylabel("realised ΔH, same batch", fontsize=7)
                ax.tick_params(labelsize=6)
        fig.tight_layout()
        _save(fig, out / "law.png")
    for setup in sorted({r["setup"] for r in records if r["tag"] in TARGETS}):
        fig, axes = plt.subplots(2, len(TARGETS), figsize=(11, 5.5), squeeze=False)
        for j, tag in enumerate(TARGETS):
            recs = [r for r in records if r["setup"] == setup and r["tag"] == tag]
            for seed in sorted({r["seed"] for r in recs}):  # per RL step: the mean of its mini-batches
                rs = [r for r in recs if r["seed"] == seed]
                x = sorted({r["step"] for r in rs})
                mean = {k: [statistics.mean(r[k] for r in rs if r["step"] == s) for s in x]
                        for k in ("autopilot_entropy", "autopilot_target_entropy", "autopilot_dropped_frac")}
                line, = axes[0][j].plot(x, mean["autopilot_entropy"], lw=0.6)
                probe = [(r["step"], r["autopilot_entropy_probe"]) for r in rs
                         if r["mb"] == 0 and "autopilot_entropy_probe" in r]
                if probe:
                    axes[0][j].plot(*zip(*probe), "o", ms=2, color=line.get_color())
                axes[0][j].plot(x, mean["autopilot_target_entropy"], "k--", lw=0.8)
                axes[1][j].plot(x, mean["autopilot_dropped_frac"], lw=0.6)
            axes[0][j].set_title(f"{setup}, target {tag} the start", fontsize=9)
            axes[0][j].set_ylabel("entropy: batch (solid), probe (dots); target (dashed)", fontsize=7)
            axes[1][j].axhline(AUTOPILOT_SETTINGS["max_frac"], color="r", lw=0.7, ls=":")
            axes[1][j].set_ylabel("dropped share, mean of the RL step (cap dotted)", fontsize=7)
            axes[1][j].set_xlabel("RL step", fontsize=7)
        fig.tight_layout()
        _save(fig, out / f"autopilot_{setup}.png")
    return {"law": lt, "autopilot": at}


def _save(fig, path: Path) -> None:
    """Write ``fig`` as a PNG of at most 64 colours (small records), with Pillow when present; closes it."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    try:
        from PIL import Image
    except ImportError:
        path.write_bytes(buf.getvalue())
        return
    Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m entropy_lab.law_eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("validate", "autopilot"):
        p = sub.add_parser(name, allow_abbrev=False)
        p.add_argument("--setups", default="demo,custom,s1,s2" if name == "validate" else "s1,s2")
        p.add_argument("--seeds", default="0" if name == "validate" else "0,1,2,3,4")
        p.add_argument("--steps", type=int, default=120 if name == "validate" else 200)
        p.add_argument("--jobs", type=int, default=1)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--quick", action="store_true", help="tiny warm-ups (tests)")
        if name == "autopilot":
            p.add_argument("--validate-too", default="", help="set-ups (comma-separated) whose first seed also runs "
                           "plain GRPO for the same-batch table")
            p.add_argument("--probe-batches", type=int, default=PROBE_BATCHES,
                           help=f"batches of the probe reading every {PROBE_EVERY} RL steps (0: none)")
    p = sub.add_parser("report", allow_abbrev=False)
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "report":
        records = load_jsonl(*args.runs)
        tables = report(records, args.out)
        print((args.out / "law.md").read_text())
        print((args.out / "autopilot.md").read_text())
        return 0 if tables else 1
    setups = [s for s in args.setups.split(",") if s]
    for s in setups:
        if s not in SETUPS:
            parser.error(f"--setups: {s!r} is not one of {SETUPS}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.steps < 3:
        parser.error(f"--steps must be >= 3, got {args.steps}")
    if args.cmd == "validate":
        work = [(s, seed, "validate") for s in setups for seed in seeds]
    else:
        work = [(s, seed, arm) for s in setups for seed in seeds for arm in TARGETS]
        work = [(s, seeds[0], "validate") for s in args.validate_too.split(",") if s] + work
    if getattr(args, "probe_batches", 0) < 0:
        parser.error(f"--probe-batches must be >= 0, got {args.probe_batches}")
    records = run_jobs(work, args.steps, args.out, jobs=args.jobs, quick=args.quick,
                       probe_batches=getattr(args, "probe_batches", 0))
    tables = report(records, args.out)
    print((args.out / "law.md").read_text())
    if args.cmd == "autopilot":
        print((args.out / "autopilot.md").read_text())
    return 0 if tables else 1


if __name__ == "__main__":
    sys.exit(main())
