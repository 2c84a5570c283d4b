"""A guard for the fused-head tests (``tests/test_kernels.py``, ``tests/gpu/test_gpu_kernels.py``): only the
expected one of the fused head's three kernels may launch."""

from __future__ import annotations

import importlib

# kernel -> (module under entropy_discriminator.kernels, attribute)
_KERNELS = {"stream": ("triton_fused", "_fused_stream_kernel"), "tile": ("triton_fused", "_fused_tile_kernel"),
            "gluon": ("gluon_fused", "ws_kernel")}


def _module(kernel: str):
    """The module holding ``kernel``, or None where it cannot import (a Triton without Gluon: never launched)."""
    try:
        return importlib.import_module(f"entropy_discriminator.kernels.{_KERNELS[kernel][0]}")
    except ImportError:
        return None


def only_fused_kernel(monkeypatch, kernel: str) -> dict[str, int]:
    """Let only ``kernel`` ("stream", "tile" or "gluon") of the fused head run: the others raise when launched.
    Returns the count of launches of ``kernel``, filled as the call runs."""
    runs = {"launches": 0}
    real = getattr(_module(kernel), _KERNELS[kernel][1])

    class Counted:
        def __getitem__(self, grid):
            runs["launches"] += 1
            return real[grid]

        def __getattr__(self, name):  # e.g. ``warmup``: on CUDA the plan compiles the kernel to read its occupancy
            return getattr(real, name)

    class Forbidden:
        def __getitem__(self, grid):
            raise AssertionError(f"{kernel} was expected, but another fused kernel was launched")

    monkeypatch.setattr(_module(kernel), _KERNELS[kernel][1], Counted())
    for other in set(_KERNELS) - {kernel}:
        if _module(other) is not None:
            monkeypatch.setattr(_module(other), _KERNELS[other][1], Forbidden())
    return runs
