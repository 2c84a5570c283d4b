"""One round of updates in OpenRLHF's ``ActorPPOTrainer``: statistics, mask, metrics.

Before ``ppo_train`` runs its epochs over the replay buffer, :func:`begin_round` checks the
training arguments (:func:`~._checks.check_training_args`), then

1. collects ``logp, H, S*, E_p[S], S_c`` of every response token of every buffered sample, as
   scored in the old-policy forward of ``make_experience`` (``PolicyModelActor.forward``: the
   forward whose fp32, temperature-scaled logits give OpenRLHF its old log-probs; see
   ``_experience.py``): no forward of its own. Samples that dynamic batching moved to another
   data-parallel rank are fetched from it. **Fallback**: if any buffered sample on any rank has no
   statistics from that forward (the trainer was built before the patch so its first
   ``make_experience`` was not scored, the buffer was filled outside ``make_experience``, or a
   sample's action mask gained tokens after scoring), every rank instead runs the previous no-grad
   pass of the policy over its buffer (:func:`replay_buffer_stats`), the same policy and the same
   distribution as long as no update happened in between, at the cost of one more forward; the
   round's metric ``entropy_disc/stats/from_forward`` is 0 then (1 normally);
2. computes the configured Clip_B / Clip_V keep-mask over the whole data-parallel batch (the
   ``dp`` group of OpenRLHF's device mesh, so ring-attention / tensor-parallel replicas of the
   same samples are counted once), or, for ``method="autopilot"``, steps the policy's controller
   once on the same statistics and OpenRLHF's per-token advantages (``_autopilot.py``: its keep-mask
   and its ``entropy_disc/autopilot/*`` metrics; its state rides in the actor's checkpoints);
3. writes the mask into the buffered samples through
   :func:`~entropy_discriminator.apply_keep_mask`, so every epoch, micro-batch and the dynamic-batch
   path read it:

   * ``zero_pg``: ``advantages * keep``. OpenRLHF's per-token PPO loss is
     ``-min(r A, clip(r) A)`` (also with dual-clip and the detached IS correction), which is
     exactly ``keep * loss`` for a 0/1 ``keep``; ``action_mask`` and so the global token
     normaliser are unchanged. Terms without the advantage (KL loss, entropy bonus, GSPO's
     sequence ratio) are refused with this mode (``_checks.py``).
   * ``drop_token``: ``action_mask * keep``. The token leaves the loss and its global token count
     (``iter_grad_accum_global_norm`` and the dynamic-batch token counts read ``action_mask``),
     and with it the KL and entropy terms of that token, as in the reference implementation.

After the stock epochs, on a calibration round of the law scale (``calibrate_every``) and, with
``--entropy_disc.realised``, on every round, :func:`end_round` reads the entropy of the same tokens again in a
no-grad pass: on a calibration round over the ``calibrate_share`` of each rank's buffered samples that
:func:`~entropy_discriminator.law_scale.calibration_rows` picks, otherwise over all of them.

Alignment (the one-token shift) is ``Actor.forward``'s: for a right-padded batch of ``A`` action
columns, ``logits[:, :-1][:, -A:]`` score ``sequences[:, 1:][:, -A:]`` (see ``replay_buffer_stats``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from entropy_discriminator import (
    EntropyDiscConfig,
    EntropyMonitor,
    MaskResult,
    TokenStats,
    apply_keep_mask,
    token_stats,
)
from entropy_discriminator.law_scale import PREDICTED_KEY, REALISED_KEY, SKIPPED_KEY, calibration_rows, cheap_change
from ._checks import check_training_args
from entropy_discriminator.distributed import Group, all_gather_cat, all_reduce

IGNORE_INDEX = -100
_FIELDS = ("logp", "entropy", "s_star", "s_expected", "s_centered", "valid")


@dataclass
class RoundState:
    """What one round keeps between the pass before the update and the optional pass after it."""

    valids: list[torch.Tensor]  # per buffered sample, bool [A_i]: the action mask before masking
    stats: TokenStats  # flat over all samples' action columns, on the compute device
    mask: MaskResult | None
    metrics: dict[str, float] = field(default_factory=dict)
    #: ``-eta Cov_B(A, S_c)`` of the round (None without a step size) and whether it is a calibration round
    cheap: float | None = None
    calibrate: bool = False
    #: ``"forward"``: taken in make_experience's old-policy forward; ``"pass"``: the fallback pass
    source: str = "forward"


def dp_group(strategy: Any) -> Group:
    """The data-parallel group of OpenRLHF's device mesh (None without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = getattr(strategy, "ds_device_mesh", None)
    return mesh["dp"].get_group() if mesh is not None else dist.group.WORLD


