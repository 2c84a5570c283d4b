"""A guard for the fused-head tests (``tests/test_kernels.py``, ``tests/gpu/test_gpu_kernels.py``): only the
expected one of the fused module's two kernels may launch."""

from __future__ import annotations

_KERNELS = {"stream": "_fused_stream_kernel", "tile": "_fused_tile_kernel"}


def only_fused_kernel(monkeypatch, kernel: str) -> dict[str, int]:
    """Let only ``kernel`` ("stream" or "tile") of ``kernels/triton_fused`` run: the others raise when
    launched.  Returns the count of launches of ``kernel``, filled as the call runs."""
    from entropy_discriminator.kernels import triton_fused

    runs = {"launches": 0}
    real = getattr(triton_fused, _KERNELS[kernel])

    class Counted:
        def __getitem__(self, grid):
            runs["launches"] += 1
            return real[grid]

        def __getattr__(self, name):  # e.g. ``warmup``: on CUDA the plan compiles the kernel to read its occupancy
            return getattr(real, name)

    class Forbidden:
        def __getitem__(self, grid):
            raise AssertionError(f"{kernel} was expected, but the other fused kernel was launched")

    monkeypatch.setattr(triton_fused, _KERNELS[kernel], Counted())
    for other in set(_KERNELS) - {kernel}:
        monkeypatch.setattr(triton_fused, _KERNELS[other], Forbidden())
    return runs
