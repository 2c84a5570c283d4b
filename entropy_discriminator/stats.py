"""Per-token entropy-discriminator statistics from logits: logp, H, S*, E_p[S], S_c.

For one row of (temperature-scaled) logits ``z`` with ``p = softmax(z)`` and sampled token ``k``::

    H      = -sum_i p_i log p_i
    S*     = p_k (H + log p_k)                         (the entropy discriminator, Theorem 1)
    E_p[S] = sum_i p_i^2 (H + log p_i) = H sum p^2 + sum p^2 log p
    S_c    = S* - E_p[S]                               (Theorem 2)

All of them follow from one streaming pass over the row with the row max ``m`` and
``u_i = z_i - m``, ``e_i = exp(u_i)``::

    s0 = sum e,  s1 = sum e u,  s2 = sum e^2,  s3 = sum e^2 u,   log Z = log s0
    H = log Z - s1/s0,   sum p^2 = s2/s0^2,   sum p^2 log p = (s3 - log Z s2)/s0^2,   log p_k = u_k - log Z

The torch path below evaluates these per chunk of rows; ``kernels/`` holds a one-pass Triton kernel
for CUDA (``impl="triton"``), chosen by ``impl="auto"`` when it is available.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._checks import common_shape, require_float, require_tensor

#: ``impl=`` names accepted by :func:`token_stats`.
IMPLS = ("auto", "torch", "triton")

# Elements of one [chunk, V] working buffer when ``chunk_size`` is None (the torch path holds three).
_DEFAULT_CHUNK_ELEMENTS = 1 << 25
# exp(u) is exactly 0 in fp32 and fp64 below this, so clamping -inf here keeps e*u finite (0, not NaN).
_NEG_CLAMP = -1.0e4


@dataclass(frozen=True)
class TokenStats:
    """Per-token statistics, every field of the labels' shape.

    ``logp, entropy, s_star, s_expected, s_centered`` are float32 (float64 when the logits are
    float64); ``valid`` is bool (``labels != ignore_index``).  Ignored positions hold 0.
    ``logp`` is ``-inf`` where the sampled token's logit is ``-inf`` (its ``s_star`` is then 0).
    """

    logp: torch.Tensor
    entropy: torch.Tensor
    s_star: torch.Tensor
    s_expected: torch.Tensor
    s_centered: torch.Tensor
    valid: torch.Tensor


def discriminator_score(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """``S* = exp(logp) * (entropy + logp)`` from what every framework already logs.

    Equivalent torch: ``logp.exp() * (entropy + logp)``, computed in float32 (float64 stays float64),
    with ``S* = 0`` where ``logp = -inf``; a NaN in ``logp`` or ``entropy`` gives a NaN score (which
    the masks then refuse at a valid position).  ``logp`` and ``entropy`` must broadcast
    (``ValueError`` naming both otherwise); the result has their broadcast shape.  Clip_B needs
    nothing more.
    """
    require_float("logp", logp)
    require_float("entropy", entropy)
    common_shape(logp=logp, entropy=entropy)
    dtype = torch.float64 if torch.float64 in (logp.dtype, entropy.dtype) else torch.float32
    lp, h = logp.to(dtype), entropy.to(dtype)
    p = lp.exp()
    return torch.where((p > 0) | torch.isnan(lp), p * (h + lp), torch.zeros((), dtype=dtype, device=p.device))


def token_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    impl: str = "auto",
    vocab_parallel_group: dist.ProcessGroup | None = None,
    vocab_start_index: int = 0,
) -> TokenStats:
    """Exact per-token ``logp, H, S*, E_p[S], S_c`` of ``softmax(logits / temperature)``.

    Equivalent (memory-hungry) torch, with ``k = labels``::

        logq = torch.log_softmax(logits.double() / temperature, -1); p = logq.exp()
        H = -(p * logq).sum(-1); lpk = logq.gather(-1, k[..., None])[..., 0]
        s_star = lpk.exp() * (H + lpk); s_expected = (p**2 * (H[..., None] + logq)).sum(-1)

    Args:
        logits: ``[..., V]`` bf16/fp16/fp32/fp64, any leading shape, any strides (non-contiguous
            views are read in place). ``-inf`` entries are legal (masked vocabulary); NaN or
            ``+inf`` in a counted row raises ``ValueError``.
        labels: integer tensor of shape ``logits.shape[:-1]``: the sampled token of each row,
            in ``[0, V)`` or ``ignore_index``. Aligning labels with logits (the one-token shift)
            is the caller's job.
        temperature: logits are upcast, then divided by it, exactly as samplers do.
        ignore_index: label of positions that are skipped; they return 0 and ``valid=False``.
        chunk_size: rows per chunk on the torch path; peak extra memory is about
            ``3 * chunk_size * V`` accumulator elements (fp32, or fp64 for fp64 logits), never a
            full fp32 copy of the logits. Default: ``2**25 // V`` rows.
        impl: ``"torch"`` (chunked, any device), ``"triton"`` (one-pass CUDA kernel) or
            ``"auto"`` (Triton for CUDA logits when available, else torch).
        vocab_parallel_group: tensor-parallel group when each rank holds a vocabulary shard
            (Megatron style). Labels stay global ids; max, the four sums and the label logit are
            all-reduced, so every rank returns the full-vocabulary statistics.
        vocab_start_index: first global vocabulary id of this rank's shard.

    Returns:
        :class:`TokenStats`, every field of ``labels.shape``; float32 (float64 for fp64 logits).
    """
    logits = require_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    check_stats_args(labels, logits, "logits", temperature, chunk_size, impl)
    v_local = logits.shape[-1]
    v_total = _global_vocab(v_local, vocab_parallel_group, logits.device)
    if vocab_parallel_group is None and vocab_start_index != 0:
        raise ValueError("vocab_start_index needs vocab_parallel_group")
    flat_labels = labels.reshape(-1)
    valid = checked_valid(flat_labels, v_total, ignore_index)

    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    block_fn = _select_impl(impl, logits, vocab_parallel_group)
    n = flat_labels.numel()
    cols = [torch.zeros(n, dtype=acc, device=logits.device) for _ in range(4)]
    row_max = torch.zeros(n, dtype=acc, device=logits.device)
    if chunk_size is None:
        chunk_size = max(1, _DEFAULT_CHUNK_ELEMENTS // v_total)
        if block_fn is _moments_triton:
            chunk_size = n or 1  # the kernel streams each row itself: one launch per row block
    with torch.no_grad():
        chunks = _row_chunks(logits, chunk_size, copy_rows=block_fn is _moments_torch)
        for sl, rows in chunks:
            out = block_fn(rows, flat_labels[sl], float(temperature), ignore_index, acc, vocab_parallel_group, vocab_start_index)
            for col, val in zip(cols, out[:4]):
                col[sl] = val
            row_max[sl] = out[4]

    _check_rows(row_max, valid)
    logp, entropy, s_star, s_expected = (torch.where(valid, c, torch.zeros((), dtype=acc, device=c.device)) for c in cols)
    s_centered = s_star - s_expected
    shape = labels.shape
    return TokenStats(
        logp=logp.reshape(shape),
        entropy=entropy.reshape(shape),
        s_star=s_star.reshape(shape),
        s_expected=s_expected.reshape(shape),
        s_centered=s_centered.reshape(shape),
        valid=valid.reshape(shape),
    )


def check_stats_args(
    labels: object, source: torch.Tensor, source_name: str, temperature: object, chunk_size: object, impl: object
) -> None:
    """Validate the arguments :func:`token_stats` and ``token_stats_from_hidden`` share.

    ``labels`` must be an integer tensor of shape ``source.shape[:-1]`` on ``source``'s device.
    """
    labels = require_tensor("labels", labels)
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if labels.shape != source.shape[:-1]:
        raise ValueError(
            f"labels must have shape {source_name}.shape[:-1] = {tuple(source.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if labels.device != source.device:
        raise ValueError(f"labels are on {labels.device} but {source_name} on {source.device}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def checked_valid(flat_labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """``flat_labels != ignore_index``, after checking every other label lies in ``[0, vocab)``."""
    valid = flat_labels != ignore_index
    out_of_range = valid & ((flat_labels < 0) | (flat_labels >= vocab))
    if bool(out_of_range.any()):
        bad = flat_labels[out_of_range][:5].tolist()
        raise ValueError(f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; got {bad}")
    return valid


def _global_vocab(v_local: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    if group is None:
        return v_local
    t = torch.tensor([v_local], dtype=torch.int64, device=_collective_device(group, device))
    dist.all_reduce(t, group=group)
    return int(t.item())


def _collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    backend = dist.get_backend(group)
    return device if backend == "nccl" else torch.device("cpu")


def _select_impl(impl: str, logits: torch.Tensor, group: dist.ProcessGroup | None):
    if impl == "torch":
        return _moments_torch
    reason = _triton_unavailable_reason(logits)
    if impl == "triton":
        if group is not None:
            raise ValueError("impl='triton' does not support vocab_parallel_group; use impl='torch'")
        if reason:
            raise RuntimeError(f"impl='triton' is unavailable: {reason}")
        return _moments_triton
    return _moments_triton if (reason is None and group is None) else _moments_torch


def _triton_unavailable_reason(logits: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take these logits, or None when it can."""
    if not logits.is_cuda:
        return f"logits are on {logits.device}, the kernel needs a CUDA device"
    if logits.dtype == torch.float64:
        return "the kernel reads bf16/fp16/fp32 logits; float64 runs on impl='torch'"
    try:
        from .kernels import triton_stats  # noqa: F401  (imports triton)
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return None


