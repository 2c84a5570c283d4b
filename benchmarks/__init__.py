"""Benchmarks of the per-token statistics kernels (``python -m benchmarks stats|fused``)."""