def _model_device(actor: torch.nn.Module) -> torch.device:
    for p in actor.parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def replay_buffer_stats(
    actor: Any,
    items: list[Any],
    valids: list[torch.Tensor],
    *,
    micro_batch_size: int,
    chunk_size: int | None = None,
    impl: str = "auto",
    ring_attn_group: Any = None,
    sync_group: Group = None,
) -> TokenStats:
    """Per-token statistics of ``actor`` over buffered single-sample ``Experience`` items.

    ``items[i]`` holds ``sequences [T_i]``, ``attention_mask [T_i]``; ``valids[i]`` is bool
    ``[A_i]`` (its action mask). Items are batched ``micro_batch_size`` at a time with OpenRLHF's
    ``make_experience_batch`` (right padding to ``[b, T]``, ``A`` action columns) and run through
    ``actor(sequences, None, attention_mask, return_output=True)`` with the actor's temperature
    switched off, so its ``logits`` are the model's logits upcast by ``Actor.forward``
    (``.to(torch.float32)``: with DeepSpeed bf16 the module's weights are bf16, so these are the
    bf16-rounded logits, exactly representable in fp32), in the actor's own layout:

    * unpacked: ``[b, T, V]``; row ``t`` scores token ``t + 1``, action column ``j`` is row
      ``T - 1 - A + j`` (``Actor.forward``'s ``log_probs[:, :-1][:, -A:]``);
    * packed (``actor.packing_samples``): ``[1, L, V]`` over the unpadded positions in row-major
      order; with ring attention (``ring_attn_group``) only this rank's contiguous slice of those
      positions, padded to a multiple of the ring size. The statistics are computed on the slice,
      then the per-token results (6 numbers per token, never logits) are all-gathered over the ring
      group and put back in place.

    Precision: the statistics are those of the distribution OpenRLHF's log-probs come from,
    ``softmax(z.float() / T)``. The adapter applies the temperature exactly as OpenRLHF does (an
    in-place fp32 ``z.div_(T)`` after the upcast: ``Actor.forward`` in 0.11, ``log_probs_from_logits``
    in 0.10), then ``token_stats(z / T, labels)`` (temperature 1, fp32 accumulation) counts the
    positions where the action mask is 1. Returns a :class:`TokenStats` whose fields are the concatenation over items of their
    ``A_i`` columns (float32 / bool, on the model's device).

    ``sync_group``: every rank runs as many forwards as the rank with the most micro-batches
    (extra forwards repeat the last micro-batch and are discarded), as ZeRO-3 parameter gathering
    and ring attention need all ranks in step.
    """
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    device = _model_device(actor)
    packed = bool(getattr(actor, "packing_samples", False))
    if ring_attn_group is not None and not packed:
        raise ValueError("ring attention needs packed samples (OpenRLHF sets packing_samples with ring_attn_size > 1)")
    chunks = [list(range(i, min(i + micro_batch_size, len(items)))) for i in range(0, len(items), micro_batch_size)]
    n_forward = len(chunks)
    if sync_group is not None:
        n_forward = int(all_reduce(torch.tensor([n_forward], device=device), sync_group, dist.ReduceOp.MAX).item())
    temperature = float(actor.temperature)
    was_training = actor.training
    parts: list[torch.Tensor] = []
    actor.eval()
    actor.temperature = 1.0  # the division below is OpenRLHF's own, on the fp32 logits (0.10.2 skips it here)
    try:
        for step in range(n_forward):
            if not chunks:
                break  # an empty shard cannot run a forward; every rank has samples in OpenRLHF
            idx = chunks[min(step, len(chunks) - 1)]
            batch = make_experience_batch([items[i] for i in idx])
            sequences = batch.sequences.to(device)
            attention_mask = batch.attention_mask.to(device)
            first = sequences.shape[1] - 1 - batch.action_mask.shape[-1]  # row of action column 0
            output = actor(
                sequences,
                None,
                attention_mask=attention_mask,
                return_output=True,
                ring_attn_group=ring_attn_group,
                **_mm_inputs(actor, batch, device),
            )
            if step >= len(chunks):
                continue  # a step-keeping forward of a rank that ran out of samples
            labels = _action_labels(sequences, first, [valids[i].to(device) for i in idx])
            logits = output["logits"]
            if temperature != 1.0:  # OpenRLHF's scaling: fp32 logits divided in place after the upcast
                logits.div_(temperature)
            fields = stats_in_batch_layout(
                logits, labels, attention_mask if packed else None, ring_attn_group,
                first=first, chunk_size=chunk_size, impl=impl,
            )
            for row, i in enumerate(idx):
                parts.append(fields[row, first : first + valids[i].numel()])
            del output, logits, fields
    finally:
        actor.temperature = temperature
        actor.train(was_training)
    flat = torch.cat(parts) if parts else torch.zeros(0, len(_FIELDS), device=device)
    values = {name: flat[:, k].contiguous() for k, name in enumerate(_FIELDS[:-1])}
    return TokenStats(**values, valid=flat[:, -1] > 0.5)


