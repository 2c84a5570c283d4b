"""Statistics taken in the old-policy forward of ``make_experience`` and carried to the replay buffer.

OpenRLHF computes the old action log-probs in ``PolicyModelActor.forward`` (the Ray method
``make_experience`` dispatches per micro-batch): ``self.actor.eval()``, then under ``torch.no_grad()``
``self.actor(sequences, action_mask, attention_mask, ring_attn_group=...)``, i.e. OpenRLHF's
``Actor.forward`` with an action mask and no ``return_output``. The patch wraps ``Actor.forward``;
for exactly that call, on the policy (an ``Actor`` registered by :func:`register_policy`, which the
patched ``ActorPPOTrainer.__init__`` and every round do), it asks the original for its output too
(``return_output=True``: same computation, the log-probs it returns are unchanged) and scores the
micro-batch's action tokens from ``output["logits"]``: the fp32 logits OpenRLHF took its log-probs
from, after its own in-place ``div_(T)`` (in ``Actor.forward`` in 0.11, in ``log_probs_from_logits``
in 0.10, on the same tensor), in the actor's own layout (padded, packed, or this rank's
ring-attention slice; :func:`~._round.stats_in_batch_layout`). Only the per-token results leave the
forward (``logp, H, S*, E_p[S], S_c`` and the valid flag, 24 bytes per action column, moved to the
CPU as OpenRLHF moves its log-probs); the ``[N, V]`` logits are freed when the forward returns, as
without the adapter.

Carrying them to the buffer: the Experience OpenRLHF builds from the log-probs goes through the
driver (rewards, advantages, optionally ``balance_experiences`` for dynamic batching) and comes back
to a policy worker's ``NaiveReplayBuffer.append``, which splits it into single samples and removes
their right padding. The samples are matched by content: :class:`SampleStore` keys each sample by
its token ids without right padding (exactly what the buffered item's ``sequences`` holds), and
:func:`~._round.begin_round` takes every buffered item's statistics from it (same token ids, same
number of action columns, its action mask within the one scored). Identical samples (the same
tokens twice) share a key; they are taken in the order they were scored, and their statistics are
equal up to the rounding of batched kernels. Samples that dynamic batching moved to another
data-parallel rank are fetched from the rank that scored them (:func:`exchange`). Entries left over
(scored, never buffered here) are dropped after one more round.
"""

from __future__ import annotations

import hashlib
import inspect
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

_NFIELDS = 6  # logp, entropy, s_star, s_expected, s_centered, valid (as 0/1)

#: The ``Actor`` instances that are a policy (the actor of an ``ActorPPOTrainer`` in this process).
_POLICIES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_policy(actor: Any) -> None:
    """Mark ``actor`` (OpenRLHF's ``Actor``) as this process's policy: its old-log-prob forwards are scored."""
    if actor is not None:
        _POLICIES.add(actor)


def is_policy(actor: Any) -> bool:
    try:
        return actor in _POLICIES
    except TypeError:
        return False


def sample_key(tokens: torch.Tensor) -> bytes:
    """Key of one sample: digest of its int64 token ids (right padding already removed)."""
    data = tokens.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class Entry:
    tokens: torch.Tensor  # int64 [T_i] on the CPU, no right padding
    fields: torch.Tensor  # float32 [A_i, 6] on the CPU (the last column: valid as 0/1)
    round: int


class SampleStore:
    """Per-sample statistics of this process's old-policy forwards, until a round takes them."""

    def __init__(self) -> None:
        self.entries: dict[bytes, list[Entry]] = {}
        self.round = 0
        self.forward_s = 0.0  # time spent scoring inside forwards since the last round took it
        self.n_forwards = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    def clear(self) -> None:
        self.entries.clear()
        self.forward_s, self.n_forwards = 0.0, 0

    def put(self, tokens: torch.Tensor, fields: torch.Tensor) -> None:
        self.entries.setdefault(sample_key(tokens), []).append(Entry(tokens, fields, self.round))

    def find(self, key: bytes, tokens: torch.Tensor, valid: torch.Tensor, *, pop: bool) -> torch.Tensor | None:
        """``[A_i, 6]`` statistics of the sample ``tokens`` whose scored action columns cover ``valid``."""
        candidates = self.entries.get(key, [])
        for k, entry in enumerate(candidates):
            if matches(entry.tokens, entry.fields, tokens, valid):
                if pop:
                    del candidates[k]
                    if not candidates:
                        del self.entries[key]
                return entry.fields
        return None

    def end_round(self) -> None:
        """Drop entries that survived a whole round without being taken (scored on this rank, buffered
        elsewhere or never); entries scored for the next batch (asynchronous training) stay."""
        self.round += 1
        for key in list(self.entries):
            kept = [e for e in self.entries[key] if e.round >= self.round - 1]
            if kept:
                self.entries[key] = kept
            else:
                del self.entries[key]

    def take_timing(self) -> tuple[float, int]:
        out = (self.forward_s, self.n_forwards)
        self.forward_s, self.n_forwards = 0.0, 0
        return out


