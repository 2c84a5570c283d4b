"""What the TRL adapter does at its three seams of ``GRPOTrainer`` (TRL 1.16.x).

The seams, read from ``trl/trainer/grpo_trainer.py`` 1.16.0:

1. ``_generate_and_score_completions(inputs) -> dict``: returns the local generation batch
   (``prompt_ids/mask``, ``completion_ids/mask`` (B, T), ``advantages`` (B,) computed on the
   globally gathered rewards, optional ``tool_mask`` (B, T), ``num_items_in_batch``).  The dict is
   then shuffled (``shuffle_sequence_dict``) and split over ``steps_per_generation``
   (``split_tensor_dict``) in unison, so an extra (B, T) key rides along with its rows and is
   reused unchanged over ``num_iterations``.  :func:`after_generation` adds the keep-mask there.
2. ``_compute_loss(model, inputs)``: reads ``tool_mask`` to build the loss mask *before* the
   policy forward, and ``inputs["advantages"]`` (B,) or (B, T) *after* it.
   :func:`loss_inputs` turns the carried keep-mask into per-token advantages
   ``A_t = A * keep_t`` (mode ``zero_pg``: the clipped token's policy-gradient term is exactly 0
   for every TRL loss type, since each is proportional to A; KL term and normaliser unchanged) or
   into ``tool_mask * keep`` (mode ``drop_token``: the token leaves the loss mask).
3. ``_get_per_token_logps_and_entropies(...) -> (logps, entropies, aux)``: inside
   ``_compute_loss`` it returns the current policy's log-probs and entropies (TRL's fused LM head,
   same temperature).  With ``mask_source="current"`` :func:`current_policy_mask` scores
   ``S* = exp(logp) (H + logp)`` from them (no grad) and writes ``A * keep`` into the inputs
   dict before ``_compute_loss`` reads its advantages.

Everything here is framework-agnostic glue: ``trainer`` is any object with the TRL attributes
used (``model``, ``accelerator``, ``temperature``, ``args.per_device_train_batch_size``,
``_metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from entropy_discriminator import (
    EntropyDiscConfig,
    EntropyMonitor,
    MaskResult,
    TokenStats,
    discriminator_score,
    token_stats,
)

#: Key of the (B, T) bool keep-mask carried in TRL's generation batch (True = token stays).
KEEP_KEY = "entropy_disc_keep"
#: Where the mask comes from: the policy that generated the batch, or the loss's current policy.
MASK_SOURCES = ("generation", "current")
# Keys whose presence means a multimodal batch: the stats forward below passes only token ids.
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                    "mm_token_type_ids", "image_position_ids", "num_images")


@dataclass
class AdapterState:
    """Per-trainer settings.  ``pending`` holds the inputs dict of the ``_compute_loss``
    call whose current-policy mask is still to be computed (``mask_source="current"``)."""

    config: EntropyDiscConfig
    mask_source: str = "generation"
    pending: dict[str, Any] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        validate_options(self.config, self.mask_source)

    @property
    def masking(self) -> bool:
        return self.config.method != "none"


def validate_options(config: EntropyDiscConfig, mask_source: str) -> None:
    """Raise ``ValueError`` naming the bad argument for combinations the TRL seams cannot serve."""
    if not isinstance(config, EntropyDiscConfig):
        raise TypeError(f"config must be an EntropyDiscConfig, got {type(config).__name__}")
    config.validate()
    if mask_source not in MASK_SOURCES:
        raise ValueError(f"mask_source must be one of {MASK_SOURCES}, got {mask_source!r}")
    if mask_source == "current" and config.method == "clip_v":
        raise ValueError(
            "mask_source='current' supports method='clip_b' only: Clip_V needs E_p[S] = sum p^2 (H + log p), "
            "which TRL's fused LM head (log-probs, entropy) does not return; use mask_source='generation'"
        )
    if mask_source == "current" and config.mask_mode == "drop_token":
        raise ValueError(
            "mask_mode='drop_token' needs mask_source='generation': TRL 1.16 builds the loss mask before the "
            "current-policy forward, so only mask_mode='zero_pg' can act on a mask found inside the loss"
        )


def process_group(trainer: Any) -> dist.ProcessGroup | None:
    """The group the statistics are reduced over: the default (world) group when accelerate runs
    more than one process, else None (local)."""
    if trainer.accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """TRL's loss mask, (B, T) bool: ``completion_mask`` times ``tool_mask`` when present."""
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    return mask


@torch.no_grad()
def policy_token_stats(trainer: Any, batch: dict[str, Any], *, chunk_size: int | None, impl: str) -> TokenStats:
    """Token statistics of the completion tokens under ``trainer.model`` (no grad).

    Runs ``model(prompt ++ completion, logits_to_keep=T+1)`` in chunks of
    ``per_device_train_batch_size`` rows under ``accelerator.autocast()``; the logits at
    positions P-1 .. P+T-2 score the completion tokens (the one-token shift), divided by
    ``trainer.temperature`` (the temperature of TRL's fused head) inside :func:`token_stats`.
    Labels are the completion ids with -100 outside the loss mask.  Returns (B, T) fields.
    """
    multimodal = [k for k in _MULTIMODAL_KEYS if batch.get(k) is not None]
    if multimodal:
        raise ValueError(
            f"the entropy-discriminator TRL adapter scores text-only batches; this batch carries {multimodal}"
        )
    prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    labels = completion_ids.masked_fill(~loss_mask(batch), -100)
    t = completion_ids.size(1)
    rows = max(1, int(trainer.args.per_device_train_batch_size))
    parts: list[TokenStats] = []
    for start in range(0, input_ids.size(0), rows):
        end = start + rows
        with trainer.accelerator.autocast():
            out = trainer.model(
                input_ids=input_ids[start:end], attention_mask=attention[start:end], logits_to_keep=t + 1,
                use_cache=False,
            )
        logits = out.logits[:, -(t + 1) : -1]
        parts.append(
            token_stats(logits, labels[start:end], temperature=float(trainer.temperature), chunk_size=chunk_size,
                        impl=impl)
        )
    return TokenStats(**{name: torch.cat([getattr(p, name) for p in parts], dim=0)
                         for name in ("logp", "entropy", "s_star", "s_expected", "s_centered", "valid")})