def _action_labels(sequences: torch.Tensor, first: int, valids: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """``[b, T]`` int64: at row ``first + j`` of sample ``r`` the token ``sequences[r, first + j + 1]``
    where ``valids[r][j]``, :data:`IGNORE_INDEX` everywhere else (prompt, padding, masked tokens).
    ``valids``: a ``[b, A]`` mask (the batch's action mask) or one ``[A_r]`` mask per row (``A_r <= A``,
    the columns past ``A_r`` ignored); one ``where`` over the batch either way."""
    n_rows, width = sequences.shape
    n_act = width - 1 - first
    if isinstance(valids, torch.Tensor):
        valid = valids.to(device=sequences.device, dtype=torch.bool)
    else:
        valid = torch.zeros(n_rows, n_act, dtype=torch.bool, device=sequences.device)
        for row, v in enumerate(valids):
            valid[row, : v.numel()] = v.reshape(-1)
    labels = torch.full_like(sequences, IGNORE_INDEX)
    labels[:, first : first + n_act] = sequences[:, first + 1 :].masked_fill(~valid, IGNORE_INDEX)
    return labels


def stats_in_batch_layout(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ring_attn_group: Any,
    *,
    first: int,
    chunk_size: int | None,
    impl: str,
) -> torch.Tensor:
    """``[b, T, 6]`` float32: the :data:`_FIELDS` of ``token_stats`` at every position of the
    right-padded batch (``valid`` as 0/1), from the actor's temperature-scaled fp32 unpacked ``[b, T, V]`` logits
    (``attention_mask`` None; only rows ``first .. T-2``, the action columns, are scored) or packed
    ``[1, L, V]`` logits (``attention_mask [b, T]`` given; every packed row is scored, prompt rows
    as ignored; see :func:`replay_buffer_stats`)."""
    if attention_mask is None:  # only the action rows, read in place (a view, no copy)
        out = torch.zeros(*labels.shape, len(_FIELDS), dtype=torch.float32, device=labels.device)
        rows = slice(first, labels.shape[1] - 1)
        st = token_stats(logits[:, rows], labels[:, rows], chunk_size=chunk_size, impl=impl)
        out[:, rows] = torch.stack([getattr(st, name).float() for name in _FIELDS], dim=-1)
        return out
    positions = attention_mask.reshape(-1).nonzero().squeeze(-1)  # the packed order
    packed_labels = labels.reshape(-1)[positions]
    n_total = packed_labels.numel()
    if ring_attn_group is not None:
        size, rank = dist.get_world_size(ring_attn_group), dist.get_rank(ring_attn_group)
        local = (n_total + size - 1) // size
        padded = torch.full((local * size,), IGNORE_INDEX, dtype=packed_labels.dtype, device=packed_labels.device)
        padded[:n_total] = packed_labels
        packed_labels = padded[rank * local : (rank + 1) * local]
    if logits.shape[:2] != (1, packed_labels.numel()):
        raise RuntimeError(
            f"packed logits have shape {tuple(logits.shape)}, expected (1, {packed_labels.numel()}, V): "
            "Actor.forward's packing layout is not the one this adapter was written for"
        )
    st = token_stats(logits[0], packed_labels, chunk_size=chunk_size, impl=impl)
    local_fields = torch.stack([getattr(st, name).float() for name in _FIELDS], dim=-1)
    if ring_attn_group is not None:
        local_fields = all_gather_cat(local_fields, ring_attn_group)[:n_total]
    out = torch.zeros(labels.numel(), len(_FIELDS), dtype=torch.float32, device=labels.device)
    out[positions] = local_fields.to(out.device)
    return out.reshape(*labels.shape, len(_FIELDS))


def _mm_inputs(actor: Any, batch: Any, device: torch.device) -> dict[str, Any]:
    """Multimodal inputs exactly as ``ActorPPOTrainer.training_step`` passes them (VLM actors)."""
    if getattr(batch, "mm_train_inputs", None) and getattr(actor, "is_vlm", False):
        from openrlhf.utils.vlm_utils import merge_mm_train_inputs

        return merge_mm_train_inputs(batch.mm_train_inputs, device)
    return {}


def _flat_advantages(items: list[Any], device: torch.device) -> torch.Tensor:
    """The items' advantages, float32, concatenated: joined where they lie, moved to ``device`` once."""
    parts = [item.advantages.reshape(-1).to(torch.float32) for item in items]
    if len({t.device for t in parts}) > 1:
        parts = [t.to(device) for t in parts]
    return torch.cat(parts).to(device)


def apply_keep(items: list[Any], keep: torch.Tensor, mode: str) -> None:
    """Write the flat ``keep`` (bool, concatenated ``[A_i]``) into the items, per ``mode``.

    ``zero_pg``: ``item.advantages * keep``; ``drop_token``: ``item.action_mask * keep`` — both via
    :func:`~entropy_discriminator.apply_keep_mask` with the advantages in the role of the per-token
    policy-gradient loss (the PPO loss is linear in a 0/1 factor on ``A``). Dtypes are preserved.
    """
    sizes = [item.action_mask.numel() for item in items]
    if keep.numel() != sum(sizes):
        raise ValueError(f"keep has {keep.numel()} entries but the items have {sum(sizes)} action columns")
    if not items:
        return
    kinds = {(i.advantages.device, i.advantages.dtype, i.action_mask.device, i.action_mask.dtype) for i in items}
    if len(kinds) == 1 and all(item.advantages.shape == item.action_mask.shape for item in items):
        # one call over the concatenation (elementwise: the same numbers as item by item), split back
        k = keep.to(items[0].advantages.device)
        adv, mask = apply_keep_mask(
            torch.cat([item.advantages.reshape(-1) for item in items]), k,
            torch.cat([item.action_mask.reshape(-1) for item in items]), mode=mode,
        )
        for item, a, m in zip(items, adv.split(sizes), mask.split(sizes)):  # the field the mode leaves alone stays
            if mode == "zero_pg":
                item.advantages = a.view(item.advantages.shape)
            else:
                item.action_mask = m.view(item.action_mask.shape)
        return
    by_device = {d: keep.to(d) for d in {item.advantages.device for item in items}}  # one copy per device
    offset = 0
    for item, n in zip(items, sizes):
        k = by_device[item.advantages.device][offset : offset + n].reshape(item.advantages.shape)
        offset += n
        adv, mask = apply_keep_mask(item.advantages, k, item.action_mask, mode=mode)
        item.advantages, item.action_mask = adv, mask


def collect_stats(trainer: Any, items: list[Any], valids: list[torch.Tensor], config: EntropyDiscConfig) -> tuple[TokenStats, str]:
    """The round's :class:`TokenStats` (flat over the items' action columns, on the model's device)
    and where they came from: ``"forward"`` (``make_experience``'s old-policy forward, via
    ``_experience.STORE`` and, across ranks, :func:`~._experience.exchange`) or ``"pass"`` (the
    fallback :func:`replay_buffer_stats`, run by every rank as soon as one rank lacks a sample)."""
    from ._experience import STORE, exchange, sample_key

    device = _model_device(trainer.actor)
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    keys = [sample_key(item.sequences) for item in items]
    found = [STORE.find(k, item.sequences, v, pop=True) for k, item, v in zip(keys, items, valids)]
    missing = [i for i, f in enumerate(found) if f is None]
    n_missing = int(all_reduce(torch.tensor([len(missing)], device=device), world).item())
    if n_missing and world is not None:
        fetched = exchange([(keys[i], items[i].sequences, valids[i]) for i in missing])
        for i, fields in zip(missing, fetched):
            found[i] = fields
        missing = [i for i, f in enumerate(found) if f is None]
        n_missing = int(all_reduce(torch.tensor([len(missing)], device=device), world).item())
    STORE.end_round()
    if n_missing:
        stats = replay_buffer_stats(
            trainer.actor,
            items,
            valids,
            micro_batch_size=int(trainer.micro_train_batch_size),
            chunk_size=config.chunk_size,
            impl=config.impl,
            ring_attn_group=getattr(trainer.strategy, "ring_attn_group", None),
            sync_group=world,
        )
        return stats, "pass"
    if not items:
        flat = torch.zeros(0, len(_FIELDS), device=device)
    else:
        # a token the action mask dropped since scoring (valid False now) counts as ignored: zeros
        fields = torch.cat(found)
        valid = torch.cat([v.reshape(-1).cpu() for v in valids])
        flat = (fields * valid.to(fields.dtype)[:, None]).to(device)
    values = {name: flat[:, k].contiguous() for k, name in enumerate(_FIELDS[:-1])}
    return TokenStats(**values, valid=flat[:, -1] > 0.5), "forward"


def begin_round(trainer: Any, config: EntropyDiscConfig) -> RoundState:
    """Statistics, mask and metrics for the samples now in ``trainer.replay_buffer`` (see module doc)."""
    from ._experience import STORE, register_policy

    started = time.perf_counter()
    check_training_args(trainer.strategy.args, config)
    register_policy(trainer.actor)  # a trainer built before the patch: its later forwards are scored
    items = trainer.replay_buffer.items
    group = dp_group(trainer.strategy)
    valids = [item.action_mask.reshape(-1).bool().clone() for item in items]
    stats, source = collect_stats(trainer, items, valids, config)
    advantages = _flat_advantages(items, stats.valid.device) if items else torch.zeros(0, device=stats.valid.device)
    mask, pilot_metrics = None, {}
    if config.method == "autopilot":  # one controller step (its state with the checkpoints: _autopilot.py)
        from ._autopilot import step

        mask, pilot_metrics = step(trainer, config, group, stats, advantages)
    elif config.enabled:
        mask = config.compute_mask(
            advantages=advantages,
            valid=stats.valid,
            s_star=stats.s_star,
            s_centered=stats.s_centered,
            process_group=group,
        )
    if mask is not None:
        apply_keep(items, mask.keep, config.mask_mode)
    from ._autopilot import law_scale

    scale = law_scale(trainer, config, group)
    eta = _law_step_size(trainer, config)
    cheap = cheap_change(advantages, stats.s_centered, stats.valid, eta=eta, form=config.form, process_group=group)
    calibrate = scale.tick() and cheap is not None
    forward_s, _ = STORE.take_timing()
    metrics: dict[str, float] = {}
    if config.log_metrics:
        monitor = EntropyMonitor(process_group=group)
        metrics = monitor.from_stats(stats, advantages=advantages, mask=mask, lr=_current_lr(trainer))
        metrics.pop(monitor.prefix + PREDICTED_KEY, None)  # replaced by the law scale's (cheap, kappa * cheap)
        metrics.update(scale.metrics(cheap, monitor.prefix))
        metrics.update(pilot_metrics)
        metrics[monitor.prefix + "stats/from_forward"] = float(source == "forward")
        metrics[monitor.prefix + "timing/stats_in_forward"] = forward_s
        metrics[monitor.prefix + "timing/stats_pass"] = time.perf_counter() - started
    return RoundState(valids=valids, stats=stats, mask=mask, metrics=metrics, source=source, cheap=cheap,
                      calibrate=calibrate)


def _law_step_size(trainer: Any, config: EntropyDiscConfig) -> float | None:
    """``eta`` of the cheap prediction: the autopilot's step size (``entropy_disc.eta`` or ``--actor.adam.lr``),
    else the actor scheduler's current learning rate (what the monitor's prediction used before the law scale);
    None where there is neither (no cheap prediction)."""
    from ._autopilot import step_size

    try:
        return step_size(trainer.strategy.args, config)
    except ValueError:
        lr = _current_lr(trainer)
        return lr if lr is not None and math.isfinite(lr) and lr > 0 else None


def end_round(trainer: Any, config: EntropyDiscConfig, state: RoundState) -> dict[str, float]:
    """``entropy_disc/delta_entropy/realised``: the mean, over the valid tokens (the action masks before masking) of
    the samples read on every rank of the data-parallel group, of their entropy after the round's update minus
    before it, from a second no-grad pass (:func:`replay_buffer_stats`) over those samples.

    Samples read, on each rank (:func:`read_rows`): on a calibration round the ``calibrate_share`` of its buffered
    samples that :func:`~entropy_discriminator.law_scale.calibration_rows` picks (at least one when it has any), and
    ``(cheap, realised)`` is fed to the law scale (:mod:`entropy_discriminator.law_scale`); on any other round (the
    pass ``--entropy_disc.realised`` adds) every buffered sample.  The samples are chosen from the buffer's
    single-sample items before the pass batches (and, with ``packing_samples``, packs) them into micro-batches."""
    items = trainer.replay_buffer.items
    rows = read_rows(len(items), config, state)
    picked = rows.tolist()
    tokens = sample_tokens(state.valids, rows).to(state.stats.entropy.device)
    after = replay_buffer_stats(
        trainer.actor,
        [items[i] for i in picked],
        [state.valids[i] for i in picked],
        micro_batch_size=int(trainer.micro_train_batch_size),
        chunk_size=config.chunk_size,
        impl=config.impl,
        ring_attn_group=getattr(trainer.strategy, "ring_attn_group", None),
        sync_group=dist.group.WORLD if dist.is_available() and dist.is_initialized() else None,
    )
    monitor = EntropyMonitor(process_group=dp_group(trainer.strategy))
    out = monitor.realised(state.stats.entropy[tokens], after.entropy, state.stats.valid[tokens])
    if state.calibrate:
        from ._autopilot import law_scale

        scale = law_scale(trainer, config, dp_group(trainer.strategy))
        out[monitor.prefix + SKIPPED_KEY] = float(not scale.feed(state.cheap, out[monitor.prefix + REALISED_KEY]))
    return out


def read_rows(n_items: int, config: EntropyDiscConfig, state: RoundState) -> torch.Tensor:
    """Indices (int64, sorted) of this rank's ``n_items`` buffered samples that :func:`end_round`'s pass reads:
    ``calibration_rows(n_items, config.calibrate_share)`` on a calibration round, all of them otherwise."""
    return calibration_rows(n_items, config.calibrate_share if state.calibrate else 1.0)


def sample_tokens(valids: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """bool ``[sum_i A_i]`` (on the CPU): True on the action columns of the samples ``rows`` in the concatenation of
    the per-sample ``valids[i]`` (``[A_i]``), the layout of :attr:`RoundState.stats`."""
    read = torch.zeros(len(valids), dtype=torch.bool)
    read[rows] = True
    return read.repeat_interleave(torch.tensor([v.numel() for v in valids], dtype=torch.int64))


def _current_lr(trainer: Any) -> float | None:
    scheduler = getattr(trainer, "actor_scheduler", None)
    if scheduler is None or not hasattr(scheduler, "get_last_lr"):
        return None
    return float(scheduler.get_last_lr()[0])
