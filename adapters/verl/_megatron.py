"""Start-up check of a verl Megatron run for the adapter's ``E_p[S]`` hook (``_engine._wrap_megatron``).

The hook runs inside ``MegatronEngineWithLMHead._lm_head_logits_processor`` on the last pipeline
stage, on this rank's vocabulary shard ``[..., V_padded / TP]`` of the temperature-scaled logits,
and reduces the statistics over the tensor-parallel group with
``token_stats(vocab_parallel_group=..., vocab_start_index=tp_rank * V_local)`` (the torch path).
Its output is one more key of the logits processor's dict, which verl 0.9.1 post-processes key by
key exactly like ``entropy``: the context-parallel all-gather and un-padding
(``postprocess_thd_engine`` / ``postprocess_bshd_engine``), dynamic-CP regrouping, collection on
the last pipeline stage and the worker's return of the whole ``model_output``.  So tensor,
sequence, pipeline (also virtual) and context parallelism need nothing of their own; megatron's
vocabulary padding (``should_pad_vocab``; the bridges load zero rows, logits 0) is part of the
distribution verl computes ``log_probs`` and ``entropy`` from, and the hook sees the same columns.

What cannot run is the one-pass Triton kernel: it has no vocabulary-parallel reduction, and
``token_stats`` raises for ``impl="triton"`` with a process group, which the hook always passes
(the tensor-parallel group, also when its size is 1).
"""

from __future__ import annotations

from typing import Any

MEGATRON_STRATEGY = "megatron"


def megatron_layout_refusal(config: Any) -> str | None:
    """Why the Megatron ``E_p[S]`` hook cannot run under this verl config, or None.

    ``config`` is verl's full trainer config (an OmegaConf ``DictConfig`` or a nested mapping) with
    the adapter's options under ``entropy_disc``.  Returns None when the actor's strategy is not
    ``megatron``.  ``_support.check_config`` calls it for Megatron runs that compute ``E_p[S]``.
    The returned message names the setting to change.
    """
    actor = _get(_get(config, "actor_rollout_ref"), "actor")
    if _get(actor, "strategy", "fsdp") != MEGATRON_STRATEGY:
        return None
    impl = _get(_get(config, "entropy_disc"), "impl", "auto")
    if impl == "triton":
        return (
            "entropy_disc.impl=triton cannot run with actor_rollout_ref.actor.strategy=megatron: the Megatron "
            "engine holds the logits as vocabulary shards of the tensor-parallel group, and the Triton kernel has "
            "no vocabulary-parallel reduction; set +entropy_disc.impl=auto (or torch)"
        )
    return None


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    value = node.get(key, default)
    return default if value is None else value