def _moments_triton(
    rows: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    acc: torch.dtype,
    group: dist.ProcessGroup | None,
    vocab_start: int,
) -> tuple[torch.Tensor, ...]:
    """logp, H, S*, E_p[S] and the row max of one ``[n, V]`` chunk from the one-pass kernel."""
    from .kernels.triton_stats import token_stats_triton

    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return token_stats_triton(rows, labels.to(torch.int64), temperature, ignore_index)


def _row_chunks(x: torch.Tensor, chunk_size: int, copy_rows: bool) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield ``(flat_rows, [n, V] rows)`` covering ``x[..., V]`` in flat row order, ``n <= chunk_size``.

    Where ``x`` views as ``[rows, V]`` the chunks are views. Otherwise (e.g. ``logits[:, :-1]``),
    with ``copy_rows`` each chunk's rows are gathered into a ``[n, V]`` copy of the input dtype
    (one chunk at a time, never the whole tensor); without it (the Triton path, which takes any row
    stride) the chunks are views of the viewable sub-blocks ``x[i]``, ``x[i, j]``...
    """
    n_rows = math.prod(x.shape[:-1])
    try:
        flat = x.view(-1, x.shape[-1])
    except RuntimeError:
        flat = None
    if flat is not None:
        for lo in range(0, n_rows, chunk_size):
            yield slice(lo, min(lo + chunk_size, n_rows)), flat[lo : lo + chunk_size]
    elif copy_rows:
        for lo in range(0, n_rows, chunk_size):
            idx = torch.arange(lo, min(lo + chunk_size, n_rows), device=x.device)
            yield slice(lo, lo + idx.numel()), x[torch.unravel_index(idx, x.shape[:-1])]
    else:
        start = 0
        for i in range(x.shape[0]):
            for sl, rows in _row_chunks(x[i], chunk_size, copy_rows):
                yield slice(start + sl.start, start + sl.stop), rows
            start += math.prod(x.shape[1:-1])


def _moments_torch(
    rows: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    acc: torch.dtype,
    group: dist.ProcessGroup | None,
    vocab_start: int,
) -> tuple[torch.Tensor, ...]:
    """logp, H, S*, E_p[S] and the row max of one ``[n, V]`` chunk (torch, three [n, V] buffers)."""
    z = rows.to(acc, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    m = z.amax(dim=-1)
    if group is not None:
        # NaN / +inf rows become +inf so that every rank of the group sees the same bad row.
        m = torch.where(torch.isnan(m), torch.full_like(m, math.inf), m)
        m_c = m.to(_collective_device(group, m.device))
        dist.all_reduce(m_c, op=dist.ReduceOp.MAX, group=group)
        m = m_c.to(m.device)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z.sub_(m_safe[:, None])
    k = labels.to(torch.int64) - vocab_start
    here = (k >= 0) & (k < z.shape[-1]) & (labels != ignore_index)
    u_k = torch.where(here, z.gather(-1, torch.where(here, k, 0)[:, None])[:, 0], torch.zeros_like(m))
    z.clamp_(min=_NEG_CLAMP)
    e = torch.exp(z)
    w = e * z
    sums = torch.stack([e.sum(-1), w.sum(-1), w.mul_(e).sum(-1), e.square_().sum(-1), u_k])
    del z, e, w
    if group is not None:
        s_c = sums.to(_collective_device(group, sums.device))
        dist.all_reduce(s_c, group=group)
        sums = s_c.to(sums.device)
    s0, s1, s3, s2, u_k = sums
    return (*_finish(s0, s1, s2, s3, u_k), m)


def _finish(s0, s1, s2, s3, u_k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logp, H, S*, E_p[S] from the streaming sums (see the module docstring)."""
    log_z = torch.log1p(s0 - 1.0)
    inv = 1.0 / s0
    entropy = log_z - s1 * inv
    logp = u_k - log_z
    p_k = logp.exp()
    s_star = torch.where(p_k > 0, p_k * (entropy + logp), torch.zeros_like(p_k))
    inv2 = inv * inv
    s_expected = entropy * (s2 * inv2) + (s3 - log_z * s2) * inv2
    return logp, entropy, s_star, s_expected


def _check_rows(row_max: torch.Tensor, valid: torch.Tensor) -> None:
    """Reject counted rows holding NaN / +inf, or made of -inf only."""
    nan_or_inf = valid & (torch.isnan(row_max) | (row_max == math.inf))
    if bool(nan_or_inf.any()):
        raise ValueError(f"logits contain NaN or +inf in {int(nan_or_inf.sum())} counted row(s)")
    all_masked = valid & (row_max == -math.inf)
    if bool(all_masked.any()):
        raise ValueError(f"logits rows with every entry -inf at {int(all_masked.sum())} counted position(s)")
