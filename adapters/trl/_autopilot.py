"""The entropy autopilot (``method="autopilot"``) in ``GRPOTrainer``: one controller per trainer,
stepped once per training batch, its state in every Trainer checkpoint.

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

from typing import Any

import torch

from entropy_discriminator import MaskResult, TokenStats

from ._mask import process_group

#: Key of the controller's ``state_dict()`` in ``TrainerState.stateful_callbacks`` (trainer_state.json).
STATE_KEY = "EntropyDiscAutopilot"


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
    pilot = state.config.build_autopilot(process_group(trainer))
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
