"""Worker side of the verl adapter: ``E_p[S]`` from the old-policy forward of verl's engines.

The hook wraps engine methods, only in processes that install it (see :func:`install_engine_hook`),
and does nothing unless the micro-batch carries the non-tensor flag ``entropy_disc_stats=True``
(set by the adapter's trainer for the old-log-prob pass only):

* FSDP, logits materialised (``use_fused_kernels=False``):
  ``FSDPEngineWithLMHead.prepare_model_outputs``. Its own result is returned untouched; the hook
  scales ``output.logits`` by the same per-token temperatures verl uses (``logits / T``, ``T``
  clamped at 1e-8, skipped when verl marks the temperature as exactly 1), runs the core's
  :func:`~entropy_discriminator.token_stats` on them and adds ``entropy_disc_s_expected_seq``, laid
  out like verl's ``entropy`` (a jagged tensor over prompt+response positions, position ``i``
  holding the statistic of the distribution that predicts token ``i+1``).
* FSDP, fused kernels (``use_fused_kernels=True``, no logits exist): ``forward_step`` registers a
  forward hook on the causal LM's base model for that one forward; the hook reads the final hidden
  states and, while the LM-head weight is gathered, runs the core's
  :func:`~entropy_discriminator.token_stats_from_hidden` with verl's scalar temperature
  (``logits = hidden @ W.T / T``, as verl's fused head forms them, in the autocast dtype when
  autocast is on); ``prepare_model_outputs`` lays the result out like the logits path.
* Megatron: ``MegatronEngineWithLMHead._lm_head_logits_processor``. The statistic is computed
  before verl's in-place ``logits.div_(temperature)`` and its (destructive) entropy, on the local
  vocabulary shard, reduced across the tensor-parallel group through the core's
  ``vocab_parallel_group``; verl's post-processing then packs it like ``entropy``.

``E_p[S] = sum_i p_i^2 (log p_i + H)`` does not depend on the sampled token, so the hook passes
dummy labels (0); ``S*`` is formed on the driver from verl's own ``old_log_probs`` and ``entropy``
of the same pass.

The hooks call the core with ``check=False``: no host synchronisation per micro-batch (one would
stall verl's launch queue in the middle of its pass). A NaN or ``+inf`` logit, or a row of ``-inf``
only, then gives a NaN ``E_p[S]`` at that position instead of an exception on one worker rank (which
could leave the other ranks waiting in a collective); the driver's
:meth:`~entropy_discriminator.adapters.verl._trainer.EntropyDiscTrainerMixin.entropy_disc_step`
refuses the batch with a ``ValueError`` naming ``E_p[S]`` and the positions, on the one driver process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from entropy_discriminator import token_stats, token_stats_from_hidden

from .._patching import PatchSet

#: Non-tensor micro-batch flag that switches the statistics on (set by the driver for one pass).
STATS_FLAG = "entropy_disc_stats"
#: Non-tensor options forwarded to the core (``chunk_size``, ``impl``).
STATS_CHUNK = "entropy_disc_chunk_size"
STATS_IMPL = "entropy_disc_impl"
#: Model-output field written by the hook (prompt+response positions, like ``entropy``).
SEQ_FIELD = "entropy_disc_s_expected_seq"

_PATCHES = PatchSet("entropy_disc verl engine hook")
#: Engine attribute holding the fused path's per-position values between forward and output step.
_HIDDEN_STASH = "_entropy_disc_from_hidden"


def _flag(data: Any, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def expected_score(logits: torch.Tensor, data: Any, vocab_parallel_group: Any = None, vocab_start_index: int = 0) -> torch.Tensor:
    """``E_p[S]`` per row of already temperature-scaled ``logits`` ``[..., V]`` -> float32 ``[...]``.

    Runs :func:`token_stats` (no autocast, no grad) with the chunk size and implementation the
    driver put into ``data``; with ``vocab_parallel_group`` the rows are vocabulary shards.
    ``check=False`` (see the module docstring: bad logits give NaN, which the driver refuses).
    """
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    with torch.no_grad(), torch.autocast(device_type=logits.device.type, enabled=False):
        stats = token_stats(
            logits,
            labels,
            chunk_size=_flag(data, STATS_CHUNK, None),
            impl=_flag(data, STATS_IMPL, "auto"),
            check=False,
            vocab_parallel_group=vocab_parallel_group,
            vocab_start_index=vocab_start_index,
        )
    return stats.s_expected.float()


def expected_score_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, data: Any) -> torch.Tensor:
    """``E_p[S]`` of ``softmax(hidden @ weight.T / temperature)`` per row of ``hidden`` ``[..., H]`` -> float32 ``[...]``.

    ``hidden`` and ``weight`` are cast to the autocast dtype when autocast is on for their device
    (the dtype verl's fused head multiplies in), else to ``hidden``'s dtype; the product is formed
    with fp32 accumulation by :func:`token_stats_from_hidden`, without ``[N, V]`` logits, and
    ``check=False`` (see the module docstring: bad values give NaN, which the driver refuses).
    """
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    labels = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    with torch.no_grad(), torch.autocast(device_type=device, enabled=False):
        stats = token_stats_from_hidden(
            hidden.detach().to(dtype),
            weight.detach().to(dtype),
            labels,
            temperature=float(temperature),
            chunk_size=_flag(data, STATS_CHUNK, None),
            impl=_flag(data, STATS_IMPL, "auto"),
            check=False,
        )
    return stats.s_expected.float()


def _scaled(logits: torch.Tensor, temperature: torch.Tensor, unit: bool) -> torch.Tensor:
    """``logits / T`` with verl's clamp of ``T`` at 1e-8 (no-op when verl marks ``T`` as exactly 1)."""
    return logits if unit else logits / temperature.clamp(min=1e-8).to(logits.dtype)


def _causal_lm(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside an (FSDP-wrapped) engine module: it has an output embedding."""
    for m in module.modules():
        get_head = getattr(m, "get_output_embeddings", None)
        if callable(get_head) and get_head() is not None and hasattr(m, "base_model"):
            return m
    raise RuntimeError(
        "entropy_disc: use_fused_kernels=True needs the LM head's hidden states, but the actor module has no "
        "Hugging Face causal LM with get_output_embeddings()"
    )


def _fsdp_expected_seq(engine: Any, output: Any, output_args: dict, micro_batch: Any) -> torch.Tensor:
    """The FSDP engine's ``E_p[S]`` as a jagged ``[bsz, j1]`` tensor aligned with its ``entropy``."""
    from torch.distributed.tensor import DTensor

    cu_seqlens = micro_batch["input_ids"].offsets()
    remove_padding = _flag(micro_batch, "use_remove_padding", True)
    values = engine.__dict__.pop(_HIDDEN_STASH, None)
    if values is None:  # logits materialised
        logits = output.logits.squeeze(0) if remove_padding else output.logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        unit = output_args.get("temperature_is_one", False)
        if remove_padding:  # (total_nnz [/ sp + pad], V), one temperature per position
            temperature = output_args["temperature_rmpad"].unsqueeze(-1)
        else:  # (bsz, max_len, V), one temperature per sequence
            temperature = output_args["temperature"].unsqueeze(-1).unsqueeze(-1)
        values = expected_score(_scaled(logits, temperature, unit), micro_batch)
    elif remove_padding:
        values = values.squeeze(0)
    if remove_padding:
        values = engine._gather_and_unpad_packed(values, output_args["pad_size"])
    else:
        lengths = cu_seqlens.diff()
        keep = torch.arange(values.shape[1], device=values.device) < lengths.unsqueeze(1).to(values.device)
        values = values[keep]
    return torch.nested.nested_tensor_from_jagged(values, cu_seqlens)


def _wrap_fsdp_outputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = original(self, output, output_args, micro_batch, logits_processor_func)
        if _flag(micro_batch, STATS_FLAG, False):
            model_output[SEQ_FIELD] = _fsdp_expected_seq(self, output, output_args, micro_batch)
        return model_output

    return prepare_model_outputs


def _wrap_fsdp_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_step(self, micro_batch, loss_function, forward_only):
        if not (_flag(micro_batch, STATS_FLAG, False) and _flag(micro_batch, "use_fused_kernels", False)):
            return original(self, micro_batch, loss_function, forward_only)
        causal_lm = _causal_lm(self.module)
        temperature = _flag(micro_batch, "temperature", 1.0)

        def from_hidden(module, args, out):  # the final hidden states, while the LM head is gathered
            hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
            weight = causal_lm.get_output_embeddings().weight
            self.__dict__[_HIDDEN_STASH] = expected_score_from_hidden(hidden, weight, temperature, micro_batch)

        handle = causal_lm.base_model.register_forward_hook(from_hidden)
        try:
            return original(self, micro_batch, loss_function, forward_only)
        finally:
            handle.remove()
            self.__dict__.pop(_HIDDEN_STASH, None)

    return forward_step


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

    targets = [
        (FSDPEngineWithLMHead, "prepare_model_outputs", _wrap_fsdp_outputs),
        (FSDPEngineWithLMHead, "forward_step", _wrap_fsdp_forward_step),
    ]
    try:  # megatron-core is optional; without it there is no Megatron engine to hook
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    except ImportError:
        return targets
    targets.append((MegatronEngineWithLMHead, "_lm_head_logits_processor", _wrap_megatron))
    return targets


def install_engine_hook() -> None:
    """Wrap the engines' methods in this process (idempotent)."""
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
