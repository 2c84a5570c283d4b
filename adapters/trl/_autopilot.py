"""The entropy autopilot (``method="autopilot"``) in ``GRPOTrainer``: one controller per trainer,
stepped once per training batch, its state in every Trainer checkpoint; and, for every method, the
scale ``kappa`` of the cheap prediction (:mod:`entropy_discriminator.law_scale`).

Law scale: :func:`law_batch` counts each statistics batch, logs ``entropy_disc/delta_entropy/cheap``
(``-eta Cov_B(A, r S_c)`` of the batch, global over the group), ``/predicted = kappa * cheap`` and
``/scale``, and parks every ``calibrate_every``-th batch; once the updates that used it are done
(:class:`_AfterUpdate`, at the end of the optimizer step that exhausted its generation batch)
:func:`calibrate_pending` re-reads that batch's entropy with TRL's own log-prob pass (no grad, the
statistics captured as before the update) and feeds ``(cheap, realised)``.  Why the realised change
and not ``law.step_entropy_change``: a generation batch spans ``steps_per_generation x num_iterations``
micro-batches of possibly several optimizer steps, and under FSDP / DeepSpeed the parameters and the
optimizer state are sharded; the realised change of the same tokens needs neither.  The scale's state
is ``stateful_callbacks[LAW_KEY]`` of ``trainer_state.json``.

Stepping: where Clip_B / Clip_V compute their mask (:mod:`._patch`: once per generation batch, or
in the first training forward of the batch), :func:`step` calls
``EntropyAutopilot.from_stats(stats, advantages, lr=eta, ratio=r)`` instead, global over the
data-parallel group: ``stats`` (B, T) the adapter's statistics of the generating policy,
``advantages`` TRL's (B,), ``eta =`` :func:`step_size` (``entropy_disc.eta`` or ``args.learning_rate``), ``r`` (B, T) vLLM's
importance-sampling ratio ``pi_trainer / pi_vllm`` when TRL applies one to the loss (its
``importance_sampling_ratio``; (B, 1) in the sequence modes, broadcast), else None (r = 1: the
statistics are those of the policy that generated the batch).  The keep-mask reaches the loss
exactly like the masks' (``zero_pg`` or ``drop_token``); the controller's metrics
``entropy_disc/autopilot/*`` go to TRL's logs next to the monitor's.

State with the checkpoint: after every step the controller's ``state_dict()`` (plain JSON values) is written to ``trainer.state.stateful_callbacks[STATE_KEY]``, so it is part of the
``trainer_state.json`` of every checkpoint Trainer saves (rank 0 writes it; every rank holds the
same state).  On ``train(resume_from_checkpoint=...)`` Trainer loads that file into a new
``trainer.state``; :func:`sync`, run before the first generation of every ``train()`` call,
restores the controller from it.  A ``train()`` from step 0 starts a fresh controller (as Trainer
starts a fresh state); a resume (``global_step > 0``) from a checkpoint without the entry is
refused before any generation.  Transformers' own ``restore_callback_states_from_checkpoint``
(off by default) is not involved: with it on, Transformers logs that the entry is no callback of
the run and ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import TrainerCallback

from entropy_discriminator import EntropyMonitor, MaskResult, TokenStats

from entropy_discriminator.law_scale import REALISED_KEY, SKIPPED_KEY, LawScale, calibration_rows, cheap_change
from ._mask import loss_mask, process_group
from ._stats import restrict

#: Key of the controller's ``state_dict()`` in ``TrainerState.stateful_callbacks`` (trainer_state.json).
STATE_KEY = "EntropyDiscAutopilot"
#: Key of the law scale's ``state_dict()`` (:mod:`entropy_discriminator.law_scale`: schedule, and ``kappa``
#: without the autopilot).
LAW_KEY = "EntropyDiscLawScale"
#: The inputs of TRL's log-prob pass that the after-update pass of a calibration batch reads again.
_PASS_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


@dataclass
class PendingCalibration:
    """A calibration batch waiting for its after-update pass: the inputs of its rows that the pass reads, their
    entropy before the update (``(m, T)``, from the statistics), their valid tokens, and the whole batch's cheap
    prediction."""

    batch: dict[str, torch.Tensor]
    entropy: torch.Tensor
    valid: torch.Tensor
    cheap: float


def step_size(config: Any, learning_rate: object) -> float:
    """The law's step size: ``entropy_disc.eta`` when set, else TRL's ``learning_rate`` (> 0).

    ``ValueError`` in one sentence when neither gives a finite real > 0 (e.g. ``learning_rate=0``).
    """
    if config.eta is None:
        value = learning_rate.item() if isinstance(learning_rate, torch.Tensor) else learning_rate
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
        if not ok:
            raise ValueError(
                f"entropy_disc.eta is None and TRL's learning rate is {value!r}, so the autopilot has no step size "
                "for its law: set learning_rate > 0, or entropy_disc.eta (--entropy_disc_eta) to a finite real > 0"
            )
    return config.step_size(learning_rate)


def sync(trainer: Any, state: Any) -> None:
    """Bind the controller to this ``train()`` call's ``trainer.state`` (once per call; see the module docstring).

    ``state`` is the trainer's :class:`._patch.AdapterState`; raises ``ValueError`` when a resumed
    ``trainer.state`` (``global_step > 0``) carries no controller state.
    """
    run = trainer.state
    if state.autopilot_run is run:
        return
    saved = run.stateful_callbacks.get(STATE_KEY)
    if saved is None and run.global_step > 0:
        raise ValueError(
            f"entropy_disc method='autopilot' resumes at global step {run.global_step} from a checkpoint whose "
            f"trainer_state.json has no '{STATE_KEY}' entry under stateful_callbacks (saved by a run without the "
            "autopilot, or by an older adapter); the controller's state (its step and starting entropy) cannot be "
            "restored. Resume from a checkpoint of an autopilot run, or start training from step 0."
        )
    pilot = state.config.build_autopilot(process_group(trainer), vocab_size=vocab_size(trainer))
    if saved is not None:
        pilot.load_state_dict(saved)
    state.autopilot, state.autopilot_run = pilot, run


def sampling_ratio(batch: dict[str, Any], shape: torch.Size) -> torch.Tensor | None:
    """``r`` of the law, ``shape`` (B, T): TRL's ``importance_sampling_ratio`` broadcast, or None (r = 1)."""
    ratio = batch.get("importance_sampling_ratio")
    return None if ratio is None else ratio.float().expand(shape)


