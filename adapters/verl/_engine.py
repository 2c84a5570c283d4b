"""Worker side of the verl adapter: ``E_p[S]`` from the old-policy forward of verl's engines.

The hook wraps two engine methods, only in processes that install it (see
:func:`install_engine_hook`), and does nothing unless the micro-batch carries the non-tensor flag
``entropy_disc_stats=True`` (set by the adapter's trainer for the old-log-prob pass only):

* FSDP: ``FSDPEngineWithLMHead.prepare_model_outputs``. Its own result is returned untouched; the
  hook re-derives the temperature-scaled logits exactly as verl does (``output.logits``, the same
  ``_scale_logits_by_temperature`` call with the same per-token temperatures), runs the core's
  :func:`~entropy_discriminator.token_stats` on them and adds ``entropy_disc_s_expected_seq``,
  laid out like verl's ``entropy`` (a jagged tensor over prompt+response positions, position ``i``
  holding the statistic of the distribution that predicts token ``i+1``).
* Megatron: ``MegatronEngineWithLMHead._lm_head_logits_processor``. The statistic is computed
  before verl's in-place ``logits.div_(temperature)`` and its (destructive) entropy, on the local
  vocabulary shard, reduced across the tensor-parallel group through the core's
  ``vocab_parallel_group``; verl's post-processing then packs it like ``entropy``.

``E_p[S] = H sum_i p_i^2 + sum_i p_i^2 log p_i`` does not depend on the sampled token, so the hook
passes dummy labels (0); ``S*`` is formed on the driver from verl's own ``old_log_probs`` and
``entropy`` of the same pass.  With fused kernels the logits never exist: the hook raises.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from entropy_discriminator import token_stats

from .._patching import PatchSet

#: Non-tensor micro-batch flag that switches the statistics on (set by the driver for one pass).
STATS_FLAG = "entropy_disc_stats"
#: Non-tensor options forwarded to :func:`token_stats` (``chunk_size``, ``impl``).
STATS_CHUNK = "entropy_disc_chunk_size"
STATS_IMPL = "entropy_disc_impl"
#: Model-output field written by the hook (prompt+response positions, like ``entropy``).
SEQ_FIELD = "entropy_disc_s_expected_seq"

FUSED_KERNELS_MESSAGE = (
    "entropy_disc needs E_p[S] from the full temperature-scaled logits of the old-policy pass, but "
    "use_fused_kernels=True never materialises them: set actor_rollout_ref.model.use_fused_kernels=False "
    "(or use +entropy_disc.method=clip_b, which needs only log-probs and entropy)"
)

_PATCHES = PatchSet("entropy_disc verl engine hook")


def _flag(data: Any, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def expected_score(logits: torch.Tensor, data: Any, vocab_parallel_group: Any = None, vocab_start_index: int = 0) -> torch.Tensor:
    """``E_p[S]`` per row of already temperature-scaled ``logits`` ``[..., V]`` -> float32 ``[...]``.

    Runs :func:`token_stats` (no autocast, no grad) with the chunk size and implementation the
    driver put into ``data``; with ``vocab_parallel_group`` the rows are vocabulary shards.
    """
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    with torch.no_grad(), torch.autocast(device_type=logits.device.type, enabled=False):
        stats = token_stats(
            logits,
            labels,
            chunk_size=_flag(data, STATS_CHUNK, None),
            impl=_flag(data, STATS_IMPL, "auto"),
            vocab_parallel_group=vocab_parallel_group,
            vocab_start_index=vocab_start_index,
        )
    return stats.s_expected.float()


def _fsdp_expected_seq(engine: Any, output: Any, output_args: dict, micro_batch: Any) -> torch.Tensor:
    """The FSDP engine's ``E_p[S]`` as a jagged ``[bsz, j1]`` tensor aligned with its ``entropy``."""
    from torch.distributed.tensor import DTensor
    from verl.workers.engine.fsdp import transformer_impl as impl

    if _flag(micro_batch, "use_fused_kernels", False):
        raise RuntimeError(FUSED_KERNELS_MESSAGE)
    unit = output_args.get("temperature_is_one", False)
    cu_seqlens = micro_batch["input_ids"].offsets()
    if _flag(micro_batch, "use_remove_padding", True):
        logits = output.logits.squeeze(0)  # (total_nnz [/ sp + pad], V)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logits = impl._scale_logits_by_temperature(
            logits, output_args["temperature_rmpad"].unsqueeze(-1), is_unit_temperature=unit
        )
        values = expected_score(logits, micro_batch)
        values = engine._gather_and_unpad_packed(values, output_args["pad_size"])
    else:
        logits = output.logits  # (bsz, max_len, V)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        temperature = output_args["temperature"].unsqueeze(-1).unsqueeze(-1)
        logits = impl._scale_logits_by_temperature(logits, temperature, is_unit_temperature=unit)
        padded = expected_score(logits, micro_batch)
        lengths = cu_seqlens.diff().tolist()
        values = torch.cat([padded[i, :n] for i, n in enumerate(lengths)])
    return torch.nested.nested_tensor_from_jagged(values, cu_seqlens)


def _wrap_fsdp(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = original(self, output, output_args, micro_batch, logits_processor_func)
        if _flag(micro_batch, STATS_FLAG, False):
            model_output[SEQ_FIELD] = _fsdp_expected_seq(self, output, output_args, micro_batch)
        return model_output

    return prepare_model_outputs


def _wrap_megatron(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _lm_head_logits_processor(self, logits, label, temperature, **kwargs):
        batch = kwargs["batch"]
        expected = None
        if _flag(batch, STATS_FLAG, False):
            from megatron.core import parallel_state as mpu

            t = temperature.clone()
            t[t <= 0] = 1e-8  # verl's own guard, then the same division verl does in place
            scaled = logits / t.unsqueeze(dim=-1).to(logits.dtype)
            group = mpu.get_tensor_model_parallel_group()
            start = mpu.get_tensor_model_parallel_rank() * logits.shape[-1]
            expected = expected_score(scaled, batch, vocab_parallel_group=group, vocab_start_index=start)
            del scaled
        ret = original(self, logits, label, temperature, **kwargs)
        if expected is not None:
            ret[SEQ_FIELD] = expected
        return ret

    return _lm_head_logits_processor


def _targets() -> list[tuple[type, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    targets = [(FSDPEngineWithLMHead, "prepare_model_outputs", _wrap_fsdp)]
    try:  # megatron-core is optional; without it there is no Megatron engine to hook
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    except ImportError:
        return targets
    targets.append((MegatronEngineWithLMHead, "_lm_head_logits_processor", _wrap_megatron))
    return targets


def install_engine_hook() -> None:
    """Wrap the engines' output methods in this process (idempotent)."""
    if _PATCHES.active:
        return
    for cls, name, wrap in _targets():
        _PATCHES.replace(cls, name, wrap(cls.__dict__[name]))


def remove_engine_hook() -> None:
    """Restore the original engine methods (idempotent)."""
    _PATCHES.restore()


def engine_hook_installed() -> bool:
    """True while the engine methods are wrapped in this process."""
    return _PATCHES.active