def matches(entry_tokens: torch.Tensor, fields: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> bool:
    if entry_tokens.numel() != tokens.numel() or fields.shape[0] != valid.numel():
        return False
    if not torch.equal(entry_tokens, tokens.reshape(-1).to(device="cpu", dtype=torch.int64)):
        return False
    scored = fields[:, -1] > 0.5
    return not bool((valid.to("cpu") & ~scored).any())


STORE = SampleStore()


def record_batch(
    actor: Any,
    logits: torch.Tensor,
    sequences: torch.Tensor,
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    ring_attn_group: Any,
    *,
    chunk_size: int | None,
    impl: str,
) -> None:
    """Score one old-policy micro-batch from ``Actor.forward``'s fp32 temperature-scaled ``logits`` and
    store each sample's action columns (see the module doc).

    Host cost: the labels are built by one ``where`` over the batch, the per-token results, the token
    ids and the attention mask reach the CPU by three asynchronous copies into pinned memory and one
    wait, and the per-sample bookkeeping (right padding, key) runs on those CPU copies."""
    from ._round import _action_labels, stats_in_batch_layout

    packed = bool(getattr(actor, "packing_samples", False))
    width = sequences.shape[1]
    n_act = action_mask.shape[-1]
    first = width - 1 - n_act  # row of action column 0 (Actor.forward's log_probs[:, :-1][:, -A:])
    labels = _action_labels(sequences, first, action_mask)
    fields = stats_in_batch_layout(
        logits, labels, attention_mask if packed else None, ring_attn_group,
        first=first, chunk_size=chunk_size, impl=impl,
    )
    columns, sequences, attention_mask = to_host(fields[:, first : first + n_act], sequences, attention_mask)
    pads = attention_mask.flip(1).argmax(1).tolist()  # remove_padding_in_sequences' rule, every row at once
    for row, pad in enumerate(pads):
        if pad > n_act:
            continue  # no action column left after removing the padding (never in OpenRLHF's layouts)
        STORE.put(sequences[row, : width - pad].to(torch.int64).clone(), columns[row, : n_act - pad].clone())


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of ``tensors``: from a CUDA device, asynchronous copies into pinned memory and one wait
    for all of them (instead of one synchronous pageable copy each)."""
    if not any(t.is_cuda for t in tensors):
        return [t.contiguous() if t.device.type == "cpu" else t.to("cpu") for t in tensors]
    out = []
    for t in tensors:
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        else:
            out.append(t.contiguous())
    torch.cuda.current_stream(next(t.device for t in tensors if t.is_cuda)).synchronize()
    return out


def wrap_actor_forward(original: Callable[..., Any], settings: Callable[[], Any]) -> Callable[..., Any]:
    """``Actor.forward`` that also scores the policy's old-log-prob forwards; ``settings()`` gives the
    current ``EntropyDiscConfig`` (or None: pass through)."""
    import functools

    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = settings()
        if (
            config is None
            or not (config.enabled or config.log_metrics)
            or torch.is_grad_enabled()
            or self.training
            or not is_policy(self)
        ):
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["action_mask"] is None or a["attention_mask"] is None or a["return_output"] or a.get("return_logprobs"):
            return original(self, *args, **kwargs)  # not make_experience's call
        a["return_output"] = True
        action_log_probs, output = original(*bound.args, **bound.kwargs)
        logits = output["logits"]
        if logits.is_cuda:
            # the forward's kernels may still be running: wait for them (the scoring below waits for them
            # anyway, at its first host synchronisation) so that the time taken is the adapter's own
            torch.cuda.current_stream(logits.device).synchronize()
        started = time.perf_counter()
        record_batch(
            self, logits, a["sequences"], a["action_mask"], a["attention_mask"], a["ring_attn_group"],
            chunk_size=config.chunk_size, impl=config.impl,
        )
        del output, logits
        STORE.forward_s += time.perf_counter() - started
        STORE.n_forwards += 1
        return action_log_probs

    return forward


def exchange(requests: list[tuple[bytes, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor | None]:
    """Fetch from the other ranks the statistics of this rank's ``requests`` (key, tokens, valid) that
    its store lacks (samples dynamic batching moved here). Collective over the default group: every
    rank calls it, with or without requests. Served entries stay in the serving rank's store until
    its round ages them out."""
    world = dist.get_world_size()
    asked: list[Any] = [None] * world
    dist.all_gather_object(asked, [(key, tokens.to("cpu"), valid.to("cpu")) for key, tokens, valid in requests])
    answers: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    me = dist.get_rank()
    for rank, wanted in enumerate(asked):
        if rank == me:
            continue
        for key, tokens, valid in wanted:
            fields = STORE.find(key, tokens, valid, pop=False)
            if fields is not None:
                answers.setdefault(key, []).append((tokens, fields))
    served: list[Any] = [None] * world
    dist.all_gather_object(served, answers)
    out: list[torch.Tensor | None] = []
    for key, tokens, valid in requests:
        got = None
        for rank, table in enumerate(served):
            if rank == me:
                continue
            for entry_tokens, fields in table.get(key, []):
                if matches(entry_tokens, fields, tokens, valid):
                    got = fields
                    break
            if got is not None:
                break
        out.append(got)
    return out
