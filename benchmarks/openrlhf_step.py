"""Cost of the OpenRLHF adapter in a real actor update, OpenRLHF 0.10.2-0.11.x, DeepSpeed bf16, one GPU.

OpenRLHF's own training objects, driven in this one process (rank 0 of a one-rank group; no Ray, no
vLLM, no generation): the model is loaded by OpenRLHF's ``Actor`` (bf16, sdpa attention, packed
samples, temperature 1), wrapped by OpenRLHF's ``DeepspeedStrategy.prepare`` (``deepspeed.initialize``:
ZeRO-2, bf16, gradient clipping 1.0, AdamW (``torch_adam``: DeepSpeed's FusedAdam needs a compiled CUDA
op), constant LR 1e-6) and trained by OpenRLHF's real ``ActorPPOTrainer`` (``PolicyLoss``, packed
``NaiveReplayBuffer``, one epoch).  Model: Qwen2.5-0.5B's shapes (``benchmarks/qwen_shapes.py``,
random weights, its final norm weight scaled (``--head-scale``, :data:`HEAD_SCALE`) so that its
next-token distributions are peaked as a trained policy's rather than near-uniform; written once with
``save_pretrained``).  Per step, the same batch in every arm: 8 prompts x 8 responses, 32 prompt
tokens (uniform random ids) + 512 response tokens (``--response-len``) sampled from the policy itself
before the first update (:func:`sample_responses`, not timed; without both, S* hardly varies and
Clip_B / Clip_V clip nothing), rewards multiples of 1/7, advantages from OpenRLHF's ``group_norm``
estimator (``compute_advantages_and_returns``, not timed).

Timed per step (wall time, GPU synchronised before and after):

* ``old_log_prob_s``: the old-policy forward ``make_experience`` runs (``actor(sequences,
  action_mask, attention_mask)`` under no-grad, in micro-batches of ``--micro`` sequences): with the
  adapter patched this is where it scores the tokens (its ``Actor.forward`` wrapper, from the logits
  of that forward; ``entropy_disc/timing/stats_in_forward``, column ``stats_in_forward_s``, timed from
  the moment the forward's own kernels have finished);
* ``update_s``: ``ActorPPOTrainer.ppo_train`` on the replay buffer: with the adapter this includes its
  round start (``entropy_disc/timing/stats_pass``, column ``stats_pass_s``: taking the buffered
  samples' statistics from the forward, the mask, the metrics and the law scale's cheap prediction; a
  no-grad pass of the policy only in the fallback, column ``from_forward`` 0), but not the law
  calibration's after-update pass (next item);
* ``calibration_pass_s``: the adapter's ``_round.end_round`` inside ``ppo_train`` (timed on its own,
  GPU synchronised): on a calibration round of the law scale (``EntropyDiscConfig.calibrate_every``,
  default 10: the first round, the 11th, the 21st, ...) a no-grad pass over the ``calibrate_share`` (default
  0.25) of the buffered samples that reads their entropy after the update.  Every arm's patch starts a
  fresh law scale (``unpatch`` forgets it), so here every round of an adapter arm is a calibration
  round; a default run has one in ``calibrate_every``: ``calibration_s`` = ``calibration_pass_s /
  calibrate_every`` is its time per step;
* ``total_s``: ``old_log_prob_s + update_s``, the part of an OpenRLHF step outside generation that the
  actor does (reference model, critic and reward model are the same in every arm and not run).

The adapter is patched before the arm's old-log-prob pass (and, once, before the trainer is built,
as the Ray setup hook does, so that its ``ActorPPOTrainer.__init__`` registers the policy) and
unpatched after its ``ppo_train``; ``adapter_s`` = ``stats_in_forward_s + stats_pass_s`` is the
adapter's own time per step without the calibration, ``adapter_vs_off_pct`` that over ``off``'s
``total_s``; ``adapter_calibrated_s`` = ``adapter_s + calibration_s`` is what a default run pays per
step, ``adapter_calibrated_vs_off_pct`` that over ``off``'s ``total_s``.

Arms, interleaved within each step (``off`` first) so that drift of the card's clocks hits every arm
alike: ``off`` (the adapter not patched), ``monitor`` (``method=none``: statistics and metrics),
``clip_b``, ``clip_v`` (the paper's default bounds, ``zero_pg``).  Every arm trains the same engine in
turn (its weights move by one lr-1e-6 step per arm and step).  Peak memory per arm:
``torch.cuda.max_memory_allocated`` over the arm's old-log-prob pass and update, reset before it
(``peak_gib``; the engine, its optimizer state and its weights are allocated before and counted).
Medians of steps 2..N; the adapter's own time is also given against the stock step
(``adapter_vs_off_pct``; ``stats_pass_vs_off_pct``: its round start alone).  Writes
``benchmarks/results/<card>/openrlhf_step.csv`` (or ``--out DIR``) and
prints a table with the ratios against ``off``; also writes ``step_cost.csv`` (``--step-cost FILE``,
default beside ``openrlhf_step.csv``; rows of other cards, frameworks and set-up groups are kept): per adapter
arm, set-up ``bf16_zero2/<arm>/calibrate_every=10,calibrate_share=0.25`` (``adapter_calibrated_s``
over ``off``'s ``total_s``) and ``bf16_zero2/<arm>/calibrate_every=0`` (``adapter_s`` over it).

    python -m benchmarks.openrlhf_step [--steps 4] [--arms off,monitor,clip_b,clip_v] [--response-len 512]
                                       [--micro 8] [--out DIR] [--step-cost FILE]
    python -m benchmarks.openrlhf_step --smoke   # tiny model on the CPU, CUDA calls redirected: checks the code path only

``--smoke`` redirects CUDA calls to the CPU as ``tests/gpu/openrlhf_step_on_cpu.py`` does (DeepSpeed
then uses its CPU accelerator and gloo; the statistics take the torch path); nothing it prints is a
GPU figure.  Stand-ins, as ``tests/gpu/openrlhf_step.py``: ``flash_attn`` (OpenRLHF's packing
helpers: transformers' pure-torch versions), ``vllm`` and ``ray`` (empty; not called).  Run from the
repository root.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

#: arm -> entropy_disc.method (None: the adapter not patched)
ARMS: dict[str, str | None] = {"off": None, "monitor": "none", "clip_b": "clip_b", "clip_v": "clip_v"}


@dataclass(frozen=True)
class Shape:
    """Batch and micro-batch sizes of one run."""

    prompts: int
    responses: int  # per prompt
    prompt_len: int
    response_len: int
    micro: int  # sequences per micro-batch, old-log-prob pass and update


FULL = Shape(prompts=8, responses=8, prompt_len=32, response_len=512, micro=8)
SMOKE = Shape(prompts=2, responses=4, prompt_len=8, response_len=16, micro=4)


def _gpu_script() -> Any:
    """``tests/gpu/openrlhf_step.py`` (its stand-ins and OpenRLHF arguments), imported by path."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import openrlhf_step as script

    return script