def step(trainer: Any, state: Any, stats: TokenStats, advantages: torch.Tensor,
         ratio: torch.Tensor | None) -> MaskResult:
    """One step of the controller :func:`sync` bound (global over its group); returns its keep-mask.

    Logs ``entropy_disc/autopilot/*`` (when ``log_metrics``) and writes the new state into
    ``trainer.state`` for the next checkpoint.
    """
    config = state.config
    result = state.autopilot.from_stats(stats, advantages, lr=step_size(config, trainer.args.learning_rate),
                                        ratio=ratio)
    trainer.state.stateful_callbacks[STATE_KEY] = state.autopilot.state_dict()
    if config.log_metrics:
        for key, value in result.metrics().items():
            trainer._metrics["train"][key].append(value)
    return result.mask


def vocab_size(trainer: Any) -> int | None:
    """The policy's vocabulary size from its Hugging Face config (None when not found)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and size >= 2 else None


def sync_law(trainer: Any, state: Any) -> None:
    """Bind the law scale (:mod:`entropy_discriminator.law_scale`) to this ``train()`` call's ``trainer.state``:
    restored from its :data:`LAW_KEY` entry when there is one (a resume), else fresh; bound to the controller's calibration
    with method ``"autopilot"`` (call after :func:`sync`).  A pending calibration of another call is dropped."""
    run = trainer.state
    if state.law_run is run:
        return
    scale = LawScale(state.config.calibrate_every)
    scale.bind(state.autopilot)
    saved = run.stateful_callbacks.get(LAW_KEY)
    if saved is not None:
        scale.load_state_dict(saved)
    state.law, state.law_run, state.law_pending = scale, run, None
    if not any(isinstance(cb, _AfterUpdate) and cb.trainer is trainer for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(_AfterUpdate(trainer, state))


class _AfterUpdate(TrainerCallback):
    """Runs a parked calibration batch's after-update pass at the end of the optimizer step that used the last
    of its generation batch (TRL generates anew every ``steps_per_generation * num_iterations`` micro-batches),
    before Trainer logs and saves that step, so a checkpoint holds ``kappa`` with every pair fed."""

    def __init__(self, trainer: Any, state: Any) -> None:
        self.trainer, self.state = trainer, state

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        every = trainer.args.steps_per_generation * trainer.num_iterations
        if self.state.law_pending is not None and trainer._step % every == 0:
            from ._patch import _extra_pass

            calibrate_pending(trainer, self.state, _extra_pass)


def law_step_size(trainer: Any, state: Any) -> float | None:
    """``eta`` of the cheap prediction (:func:`step_size`), None when there is none (``learning_rate`` 0 and no
    ``entropy_disc.eta``, which only the autopilot refuses: then no cheap prediction and no calibration)."""
    try:
        return step_size(state.config, trainer.args.learning_rate)
    except ValueError:
        return None


def law_batch(trainer: Any, state: Any, stats: TokenStats, advantages: torch.Tensor, batch: dict[str, Any]) -> dict[str, float]:
    """Count one statistics batch with the law scale: its cheap prediction ``-eta Cov_B(A, r S_c)`` (global over
    the group; ``r`` as the autopilot's), and, on a calibration batch, park the ``calibrate_share`` of its rows that
    :func:`~entropy_discriminator.law_scale.calibration_rows` picks for :func:`calibrate_pending` (the same count on
    every rank: TRL's per-device batches are equal).
    Returns the scale's metrics (``delta_entropy/cheap``, ``/predicted``, ``/scale``)."""
    sync_law(trainer, state)
    group = process_group(trainer)
    cheap = cheap_change(advantages, stats.s_centered, stats.valid, eta=law_step_size(trainer, state),
                         ratio=sampling_ratio(batch, stats.valid.shape), form=state.config.form, process_group=group)
    if state.law.tick() and cheap is not None:
        rows = calibration_rows(stats.valid.shape[0], state.config.calibrate_share).to(stats.valid.device)
        keys = (*_PASS_KEYS, "tool_mask") if batch.get("tool_mask") is not None else _PASS_KEYS
        parked = {k: batch[k].detach()[rows] for k in keys}
        state.law_pending = PendingCalibration(parked, stats.entropy.detach()[rows], stats.valid[rows], cheap)
    trainer.state.stateful_callbacks[LAW_KEY] = state.law.state_dict()
    return state.law.metrics(cheap)


def calibrate_pending(trainer: Any, state: Any, extra_pass: Callable[[Any, Any, dict[str, Any]], None]) -> None:
    """The after-update pass of a parked calibration batch (``extra_pass``: TRL's own no-grad log-prob pass with
    the statistics captured, as before the update), ``(cheap, realised)`` fed to the scale; logs
    ``delta_entropy/realised``.  Runs after every update the batch took part in: at the end of the step that
    exhausted its generation batch (:class:`_AfterUpdate`), else at the next training generation."""
    pending, state.law_pending = state.law_pending, None
    if pending is None:
        return
    extra_pass(trainer, state, pending.batch)
    after, state.captured = state.captured, None
    after = restrict(after, loss_mask(pending.batch))
    monitor = EntropyMonitor(process_group=process_group(trainer))
    realised = monitor.realised(pending.entropy, after.entropy, pending.valid & after.valid)
    realised[monitor.prefix + SKIPPED_KEY] = float(not state.law.feed(pending.cheap, realised[monitor.prefix + REALISED_KEY]))
    trainer.state.stateful_callbacks[LAW_KEY] = state.law.state_dict()
    if state.autopilot is not None:
        trainer.state.stateful_callbacks[STATE_KEY] = state.autopilot.state_dict()
    if state.config.log_metrics:
        for key, value in realised.items():
            trainer._metrics["train"][key].append(float(value))
