"""Cost of the verl adapter in a real actor step, verl 0.9.x on one GPU.

verl's own FSDP engine, driven in this one process (rank 0 of a one-rank group; no Ray, no rollout
engine; helpers in ``benchmarks/verl_inprocess.py``): per step the old-log-prob pass
(``ActorRolloutRefWorker.compute_log_prob``), the adapter's driver work, and the actor update
(``update_actor``: one mini-batch, optimizer step).  The batch is synthetic and the same in every
arm: 8 prompts x 8 responses, 32 prompt + 512 response tokens each (``--response-len``), uniform
random token ids, GRPO advantages from verl's ``compute_grpo_outcome_advantage`` on varied rewards.
Model: Qwen2.5-0.5B's shapes (Qwen2 config, 24 layers, hidden 896, vocabulary 151936, tied
embeddings; random weights, written once with ``save_pretrained`` to a temporary directory and
loaded by every arm, so all start from the same weights).  verl's ``ppo_trainer`` defaults
otherwise (padding removal on, FSDP with bf16 mixed precision, fp32 parameters and AdamW, lr 1e-6,
vanilla PPO loss, token-mean, temperature 1, ``torch.compile`` of verl's entropy), except: SDPA
attention, ``ppo_mini_batch_size`` = the 8 prompts (one mini-batch per step, on-policy),
micro-batches of 16 sequences (8704 tokens) for the log-prob pass and 8 for the update.  Without
flash-attn installed, verl computes log-probs from logits with its row-by-row fallback
(``logprobs_from_logits_v2``), which makes the logits arms' verl work host-bound and several times
slower than with flash-attn's cross-entropy; ``--logprobs auto`` (the default) then gives every arm
the one-pass stand-in of :func:`fast_logprobs` instead, so that the adapter's cost is measured
against a realistic baseline (``--logprobs verl`` keeps the fallback).  Not included: Ray and
TransferQueue transfers (the adapter adds one get/put of ``E_p[S]`` and, for the clip arms, of the
advantages), the reference model, rollout.

Arms (each builds its worker, runs ``--steps`` steps, frees it; in this order):

* ``off``: stock verl (``ActorRolloutRefWorker``, no adapter config, the engine hook not installed);
* ``monitor``, ``clip_b``, ``clip_v``: ``trainer.v1.trainer_mode=entropy_disc`` with
  ``+entropy_disc.method=none|clip_b|clip_v`` (the paper's default bounds): the adapter's worker
  class (hook installed), the old-log-prob pass flagged to add ``log p_k``, ``H`` and ``E_p[S]`` of
  verl's own bf16 logits (all three arms), the driver's slice of them, mask and metrics
  (``EntropyDiscTrainerMixin.entropy_disc_step``) and, for the clip arms, the mask applied to the
  advantages as ``_update_actor`` does (``apply_mask``, zero_pg);
* ``off_fused``, ``monitor_fused``, ``clip_b_fused``, ``clip_v_fused``: the same four with
  ``actor_rollout_ref.model.use_fused_kernels=True`` (no logits; the hook re-forms verl's torch fused
  head, bf16 ``(hidden @ W.T) / T`` per 512 rows, in the forward, ``fused_head_stats``).  Last,
  because verl's fused patch replaces the model class's forward for the rest of the process.

Per step, CUDA-synchronised wall time of the old-log-prob pass, the driver work (0 for the off
arms; it runs on the CPU tensors verl's worker returns, as on verl's driver) and the update; and,
inside the old-log-prob pass, the GPU time of the engine hook's own work (``HookClock``: CUDA
events, no synchronisation); per arm the peak ``torch.cuda.max_memory_allocated`` above what was
allocated before the arm's build (``peak_gib``; the peak is reset after the previous arm's worker
is freed, and ``allocated_before_gib`` is what an earlier arm left allocated: about the fp32
parameters' size stays allocated after each freed worker, so later arms start higher).
Medians of steps 2..N.  Not timed (the same in every arm): building the batch and verl's GRPO
advantages.  Writes ``benchmarks/results/<card>/verl_step.csv`` (or ``--out DIR``) and prints a
table; the fused arms are compared with ``off_fused``, the others with ``off``, both as the whole
step (``total_vs_base_pct``, which carries the update's run-to-run drift of several percent: the arms
run one after another) and as the adapter's own time, engine hook plus driver, against the
baseline's step (``adapter_vs_base_pct``).

    python -m benchmarks.verl_step [--steps 4] [--arms off,monitor,...] [--response-len 512] [--logprobs auto|verl|torch]
                                   [--no-compile] [--out DIR]
    python -m benchmarks.verl_step --smoke     # tiny model and batch on the CPU: checks the code path only

Run from the repository root (an installed ``entropy_discriminator`` is not needed; the checkout's
``adapters/`` are used).  The two groups can run in separate processes (``--arms
off,monitor,clip_b,clip_v`` and ``--arms off_fused,clip_v_fused``, different ``--out``).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.common import card_dir, free_memory, timed
from benchmarks.qwen_shapes import SPECIAL, qwen25_05b_shapes, tokenizer
from benchmarks.verl_inprocess import (
    base_tensors,
    checkout_adapters,
    compose_ppo_config,
    nested,
    one_rank_env,
    use_cpu_platform,
)

#: arm -> (entropy_disc.method or None for stock verl, use_fused_kernels)
ARMS: dict[str, tuple[str | None, bool]] = {
    "off": (None, False),
    "monitor": ("none", False),
    "clip_b": ("clip_b", False),
    "clip_v": ("clip_v", False),
    "off_fused": (None, True),
    "monitor_fused": ("none", True),
    "clip_b_fused": ("clip_b", True),
    "clip_v_fused": ("clip_v", True),
}


@dataclass(frozen=True)
class Shape:
    """Batch and micro-batch sizes of one run."""

    prompts: int
    responses: int  # per prompt (rollout.n)
    prompt_len: int
    response_len: int
    log_prob_micro: int  # sequences per micro-batch of the old-log-prob pass
    update_micro: int  # sequences per micro-batch of the update


FULL = Shape(prompts=8, responses=8, prompt_len=32, response_len=512, log_prob_micro=16, update_micro=8)
SMOKE = Shape(prompts=2, responses=4, prompt_len=8, response_len=16, log_prob_micro=4, update_micro=4)


class HookClock:
    """Time of the engine hook's own work, summed over the calls since the last ``take()``.

    Wraps, in ``adapters/verl/_engine``, ``_fsdp_seq_fields`` (logits path: temperature scaling,
    ``token_stats``, unpacking; fused path: unpacking) and ``fused_head_stats`` (fused path: the
    chunked bf16 LM-head products and ``token_stats`` inside the forward); ``restore()`` puts them back.  On a GPU
    each call is bracketed by two CUDA events on the current stream and nothing is synchronised
    (a synchronisation would stall verl's launch queue and itself cost time); ``take()``, called
    after the step's own synchronisation, sums the events' elapsed times: the stretch of the GPU
    timeline the hook occupies.  On the CPU (``--smoke``) wall time of the calls.
    """

    NAMES = ("_fsdp_seq_fields", "fused_head_stats")

    def __init__(self) -> None:
        from entropy_discriminator.adapters.verl import _engine

        self.module, self.seconds, self.events = _engine, 0.0, []
        self.real = {name: getattr(_engine, name) for name in self.NAMES}
        for name, real in self.real.items():
            setattr(_engine, name, self._timed(real))

    def _timed(self, real):
        def call(*args: Any, **kwargs: Any) -> Any:
            if not torch.cuda.is_available():
                t = time.perf_counter()
                out = real(*args, **kwargs)
                self.seconds += time.perf_counter() - t
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = real(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return out

        return call

    def take(self) -> float:
        for start, end in self.events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        seconds, self.seconds, self.events = self.seconds, 0.0, []
        return seconds

    def restore(self) -> None:
        for name, real in self.real.items():
            setattr(self.module, name, real)


def fast_logprobs() -> Any:
    """Give verl's FSDP engine a one-pass torch ``logprobs_from_logits``; returns the undo function.

    verl uses flash-attn's fused cross-entropy kernel when flash-attn is installed and otherwise a
    row-by-row ``log_softmax`` loop (``logprobs_from_logits_v2``: one small launch per token, tens
    of thousands per micro-batch, so the pass is bound by the host).  flash-attn is not installed on
    the benchmark's device, so ``--logprobs torch`` stands in for its kernel with
    ``log_softmax(logits.float()).gather(labels)`` (same values; it reads the logits a few times
    where flash-attn's kernel reads them once, so the stand-in is, if anything, the slower
    baseline).  Every arm gets the same function.
    """
    from verl.workers.engine.fsdp import transformer_impl

    real = transformer_impl.logprobs_from_logits

    def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    transformer_impl.logprobs_from_logits = logprobs_from_logits

    def undo() -> None:
        transformer_impl.logprobs_from_logits = real

    return undo


def write_model(path: Path, smoke: bool) -> None:
    """Random model with Qwen2.5-0.5B's shapes (bf16; tiny and fp32 with ``smoke``) and its tokenizer."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = qwen25_05b_shapes(smoke)
    model = Qwen2ForCausalLM(cfg).to(torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(path)
    tokenizer(cfg.vocab_size).save_pretrained(path)


def overrides(model_dir: Path, method: str | None, fused: bool, shape: Shape, smoke: bool, compile_: bool) -> list[str]:
    """Hydra overrides of one arm on verl's ``ppo_trainer`` config."""
    out = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.rollout.n={shape.responses}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={shape.log_prob_micro}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={shape.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={shape.update_micro}",
        "algorithm.adv_estimator=grpo",
    ]
    if smoke:  # the GPU run keeps verl's default FSDP (1), whose sync_module_states needs an accelerator
        out.append("actor_rollout_ref.actor.strategy=fsdp2")
    if smoke or not compile_:  # torch.compile of verl's entropy: on a CPU it needs a C++ toolchain and minutes
        out.append("actor_rollout_ref.actor.use_torch_compile=False")
    if fused:
        out.append("actor_rollout_ref.model.use_fused_kernels=True")
    if method is not None:
        out += ["trainer.v1.trainer_mode=entropy_disc", f"+entropy_disc.method={method}"]
    return out


def make_batch(step: int, shape: Shape, vocab: int) -> tuple[list[torch.Tensor], list[int], torch.Tensor]:
    """Sequences (prompt + response ids), response lengths and varied per-sequence rewards of step ``step``.

    The responses of a prompt share its prompt ids; rewards are multiples of 1/7 in [0, 1).
    """
    g = torch.Generator().manual_seed(1000 + step)
    seqs = []
    for i in range(shape.prompts):
        prompt = torch.randint(len(SPECIAL), vocab, (shape.prompt_len,), generator=g)
        for _ in range(shape.responses):
            seqs.append(torch.cat([prompt, torch.randint(len(SPECIAL), vocab, (shape.response_len,), generator=g)]))
    rewards = torch.randint(0, 7, (len(seqs),), generator=g).float() / 7
    return seqs, [shape.response_len] * len(seqs), rewards


def grpo_advantages(rewards: torch.Tensor, shape: Shape) -> torch.Tensor:
    """verl's GRPO advantages ``[B, T_resp]`` of outcome rewards placed on each response's last token."""
    import numpy as np
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    b, t = len(rewards), shape.response_len
    token_rewards = torch.zeros(b, t)
    token_rewards[:, -1] = rewards
    index = np.array([f"p{i // shape.responses}" for i in range(b)], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=token_rewards, response_mask=torch.ones(b, t), index=index)
    return adv


def padded(values: torch.Tensor) -> torch.Tensor:
    """A jagged ``[B, j]`` tensor as a dense ``[B, max j]`` one, 0 past each row's end (as verl's driver pads)."""
    return torch.nested.to_padded_tensor(values, 0)


def run_arm(arm: str, model_dir: Path, shape: Shape, ns: argparse.Namespace) -> dict:
    """Build ``arm``'s worker, run ``ns.steps`` steps, free it; the arm's CSV row."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import response_from_nested, response_to_nested

    from entropy_discriminator import EntropyMonitor
    from entropy_discriminator.adapters.verl import check_config
    from entropy_discriminator.adapters.verl._engine import (
        SEQ_FIELD,
        SEQ_FIELDS,
        STATS_CHUNK,
        STATS_FLAG,
        STATS_IMPL,
        engine_hook_installed,
        remove_engine_hook,
    )
    from entropy_discriminator.adapters.verl._trainer import MASKED_FIELDS, EntropyDiscTrainerMixin, apply_mask
    from entropy_discriminator.adapters.verl._workers import stats_worker

    method, fused = ARMS[arm]
    cfg = compose_ppo_config(overrides(model_dir, method, fused, shape, ns.smoke, not ns.no_compile))
    plan = check_config(cfg)
    assert (plan is None) == (method is None), f"{arm}: check_config gave {plan}"
    expected = plan is not None and plan.expected
    remove_engine_hook()  # a previous arm's worker installed it; only the adapter's worker class reinstalls it
    worker_cls = stats_worker(ActorRolloutRefWorker) if expected else ActorRolloutRefWorker
    free_memory()
    held = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else math.nan  # left by earlier arms
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    worker = worker_cls(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    build_s = time.perf_counter() - t0
    assert engine_hook_installed() == expected, f"{arm}: engine hook installed {engine_hook_installed()}, wanted {expected}"
    a, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert bool(cfg.actor_rollout_ref.model.use_remove_padding), "padding removal is verl's default and stays on"
    driver = None
    if plan is not None:
        driver = SimpleNamespace(entropy_disc=plan.options, config=cfg, _entropy_disc_monitor=EntropyMonitor())
    mini = a.ppo_mini_batch_size * rollout.n
    vocab = qwen25_05b_shapes(ns.smoke).vocab_size

    def one_step(step: int) -> dict:
        seqs, r_lens, rewards = make_batch(step, shape, vocab)
        adv = grpo_advantages(rewards, shape)
        response_mask = nested([torch.ones(r, dtype=torch.int64) for r in r_lens])
        flags: dict[str, Any] = {"calculate_entropy": True, "compute_loss": False, "temperature": rollout.temperature}
        if expected:  # the adapter's _compute_old_log_prob
            flags.update({STATS_FLAG: True, STATS_CHUNK: plan.options.chunk_size, STATS_IMPL: plan.options.impl})
        td = tu.get_tensordict(tensor_dict=base_tensors(seqs, r_lens), non_tensor_dict=flags)

        def old_log_prob_pass():  # verl's worker call and its trainer's slicing to the response
            out = worker.compute_log_prob(td)
            return out, response_from_nested(out["log_probs"], response_mask), response_from_nested(out["entropy"], response_mask)

        hook_clock.take()
        (out, old_lp, ent), old_s = timed(old_log_prob_pass)
        assert (SEQ_FIELD in out.keys()) == expected, f"{arm}: E_p[S] in the pass's output: {SEQ_FIELD in out.keys()}"  # noqa: SIM118
        advantages = response_to_nested(adv, response_mask)
        record: dict[str, Any] = {"old_log_prob_s": old_s, "hook_s": hook_clock.take(), "driver_s": 0.0}
        if driver is not None:

            def driver_work():  # _compute_old_log_prob's slice, _compute_advantage's step, _update_actor's mask
                if expected:  # the hook's one distribution
                    hooked = {name: padded(response_from_nested(out[f], response_mask)) for name, f in SEQ_FIELDS.items()}
                    stats = dict(old_log_probs=hooked["logp"], entropy=hooked["entropy"], s_expected=hooked["s_expected"])
                else:
                    stats = dict(old_log_probs=padded(old_lp), entropy=padded(ent), s_expected=None)
                mask, metrics = EntropyDiscTrainerMixin.entropy_disc_step(
                    driver, advantages=padded(advantages), response_mask=padded(response_mask), **stats
                )
                masked = advantages
                if mask is not None:
                    fields = {"advantages": advantages, "response_mask": response_mask, "loss_mask": response_mask}
                    masked = apply_mask(fields, mask.keep, plan.options.mask_mode)["advantages"]
                    assert MASKED_FIELDS[plan.options.mask_mode] == ("advantages",), "verl's defaults: zero_pg"
                return mask, metrics, masked

            (mask, metrics, advantages), record["driver_s"] = timed(driver_work)
            assert mask is None or mask.n_valid == metrics["entropy_disc/tokens/valid"], f"{arm}: mask and metrics disagree"
            record.update(
                n_valid=int(metrics["entropy_disc/tokens/valid"]), n_clipped=mask.n_clipped if mask else 0,
                entropy_mean=metrics["entropy_disc/entropy/mean"], s_centered_std=metrics["entropy_disc/s_centered/std"],
                metrics=len(metrics),
            )
        record["entropy_verl"] = float(ent.values().float().mean())
        train = base_tensors(seqs, r_lens)
        train.update(old_log_probs=old_lp, advantages=advantages)
        td = tu.get_tensordict(
            tensor_dict=train,
            non_tensor_dict={  # what verl's _update_actor puts into the batch
                "calculate_entropy": bool(a.calculate_entropy or a.entropy_coeff != 0.0),
                "distillation_use_topk": False, "distillation_only": False,
                "global_batch_size": mini, "mini_batch_size": mini, "epochs": a.ppo_epochs,
                "seed": a.data_loader_seed, "dataloader_kwargs": {"shuffle": a.shuffle},
                "temperature": rollout.temperature,
            },
        )
        upd, record["update_s"] = timed(worker.update_actor, td)
        upd_metrics = tu.get(upd, "metrics")
        record["pg_loss"] = float(torch.as_tensor(upd_metrics.get("actor/pg_loss", upd_metrics.get("pg_loss"))).float().mean())
        record["total_s"] = record["old_log_prob_s"] + record["driver_s"] + record["update_s"]
        return record

    hook_clock = HookClock()
    try:
        steps = [one_step(step) for step in range(ns.steps)]
    finally:
        hook_clock.restore()
    peak = torch.cuda.max_memory_allocated() / 2**30 - held if torch.cuda.is_available() else math.nan
    worker = None  # frees the engine (the closures above hold the variable, not the worker)
    remove_engine_hook()
    free_memory()
    sel = steps[1:] if len(steps) > 1 else steps  # steps 2..N
    med = {k: statistics.median(s[k] for s in sel) for k in ("old_log_prob_s", "hook_s", "driver_s", "update_s", "total_s")}
    first = steps[0]
    return {
        "arm": arm, "method": method or "stock verl", "fused_kernels": fused, "e_p_s_in_pass": expected,
        "from_hidden": bool(plan is not None and plan.from_hidden), **med, "peak_gib": peak, "allocated_before_gib": held,
        "build_s": build_s,
        "n_valid": first.get("n_valid", ""), "n_clipped": first.get("n_clipped", ""),
        "entropy_verl": first["entropy_verl"], "entropy_mean": first.get("entropy_mean", ""),
        "s_centered_std": first.get("s_centered_std", ""), "n_metrics": first.get("metrics", ""),
        "pg_loss_step1": first["pg_loss"], "total_s_per_step": " ".join(f"{s['total_s']:.4f}" for s in steps),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, run in the given order; of {list(ARMS)}")
    parser.add_argument("--response-len", type=int, default=None, help="response tokens per sequence (default 512)")
    parser.add_argument("--out", type=Path, default=None, help="folder of verl_step.csv (default benchmarks/results/<card>)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and batch on the CPU: checks the code path only")
    parser.add_argument("--logprobs", choices=("auto", "verl", "torch"), default="auto",
                        help="verl: verl's own logprobs_from_logits; torch: the one-pass stand-in of fast_logprobs() in "
                        "every arm; auto (default): torch when flash-attn's cross-entropy is not installed, else verl")
    parser.add_argument("--no-compile", action="store_true",
                        help="actor.use_torch_compile=False (verl's default compiles its entropy function)")
    ns = parser.parse_args(argv)
    checkout_adapters()
    arms = [x.strip() for x in ns.arms.split(",") if x.strip()]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; known: {list(ARMS)}")
    fused_seen = False
    for x in arms:
        if fused_seen and not ARMS[x][1]:
            parser.error(f"--arms: {x!r} after a fused arm; put the fused arms last (verl's fused patch stays)")
        fused_seen |= ARMS[x][1]
    if ns.steps < 1:
        parser.error("--steps must be >= 1")
    if not ns.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; --smoke runs a tiny model on the CPU")
    shape = SMOKE if ns.smoke else FULL
    if ns.response_len is not None:
        if ns.response_len < 1:
            parser.error("--response-len must be >= 1")
        shape = Shape(**{**shape.__dict__, "response_len": ns.response_len})
    one_rank_env()
    if ns.smoke:
        use_cpu_platform()
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", rank=0, world_size=1)

    import transformers
    import verl

    card = "cpu_smoke" if ns.smoke else torch.cuda.get_device_name()
    versions = f"verl {verl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}"
    if ns.no_compile:
        versions += "; actor.use_torch_compile=False"
    from verl.utils import torch_functional

    flash_ce = bool(getattr(torch_functional, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False))
    stand_in = ns.logprobs == "torch" or (ns.logprobs == "auto" and not flash_ce)
    versions += "; log-probs: " + ("one-pass torch stand-in (fast_logprobs)" if stand_in else
                                   "verl's own (" + ("flash-attn cross-entropy" if flash_ce else "row-by-row fallback") + ")")
    model_dir = Path(tempfile.mkdtemp(prefix="verl_step_")) / "qwen25_05b_shapes"
    write_model(model_dir, ns.smoke)
    undo = fast_logprobs() if stand_in else (lambda: None)
    try:
        rows = [run_arm(arm, model_dir, shape, ns) for arm in arms]
    finally:
        undo()
    for r in rows:
        base = next((b for b in rows if b["arm"] == ("off_fused" if r["fused_kernels"] else "off")), None)
        r["baseline"] = base["arm"] if base else ""
        r["total_vs_base_pct"] = 100 * (r["total_s"] / base["total_s"] - 1) if base else math.nan
        # the adapter's own time (engine hook + driver) against the baseline's step: immune to the update's drift
        r["adapter_vs_base_pct"] = 100 * (r["hook_s"] + r["driver_s"]) / base["total_s"] if base else math.nan
        r["peak_vs_base_pct"] = 100 * (r["peak_gib"] / base["peak_gib"] - 1) if base else math.nan
        r["card"], r["versions"] = card, versions
    out = ns.out or Path(__file__).resolve().parent / "results" / ("cpu_smoke" if ns.smoke else card_dir(card))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "verl_step.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    n_seq = shape.prompts * shape.responses
    which = f"medians of steps 2-{ns.steps}" if ns.steps > 1 else "step 1 only (compilation and warm-up included)"
    print(f"card {card}; {versions}; {which}; {n_seq} sequences x "
          f"({shape.prompt_len} + {shape.response_len}) tokens; micro-batches {shape.log_prob_micro} (log-prob), "
          f"{shape.update_micro} (update); CSV {out / 'verl_step.csv'}")
    print("| arm | old-log-prob s | of which hook s | driver s | update s | total s | total vs base | "
          "hook + driver vs base | peak GiB | peak vs base | clipped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        clipped = f"{r['n_clipped']}/{r['n_valid']}" if r["n_valid"] != "" else "-"
        print(f"| {r['arm']} | {r['old_log_prob_s']:.4f} | {r['hook_s']:.4f} | {r['driver_s']:.4f} | {r['update_s']:.4f} | "
              f"{r['total_s']:.4f} | {r['total_vs_base_pct']:+.1f}% vs {r['baseline']} | "
              f"{r['adapter_vs_base_pct']:.2f}% | {r['peak_gib']:.2f} | "
              f"{r['peak_vs_base_pct']:+.1f}% | {clipped} |")
    for r in rows:
        print(f"{r['arm']}: build {r['build_s']:.1f} s; per-step totals {r['total_s_per_step']} s; allocated before "
              f"build {r['allocated_before_gib']:.2f} GiB; step 1: verl entropy {r['entropy_verl']:.6f}, adapter "
              f"{r['entropy_mean']}, S_c std {r['s_centered_std']}, pg_loss {r['pg_loss_step1']:.3e}")
    return rows


if __name__ == "__main__":
    main()
