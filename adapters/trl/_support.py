"""What the TRL adapter supports: the release range, the seams it enters, and which trainer
configurations it serves exactly (and how), or refuses at start-up.

Release range ``trl>=1.14.0,<1.17.0``; every release in it (1.14.0, 1.14.1, 1.14.2, 1.15.0,
1.16.0) was diffed.  What changed inside the range, and why the seams still hold:

* 1.15.0 replaced the full-logits log-prob pass (``model(...).logits`` per ``batch_size`` rows,
  or the chunked ``_chunked_logps`` from hidden states under ``use_liger_kernel``) by a fused LM
  head added to ``model.forward`` (``add_fused_lm_head``: backbone, then a chunked projection).
  Every variant calls the model's backbone module (``base_model``) once per chunk of rows, which
  is where :mod:`._stats` takes the hidden states, so the statistics are the same in all of them.
  Why the adapter forms ``hidden @ W.T`` again instead of reading TRL's logits (checked in
  TRL 1.15.0 and 1.16.0): the only place a logits tile exists is inside
  ``trl.kernels.ChunkedLogProbFunction.forward`` (one call per model call, given all ``[N, H]``
  hidden rows and the weight), which folds each ``[<=4096, <=32768]`` tile, rounded to the compute
  dtype with the bias added, through the private module global ``_forward_kernel[(n,)]`` (a Triton
  ``JITFunction``; 1.16 calls the torch ``_forward_tile`` instead on devices without Triton) into
  running max, sum e, sum e z, and optionally sum e^2 (``outputs``).  No requestable output gives
  sum e^2 z, so E_p[S] and S_c cannot come from TRL's outputs; taking the tiles would mean
  replacing a private Triton kernel object and re-deriving TRL's row compaction.  Not done.
* 1.14.1 changed ``_generate_single_turn``'s signature, 1.16.0 the eos handling; neither is a seam.
* The loss types (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo), the batch keys
  (``completion_mask``, ``tool_mask``, ``advantages``, ``num_items_in_batch``,
  ``old_per_token_logps``), the split/shuffle of the generation batch and the condition under
  which TRL runs its own old-policy pass are the same in all five releases.

:func:`plan` is the one place that decides, per trainer, which route the statistics take and
which settings are refused; docs/adapters/trl.md's support table lists the same cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trl
from trl import GRPOTrainer

from entropy_discriminator import EntropyDiscConfig

from .._patching import UnsupportedVersionError, require_version

#: TRL releases this adapter is checked against (each one's GRPOTrainer seams read and tested).
SUPPORTED_TRL = ">=1.14.0,<1.17.0"
#: The GRPOTrainer methods the adapter wraps.
HOOKED_METHODS = ("_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies")
#: TRL's loss types in every supported release.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
#: Where the mask comes from: the policy that generated the batch, or the loss's current policy.
MASK_SOURCES = ("generation", "current")
#: Model-config fields that rescale or squash the logits after the LM head (TRL's fused head
#: applies them); the statistics are computed from ``hidden @ W.T + b`` and cannot follow them.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")

#: Routes of the statistics (see :func:`plan`).
OLD_PASS = "old_pass"  # hidden states of TRL's own old-policy pass
TRAINING_FORWARD = "training_forward"  # hidden states of the first training forward of the batch
EXTRA_PASS = "extra_pass"  # one no-grad pass of TRL's log-prob method, run by the adapter
CURRENT = "current"  # every training forward, per micro-batch (mask_source="current")
MONITOR_OFF = "off"  # method none and no metrics: nothing to compute


def check_trl_version(version: str | None = None) -> str:
    """Return the installed (or given) TRL version; raise :class:`UnsupportedVersionError`
    (a ``RuntimeError``) outside ``SUPPORTED_TRL``, saying why."""
    return require_version(
        "trl", SUPPORTED_TRL, installed=trl.__version__ if version is None else version,
        why=(f"the adapter enters GRPOTrainer through private methods ({', '.join(HOOKED_METHODS)}) and relies "
             "on their call order, batch keys and loss types as read in the TRL 1.14.0-1.16.0 sources; another "
             "release may change them without raising an error"),
    )


def validate_options(config: EntropyDiscConfig, mask_source: str) -> None:
    """Raise ``TypeError``/``ValueError`` naming the bad argument for settings no trainer can serve."""
    if not isinstance(config, EntropyDiscConfig):
        raise TypeError(f"config must be an EntropyDiscConfig, got {type(config).__name__}")
    config.validate()
    if mask_source not in MASK_SOURCES:
        raise ValueError(f"mask_source must be one of {MASK_SOURCES}, got {mask_source!r}")
    if mask_source == "current" and config.mask_mode == "drop_token":
        raise ValueError(
            "mask_mode='drop_token' needs mask_source='generation': TRL builds the loss mask before the "
            "current-policy forward, so only mask_mode='zero_pg' can act on a mask found inside the loss"
        )
    if mask_source == "current" and config.method == "autopilot":
        raise ValueError(
            "method='autopilot' needs mask_source='generation': the controller steps once per training batch, "
            "while mask_source='current' finds a mask in every training forward (each micro-batch, each "
            "num_iterations pass)"
        )


@dataclass(frozen=True)
class Plan:
    """How one trainer is served: ``route``, one of the route names above."""

    route: str


def trl_runs_old_pass(trainer: Any) -> bool:
    """TRL's own condition (``_generate_and_score_completions``, 1.14-1.16) for scoring each
    generation batch with the generating policy: the batch outlives one optimiser step
    (``gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0``) or vLLM's
    importance-sampling correction needs the trainer's log-probs."""
    args = trainer.args
    generate_every = args.steps_per_generation * trainer.num_iterations
    return bool(args.gradient_accumulation_steps % generate_every != 0
                or (trainer.use_vllm and trainer.vllm_importance_sampling_correction))


