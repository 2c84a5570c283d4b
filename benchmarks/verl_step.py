"""Cost of the verl adapter in a real actor step, verl 0.9.x on one GPU.

verl's own FSDP engine, driven in this one process (rank 0 of a one-rank group; no Ray, no rollout
engine; helpers in ``benchmarks/verl_inprocess.py``): per step the old-log-prob pass
(``ActorRolloutRefWorker.compute_log_prob``), the adapter's driver work, and the actor update
(``update_actor``: one mini-batch, optimizer step), run as verl's V1 trainer runs them: its
``_compute_old_log_prob``, ``_compute_advantage`` and ``_update_actor`` (:class:`InProcessTrainer`, the
in-process stand-ins of verl's own, which need Ray), with the adapter's ``EntropyDiscTrainerMixin`` in
front of them in the adapter arms, so that every line of the adapter's driver code runs, the law
calibration's after-update pass included.  The worker group and TransferQueue are in-process stand-ins
(:class:`InProcessWorkerGroup`, :class:`InProcessQueue`: the mixin's ``tq`` calls go to the latter).
The batch is synthetic and the same in every arm: 8 prompts x 8 responses, 32 prompt + 512 response
tokens each (``--response-len``), uniform random token ids, GRPO advantages from verl's
``compute_grpo_outcome_advantage`` on varied rewards.
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
TransferQueue transfers (the adapter adds gets and puts of ``E_p[S]``, ``log p_k`` and ``H``, for the clip
arms of the advantages, and, on a calibration batch, of its rows' ``entropy`` / ``log_probs``), the
reference model, rollout.

Arms (each builds its worker, runs ``--steps`` steps, frees it; in this order):

* ``off``: stock verl (``ActorRolloutRefWorker``, no adapter config, the engine hook not installed);
* ``monitor``, ``clip_b``, ``clip_v``: ``trainer.v1.trainer_mode=entropy_disc`` with
  ``+entropy_disc.method=none|clip_b|clip_v`` (the paper's default bounds): the adapter's worker
  class (hook installed), the old-log-prob pass flagged to add ``log p_k``, ``H`` and ``E_p[S]`` of
  verl's own bf16 logits (all three arms), the driver's slice of them (``_compute_old_log_prob``), mask,
  metrics and the law scale's cheap prediction (``_compute_advantage``: ``entropy_disc_step``) and, for the
  clip arms, the mask applied to the advantages (``_update_actor``: ``apply_mask``, zero_pg), then, on a
  calibration batch, the law calibration's after-update pass (``_entropy_disc_calibrate``: verl's
  ``compute_log_prob`` once more over ``calibrate_share`` (default 0.25) of the batch's rows, rounded up
  to whole micro-batches: 16 of the 64 sequences, one micro-batch);
* ``off_fused``, ``monitor_fused``, ``clip_b_fused``, ``clip_v_fused``: the same four with
  ``actor_rollout_ref.model.use_fused_kernels=True`` (no logits; the hook re-forms verl's torch fused
  head, bf16 ``(hidden @ W.T) / T`` per 512 rows, in the forward, ``fused_head_stats``).  Last,
  because verl's fused patch replaces the model class's forward for the rest of the process.

Per step, CUDA-synchronised wall time of the old-log-prob pass (verl's worker call and its slicing of
the outputs), the driver work (the mixin's three methods less verl's calls inside them and less the
calibration pass; 0 for the off arms; it runs on the CPU tensors verl's worker returns, as on verl's
driver), the update and the calibration's after-update pass (``calibration_pass_s``: the adapter's
``_entropy_disc_calibrate``, verl's pass included); the in-process queue's own time is left out of every
column, as TransferQueue's transfers are not part of the measured step; and,
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

The law calibration (``EntropyDiscConfig.calibrate_every``, default 10) runs its pass on the law scale's
first batch and every 10th after it: here on step 1 (and on steps 11, 21, ... of a longer run).  The pass is
timed where it runs (``calibration_pass_s``: the mean over the passes; ``calibration_s_per_step`` lists
them) and spread over the batches it serves (``calibration_s`` = ``calibration_pass_s /
calibrate_every``); ``adapter_calibrated_vs_base_pct`` is engine hook + driver + ``calibration_s``
against the baseline's step, what a default run pays.  Also writes ``step_cost.csv`` (``--step-cost
FILE``, default beside ``verl_step.csv``; rows of other cards, frameworks and set-up groups are kept): per
adapter arm, set-up ``bf16_fsdp[_fused]/<arm>/calibrate_every=10,calibrate_share=0.25`` (hook + driver +
``calibration_s``, over the stock arm's ``total_s``) and ``.../calibrate_every=0`` (hook + driver).

    python -m benchmarks.verl_step [--steps 4] [--arms off,monitor,...] [--response-len 512] [--logprobs auto|verl|torch]
                                   [--no-compile] [--out DIR] [--step-cost FILE]
    python -m benchmarks.verl_step --smoke     # tiny model and batch on the CPU: checks the code path only

Run from the repository root (an installed ``entropy_discriminator`` is not needed; the checkout's
``adapters/`` are used).  The two groups can run in separate processes (``--arms
off,monitor,clip_b,clip_v`` and ``--arms off_fused,clip_v_fused``, different ``--out``, the same
``--step-cost``: each replaces only its own set-ups' rows).
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
from typing import Any

import torch

from benchmarks.common import (
    card_dir, free_memory, print_step_cost, step_cost_card, step_cost_pair, timed, write_step_cost,
)
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


class InProcessQueue:
    """TransferQueue's ``kv_batch_get`` / ``kv_batch_put`` in this process, for the adapter's driver methods (which
    call them as ``tq.kv_batch_get`` / ``tq.kv_batch_put`` in ``adapters/verl/_trainer.py``) and the stand-ins of
    verl's trainer and worker group below.  Each key's fields are kept as the rows put; a get returns them as the
    jagged ``TensorDict`` verl's TransferQueue returns (a requested field that not every row holds is left out, as
    ``rollout_log_probs`` without a rollout engine).  The time spent in these calls is summed in ``seconds`` and left
    out of every timed column: as before, TransferQueue's transfers are not part of the measured step.
    """

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self.seconds = 0.0

    def clear(self) -> None:
        self.rows.clear()

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None, tags: Any = None) -> Any:
        from transfer_queue import KVBatchMeta

        t = time.perf_counter()
        if fields is not None:
            for name, value in fields.items():
                for key, row in zip(keys, value.unbind(0), strict=True):
                    self.rows.setdefault((partition_id, key), {})[name] = row
        held = set().union(*(self.rows.get((partition_id, k), {}).keys() for k in keys))
        meta = KVBatchMeta(keys=list(keys), tags=[{} for _ in keys], partition_id=partition_id, fields=sorted(held))
        self.seconds += time.perf_counter() - t
        return meta

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: Any = None) -> Any:
        from tensordict import TensorDict

        t = time.perf_counter()
        rows = [self.rows[(partition_id, k)] for k in keys]
        names = list(rows[0]) if select_fields is None else [select_fields] if isinstance(select_fields, str) else select_fields
        data = TensorDict({n: nested([r[n] for r in rows]) for n in names if all(n in r for r in rows)},
                          batch_size=[len(keys)])
        self.seconds += time.perf_counter() - t
        return data


class InProcessWorkerGroup:
    """verl's actor worker group for the one worker of this process (``actor_rollout_wg``): a call on batch metadata
    reads its rows' fields from the queue, adds the metadata's ``extra_info`` as non-tensor entries, calls the
    worker's method and writes the tensors it returns back to the queue: what verl's dispatch and ``tqbridge`` do
    for one data-parallel rank.  ``_dispatch_info`` is that one rank's (``_entropy_disc_read_multiple`` reads it).
    """

    INPUTS = ("prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask")

    def __init__(self, worker: Any, queue: InProcessQueue) -> None:
        self.worker, self.queue = worker, queue
        self._dispatch_info = {"actor": [0]}

    def _data(self, meta: Any, names: tuple[str, ...]) -> Any:
        from verl.utils import tensordict_utils as tu

        data = self.queue.kv_batch_get(meta.keys, meta.partition_id, list(names))
        return tu.get_tensordict(tensor_dict=dict(data.items()), non_tensor_dict=dict(meta.extra_info))

    def compute_log_prob(self, meta: Any) -> Any:
        from tensordict import TensorDict

        out = self.worker.compute_log_prob(self._data(meta, self.INPUTS))
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        return self.queue.kv_batch_put(meta.keys, meta.partition_id, TensorDict(tensors, batch_size=[len(meta)]))

    def update_actor(self, meta: Any) -> Any:
        return self.worker.update_actor(self._data(meta, (*self.INPUTS, "old_log_probs", "advantages")))


class InProcessTrainer:
    """The per-step methods of verl's V1 ``PPOTrainer`` that the adapter's ``EntropyDiscTrainerMixin`` wraps, for the
    in-process worker (verl's own need Ray and TransferQueue): ``_compute_old_log_prob`` (verl's flags, the worker
    group's ``compute_log_prob``, ``log_probs`` and ``entropy`` sliced to the response and written back as
    ``old_log_probs`` / ``entropy``, as verl's), ``_compute_advantage`` (the batch's GRPO advantages are in the queue
    already: computed before the step, not timed) and ``_update_actor`` (verl's flags, ``update_actor``).  The stock
    arms run this class, the adapter arms the mixin in front of it.  ``timing``: the wall time of the old-log-prob
    pass with verl's slicing (``old_log_prob_s``) and of the update (``update_s``), the queue's time left out.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.queue: InProcessQueue = None  # type: ignore[assignment]
        self.actor_rollout_wg: InProcessWorkerGroup = None  # type: ignore[assignment]
        self.timing: dict[str, float] = {}
        self.update_output: Any = None

    def _timed(self, name: str, fn: Any, *args: Any) -> Any:
        q = self.queue.seconds
        out, seconds = timed(fn, *args)
        self.timing[name] = seconds - (self.queue.seconds - q)
        return out

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        from verl.workers.utils.padding import response_from_nested

        rollout = self.config.actor_rollout_ref.rollout
        batch.extra_info.update({"calculate_entropy": True, "compute_loss": False, "temperature": rollout.temperature})

        def old_log_prob_pass():  # verl's worker call and its trainer's slicing to the response
            self.actor_rollout_wg.compute_log_prob(batch)
            data = self.queue.kv_batch_get(batch.keys, batch.partition_id, ["entropy", "log_probs", "response_mask"])
            data["old_log_probs"] = response_from_nested(data.pop("log_probs"), data["response_mask"])
            data["entropy"] = response_from_nested(data.pop("entropy"), data["response_mask"])
            return self.queue.kv_batch_put(batch.keys, batch.partition_id, data.select("old_log_probs", "entropy"))

        return self._timed("old_log_prob_s", old_log_prob_pass)

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        return batch

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        a, rollout = self.config.actor_rollout_ref.actor, self.config.actor_rollout_ref.rollout
        mini = a.ppo_mini_batch_size * rollout.n
        batch.extra_info.update({  # what verl's _update_actor puts into the batch
            "calculate_entropy": bool(a.calculate_entropy or a.entropy_coeff != 0.0),
            "distillation_use_topk": False, "distillation_only": False,
            "global_batch_size": mini, "mini_batch_size": mini, "epochs": a.ppo_epochs,
            "seed": a.data_loader_seed, "dataloader_kwargs": {"shuffle": a.shuffle},
            "temperature": rollout.temperature,
        })
        self.update_output = self._timed("update_s", self.actor_rollout_wg.update_actor, batch)
        return batch


def make_driver(cfg: Any, plan: Any, worker: Any, queue: InProcessQueue) -> InProcessTrainer:
    """The arm's driver: :class:`InProcessTrainer` for stock verl (``plan`` None), else the adapter's
    ``EntropyDiscTrainerMixin`` in front of it (its own ``__init__``: plan, monitor, law scale), both on ``worker``
    through an :class:`InProcessWorkerGroup` and ``queue``."""
    from entropy_discriminator.adapters.verl._trainer import EntropyDiscTrainerMixin

    class EntropyDiscInProcess(EntropyDiscTrainerMixin, InProcessTrainer):
        pass

    driver = InProcessTrainer(cfg) if plan is None else EntropyDiscInProcess(cfg)
    driver.queue, driver.actor_rollout_wg = queue, InProcessWorkerGroup(worker, queue)
    return driver


def run_arm(arm: str, model_dir: Path, shape: Shape, ns: argparse.Namespace) -> dict:
    """Build ``arm``'s worker, run ``ns.steps`` steps, free it; the arm's CSV row."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import response_to_nested

    from entropy_discriminator.adapters.verl import _trainer, check_config
    from entropy_discriminator.adapters.verl._engine import SEQ_FIELD, engine_hook_installed, remove_engine_hook
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
    rollout = cfg.actor_rollout_ref.rollout
    assert bool(cfg.actor_rollout_ref.model.use_remove_padding), "padding removal is verl's default and stays on"
    queue = InProcessQueue()
    driver = make_driver(cfg, plan, worker, queue)
    every = plan.options.calibrate_every if plan is not None else 0
    share = plan.options.calibrate_share if plan is not None else 0.0
    vocab = qwen25_05b_shapes(ns.smoke).vocab_size
    passes: list[dict] = []  # the law calibration's after-update passes (the adapter's _entropy_disc_calibrate)
    if plan is not None:
        calibrate = driver._entropy_disc_calibrate  # the adapter's own method, bound; _update_actor calls it

        def timed_calibrate(batch: Any, metrics: dict) -> None:
            pending = driver._entropy_disc_calibration
            q = queue.seconds
            _, seconds = timed(calibrate, batch, metrics)
            if pending is not None and pending.keys == tuple(batch.keys):  # a calibration batch: the pass ran
                rows = len(getattr(pending, "rows", batch.keys))  # the rows the pass read (all: an adapter without a share)
                passes.append({"step": STEP[0], "seconds": seconds - (queue.seconds - q), "rows": rows})

        driver._entropy_disc_calibrate = timed_calibrate
    real_tq, _trainer.tq = _trainer.tq, queue  # the adapter's TransferQueue calls, in this process

    def one_step(step: int) -> dict:
        STEP[0] = step
        seqs, r_lens, rewards = make_batch(step, shape, vocab)
        adv = grpo_advantages(rewards, shape)  # not timed (the same in every arm), as the batch itself
        response_mask = nested([torch.ones(r, dtype=torch.int64) for r in r_lens])
        keys = [f"step{step}_{i}" for i in range(len(seqs))]
        queue.clear()
        fields = base_tensors(seqs, r_lens)
        fields["advantages"] = response_to_nested(adv, response_mask)
        batch = queue.kv_batch_put(keys, "train", TensorDict(fields, batch_size=[len(keys)]))
        batch.extra_info["temperature"] = rollout.temperature  # as verl's _step_once
        metrics: dict[str, Any] = {}
        wall = 0.0  # the driver's three calls, the queue's time left out

        def call(fn: Any) -> Any:
            nonlocal wall
            q = queue.seconds
            out, seconds = timed(fn, batch, metrics)
            wall += seconds - (queue.seconds - q)
            return out

        hook_clock.take()
        before = len(passes)
        batch = call(driver._compute_old_log_prob)
        record: dict[str, Any] = {"hook_s": hook_clock.take()}
        in_pass = SEQ_FIELD in queue.rows[("train", keys[0])]
        assert in_pass == expected, f"{arm}: E_p[S] in the pass's output: {in_pass}"
        batch = call(driver._compute_advantage)
        ours = {k: v for k, v in metrics.items() if k.startswith("entropy_disc/")}
        batch = call(driver._update_actor)
        hook_clock.take()  # (the calibration's pass is not flagged: the hook computes nothing there)
        record.update(old_log_prob_s=driver.timing["old_log_prob_s"], update_s=driver.timing["update_s"])
        step_passes = passes[before:]
        record["calibration_pass_s"] = sum(p["seconds"] for p in step_passes)
        record["driver_s"] = 0.0
        if plan is not None:  # the adapter's driver work: its three methods less verl's calls and the calibration
            record["driver_s"] = wall - record["old_log_prob_s"] - record["update_s"] - record["calibration_pass_s"]
            record.update(
                n_valid=int(ours["entropy_disc/tokens/valid"]), n_clipped=int(ours.get("entropy_disc/clip/n_clipped", 0)),
                entropy_mean=ours["entropy_disc/entropy/mean"], s_centered_std=ours["entropy_disc/s_centered/std"],
                metrics=len(ours), realised=metrics.get("entropy_disc/delta_entropy/realised", math.nan),
            )
            assert bool(step_passes) == ("entropy_disc/delta_entropy/realised" in metrics), f"{arm}: pass vs metrics"
        entropy = queue.kv_batch_get(keys, "train", ["entropy"])["entropy"]  # verl's old-pass entropy, put back
        record["entropy_verl"] = float(entropy.values().float().mean())
        upd_metrics = tu.get(driver.update_output, "metrics")
        record["pg_loss"] = float(torch.as_tensor(upd_metrics.get("actor/pg_loss", upd_metrics.get("pg_loss"))).float().mean())
        record["total_s"] = record["old_log_prob_s"] + record["driver_s"] + record["update_s"]
        return record

    hook_clock = HookClock()
    try:
        steps = [one_step(step) for step in range(ns.steps)]
    finally:
        hook_clock.restore()
        _trainer.tq = real_tq
    want = sum(1 for b in range(ns.steps) if every and b % every == 0)  # LawScale.tick: batches 0, every, 2 every, ...
    assert len(passes) == want, f"{arm}: {len(passes)} calibration passes in {ns.steps} steps, wanted {want}"
    peak = torch.cuda.max_memory_allocated() / 2**30 - held if torch.cuda.is_available() else math.nan
    worker = driver = None  # frees the engine (the closures above hold the variables, not the worker)
    remove_engine_hook()
    free_memory()
    sel = steps[1:] if len(steps) > 1 else steps  # steps 2..N
    med = {k: statistics.median(s[k] for s in sel) for k in ("old_log_prob_s", "hook_s", "driver_s", "update_s", "total_s")}
    first = steps[0]
    pass_s = statistics.mean(p["seconds"] for p in passes) if passes else 0.0
    return {
        "arm": arm, "method": method or "stock verl", "fused_kernels": fused, "e_p_s_in_pass": expected,
        "from_hidden": bool(plan is not None and plan.from_hidden), **med, "peak_gib": peak, "allocated_before_gib": held,
        "build_s": build_s,
        "n_valid": first.get("n_valid", ""), "n_clipped": first.get("n_clipped", ""),
        "entropy_verl": first["entropy_verl"], "entropy_mean": first.get("entropy_mean", ""),
        "s_centered_std": first.get("s_centered_std", ""), "n_metrics": first.get("metrics", ""),
        "pg_loss_step1": first["pg_loss"],
        # the law calibration's after-update pass (the adapter's _entropy_disc_calibrate: verl's compute_log_prob over
        # calibrate_share of the batch's rows, rounded up to whole micro-batches; on step 1, the law scale's first
        # batch): its mean time, and that time spread over the calibrate_every batches it serves
        "calibrate_every": every, "calibrate_share": share, "calibration_passes": len(passes),
        "calibration_rows": passes[0]["rows"] if passes else 0,
        "calibration_pass_s": pass_s, "calibration_s": pass_s / every if passes and every else 0.0,
        "realised_step1": first.get("realised", ""),
        "total_s_per_step": " ".join(f"{s['total_s']:.4f}" for s in steps),
        "calibration_s_per_step": " ".join(f"{s['calibration_pass_s']:.4f}" for s in steps),
    }


#: The step running now (``one_step`` sets it; the calibration clock reads it).
STEP = [0]


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
    parser.add_argument("--step-cost", type=Path, default=None,
                        help="the adapter-share CSV (default: step_cost.csv beside verl_step.csv; rows of other cards, "
                        "frameworks and set-up groups are kept)")
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
        # ... and with the law calibration's after-update pass spread over its calibrate_every batches (a default run)
        r["adapter_calibrated_vs_base_pct"] = (
            100 * (r["hook_s"] + r["driver_s"] + r["calibration_s"]) / base["total_s"] if base else math.nan)
        r["peak_vs_base_pct"] = 100 * (r["peak_gib"] / base["peak_gib"] - 1) if base else math.nan
        r["card"], r["versions"] = card, versions
    out = ns.out or Path(__file__).resolve().parent / "results" / ("cpu_smoke" if ns.smoke else card_dir(card))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "verl_step.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shares = step_cost_rows(rows, card)
    step_cost = ns.step_cost or out / "step_cost.csv"
    if shares:
        write_step_cost(step_cost, shares)
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
    print("| arm | calibrate_every, share | rows read | after-update pass s (step 1) | / calibrate_every s | "
          "hook + driver + it vs base | realised (step 1) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["calibrate_every"]:
            print(f"| {r['arm']} | {r['calibrate_every']}, {r['calibrate_share']:g} | {r['calibration_rows']} | "
                  f"{r['calibration_pass_s']:.4f} | {r['calibration_s']:.4f} | {r['adapter_calibrated_vs_base_pct']:.2f}% | "
                  f"{r['realised_step1']:.3e} |")
    print_step_cost(shares, step_cost, "needs an adapter arm and its stock arm, off or off_fused")
    for r in rows:
        print(f"{r['arm']}: build {r['build_s']:.1f} s; per-step totals {r['total_s_per_step']} s; allocated before "
              f"build {r['allocated_before_gib']:.2f} GiB; step 1: verl entropy {r['entropy_verl']:.6f}, adapter "
              f"{r['entropy_mean']}, S_c std {r['s_centered_std']}, pg_loss {r['pg_loss_step1']:.3e}; calibration pass "
              f"per step {r['calibration_s_per_step']} s")
    return rows


#: The set-up prefix of this benchmark's ``step_cost.csv`` rows: FSDP, bf16 mixed precision (fp32 parameters), verl's
#: logits path or its torch fused kernels.
SETUPS = {False: "bf16_fsdp", True: "bf16_fsdp_fused"}


def step_cost_rows(rows: list[dict], card: str) -> list[dict]:
    """Two ``step_cost.csv`` rows per adapter arm whose stock arm ran (:func:`benchmarks.common.step_cost_pair`): its
    own time per step, engine hook + driver (medians of steps 2..N) with the calibration pass / ``calibrate_every``
    and without, over the stock arm's ``total_s``."""
    out = []
    for r in rows:
        if r["method"] == "stock verl" or not r["baseline"]:
            continue
        base = next(b for b in rows if b["arm"] == r["baseline"])
        out += step_cost_pair(step_cost_card(card), "verl", f"{SETUPS[r['fused_kernels']]}/{r['arm'].removesuffix('_fused')}",
                              adapter_s=r["hook_s"] + r["driver_s"], calibration_s=r["calibration_s"],
                              stock_s=base["total_s"], every=r["calibrate_every"], share=r["calibrate_share"])
    return out


if __name__ == "__main__":
    main()