def compute_mask(
    config: EntropyDiscConfig,
    *,
    s_star: torch.Tensor,
    s_centered: torch.Tensor | None,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> MaskResult:
    """Clip_B on ``s_star`` or Clip_V on ``s_centered`` (B, T) with the config's thresholds,
    global over ``group`` (:meth:`EntropyDiscConfig.compute_mask`)."""
    return config.compute_mask(advantages=advantages, valid=valid, s_star=s_star, s_centered=s_centered,
                               process_group=group)


def _log(trainer: Any, metrics: dict[str, float], mode: str = "train") -> None:
    for key, value in metrics.items():
        trainer._metrics[mode][key].append(float(value))


def after_generation(trainer: Any, state: AdapterState, batch: dict[str, Any]) -> dict[str, Any]:
    """Seam 1: add ``batch[KEEP_KEY]`` ((B, T) bool) from the generating policy and log metrics.

    Train mode only; a batch that already carries the key is returned unchanged (so nested
    wrappers act once).  With ``mask_mode="drop_token"``, ``num_items_in_batch`` (the global
    token count TRL's "dapo"/"cispo" losses divide by) becomes the global count of kept tokens.
    """
    if not trainer.model.training or KEEP_KEY in batch or state.mask_source == "current":
        return batch
    if not state.masking and not state.config.log_metrics:
        return batch
    group = process_group(trainer)
    stats = policy_token_stats(trainer, batch, chunk_size=state.config.chunk_size, impl=state.config.impl)
    advantages = batch["advantages"]
    result = None
    if state.masking:
        result = compute_mask(state.config, s_star=stats.s_star, s_centered=stats.s_centered,
                              advantages=advantages, valid=stats.valid, group=group)
        batch = dict(batch)
        batch[KEEP_KEY] = result.keep.bool()
        if state.config.mask_mode == "drop_token":
            kept = (loss_mask(batch) & batch[KEEP_KEY]).sum()
            batch["num_items_in_batch"] = trainer.accelerator.gather(kept).sum()
    if state.config.log_metrics:
        monitor = EntropyMonitor(process_group=group)
        _log(trainer, monitor.from_stats(stats, advantages=advantages, mask=result))
    return batch


def loss_inputs(state: AdapterState | None, trainer: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Seam 2: a shallow copy of ``inputs`` without ``KEEP_KEY``, the keep-mask applied
    (``inputs`` itself when there is nothing to apply or park).

    ``zero_pg``: ``advantages`` -> ``A[:, None] * keep`` (B, T) (or ``A * keep`` when already
    per token).  ``drop_token``: ``tool_mask`` -> ``tool_mask * keep`` (``completion_mask`` stays,
    it is also the attention mask).  The buffered batch itself is never modified, so the same
    mask applies to every ``num_iterations`` pass.  With ``mask_source="current"`` in train mode
    the copy is parked in ``state.pending`` for :func:`current_policy_mask`.
    """
    keep = inputs.get(KEEP_KEY)
    park = (state is not None and keep is None and state.mask_source == "current" and state.masking
            and trainer.model.training and state.pending is None)
    if keep is None and not park:
        return inputs  # nothing to do; the same dict, so an outer wrapper's parked copy stays the one read
    out = {k: v for k, v in inputs.items() if k != KEEP_KEY}
    if park:
        state.pending = out
    elif state is not None:
        if state.config.mask_mode == "zero_pg":
            out["advantages"] = _keep_advantages(out["advantages"], keep)
        else:
            tool = out.get("tool_mask")
            out["tool_mask"] = keep.to(out["completion_mask"].dtype) if tool is None else tool * keep.to(tool.dtype)
    return out


def _keep_advantages(advantages: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, T) advantages times a (B, T) keep-mask -> (B, T); clipped tokens get A = 0."""
    per_token = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    return per_token * keep.to(per_token.dtype)


def current_policy_mask(
    trainer: Any, state: AdapterState, logps: torch.Tensor, entropies: torch.Tensor | None
) -> None:
    """Seam 3: Clip_B from the loss's own current-policy ``logps``/``entropies`` (B, T), no grad.

    ``S* = exp(logp) (H + logp)`` (:func:`discriminator_score`), the mask global over the process
    group of this micro-batch, written as ``A * keep`` into the parked inputs dict, which
    ``_compute_loss`` reads after this forward.  Logs the monitor's metrics of this micro-batch.
    """
    inputs, state.pending = state.pending, None
    if inputs is None or entropies is None:
        return
    group = process_group(trainer)
    with torch.no_grad():
        logp, entropy = logps.detach().float(), entropies.detach().float()
        s_star = discriminator_score(logp, entropy)
        valid = loss_mask(inputs)
        advantages = inputs["advantages"]
        result = compute_mask(state.config, s_star=s_star, s_centered=None, advantages=advantages,
                              valid=valid, group=group)
        inputs["advantages"] = _keep_advantages(advantages, result.keep.bool())
        if state.config.log_metrics:
            monitor = EntropyMonitor(process_group=group)
            _log(trainer, monitor(entropy=entropy, valid=valid, advantages=advantages, s_star=s_star, mask=result))
