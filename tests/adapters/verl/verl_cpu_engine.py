"""verl's real FSDP engine on CPU without FSDP, for the verl tests (imported only where verl is installed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def cpu_engine(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, *, autocast_dtype: torch.dtype,
               entropy_chunk: int):
    """verl's ``FSDPEngineWithLMHead`` around ``model`` without building FSDP: the attributes its
    ``forward_step`` / ``prepare_model_outputs`` read, device lookups pointed at the CPU, verl's own
    chunked entropy (``entropy_chunk`` rows per chunk) and autocast in ``autocast_dtype``."""
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    eng = object.__new__(FSDPEngineWithLMHead)
    eng.module = model
    eng.engine_config = SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=True, entropy_from_logits_chunk_size=entropy_chunk
    )
    eng.compute_entropy_from_logits = transformer_impl.verl_F.entropy_from_logits_with_chunking
    eng.ulysses_sequence_parallel_size = 1
    eng.ulysses_device_mesh = None
    eng.use_ulysses_sp = False
    eng.pad_to_length = False
    eng.pad_to_length_bucket = 1
    eng._autocast_dtype = autocast_dtype
    eng.scaler = None
    return eng
