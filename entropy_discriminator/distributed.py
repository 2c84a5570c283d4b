"""Collectives the batch statistics need, each a no-op without a process group.

Batch statistics are reduced from sums and counts (never a mean of means), so a data-parallel job sees what one
process would compute on the concatenated batch.  Every rank of ``group`` calls each function in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None
T = TypeVar("T")
_INT32_MAX = 2**31 - 1


def collective_device(group: Group, device: torch.device) -> torch.device:
    """Device on which ``group``'s backend takes tensors (CUDA for NCCL, CPU otherwise)."""
    return device if group is None or dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_reduce(values: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``values`` over ``group``: a new tensor, or ``values`` itself when ``group`` is None."""
    if group is None:
        return values
    t = values.to(collective_device(group, values.device), copy=True)
    dist.all_reduce(t, op=op, group=group)
    return t.to(values.device)


def all_gather_cat(values: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate along dim 0 the equally shaped ``values`` of every rank, in rank order."""
    if group is None:
        return values
    t = values.to(collective_device(group, values.device)).contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts).to(values.device)


def reduce_or_raise(build: Callable[[], tuple[torch.Tensor, T]], size: int, group: Group) -> tuple[list[float], T]:
    """Sum over ``group`` the float64 ``payload`` of ``size`` entries from ``build() -> (payload, context)``, and
    return it as Python floats (one host synchronisation) with ``context``.

    A rank whose ``build`` raises still takes part (zeros and a failure flag); then every rank raises the lowest
    failing rank's error (``ValueError`` / ``TypeError`` as raised, others as ``RuntimeError``).  Without a group the
    error propagates unchanged.
    """
    if group is None:
        payload, context = build()
        return payload.tolist(), context
    failure: Exception | None = None
    try:
        payload, context = build()
        if payload.numel() != size:
            raise RuntimeError(f"internal: payload of {payload.numel()} entries, expected {size}")
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank
        failure, context = exc, None  # type: ignore[assignment]
        nccl = dist.get_backend(group) == "nccl"
        payload = torch.zeros(size, dtype=torch.float64, device=torch.cuda.current_device() if nccl else "cpu")
    flag = torch.tensor([0.0 if failure is None else 1.0], dtype=torch.float64, device=payload.device)
    values = all_reduce(torch.cat([payload.to(torch.float64), flag]), group).tolist()
    if values[-1] > 0:
        messages: list[tuple[str, str] | None] = [None] * dist.get_world_size(group)
        mine = None if failure is None else (type(failure).__name__, str(failure))
        dist.all_gather_object(messages, mine, group=group)
        rank, (kind, text) = next((r, m) for r, m in enumerate(messages) if m is not None)
        error = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        raise error(f"{text} (raised on rank {rank}; every rank of the process group raises this error)") from failure
    return values[:-1], context


def rank_offset(n_local: int, group: Group, device: torch.device) -> int:
    """Number of elements held by lower ranks: this shard's start in the concatenated batch."""
    if group is None:
        return 0
    counts = all_gather_cat(torch.tensor([n_local], dtype=torch.int64, device=device), group)
    return int(counts[: dist.get_rank(group)].sum())


def top_k_mask(score: torch.Tensor, candidate: torch.Tensor, k: int, group: Group) -> torch.Tensor:
    """Bool mask (``candidate``'s shape) of the ``k`` candidates with the largest float64 ``score`` over all ranks,
    ties to the smaller position in the concatenated flat batch: ``sorted(candidates, key=lambda i: (-score[i],
    i))[:k]``.  One process: one stable sort on the device, no host synchronisation."""
    flat = candidate.reshape(-1)
    if k <= 0:
        return torch.zeros_like(candidate)
    if group is None:
        keyed = torch.where(flat, score.reshape(-1), -torch.inf)
        order = torch.sort(keyed, descending=True, stable=True).indices[:k]
        return (torch.zeros_like(flat).index_fill_(0, order, True) & flat).reshape(candidate.shape)
    idx = torch.nonzero(flat).reshape(-1)
    offset = rank_offset(flat.numel(), group, score.device)
    won = global_top_k(score.reshape(-1)[idx], idx + offset, k, group)
    chosen = torch.zeros_like(flat)
    chosen[idx[won]] = True
    return chosen.reshape(candidate.shape)


