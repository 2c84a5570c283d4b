"""Per-token statistics straight from LM-head inputs, for frameworks that fuse the LM head: on CUDA (bf16/fp16) a
Triton matmul with the streaming reduction in its epilogue, elsewhere ``[chunk, V]`` fp32 logits at a time
(rounding as a framework's bf16/fp16 head does: docs/precision.md).
"""

from __future__ import annotations

import torch

from . import deferred, kernels
from ._checks import require_float
from .stats import _DEFAULT_CHUNK_ELEMENTS, TokenStats, check_stats_args, raise_for_errors, token_stats

__all__ = ["token_stats_from_hidden"]

_LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def token_stats_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                            bias: torch.Tensor | None = None, temperature: float = 1.0, ignore_index: int | None = -100,
                            chunk_size: int | None = None, impl: str = "auto", check: bool | str = True,
                            logits_dtype: torch.dtype | None = None,
                            temperature_in_logits_dtype: bool = False) -> TokenStats:
    """``token_stats(hidden @ weight.T + bias, labels, temperature=...)`` without [N, V] logits.

    Args:
        hidden, weight, bias: ``[..., H]`` bf16/fp16/fp32 inputs, ``[V, H]`` of their dtype and device, ``[V]`` or None.
        labels: integer, of shape ``hidden.shape[:-1]``.
        temperature: ``z = L / temperature``, ``L = hidden @ weight.T + bias`` with fp32 accumulation.
        ignore_index, check: as in :func:`token_stats`.
        chunk_size: rows per slice on the torch path (default ``2**25 // V``: 128 MiB of fp32 logits).
        impl: ``"triton"`` (fused CUDA kernel), ``"torch"`` or ``"auto"`` (Triton for bf16/fp16 CUDA when available).
        logits_dtype: bf16 / fp16 / fp32: L rounded to it (nearest even) as a framework's head in it does.
        temperature_in_logits_dtype: the division rounded too, ``z = fp32(round(round(L) / T))``.

    Returns :class:`TokenStats` of ``labels.shape`` (float32, formulas of :func:`token_stats`); ``ValueError`` for
    bad shapes, dtypes, devices, labels, temperature or ``logits_dtype``, or logits rows holding NaN / +inf.
    """
    hidden = require_float("hidden", hidden)
    weight = require_float("weight", weight)
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must be [..., H] and weight [V, H] with the same H, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if hidden.dtype == torch.float64 or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight must share a bf16/fp16/fp32 dtype, got {hidden.dtype} and {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden on {hidden.device}")
    temperature, ignore_index = check_stats_args(labels, hidden, "hidden", temperature, ignore_index, chunk_size, impl)
    vocab = weight.shape[0]
    if bias is not None and (bias.shape != (vocab,) or bias.device != hidden.device):
        raise ValueError(f"bias must be a [{vocab}] tensor on {hidden.device}, got {tuple(bias.shape)} on "
                         f"{bias.device}")

    check = deferred.check_mode(check)
    if logits_dtype is not None and logits_dtype not in _LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be None or one of {_LOGITS_DTYPES}, got {logits_dtype!r}")
    if not isinstance(temperature_in_logits_dtype, bool):
        raise ValueError(f"temperature_in_logits_dtype must be a bool, got {temperature_in_logits_dtype!r}")
    if temperature_in_logits_dtype and logits_dtype is None:
        raise ValueError("temperature_in_logits_dtype=True needs a logits_dtype to round to")

    deferred.resolve_ready(make_room=check == "deferred")  # earlier deferred checks whose counts have arrived
    shape = labels.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    k = labels.reshape(-1)
    use_triton = impl == "triton" or (impl == "auto" and hidden.is_cuda and hidden.dtype != torch.float32
                                      and kernels.is_available())
    if not use_triton:
        return _from_hidden_torch(h2, weight, k, bias, float(temperature), int(ignore_index), chunk_size, impl, check,
                                  shape, logits_dtype, temperature_in_logits_dtype)
    if not (hidden.is_cuda and kernels.is_available()):
        raise RuntimeError("impl='triton' needs CUDA tensors and an importable triton")
    from .kernels.triton_fused import token_stats_fused_triton

    with torch.no_grad():
        out = token_stats_fused_triton(h2, weight, k, bias, float(temperature), int(ignore_index),
                                       logits_dtype=logits_dtype,
                                       temperature_in_logits_dtype=temperature_in_logits_dtype)  # fmt: skip
    result = TokenStats(*(t.view(shape) for t in out[:6]))
    if check == "deferred":
        deferred.defer_counts(out.errors, lambda errors: raise_for_errors(errors, labels, vocab, ignore_index),
                              "token_stats_from_hidden")
    elif check:
        errors = out.errors.tolist()  # the one host synchronisation
        if any(errors):
            raise_for_errors(errors, labels, vocab, ignore_index)
    return result


def _from_hidden_torch(h2: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
                       temperature: float, ignore_index: int, chunk_size: int | None, impl: str, check: bool,
                       shape: torch.Size, dtype: torch.dtype | None, temperature_in_dtype: bool) -> TokenStats:
    """Chunked torch path: :func:`token_stats` of the logits of ``chunk_size`` rows at a time (``dtype``: ``round(L)``
    at ``T``, or ``round(round(L) / T)`` at 1 with ``temperature_in_dtype``)."""
    n, vocab = h2.shape[0], weight.shape[0]
    rows = chunk_size or max(1, _DEFAULT_CHUNK_ELEMENTS // vocab)
    # Logits rounded to the inputs' own dtype come from the GEMM in that dtype, the framework's op (bit for bit).
    native = dtype is not None and dtype == h2.dtype
    w32 = weight if native else weight.float()
    b32 = None if bias is None else bias.to(w32.dtype)
    temp = 1.0 if temperature_in_dtype else temperature  # the logits then carry the rounded division
    parts: list[TokenStats] = []
    with torch.no_grad():
        for lo in range(0, max(n, 1), rows):  # n = 0: one empty slice
            h_rows = h2[lo : lo + rows] if native else h2[lo : lo + rows].float()
            logits = torch.nn.functional.linear(h_rows, w32, b32)
            if dtype is not None:
                logits = (logits.to(dtype) / temperature).to(dtype) if temperature_in_dtype else logits.to(dtype)
            parts.append(token_stats(logits, labels[lo : lo + rows], temperature=temp, ignore_index=ignore_index,
                                     impl="torch" if impl == "torch" else "auto", check=check))
            del logits
    fields = ("logp", "entropy", "s_star", "s_expected", "s_centered", "valid")
    return TokenStats(**{f: torch.cat([getattr(p, f) for p in parts]).reshape(shape) for f in fields})