def rollout_prompts(step: int, shape: Shape, vocab: int) -> torch.Tensor:
    """Step ``step``'s prompts: ``[prompts * responses, prompt_len]`` uniform random token ids, each
    prompt repeated for its ``responses`` samples (as the group estimator needs)."""
    g = torch.Generator().manual_seed(1000 + step)
    prompts = torch.randint(2, vocab, (shape.prompts, shape.prompt_len), generator=g)
    return prompts.repeat_interleave(shape.responses, dim=0)


@torch.no_grad()
def sample_responses(model_dir: Path, shape: Shape, steps: int, vocab: int) -> list[torch.Tensor]:
    """Every step's responses, ``[n, response_len]`` on the CPU, sampled from the policy itself (the saved
    model, before any update; bf16, KV cache, plain ``softmax`` sampling at temperature 1, no top-k/top-p,
    no stop at EOS so every response has ``response_len`` tokens), all steps in one batch.  Not timed."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device=device, dtype=torch.bfloat16).eval()
    prompts = torch.cat([rollout_prompts(step, shape, vocab) for step in range(steps)]).to(device)
    g = torch.Generator(device=device).manual_seed(2000)
    out = model.model(prompts, use_cache=True)
    past, hidden = out.past_key_values, out.last_hidden_state[:, -1]
    tokens = []
    for i in range(shape.response_len):
        probs = torch.softmax(model.lm_head(hidden).float(), dim=-1)
        tokens.append(torch.multinomial(probs, 1, generator=g))
        if i + 1 < shape.response_len:
            out = model.model(tokens[-1], past_key_values=past, use_cache=True)
            past, hidden = out.past_key_values, out.last_hidden_state[:, -1]
    responses = torch.cat(tokens, dim=1).cpu()
    del model, past, out
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return list(responses.split(shape.prompts * shape.responses))


def make_experience(step: int, shape: Shape, vocab: int, responses: torch.Tensor) -> Any:
    """Step ``step``'s rollout batch in OpenRLHF 0.11's layout: unpadded prompt + response (``responses``,
    sampled from the policy by :func:`sample_responses`), right padding, ``action_mask`` over positions
    ``1..T-1`` (0.10.2 reads the same); no log-probs or advantages yet."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    prompts = rollout_prompts(step, shape, vocab)
    seqs, masks = [], []
    for prompt, response in zip(prompts, responses):
        seqs.append(torch.cat([prompt, response]))
        masks.append(torch.cat([torch.zeros(shape.prompt_len - 1), torch.ones(shape.response_len)]).bool())
    n, width = len(seqs), max(len(x) for x in seqs)
    sequences = torch.zeros(n, width, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    action_mask = torch.zeros(n, width - 1, dtype=torch.bool)
    for i, (x, m) in enumerate(zip(seqs, masks)):
        sequences[i, : len(x)], attention_mask[i, : len(x)], action_mask[i, : len(m)] = x, 1, m
    rewards = torch.randint(0, 7, (n,), generator=torch.Generator().manual_seed(3000 + step)).float() / 7
    return Experience(
        sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
        kl=torch.zeros(action_mask.shape), rewards=rewards, response_length=action_mask.sum(-1).float(),
        total_length=attention_mask.sum(-1).float(), index=list(range(n)), info={"reward": rewards.clone()},
    )


def old_log_probs(actor: Any, exp: Any, micro: int) -> torch.Tensor:
    """``make_experience``'s old-policy pass: ``actor(sequences, action_mask, attention_mask)``, no grad,
    ``micro`` sequences at a time; float32 ``[n, A]`` on the CPU (as the experience stores them)."""
    parts = []
    was_training = actor.training
    actor.eval()
    with torch.no_grad():
        for i in range(0, exp.sequences.shape[0], micro):
            sl = slice(i, i + micro)
            lp = actor(exp.sequences[sl].cuda(), exp.action_mask[sl].cuda(), exp.attention_mask[sl].cuda())
            parts.append(lp.float().cpu())
    actor.train(was_training)
    return torch.cat(parts)


def build(shape: Shape, smoke: bool, model_dir: Path) -> tuple[Any, Any, Any]:
    """OpenRLHF's strategy, DeepSpeed-wrapped ``Actor`` and ``ActorPPOTrainer``, and the arguments."""
    from openrlhf.models import Actor
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    n = shape.prompts * shape.responses
    args = _gpu_script().training_args(micro=shape.micro, total=n, n_per_prompt=shape.responses)
    strategy = DeepspeedStrategy(seed=0, max_norm=1.0, micro_train_batch_size=shape.micro, train_batch_size=n,
                                 zero_stage=2, args=args)
    strategy.setup_distributed()
    actor = Actor(str(model_dir), attn_implementation="sdpa", param_dtype="bf16", packing_samples=True,
                  temperature=1.0, ds_config=strategy.get_ds_train_config())
    original_config = strategy.get_ds_train_config

    def with_torch_adam(*a: Any, **k: Any) -> dict:
        config = original_config(*a, **k)
        if "optimizer" in config:
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    strategy.get_ds_train_config = with_torch_adam
    actor_cfg = dict(optim="adam", adam=dict(lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
                     lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0, scheduler_steps=100)
    actor.cuda()
    actor, optim, scheduler = strategy.prepare((actor, actor_cfg))
    trainer = ActorPPOTrainer(strategy, actor, None, optim, scheduler, micro_train_batch_size=shape.micro,
                              dataloader_pin_memory=False)
    return args, actor, trainer


class CallClock:
    """Wall time of ``owner.name``'s calls (GPU synchronised before and after each, :func:`benchmarks.common.timed`),
    summed until :meth:`take`; :meth:`restore` puts the original back."""

    def __init__(self, owner: Any, name: str) -> None:
        from benchmarks.common import timed

        self.owner, self.name, self.real = owner, name, getattr(owner, name)
        self.seconds, self.calls = 0.0, 0
        real = self.real

        def call(*args: Any, **kwargs: Any) -> Any:
            out, seconds = timed(real, *args, **kwargs)
            self.seconds += seconds
            self.calls += 1
            return out

        setattr(owner, name, call)

    def take(self) -> tuple[float, int]:
        """``(seconds, calls)`` since the last take."""
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out

    def restore(self) -> None:
        setattr(self.owner, self.name, self.real)


#: Factor on the random model's final RMSNorm weight (``--head-scale``): a freshly initialised model's
#: next-token distribution is nearly uniform (entropy ~11.75 nats at V = 151936, logit std 0.6), on which
#: S* hardly varies and Clip_B / Clip_V clip nothing.  Scaled by 12 (Qwen shapes; 8 for the smoke model),
#: the entropy of its rows spans ~0.02-3.8 nats, mean ~1.8 (measured on random token ids; 0.1-5.5, mean
#: ~1.7, for the smoke model): peaked rows with occasional forks, as a trained policy's.
HEAD_SCALE = {False: 12.0, True: 8.0}


def write_model(path: Path, smoke: bool, head_scale: float | None = None) -> int:
    """Random model with Qwen2.5-0.5B's shapes (tiny with ``smoke``), final norm weight times ``head_scale``
    (default :data:`HEAD_SCALE`), bf16; returns its vocabulary size."""
    from transformers import Qwen2ForCausalLM

    from benchmarks.qwen_shapes import qwen25_05b_shapes

    torch.manual_seed(0)
    cfg = qwen25_05b_shapes(smoke)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.mul_(HEAD_SCALE[smoke] if head_scale is None else head_scale)
    model.to(torch.bfloat16).save_pretrained(path)
    return cfg.vocab_size


def run(ns: argparse.Namespace, shape: Shape, arms: list[str]) -> list[dict]:
    """All steps of all arms; one CSV row per arm."""
    from entropy_discriminator.adapters.openrlhf import _round

    model_dir = Path(tempfile.mkdtemp(prefix="openrlhf_step_")) / "qwen25_05b_shapes"
    vocab = write_model(model_dir, ns.smoke, ns.head_scale)
    responses = sample_responses(model_dir, shape, ns.steps, vocab)
    # the law calibration's after-update pass, timed on its own: the adapter's ppo_train wrapper takes end_round
    # from _round when patch() wraps it, so the clock goes in first
    calibration = CallClock(_round, "end_round")
    try:
        return _run_steps(ns, shape, arms, model_dir, vocab, responses, calibration)
    finally:
        calibration.restore()


def _run_steps(ns: argparse.Namespace, shape: Shape, arms: list[str], model_dir: Path, vocab: int,
               responses: list[torch.Tensor], calibration: CallClock) -> list[dict]:
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from benchmarks.common import timed
    from entropy_discriminator import EntropyDiscConfig
    from entropy_discriminator.adapters import openrlhf as adapter

    adapter.patch(EntropyDiscConfig())  # as in a Ray worker: patched before ActorPPOTrainer.__init__ (registers the policy)
    try:
        args, actor, trainer = build(shape, ns.smoke, model_dir)
    finally:
        adapter.unpatch()
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.advantage_estimator = SimpleNamespace(args=args), args, "group_norm"
    maker.kl_ctl = SimpleNamespace(value=0.0)
    cuda = torch.cuda.is_available()
    records: dict[str, list[dict]] = {arm: [] for arm in arms}
    configs = {arm: EntropyDiscConfig(method=ARMS[arm], mask_mode="zero_pg") for arm in arms if ARMS[arm]}
    for step in range(ns.steps):
        for arm in arms:
            method = ARMS[arm]
            exp = make_experience(step, shape, vocab, responses[step])
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if method is None:
                adapter.unpatch()
            else:  # before the old-log-prob pass: the adapter scores the tokens inside it
                adapter.patch(configs[arm])  # a fresh law scale: this round is a calibration round
            calibration.take()
            try:
                lp, old_s = timed(old_log_probs, actor, exp, shape.micro)
                exp.action_log_probs = lp * exp.action_mask
                maker.compute_advantages_and_returns([exp])
                trainer.replay_buffer.clear()
                trainer.replay_buffer.append(exp)
                status, ppo_train_s = timed(trainer.ppo_train, 0.0)
            finally:
                adapter.unpatch()
            calibration_s, passes = calibration.take()
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan
            if method is not None:
                assert "entropy_disc/entropy/mean" in status, f"{arm}: no entropy_disc metrics in ppo_train's status"
                every = configs[arm].calibrate_every
                assert passes == (1 if every else 0), (
                    f"{arm}: {passes} after-update calibration passes in a round with a fresh law scale (calibrate_every "
                    f"{every}; none means no cheap prediction: no learning rate?)")
                assert not passes or "entropy_disc/delta_entropy/realised" in status, f"{arm}: no realised change"
            else:
                assert passes == 0, f"{arm}: the stock arm ran the adapter's end_round"
            if method in ("clip_b", "clip_v"):
                assert "entropy_disc/clip/frac" in status, f"{arm}: no mask"
            update_s = ppo_train_s - calibration_s  # the calibration pass is spread over calibrate_every rounds below
            records[arm].append({
                "old_log_prob_s": old_s, "update_s": update_s, "total_s": old_s + update_s, "peak_gib": peak,
                "calibration_pass_s": calibration_s, "calibration_passes": passes,
                "realised": float(status.get("entropy_disc/delta_entropy/realised", math.nan)),
                "stats_pass_s": float(status.get("entropy_disc/timing/stats_pass", 0.0)),
                "stats_in_forward_s": float(status.get("entropy_disc/timing/stats_in_forward", 0.0)),
                "from_forward": float(status.get("entropy_disc/stats/from_forward", math.nan)),
                "clip_frac": float(status.get("entropy_disc/clip/frac", 0.0)),
                "n_valid": int(status.get("entropy_disc/tokens/valid", 0)),
                "policy_loss": float(status.get("policy_loss", math.nan)),
            })
    rows = []
    for arm in arms:
        steps = records[arm]
        sel = steps[1:] if len(steps) > 1 else steps  # steps 2..N
        for s in steps:
            s["adapter_s"] = s["stats_in_forward_s"] + s["stats_pass_s"]
        med = {k: statistics.median(s[k] for s in sel)
               for k in ("old_log_prob_s", "update_s", "total_s", "stats_in_forward_s", "stats_pass_s", "adapter_s")}
        config = configs.get(arm)
        every = config.calibrate_every if config else 0
        passes = [s["calibration_pass_s"] for s in sel if s["calibration_passes"]]
        pass_s = statistics.median(passes) if passes else 0.0
        calibration_s = pass_s / every if every else 0.0
        rows.append({
            "arm": arm, "method": ARMS[arm] or "stock OpenRLHF", **med,
            # the law calibration's after-update pass (median over the timed steps; every round here), that time
            # spread over the calibrate_every rounds it serves, and the adapter's own time per step with it
            "calibrate_every": every, "calibrate_share": config.calibrate_share if config else 0.0,
            "calibration_pass_s": pass_s, "calibration_s": calibration_s,
            "calibration_passes": sum(s["calibration_passes"] for s in steps),
            "adapter_calibrated_s": med["adapter_s"] + calibration_s,
            "realised_step1": steps[0]["realised"],
            "peak_gib": max(s["peak_gib"] for s in steps) if cuda else math.nan,
            "from_forward": min(s["from_forward"] for s in steps) if ARMS[arm] else math.nan,
            "clip_frac_step1": steps[0]["clip_frac"], "n_valid_step1": steps[0]["n_valid"],
            "policy_loss_step1": steps[0]["policy_loss"],
            "total_s_per_step": " ".join(f"{s['total_s']:.4f}" for s in steps),
        })
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}; off is the baseline")
    parser.add_argument("--response-len", type=int, default=None, help="response tokens per sequence (default 512)")
    parser.add_argument("--micro", type=int, default=None, help="sequences per micro-batch (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="folder of openrlhf_step.csv (default benchmarks/results/<card>)")
    parser.add_argument("--head-scale", type=float, default=None,
                        help="factor on the random model's final norm weight (default 12, smoke 8; 1: as initialised)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and batch on the CPU: checks the code path only")
    parser.add_argument("--step-cost", type=Path, default=None,
                        help="the adapter-share CSV (default: step_cost.csv beside openrlhf_step.csv; rows of other cards, "
                        "frameworks and set-up groups are kept)")
    ns = parser.parse_args(argv)
    arms = [x.strip() for x in ns.arms.split(",") if x.strip()]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; known: {list(ARMS)}")
    if ns.steps < 1:
        parser.error("--steps must be >= 1")
    shape = SMOKE if ns.smoke else FULL
    for field, value in (("response_len", ns.response_len), ("micro", ns.micro)):
        if value is not None:
            if value < 1:
                parser.error(f"--{field.replace('_', '-')} must be >= 1")
            shape = Shape(**{**shape.__dict__, field: value})
    if ns.smoke:
        sys.path.insert(0, str(ROOT / "tests" / "gpu"))
        from openrlhf_step_on_cpu import redirect_cuda_to_cpu

        redirect_cuda_to_cpu()
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; --smoke runs a tiny model on the CPU")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29534"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from benchmarks.verl_inprocess import checkout_adapters  # (imports no verl)

    checkout_adapters()  # the checkout's adapters/ where entropy_discriminator is imported from the checkout
    _gpu_script().install_stand_ins()

    import importlib.metadata

    import deepspeed
    import transformers

    from benchmarks.common import card_dir, print_step_cost, write_step_cost

    card = "cpu_smoke" if ns.smoke else torch.cuda.get_device_name()
    versions = (f"openrlhf {importlib.metadata.version('openrlhf')}, deepspeed {deepspeed.__version__}, "
                f"torch {torch.__version__}, transformers {transformers.__version__}")
    started = time.perf_counter()
    rows = run(ns, shape, arms)
    base = next((r for r in rows if r["arm"] == "off"), None)
    for r in rows:
        r["total_vs_off_pct"] = 100 * (r["total_s"] / base["total_s"] - 1) if base else math.nan
        r["update_vs_off_pct"] = 100 * (r["update_s"] / base["update_s"] - 1) if base else math.nan
        r["stats_pass_vs_off_pct"] = 100 * r["stats_pass_s"] / base["total_s"] if base else math.nan
        r["adapter_vs_off_pct"] = 100 * r["adapter_s"] / base["total_s"] if base else math.nan
        r["calibration_vs_off_pct"] = 100 * r["calibration_s"] / base["total_s"] if base else math.nan
        r["adapter_calibrated_vs_off_pct"] = 100 * r["adapter_calibrated_s"] / base["total_s"] if base else math.nan
        r["peak_vs_off_pct"] = 100 * (r["peak_gib"] / base["peak_gib"] - 1) if base else math.nan
        r["card"], r["versions"] = card, versions
    out = ns.out or ROOT / "benchmarks" / "results" / ("cpu_smoke" if ns.smoke else card_dir(card))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "openrlhf_step.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shares = step_cost_rows(rows, card)
    step_cost = ns.step_cost or out / "step_cost.csv"
    if shares:
        write_step_cost(step_cost, shares)
    n_seq = shape.prompts * shape.responses
    which = f"medians of steps 2-{ns.steps}" if ns.steps > 1 else "step 1 only (warm-up included)"
    print(f"card {card}; {versions}; {which}; {n_seq} sequences x ({shape.prompt_len} + {shape.response_len}) "
          f"tokens, packed, micro-batches of {shape.micro}; {time.perf_counter() - started:.0f} s; "
          f"CSV {out / 'openrlhf_step.csv'}")
    print("| arm | old-log-prob s | of which stats in forward s | update s | of which round start s | total s | "
          "total vs off | adapter's own s | adapter's own vs off | from forward | peak GiB | peak vs off | clip frac |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['old_log_prob_s']:.4f} | {r['stats_in_forward_s']:.4f} | {r['update_s']:.4f} | "
              f"{r['stats_pass_s']:.4f} | {r['total_s']:.4f} | {r['total_vs_off_pct']:+.1f}% | {r['adapter_s']:.4f} | "
              f"{r['adapter_vs_off_pct']:.1f}% | {r['from_forward']:.0f} | "
              f"{r['peak_gib']:.2f} | {r['peak_vs_off_pct']:+.1f}% | {r['clip_frac_step1']:.4f} |")
    print("| arm | calibrate_every, share | after-update pass s | / calibrate_every s | adapter's own with it s | "
          "vs off | realised (step 1) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if ARMS[r["arm"]]:
            print(f"| {r['arm']} | {r['calibrate_every']}, {r['calibrate_share']:g} | {r['calibration_pass_s']:.4f} | "
                  f"{r['calibration_s']:.4f} | {r['adapter_calibrated_s']:.4f} | {r['adapter_calibrated_vs_off_pct']:.2f}% | "
                  f"{r['realised_step1']:.3e} |")
    print_step_cost(shares, step_cost, "needs the off arm and an adapter arm")
    for r in rows:
        print(f"{r['arm']}: per-step totals {r['total_s_per_step']} s; step 1 policy_loss {r['policy_loss_step1']:.4e}")
    return rows


#: The set-up prefix of this benchmark's ``step_cost.csv`` rows: bf16 weights, DeepSpeed ZeRO-2.
SETUP = "bf16_zero2"


def step_cost_rows(rows: list[dict], card: str) -> list[dict]:
    """Two ``step_cost.csv`` rows per adapter arm (:func:`benchmarks.common.step_cost_pair`): its own time per step
    (``adapter_s``, with ``calibration_s`` and without) over ``off``'s ``total_s``; none without ``off``."""
    from benchmarks.common import step_cost_card, step_cost_pair

    base = next((r for r in rows if r["arm"] == "off"), None)
    if base is None:
        return []
    out = []
    for r in rows:
        if ARMS[r["arm"]]:
            out += step_cost_pair(step_cost_card(card), "openrlhf", f"{SETUP}/{r['arm']}", adapter_s=r["adapter_s"],
                                  calibration_s=r["calibration_s"], stock_s=base["total_s"],
                                  every=r["calibrate_every"], share=r["calibrate_share"])
    return out


if __name__ == "__main__":
    main()