def plan(trainer: GRPOTrainer, config: EntropyDiscConfig, mask_source: str) -> Plan:
    """Decide the route for ``trainer`` or raise ``ValueError`` naming the setting it cannot serve.

    Refused when clipping is asked (``method != "none"``):

    * ``mask_mode="zero_pg"`` (the clipped token's advantage is zeroed) where TRL's loss gives a
      token gradient through more than ``A_t``: ``beta != 0`` (KL term), an entropy bonus
      (``entropy_coef != 0`` or ``use_adaptive_entropy``), ``importance_sampling_level="sequence"``
      (the sequence ratio averages every token's log-ratio; ``luspo`` requires it).
      ``mask_mode="drop_token"`` serves them all: the token leaves TRL's loss mask.

    Refused always (the statistics need ``hidden @ W.T + b`` to be the logits): a model whose
    config sets one of :data:`LOGIT_TRANSFORMS`.  Refused for ``method="autopilot"``: no step size
    (``entropy_disc.eta`` None and ``learning_rate`` not > 0, :meth:`EntropyDiscConfig.step_size`).

    Routes: no statistics when ``method="none"`` without metrics; ``mask_source="current"``:
    every training forward; else TRL's own old-policy pass when it runs one; else the first
    training forward when one micro-batch holds the whole generation batch
    (``steps_per_generation == 1``) and ``mask_mode="zero_pg"``; else one extra no-grad pass.
    """
    masking = config.method != "none"
    if not masking and not config.log_metrics:
        return Plan(MONITOR_OFF)
    if config.method == "autopilot":
        from ._autopilot import step_size

        step_size(config, trainer.args.learning_rate)
    text_config = trainer.model.config.get_text_config()
    for name in LOGIT_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(
                f"the model config sets {name}={value!r}: the adapter computes its statistics from the final hidden "
                "states and the LM-head weight (logits = hidden @ W.T + b, divided by TRL's temperature) and does "
                "not reproduce that logit transform; models with it are not supported"
            )
    if masking and config.mask_mode == "zero_pg":
        args = trainer.args
        reasons = []
        if trainer.beta != 0.0:
            reasons.append(f"beta={trainer.beta} (the KL term gives every token in the loss mask gradient)")
        if getattr(trainer, "_entropy_bonus_enabled", False):
            reasons.append("an entropy bonus (entropy_coef / use_adaptive_entropy: every token's entropy gets gradient)")
        if args.importance_sampling_level == "sequence":
            reasons.append(f"importance_sampling_level='sequence' (loss_type={args.loss_type!r}: the sequence ratio "
                           "averages every token's log-ratio, so a clipped token still gets gradient through it)")
        if reasons:
            raise ValueError(
                "entropy_disc mask_mode='zero_pg' zeroes only the clipped token's advantage, but with "
                + "; ".join(reasons)
                + " TRL's loss still gives that token gradient. Use mask_mode='drop_token' (the clipped token leaves "
                "TRL's loss mask, so it gets no gradient from any term) or change that setting."
            )
    if mask_source == "current":
        return Plan(CURRENT)
    if trl_runs_old_pass(trainer):
        return Plan(OLD_PASS)
    if trainer.args.steps_per_generation == 1 and (not masking or config.mask_mode == "zero_pg"):
        return Plan(TRAINING_FORWARD)
    return Plan(EXTRA_PASS)


__all__ = ["HOOKED_METHODS", "LOSS_TYPES", "MASK_SOURCES", "SUPPORTED_TRL", "Plan", "UnsupportedVersionError",
           "check_trl_version", "plan", "trl_runs_old_pass", "validate_options"]
