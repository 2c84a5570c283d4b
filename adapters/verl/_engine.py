"""Worker side of the verl adapter: the statistics of the old-policy forward of verl's engines.

The hook wraps engine methods, only in processes that install it (see :func:`install_engine_hook`),
and does nothing unless the micro-batch carries the non-tensor flag ``entropy_disc_stats=True``
(set by the adapter's trainer for the old-log-prob pass only).  It adds three fields to the pass's
model output (:data:`SEQ_FIELDS`: ``log p_k``, ``H``, ``E_p[S]``), laid out like verl's ``entropy``
(jagged over prompt+response positions, position ``i`` holding the statistic of the distribution
that predicts token ``i+1``), all three from one :func:`~entropy_discriminator.token_stats` call on
**the logits verl itself takes its log-probs from**: verl's compute dtype and rounding (bf16 under
bf16 mixed precision, fp32 when ``mixed_precision.param_dtype`` is fp32), verl's temperature
division in that dtype, fp32 accumulation.  The driver forms ``S*`` and ``S_c`` from these fields
only, so the five statistics describe one distribution (verl's own ``entropy`` is rounded to bf16
by its fused kernel, and its ``log_probs`` to bf16 where it falls back to a bf16 ``log_softmax``).

* FSDP, logits materialised (``use_fused_kernels=False``):
  ``FSDPEngineWithLMHead.prepare_model_outputs``. Its own result is returned untouched; the hook
  scales ``output.logits`` (bf16 from the autocast LM head, or fp32) exactly as verl does
  (``logits / T.to(logits.dtype)``, ``T`` clamped at 1e-8, skipped when verl marks it as exactly
  1) and scores verl's rolled labels.
* FSDP, fused kernels (``use_fused_kernels=True``, backend ``torch``; no logits exist):
  ``forward_step`` registers, for that one forward, a pre-hook on the causal LM (the labels and
  temperature verl passes) and a forward hook on its base model (the final hidden states, while the
  LM-head weight is gathered).  :func:`fused_head_stats` re-forms verl's
  ``(hidden @ W.T) / T`` per chunk of 512 rows in the forward's autocast state, so its bf16 rounding
  is verl's, and never holds ``[N, V]`` logits.
* Megatron: ``MegatronEngineWithLMHead._lm_head_logits_processor``. The statistics are computed
  before verl's in-place ``logits.div_(temperature)`` and its (destructive) entropy, with the same
  division in the logits' dtype, on the local vocabulary shard, reduced across the tensor-parallel
  group through the core's ``vocab_parallel_group``; verl's post-processing packs them like ``entropy``.

The hooks call the core with ``check=False``: no host synchronisation per micro-batch (one would
stall verl's launch queue in the middle of its pass). A NaN or ``+inf`` logit, or a row of ``-inf``
only, then gives NaN statistics at that position instead of an exception on one worker rank (which
could leave the other ranks waiting in a collective); the driver's
:meth:`~entropy_discriminator.adapters.verl._trainer.EntropyDiscTrainerMixin.entropy_disc_step`
refuses the batch with a ``ValueError`` naming ``E_p[S]`` and the positions, on the one driver process.
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
#: Non-tensor options forwarded to the core (``chunk_size``, ``impl``).
STATS_CHUNK = "entropy_disc_chunk_size"
STATS_IMPL = "entropy_disc_impl"
#: Model-output fields written by the hook (prompt+response positions, like ``entropy``), one per
#: statistic of the one distribution: ``log p_k`` of the next token, ``H`` and ``E_p[S]``.
SEQ_FIELD = "entropy_disc_s_expected_seq"
LOGP_SEQ_FIELD = "entropy_disc_logp_seq"
ENTROPY_SEQ_FIELD = "entropy_disc_entropy_seq"
#: ``TokenStats`` attribute -> model-output field.
SEQ_FIELDS = {"logp": LOGP_SEQ_FIELD, "entropy": ENTROPY_SEQ_FIELD, "s_expected": SEQ_FIELD}
#: Rows per LM-head product in verl's torch fused kernel (``FusedLinearForPPO``'s default ``chunk_size``).
VERL_FUSED_CHUNK = 512

_PATCHES = PatchSet("entropy_disc verl engine hook")
#: Engine attribute holding the fused path's per-position values between forward and output step.
_HIDDEN_STASH = "_entropy_disc_from_hidden"


def _flag(data: Any, key: str, default: Any) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def hook_stats(
    logits: torch.Tensor, labels: torch.Tensor, data: Any, vocab_parallel_group: Any = None, vocab_start_index: int = 0
) -> dict[str, torch.Tensor]:
    """``log p_k``, ``H`` and ``E_p[S]`` per row of verl's own temperature-scaled ``logits`` ``[..., V]``.

    ``logits`` are the tensor verl takes its log-probs from, in verl's dtype and rounding (bf16 under
    bf16 mixed precision); ``labels`` ``[...]`` (int) the next tokens verl scores, global vocabulary
    ids also with ``vocab_parallel_group`` (then the rows are vocabulary shards starting at
    ``vocab_start_index``). :func:`token_stats` accumulates in fp32 (no autocast, no grad) with the
    chunk size and implementation the driver put into ``data``; ``check=False`` (see the module
    docstring: bad logits give NaN, which the driver refuses). Returns :data:`SEQ_FIELDS`' keys ->
    float32 ``[...]``.
    """
    with torch.no_grad(), torch.autocast(device_type=logits.device.type, enabled=False):
        stats = token_stats(
            logits,
            labels.to(device=logits.device, dtype=torch.long),
            chunk_size=_flag(data, STATS_CHUNK, None),
            impl=_flag(data, STATS_IMPL, "auto"),
            check=False,
            vocab_parallel_group=vocab_parallel_group,
            vocab_start_index=vocab_start_index,
        )
    return {name: getattr(stats, name).float() for name in SEQ_FIELDS}


def fused_head_stats(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float, data: Any
) -> torch.Tensor:
    """The :func:`hook_stats` of verl's torch fused head, per row of ``hidden`` ``[..., H]`` -> float32 ``[..., 3]``.

    verl's ``FusedLinearForPPOFunction`` (backend ``torch``) forms, per chunk of
    :data:`VERL_FUSED_CHUNK` flattened rows, ``z = (hidden @ weight.T) / temperature`` under the
    engine's autocast (bf16 in, bf16 out under bf16 mixed precision; the division rounds to the
    product's dtype) and takes its fp32 log-probs and entropy from ``z.float()``.  This function
    forms the same ``z`` chunk by chunk, in the autocast state it is called in (the model's forward,
    so verl's), and hands each chunk to :func:`hook_stats` (fp32 accumulation): no ``[N, V]`` logits,
    one ``[512, V]`` chunk at a time.  ``labels`` ``[...]`` are the rolled next tokens verl scores.
    Columns of the result: :data:`SEQ_FIELDS` in order.
    """
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    w = weight.detach()
    out = torch.empty(flat.shape[0], len(SEQ_FIELDS), dtype=torch.float32, device=flat.device)
    with torch.no_grad():
        for start in range(0, flat.shape[0], VERL_FUSED_CHUNK):
            end = min(start + VERL_FUSED_CHUNK, flat.shape[0])
            z = (flat[start:end] @ w.t()) / temperature
            stats = hook_stats(z, flat_labels[start:end], data)
            out[start:end] = torch.stack([stats[name] for name in SEQ_FIELDS], dim=-1)
            del z
    return out.reshape(*hidden.shape[:-1], len(SEQ_FIELDS))


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


def _padded_labels(micro_batch: Any, shape: torch.Size) -> torch.Tensor:
    """``[bsz, max_len]`` next-token labels for verl's padded (no padding removal) logits: row ``i``
    of sequence ``b`` holds token ``i + 1`` (the last position of each sequence holds a token verl
    never scores)."""
    input_ids = micro_batch["input_ids"]
    pad = _flag(micro_batch, "pad_token_id", 0)
    padded = torch.nested.to_padded_tensor(input_ids, padding=pad, output_size=(shape[0], shape[1]))
    return torch.roll(padded, shifts=-1, dims=1)


def _fsdp_seq_fields(engine: Any, output: Any, output_args: dict, micro_batch: Any) -> dict[str, torch.Tensor]:
    """The FSDP engine's :data:`SEQ_FIELDS` as jagged ``[bsz, j1]`` tensors aligned with its ``entropy``."""
    from torch.distributed.tensor import DTensor

    cu_seqlens = micro_batch["input_ids"].offsets()
    remove_padding = _flag(micro_batch, "use_remove_padding", True)
    values = engine.__dict__.pop(_HIDDEN_STASH, None)
    if values is None:  # logits materialised: verl's own scaled tensor, same expression, same dtype
        logits = output.logits.squeeze(0) if remove_padding else output.logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        unit = output_args.get("temperature_is_one", False)
        if remove_padding:  # (total_nnz [/ sp + pad], V), one temperature and label per position
            temperature = output_args["temperature_rmpad"].unsqueeze(-1)
            labels = output_args["input_ids_rmpad_rolled"]
        else:  # (bsz, max_len, V), one temperature per sequence
            temperature = output_args["temperature"].unsqueeze(-1).unsqueeze(-1)
            labels = _padded_labels(micro_batch, logits.shape)
        stats = hook_stats(_scaled(logits, temperature, unit), labels, micro_batch)
        values = torch.stack([stats[name] for name in SEQ_FIELDS], dim=-1)
    elif remove_padding:
        values = values.squeeze(0)
    if remove_padding:
        values = engine._gather_and_unpad_packed(values, output_args["pad_size"])
    else:
        lengths = cu_seqlens.diff()
        keep = torch.arange(values.shape[1], device=values.device) < lengths.unsqueeze(1).to(values.device)
        values = values[keep]
    return {
        field: torch.nested.nested_tensor_from_jagged(values[:, k].contiguous(), cu_seqlens)
        for k, field in enumerate(SEQ_FIELDS.values())
    }


def _wrap_fsdp_outputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = original(self, output, output_args, micro_batch, logits_processor_func)
        if _flag(micro_batch, STATS_FLAG, False):
            model_output.update(_fsdp_seq_fields(self, output, output_args, micro_batch))
        return model_output

    return prepare_model_outputs


def _fused_labels(kwargs: dict) -> torch.Tensor:
    """The labels verl's fused forward scores (``forward_with_torch_backend``): ``shift_labels`` when
    given, else ``labels`` or ``input_ids`` rolled by one position to the left."""
    if kwargs.get("shift_labels") is not None:
        return kwargs["shift_labels"]
    source = kwargs.get("labels") if kwargs.get("labels") is not None else kwargs["input_ids"]
    return torch.roll(source, shifts=-1, dims=-1)


def _wrap_fsdp_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_step(self, micro_batch, loss_function, forward_only):
        if not (_flag(micro_batch, STATS_FLAG, False) and _flag(micro_batch, "use_fused_kernels", False)):
            return original(self, micro_batch, loss_function, forward_only)
        causal_lm = _causal_lm(self.module)
        call: dict[str, Any] = {}

        def inputs(module, args, kwargs):  # the labels and temperature verl hands its fused forward
            call["labels"] = _fused_labels(kwargs)
            call["temperature"] = kwargs.get("temperature", 1.0)

        def from_hidden(module, args, out):  # the final hidden states, while the LM head is gathered
            hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
            weight = causal_lm.get_output_embeddings().weight
            self.__dict__[_HIDDEN_STASH] = fused_head_stats(
                hidden, weight, call["labels"], call["temperature"], micro_batch
            )

        handles = [
            causal_lm.register_forward_pre_hook(inputs, with_kwargs=True),
            causal_lm.base_model.register_forward_hook(from_hidden),
        ]
        try:
            return original(self, micro_batch, loss_function, forward_only)
        finally:
            for handle in handles:
                handle.remove()
            self.__dict__.pop(_HIDDEN_STASH, None)

    return forward_step


def _wrap_megatron(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _lm_head_logits_processor(self, logits, label, temperature, **kwargs):
        batch = kwargs["batch"]
        fields = None
        if _flag(batch, STATS_FLAG, False):
            from megatron.core import parallel_state as mpu

            t = temperature.clone()
            t[t <= 0] = 1e-8  # verl's own guard, then the same division verl does in place
            scaled = logits / t.unsqueeze(dim=-1).to(logits.dtype)
            group = mpu.get_tensor_model_parallel_group()
            start = mpu.get_tensor_model_parallel_rank() * logits.shape[-1]
            stats = hook_stats(scaled, label, batch, vocab_parallel_group=group, vocab_start_index=start)
            fields = {SEQ_FIELDS[name]: value for name, value in stats.items()}
            del scaled
        ret = original(self, logits, label, temperature, **kwargs)
        if fields is not None:
            ret.update(fields)
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
