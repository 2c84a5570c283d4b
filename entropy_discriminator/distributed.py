"""Collectives the batch statistics need, each a no-op without a process group.

Every batch statistic is reduced from sums and counts (never a mean of means), so a data-parallel
job sees exactly the thresholds one process would compute on the concatenated batch.  All
functions must be called by every rank of ``group`` in the same order, with empty shards too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def collective_device(group: Group, device: torch.device) -> torch.device:
    """Device on which ``group``'s backend takes tensors (CUDA for NCCL, CPU otherwise)."""
    if group is None:
        return device
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_reduce(values: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``values`` over ``group`` (identity when ``group`` is None); returns a new tensor."""
    if group is None:
        return values.clone()
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


def rank_offset(n_local: int, group: Group, device: torch.device) -> int:
    """Number of elements held by lower ranks: this shard's start in the concatenated batch."""
    if group is None:
        return 0
    counts = all_gather_cat(torch.tensor([n_local], dtype=torch.int64, device=device), group)
    return int(counts[: dist.get_rank(group)].sum())


def global_top_k(score: torch.Tensor, position: torch.Tensor, k: int, group: Group) -> torch.Tensor:
    """Bool mask over the local ``score`` of the ``k`` largest scores over all ranks.

    Ties are broken by the smaller global ``position`` (int64, unique across ranks), so the result
    does not depend on how the batch is sharded.  Equivalent single-process torch::

        order = sorted(range(n), key=lambda i: (-score[i], position[i]))[:k]
    """
    device = score.device
    k_local = min(k, score.numel())
    local = _lexsort_desc(score, position)[:k_local]
    pad = k - k_local
    cand = torch.stack([score[local], position[local].to(torch.float64)], dim=1)
    if pad:
        filler = torch.tensor([[-torch.inf, float(2**53)]], dtype=torch.float64, device=device).expand(pad, 2)
        cand = torch.cat([cand, filler])
    everyone = all_gather_cat(cand, group)
    winners = everyone[_lexsort_desc(everyone[:, 0], everyone[:, 1].to(torch.int64))[:k]]
    winners = winners[torch.isfinite(winners[:, 0])]
    return torch.isin(position, winners[:, 1].to(torch.int64))


def _lexsort_desc(score: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Indices ordering by score descending, then position ascending."""
    by_pos = torch.argsort(position, stable=True)
    by_score = torch.argsort(score[by_pos], descending=True, stable=True)
    return by_pos[by_score]


def kth_smallest(values: torch.Tensor, ks: list[int], group: Group) -> list[float]:
    """Exact ``k``-th smallest (1-based) of the float32 ``values`` of all ranks, for each k in ``ks``.

    Bisection on the order-preserving integer image of the float32 bits: 32 rounds of one small
    all-reduce of counts, O(1) extra memory, no ``torch.quantile`` (which fails above 2**24
    elements) and no gather of the values.  Equal to ``torch.sort(cat(values))[k - 1]``.
    """
    keys = _sortable_int(values.to(torch.float32).reshape(-1))
    lo = torch.full((len(ks),), -(2**31), dtype=torch.int64, device=values.device)
    hi = torch.full((len(ks),), 2**31 - 1, dtype=torch.int64, device=values.device)
    target = torch.tensor(ks, dtype=torch.int64, device=values.device)
    for _ in range(32):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        below = (keys[None, :] <= mid[:, None]).sum(dim=1)
        below = all_reduce(below, group)
        enough = below >= target
        hi = torch.where(enough, mid, hi)
        lo = torch.where(enough, lo, mid + 1)
    return [float(_float_from_sortable(int(x))) for x in hi.tolist()]


def _sortable_int(x: torch.Tensor) -> torch.Tensor:
    """int64 keys with the order of the float32 values (negative floats have their bits flipped)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def _float_from_sortable(key: int) -> float:
    bits = key if key >= 0 else (-(key + 1)) | -(2**31)
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32).item())
