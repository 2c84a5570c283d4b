"""Argument validation shared by the core modules: every error names the argument at fault."""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def require_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_float(name: str, value: object) -> torch.Tensor:
    """A floating tensor (bf16, fp16, fp32 or fp64)."""
    t = require_tensor(name, value)
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a bf16/fp16/fp32/fp64 tensor, got dtype {t.dtype}")
    return t


def require_finite(name: str, values: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` if ``values`` (restricted to ``where``) holds NaN or inf."""
    bad = ~torch.isfinite(values)
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        raise ValueError(f"{name} contains NaN or inf at {int(bad.sum())} valid position(s)")


def as_valid_mask(valid: object, shape: torch.Size, name: str = "valid") -> torch.Tensor:
    """Return ``valid`` as a bool tensor of ``shape``.

    Accepts bool tensors and numeric 0/1 tensors (frameworks' ``response_mask`` / ``action_mask``);
    any other value raises ``ValueError`` naming the argument.
    """
    t = require_tensor(name, valid)
    if t.shape != shape:
        raise ValueError(f"{name} must have the scores' shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype == torch.bool:
        return t
    if t.dtype.is_complex:
        raise TypeError(f"{name} must be a bool or 0/1 tensor, got dtype {t.dtype}")
    as_bool = t != 0
    if bool(((t != 0) & (t != 1)).any()):
        raise ValueError(f"{name} must hold only 0 and 1 (or be a bool tensor)")
    return as_bool


def broadcast_advantages(advantages: object, shape: torch.Size) -> torch.Tensor:
    """Return float64 advantages of ``shape``.

    ``advantages`` is either per sequence, ``[B]`` with ``B == shape[0]`` (GRPO; broadcast over the
    remaining dimensions), or per token with exactly ``shape`` (PPO with GAE).
    """
    a = require_tensor("advantages", advantages)
    if a.dtype == torch.bool or a.dtype.is_complex:
        raise TypeError(f"advantages must be a real tensor, got dtype {a.dtype}")
    if a.shape == shape:
        return a.to(torch.float64)
    if a.dim() == 1 and len(shape) >= 1 and a.shape[0] == shape[0]:
        return a.to(torch.float64).reshape((shape[0],) + (1,) * (len(shape) - 1)).expand(shape)
    raise ValueError(
        f"advantages must be per sequence [B] with B = {shape[0] if len(shape) else '?'} or per token "
        f"with the scores' shape {tuple(shape)}, got {tuple(a.shape)}"
    )
