"""Optional fused GPU kernels (Triton), imported lazily.

Importing this package never imports Triton; the kernels live in
:mod:`entropy_discriminator.kernels.triton_stats` (one pass over a logits row) and
:mod:`entropy_discriminator.kernels.triton_fused` (LM-head matmul with the same reduction in its
epilogue), which callers import only after :func:`is_available` said yes.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["is_available", "interpreting"]


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_available() -> bool:
    """True when a CUDA device is present and Triton imports (the kernels' run condition).

    Triton is imported here, on the first call with a CUDA device, never at package import.
    """
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent: callers fall back to torch
        return False
    return True
