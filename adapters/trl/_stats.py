"""Per-token statistics of TRL's completion tokens from the hidden states of a pass TRL makes.

Every log-prob pass of ``GRPOTrainer`` (the old-policy pass, the training forward, and in 1.14
both the full-logits and the Liger-chunked variant) runs the model's backbone module
(``model.base_model``, e.g. ``Qwen2Model``) once per chunk of rows.  :class:`HiddenCapture`
keeps the completion part of its ``last_hidden_state`` (detached: no extra autograd memory; in the
training forward autograd keeps the tensor anyway), and :func:`stats_from_hidden` turns it into
:class:`~entropy_discriminator.TokenStats` with the core's :func:`token_stats_from_hidden`
(``logits = hidden @ W.T + b`` divided by TRL's temperature, never materialised as [N, V]: a
fused Triton kernel on CUDA, ``[chunk, V]`` fp32 slices elsewhere).

Precision (docs/precision.md): the statistics are those of the logits TRL itself computes for its
log-probs.  :func:`head_precision` reads, from the autocast state the capture recorded while the
backbone ran, TRL's compute dtype, its rounding of the logits and where it divides by the
temperature; :func:`stats_from_hidden` casts hidden and weight to that dtype (what autocast does)
and asks the core to round as TRL rounds.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

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
        #: the autocast dtype active while the backbone ran (None: autocast off); TRL's head runs
        #: in the same autocast region as its backbone
        self.autocast_dtype: torch.dtype | None = None
        self._handle: Any = None

    def _hook(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        device = hidden.device.type
        self.autocast_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
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


class HeadPrecision(NamedTuple):
    """How TRL forms the logits of its log-probs: ``L = round_{logits}(cast(hidden) @ cast(W).T + b)``
    with fp32 accumulation, hidden and W cast to ``compute``; ``z = fp32(L) / T``, or
    ``fp32(round_{logits}(L / T))`` when ``temperature_in_logits_dtype``."""

    compute: torch.dtype
    logits: torch.dtype | None
    temperature_in_logits_dtype: bool


def head_precision(trainer: Any, hidden_dtype: torch.dtype, weight_dtype: torch.dtype,
                   autocast_dtype: torch.dtype | None) -> HeadPrecision:
    """TRL's LM-head precision for one captured pass (docs/precision.md, TRL rows).

    * 1.15+ fused head (``add_fused_lm_head``) and 1.14's ``use_liger_kernel`` chunked head: the
      product in ``autocast_dtype`` when autocast is on, else in the hidden states' dtype (weight
      cast to it), rounded to that dtype; fp32 with ``cast_lm_head_to_fp32`` (1.15+: autocast off,
      hidden upcast).  The temperature multiplies the upcast fp32 logits.
    * 1.14 full logits (``model(...).logits``): under autocast (accelerate's mixed precision) the
      head's ``F.linear`` runs in ``autocast_dtype`` even after ``cast_lm_head_to_fp32`` (its fp32
      forward is autocast too), and accelerate returns the logits upcast to fp32, so T divides in
      fp32; without autocast the head runs in its weight's dtype and TRL's ``logits / T`` rounds
      to that dtype again.
    """
    fp32_head = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    if _fused_head():
        compute = torch.float32 if fp32_head else (autocast_dtype or hidden_dtype)
        return HeadPrecision(compute, _low(compute), False)
    if getattr(trainer, "use_liger_kernel", False):
        compute = autocast_dtype or hidden_dtype
        return HeadPrecision(compute, _low(compute), False)
    if autocast_dtype is not None:
        return HeadPrecision(autocast_dtype, _low(autocast_dtype), False)
    compute = torch.float32 if fp32_head else weight_dtype
    low = _low(compute)
    return HeadPrecision(compute, low, low is not None and float(trainer.temperature) != 1.0)


@functools.cache
def _fused_head() -> bool:
    """Whether this TRL scores through ``add_fused_lm_head`` (1.15+) rather than full logits."""
    import trl.trainer.utils as trl_utils

    return hasattr(trl_utils, "add_fused_lm_head")


def _low(dtype: torch.dtype) -> torch.dtype | None:
    """The rounding a head computed in ``dtype`` applies to fp32-accumulated logits (None: fp32)."""
    return None if dtype == torch.float32 else dtype


def stats_from_hidden(
    trainer: Any,
    hidden: torch.Tensor,
    completion_ids: torch.Tensor,
    valid: torch.Tensor,
    *,
    chunk_size: int | None,
    impl: str,
    autocast_dtype: torch.dtype | None = None,
) -> TokenStats:
    """Statistics of ``completion_ids`` (B, T) from ``hidden`` (B, T, H), no grad, in TRL's precision.

    ``z`` as :class:`HeadPrecision` says (:func:`head_precision` from ``autocast_dtype``, the
    autocast dtype active during TRL's pass or None): hidden, W and b cast to TRL's compute dtype,
    ``hidden @ W.T + b`` accumulated in fp32 and rounded to it, divided by ``trainer.temperature``
    as TRL divides.  A bf16 compute dtype takes the fused Triton kernel on CUDA (``impl="auto"``)
    whatever the master weights' dtype.  Only the positions inside ``valid`` (B, T) bool are
    scored: their rows of ``hidden`` are gathered first (one host synchronisation, to count them),
    so the padding after short completions costs no LM-head product; the others are zero with
    ``valid=False``.  Returns float32 (B, T) fields.
    """
    if hidden.dim() != 3 or completion_ids.shape != hidden.shape[:2] or valid.shape != completion_ids.shape:
        raise ValueError(f"hidden must be (B, T, H) with completion_ids and valid (B, T), got {tuple(hidden.shape)}, "
                         f"{tuple(completion_ids.shape)} and {tuple(valid.shape)}")
    weight, bias = lm_head(trainer)
    precision = head_precision(trainer, hidden.dtype, weight.dtype, autocast_dtype)
    dtype = precision.compute
    rows = valid.to(device=weight.device, dtype=torch.bool)
    hidden_rows = hidden.to(weight.device)[rows].to(dtype)
    labels = completion_ids.to(weight.device)[rows]
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        scored = token_stats_from_hidden(
            hidden_rows, weight.to(dtype), labels, bias=None if bias is None else bias.to(dtype),
            temperature=float(trainer.temperature), chunk_size=chunk_size, impl=impl,
            logits_dtype=precision.logits, temperature_in_logits_dtype=precision.temperature_in_logits_dtype,
        )
    return place_rows(scored, rows)


def place_rows(scored: TokenStats, rows: torch.Tensor) -> TokenStats:
    """``scored`` (n,) statistics of the ``n`` True positions of the bool mask ``rows`` put back in place: every
    field is 0 and ``valid`` False at the other positions (what ``ignore_index`` gives)."""
    def put(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(rows.shape)
        out[rows] = values
        return out

    return TokenStats(**{f: put(getattr(scored, f)) for f in _FIELDS})


def restrict(stats: TokenStats, valid: torch.Tensor) -> TokenStats:
    """``stats`` with ``valid`` narrowed to ``stats.valid & valid`` (e.g. TRL's ``tool_mask``)."""
    keep = stats.valid & valid.to(stats.valid.device)
    zero = torch.zeros((), dtype=stats.logp.dtype, device=stats.logp.device)
    return TokenStats(**{f: torch.where(keep, getattr(stats, f), zero) for f in _FIELDS[:-1]}, valid=keep)
