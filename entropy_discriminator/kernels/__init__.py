"""Optional fused GPU kernels (Triton), imported lazily: :mod:`.triton_stats` (one pass over a logits row) and
:mod:`.triton_fused` (LM-head matmul with the same reduction in its epilogue), imported only after
:func:`is_available` said yes; importing this package never imports Triton."""

from __future__ import annotations

import importlib.util
import os

__all__ = ["is_available", "interpreting"]


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_available() -> bool:
    """True when a CUDA device is present and Triton imports (on the first call with a CUDA device)."""
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent: callers fall back to torch
        return False
    return True
