"""Per-token statistics of TRL's completion tokens from the hidden states of a pass TRL makes.

Every log-prob pass of ``GRPOTrainer`` (the old-policy pass, the training forward, and in 1.14
both the full-logits and the Liger-chunked variant) runs the model's backbone module
(``model.base_model``, e.g. ``Qwen2Model``) once per chunk of rows.  :class:`HiddenCapture`
keeps the completion part of its ``last_hidden_state`` (detached: no extra autograd memory; in the
training forward autograd keeps the tensor anyway), and :func:`stats_from_hidden` turns it into
:class:`~entropy_discriminator.TokenStats` with the core's :func:`token_stats_from_hidden`
(``logits = hidden @ W.T + b`` divided by TRL's temperature, never materialised as [N, V]: a
fused Triton kernel on CUDA, ``[chunk, V]`` fp32 slices elsewhere).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from entropy_discriminator import TokenStats, token_stats_from_hidden

_FIELDS = ("logp", "entropy", "s_star", "s_expected", "s_centered", "valid")


def _inner_model(trainer: Any) -> torch.nn.Module:
    """The transformers ``PreTrainedModel`` under accelerate's and PEFT's wrappers."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone(trainer: Any) -> torch.nn.Module:
    """The module whose output holds the final hidden states (``model.base_model``)."""
    inner = _inner_model(trainer)
    body = inner.base_model
    if body is inner:
        raise ValueError(f"{type(inner).__name__} has no separate backbone module (base_model_prefix), so the "
                         "adapter cannot read its final hidden states")
    return body


def lm_head(trainer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's full (gathered) weight ``[V, H]`` and bias ``[V]`` or None, detached."""
    head = _inner_model(trainer).get_output_embeddings()
    weight, bias = head.weight, head.bias
    if isinstance(weight, DTensor):  # FSDP2 shards; the head is gathered as TRL does
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"the LM-head weight has shape {tuple(weight.shape)} here (partitioned, e.g. DeepSpeed "
                         "ZeRO-3?); the adapter needs the full [V, H] weight")
    return weight.detach(), None if bias is None else bias.detach()


class HiddenCapture:
    """Context manager: while active, every call of ``module`` appends the last ``tokens + 1``
    positions but one of its ``last_hidden_state`` (``[rows, tokens, H]``, detached) to ``parts``:
    the positions whose next-token logits score the ``tokens`` completion tokens."""

    def __init__(self, module: torch.nn.Module, tokens: int) -> None:
        self.module, self.tokens = module, tokens
        self.parts: list[torch.Tensor] = []
        self._handle: Any = None

    def _hook(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        self.parts.append(hidden[:, -(self.tokens + 1) : -1].detach())

    def __enter__(self) -> HiddenCapture:
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()

    def hidden(self) -> torch.Tensor:
        """``[rows, tokens, H]``: the captured chunks in call order."""
        if not self.parts:
            raise RuntimeError("the backbone was not called during the captured pass")
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts, dim=0)


def stats_from_hidden(
    trainer: Any,
    hidden: torch.Tensor,
    completion_ids: torch.Tensor,
    valid: torch.Tensor,
    *,
    chunk_size: int | None,
    impl: str,
) -> TokenStats:
    """Statistics of ``completion_ids`` (B, T) from ``hidden`` (B, T, H), no grad.

    ``z = (hidden @ W.T + b) / trainer.temperature`` per token, computed in the promoted dtype of
    hidden and weight (a bf16 backbone under a float32 head, as with TRL's
    ``cast_lm_head_to_fp32``, is upcast), with autocast off so that dtype holds; positions outside
    ``valid`` (B, T) bool are ignored (zero, ``valid=False``).  Returns float32 (B, T) fields.
    """
    weight, bias = lm_head(trainer)
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    hidden = hidden.to(device=weight.device, dtype=dtype)
    labels = completion_ids.to(weight.device).masked_fill(~valid.to(weight.device), -100)
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        return token_stats_from_hidden(
            hidden, weight.to(dtype), labels, bias=None if bias is None else bias.to(dtype),
            temperature=float(trainer.temperature), chunk_size=chunk_size, impl=impl,
        )


def restrict(stats: TokenStats, valid: torch.Tensor) -> TokenStats:
    """``stats`` with ``valid`` narrowed to ``stats.valid & valid`` (e.g. TRL's ``tool_mask``)."""
    keep = stats.valid & valid.to(stats.valid.device)
    zero = torch.zeros((), dtype=stats.logp.dtype, device=stats.logp.device)
    return TokenStats(**{f: torch.where(keep, getattr(stats, f), zero) for f in _FIELDS[:-1]}, valid=keep)
