"""The keep-mask and how it reaches TRL's loss.

The mask is :meth:`EntropyDiscConfig.compute_mask` over the whole batch of every data-parallel
rank (the torch.distributed world group when accelerate runs several processes).  In
``_compute_loss`` it acts through the inputs TRL reads (a shallow copy; the buffered generation
batch is never modified, so every ``num_iterations`` pass sees the same mask):

* ``zero_pg``: ``advantages`` -> ``A[:, None] * keep`` (B, T).  Every TRL loss type's policy term
  is proportional to ``A_t``, so a clipped token's policy-gradient term is exactly zero;
  :func:`._support.plan` refuses the settings whose other terms still reach that token.
* ``drop_token``: ``tool_mask`` -> ``tool_mask * keep`` (``completion_mask`` stays: it is also the
  attention mask), so the token leaves every term and normaliser of the loss; TRL's
  ``num_items_in_batch`` (the dapo/cispo/vespo normaliser) becomes the global kept-token count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from entropy_discriminator import EntropyDiscConfig, MaskResult, TokenStats

#: Key of the (B, T) bool keep-mask carried in TRL's generation batch (True = token stays).
KEEP_KEY = "entropy_disc_keep"


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


def compute_mask(config: EntropyDiscConfig, stats: TokenStats, advantages: torch.Tensor, group: Any) -> MaskResult:
    """Clip_B on ``stats.s_star`` or Clip_V on ``stats.s_centered`` over ``stats.valid`` (B, T),
    with the config's thresholds, global over ``group``."""
    return config.compute_mask(advantages=advantages, valid=stats.valid, s_star=stats.s_star,
                               s_centered=stats.s_centered, process_group=group)


def keep_advantages(advantages: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, T) advantages times a (B, T) keep-mask -> (B, T); clipped tokens get A = 0."""
    per_token = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    return per_token * keep.to(per_token.dtype)


def apply_keep(config: EntropyDiscConfig, inputs: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
    """A shallow copy of ``inputs`` (without ``KEEP_KEY``) with ``keep`` (B, T) bool applied as
    ``config.mask_mode`` says (module docstring)."""
    out = {k: v for k, v in inputs.items() if k != KEEP_KEY}
    if config.mask_mode == "zero_pg":
        out["advantages"] = keep_advantages(out["advantages"], keep)
    else:
        tool = out.get("tool_mask")
        out["tool_mask"] = keep.to(out["completion_mask"].dtype) if tool is None else tool * keep.to(tool.dtype)
    return out


def kept_token_count(trainer: Any, batch: dict[str, Any], keep: torch.Tensor) -> torch.Tensor:
    """Global count of loss-mask tokens that stay (``drop_token``'s ``num_items_in_batch``)."""
    return trainer.accelerator.gather((loss_mask(batch) & keep).sum()).sum()