def ranked_rows(score: torch.Tensor, position: torch.Tensor, k: int, group: Group, *extra: torch.Tensor,
                pad: int | None = None) -> torch.Tensor:
    """The ``k`` largest ``score`` over all ranks as float64 rows ``[score, position, *extra]`` (``[<= k, 2 + E]``),
    in order: score descending, ties to the smaller global ``position`` (int64, unique across ranks, < 2**53);
    ``sorted(rows, key=lambda r: (-r.score, r.position))[:k]``.  Each rank sends ``pad`` rows (default ``k``; at
    least its own count of rows, at most ``k``, the same on every rank), filled with ``-inf`` scores, which never
    rank."""
    local = _lexsort_desc(score, position)[:k]
    cols = [score[local], position[local], *(x[local] for x in extra)]
    rows = torch.stack([c.to(torch.float64) for c in cols], dim=1)
    fill = (k if pad is None else pad) - len(local)
    if fill > 0:
        filler = rows.new_zeros(fill, rows.shape[1])
        filler[:, 0], filler[:, 1] = -torch.inf, float(2**53)
        rows = torch.cat([rows, filler])
    everyone = all_gather_cat(rows, group) if len(rows) else rows
    ranked = everyone[_lexsort_desc(everyone[:, 0], everyone[:, 1].to(torch.int64))[:k]]
    return ranked[torch.isfinite(ranked[:, 0])]


def global_top_k(score: torch.Tensor, position: torch.Tensor, k: int, group: Group) -> torch.Tensor:
    """Bool mask over the local ``score`` of the ``k`` largest scores over all ranks (:func:`ranked_rows`' order)."""
    return torch.isin(position, ranked_rows(score, position, k, group)[:, 1].to(torch.int64))


def _lexsort_desc(score: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Indices ordering by score descending, then position ascending."""
    by_pos = torch.argsort(position, stable=True)
    by_score = torch.argsort(score[by_pos], descending=True, stable=True)
    return by_pos[by_score]


def kth_smallest(values: torch.Tensor, ks: list[int], group: Group, where: torch.Tensor | None = None) -> list[float]:
    """Exact ``k``-th smallest (1-based, in ``[1, number selected]``) of the float32 ``values[where]`` of all ranks,
    for each k in ``ks``: ``torch.sort(cat(values[where]).float())[k - 1]``, ``-0.0`` below ``+0.0``.  One process:
    one sort of integer keys; across ranks: a radix select, 4 rounds of one ``[len(ks), 256]`` all-reduce of counts.
    """
    if not ks:
        return []
    keys = _sortable_int(values.to(torch.float32).reshape(-1))
    if where is not None:
        keys = torch.where(where.reshape(-1), keys, _INT32_MAX)
    if group is None:
        ordered = torch.sort(keys).values
        found = torch.stack([ordered[k - 1] for k in ks])  # views, one gather
    else:
        found = _radix_select(keys, where, torch.tensor(ks, dtype=torch.int64, device=values.device), group)
    return _float_from_sortable(found.cpu()).tolist()


def _radix_select(keys: torch.Tensor, where: torch.Tensor | None, target: torch.Tensor, group: Group) -> torch.Tensor:
    """The ``target``-th smallest (1-based) int32 key over all ranks (as int64), 8 bits per round from the top."""
    u = keys.to(torch.int64) + 2**31  # unsigned image in [0, 2**32)
    selected = torch.ones_like(u, dtype=torch.bool) if where is None else where.reshape(-1)
    prefix = torch.zeros_like(target)
    rank = target.clone()
    for shift in (24, 16, 8, 0):
        match = selected[None, :] & ((u >> (shift + 8))[None, :] == prefix[:, None])
        digit = ((u >> shift) & 255)[None, :].expand(len(target), -1)
        hist = torch.zeros(len(target), 256, dtype=torch.int64, device=u.device)
        hist.scatter_add_(1, digit, match.to(torch.int64))
        cum = all_reduce(hist, group).cumsum(dim=1)
        d = (cum < rank[:, None]).sum(dim=1)
        rank = rank - torch.where(d > 0, cum.gather(1, (d - 1).clamp(min=0)[:, None])[:, 0], 0)
        prefix = prefix * 256 + d
    return prefix - 2**31


def _sortable_int(x: torch.Tensor) -> torch.Tensor:
    """int32 keys in the order of the float32 values: the bits, the 31 low bits of negatives flipped (an involution)."""
    bits = x.view(torch.int32)
    return bits ^ ((bits >> 31) & _INT32_MAX)


def _float_from_sortable(keys: torch.Tensor) -> torch.Tensor:
    """float32 values of int keys from :func:`_sortable_int` (its inverse)."""
    return _sortable_int(keys.to(torch.int32).view(torch.float32)).view(torch.float32)
