"""Per-token entropy-discriminator statistics from logits: logp, H, S*, E_p[S], S_c.

For one row of (temperature-scaled) logits ``z`` with ``p = softmax(z)`` and sampled token ``k``::

    H      = -sum_i p_i log p_i
    S*     = p_k (H + log p_k)                         (the entropy discriminator, Theorem 1)
    E_p[S] = sum_i p_i^2 (H + log p_i) = H sum p^2 + sum p^2 log p
    S_c    = S* - E_p[S]                               (Theorem 2)

All of them follow from the row max ``m`` and ``u_i = z_i - m``, ``e_i = exp(u_i)``::

    s0 = sum e,  s1 = sum e u,  ubar = s1/s0 = E_p[u],   log Z = log s0 (+ m)
    H = log s0 - ubar,   log p_k = u_k - log s0,   E_p[S] = sum e^2 (u - ubar) / s0^2

since ``H + log p_i = u_i - ubar``; the centred form keeps its accuracy on near-uniform rows (docs/science.md).
The torch path makes two sweeps per chunk of rows; ``kernels/`` holds the one-pass Triton kernel (``impl="triton"``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import deferred
from ._checks import (NO_IGNORE_INDEX, common_shape, ignore_index_value, one_of, real_number, require_float,
                      require_tensor)
from .distributed import all_reduce

#: ``impl=`` names accepted by :func:`token_stats`.
IMPLS = ("auto", "torch", "triton")

# Elements of one [chunk, V] working buffer when ``chunk_size`` is None (the torch path holds three).
_DEFAULT_CHUNK_ELEMENTS = 1 << 25
# exp(u) is exactly 0 in fp32 and fp64 below this, so clamping -inf here keeps e*u finite (0, not NaN).
_NEG_CLAMP = -1.0e4


@dataclass(frozen=True)
class TokenStats:
    """Per-token statistics of the labels' shape: float32 (float64 for float64 logits) ``logp, entropy, s_star,
    s_expected, s_centered`` and bool ``valid`` (``labels != ignore_index``).  Ignored positions hold 0; ``logp`` is
    ``-inf`` (and ``s_star`` 0) where the label's logit is ``-inf``; rows ``check`` did not raise for hold NaN."""

    logp: torch.Tensor
    entropy: torch.Tensor
    s_star: torch.Tensor
    s_expected: torch.Tensor
    s_centered: torch.Tensor
    valid: torch.Tensor


def field_of(value: object, field: str) -> tuple[object, torch.Tensor | None]:
    """``(value.<field>, value.valid)`` for a :class:`TokenStats`, else ``(value, None)``: the ``valid`` that
    :func:`~entropy_discriminator._checks.valid_within` intersects with the caller's mask."""
    if isinstance(value, TokenStats):
        return getattr(value, field), value.valid
    return value, None


#: How far below 0 an entropy, and above 0 a log-probability, :func:`discriminator_score` accepts as rounding (nats):
#: two roundings of half a bf16 spacing at magnitudes in [16, 32) (logsumexp and E_p[z] of bf16 logits), 1/16 each.
SCORE_SLACK = 0.125


def discriminator_score(logp: torch.Tensor, entropy: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """``S* = exp(logp) * (entropy + logp)`` from what every framework already logs (all Clip_B needs).

    ``logp`` and ``entropy``: float tensors that broadcast; returns their broadcast shape in float32 (float64 stays
    float64), ``S* = 0`` where ``logp = -inf``, NaN where an input is NaN.  Raises ``ValueError`` naming the argument
    and the count unless ``entropy >= -SCORE_SLACK`` and ``logp <= SCORE_SLACK`` at every entry (pad positions too;
    one host synchronisation); ``check=False`` skips that, for a framework's own entropies whose rounding exceeds
    the slack (e.g. verl's vocabulary-parallel Megatron entropy from bf16 logits).
    """
    require_float("logp", logp)
    require_float("entropy", entropy)
    common_shape(logp=logp, entropy=entropy)
    if check:
        out_of_range = torch.stack([(entropy < -SCORE_SLACK).sum(), (logp > SCORE_SLACK).sum()]).tolist()
        for (name, rule), n in zip((("entropy", f">= -{SCORE_SLACK}: an entropy is >= 0 nats"),
                                    ("logp", f"<= {SCORE_SLACK}: a log-probability is <= 0")), out_of_range):
            if n:
                raise ValueError(f"{name} must be {rule} (up to rounding); {n} entr{'y is' if n == 1 else 'ies are'} "
                                 "outside (check=False skips this for a framework's own entropies)")
    dtype = torch.float64 if torch.float64 in (logp.dtype, entropy.dtype) else torch.float32
    lp, h = logp.to(dtype), entropy.to(dtype)
    p = lp.exp()
    return torch.where((p > 0) | torch.isnan(lp), p * (h + lp), torch.zeros((), dtype=dtype, device=p.device))


def token_stats(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                ignore_index: int | None = -100, chunk_size: int | None = None, impl: str = "auto",
                check: bool | str = True, vocab_parallel_group: dist.ProcessGroup | None = None,
                vocab_start_index: int = 0) -> TokenStats:
    """Exact per-token ``logp, H, S*, E_p[S], S_c`` of ``softmax(logits / temperature)``.

    Equivalent (memory-hungry) torch, with ``k = labels`` (``E_p[S]`` centred as in the module docstring)::

        logq = torch.log_softmax(logits.double() / temperature, -1); p = logq.exp()
        H = -(p * logq).sum(-1); lpk = logq.gather(-1, k[..., None])[..., 0]
        s_star = lpk.exp() * (H + lpk); s_expected = (p**2 * (H[..., None] + logq)).sum(-1)

    Args:
        logits: ``[..., V]`` bf16/fp16/fp32/fp64, any strides; ``-inf`` entries are legal.
        labels: integer, of shape ``logits.shape[:-1]`` (already shifted), in ``[0, V)`` or ``ignore_index``.
        temperature: divides the upcast logits less their row max, as samplers do.
        ignore_index: label of skipped positions (0 and ``valid=False``); None skips nothing.
        chunk_size: rows per chunk of the torch path (``3 * chunk_size * V`` extra elements; default ``2**25 // V``).
        impl: ``"torch"`` (any device), ``"triton"`` (one-pass CUDA kernel) or ``"auto"`` (Triton when available).
        check: ``True`` raises ``ValueError`` for a label out of range, a NaN / ``+inf`` logit or a row of ``-inf``
            in a counted row (one host synchronisation); ``"deferred"``: the same, raised later without the wait
            (:mod:`~entropy_discriminator.deferred`); ``False``: bad rows read NaN (as do, without the wait and with
            ``impl="auto"``, logits above ``~3.4e38 * T / log2(e)``).
        vocab_parallel_group, vocab_start_index: each rank holds the vocabulary shard starting at
            ``vocab_start_index``; labels stay global ids, every rank gets the full-vocabulary statistics.

    Returns :class:`TokenStats`, every field of ``labels.shape``, float32 (float64 for fp64 logits).
    """
    logits = require_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    temperature, ignore_index = check_stats_args(labels, logits, "logits", temperature, ignore_index, chunk_size, impl)
    check = deferred.check_mode(check)
    if vocab_parallel_group is None and vocab_start_index != 0:
        raise ValueError("vocab_start_index needs vocab_parallel_group")
    deferred.resolve_ready(make_room=check == "deferred")  # earlier deferred checks whose counts have arrived
    if _use_triton(impl, logits, vocab_parallel_group):
        triton_stats = _triton_stats()
        # pinned words the kernel writes its counters to (no device counters, no autograd graph)
        report = None if not check else triton_stats.host_report() if check is True else triton_stats.spare_report()
        out = triton_stats.token_stats_triton(logits, labels, temperature, ignore_index, report=report, counters=False)
        result = TokenStats(out.logp, out.entropy, out.s_star, out.s_expected, out.s_centered, out.valid)
        if check == "deferred":
            _defer_report(report, triton_stats, labels, logits.shape[-1], ignore_index, bool(out.valid.numel()))
        elif report is not None and out.valid.numel():
            errors = report.wait()  # the one host synchronisation, last: nothing left to do after it
            if errors is not triton_stats.NO_FAULTS:
                if impl == "auto" and not any(errors[:3]):  # only the kernel's fp32 scaling overflowed
                    return _token_stats_torch(logits, labels, float(temperature), ignore_index, chunk_size, check,
                                              None, 0)
                raise_for_errors(errors, labels, logits.shape[-1], ignore_index)
        return result
    return _token_stats_torch(logits, labels, float(temperature), ignore_index, chunk_size, check, vocab_parallel_group,
                              vocab_start_index)


def _defer_report(report, triton_stats, labels: torch.Tensor, vocab: int, ignore_index: int, launched: bool) -> None:
    """Queue the deferred check of a kernel that writes its counts to ``report`` (a spare of the thread's pool)."""
    if not launched:  # an empty batch launches nothing
        triton_stats.return_report(report)
        return
    if report.device is not None:
        report.stream = torch.cuda.current_stream(report.device)
    deferred.defer(report.poll, report.wait, lambda errors: raise_for_errors(errors, labels, vocab, ignore_index),
                   lambda: triton_stats.return_report(report), "token_stats")


def _token_stats_torch(logits: torch.Tensor, labels: torch.Tensor, temperature: float, ignore_index: int,
                       chunk_size: int | None, check: bool | str, group: dist.ProcessGroup | None,
                       vocab_start: int) -> TokenStats:
    """The chunked torch path of :func:`token_stats` (any device, fp64 logits, vocabulary-parallel)."""
    v_total = logits.shape[-1]
    if group is not None:
        v_total = int(all_reduce(torch.tensor([v_total], device=logits.device), group).item())
    flat_labels = labels.reshape(-1)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    n = flat_labels.numel()
    out = torch.empty((5, n), dtype=acc, device=logits.device)
    row_max = torch.empty(n, dtype=acc, device=logits.device)
    if chunk_size is None:
        chunk_size = max(1, _DEFAULT_CHUNK_ELEMENTS // v_total)
    with torch.no_grad():
        for sl, rows in _row_chunks(logits, chunk_size):
            *stats, row_max[sl] = _moments_torch(rows, flat_labels[sl], temperature, ignore_index, acc, group,
                                                 vocab_start)
            out[:4, sl] = torch.stack(stats)
        valid = flat_labels != ignore_index
        bad_label = valid & ((flat_labels < 0) | (flat_labels >= v_total))
        nan_inf = valid & (torch.isnan(row_max) | (row_max == math.inf))
        masked = valid & (row_max == -math.inf)
        counts = torch.stack([bad_label.sum(), nan_inf.sum(), masked.sum()]) if check else None
        if check is True:
            raise_for_errors(counts.tolist(), labels, v_total, ignore_index)
        else:
            if check == "deferred" and n:
                deferred.defer_counts(counts, lambda errors: raise_for_errors(errors, labels, v_total, ignore_index),
                                      "token_stats")
            out.masked_fill_(bad_label | nan_inf | masked, math.nan)
        out[:4].masked_fill_(~valid, 0.0)
        torch.sub(out[2], out[3], out=out[4])
    shape = labels.shape
    return TokenStats(*(f.view(shape) for f in out.unbind(0)), valid=valid.view(shape))


def raise_for_errors(errors: list[int], labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise the ``ValueError`` of the first non-zero count of counted rows with: a label outside ``[0, vocab)``, a
    NaN or ``+inf`` logit, every logit ``-inf``, (Triton only) finite logits that overflow fp32 once scaled."""
    bad_label, nan_inf, masked, overflow = (list(errors) + [0])[:4]
    if bad_label:
        flat = labels.reshape(-1)
        out_of_range = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
        bad = flat[out_of_range][:5].tolist()
        allowed = "" if ignore_index == NO_IGNORE_INDEX else f" or equal ignore_index={ignore_index}"
        raise ValueError(f"labels must lie in [0, {vocab}){allowed}; got {bad}")
    if nan_inf:
        raise ValueError(f"logits contain NaN or +inf in {nan_inf} counted row(s)")
    if masked:
        raise ValueError(f"logits rows with every entry -inf at {masked} counted position(s)")
    if overflow:
        raise ValueError(f"logits / temperature overflow float32 in the Triton kernel in {overflow} counted row(s) "
                         "(it scales logits by log2(e) / temperature; |logit| must stay below ~3.4e38 * temperature / "
                         "1.44): use impl='torch' or impl='auto', which subtract the row max before scaling")


def check_stats_args(labels: object, source: torch.Tensor, source_name: str, temperature: object, ignore_index: object,
                     chunk_size: object, impl: object) -> tuple[float, int]:
    """Check the arguments :func:`token_stats` and ``token_stats_from_hidden`` share; returns ``(temperature,
    ignore_index)`` as Python ``float`` / ``int``."""
    labels = require_tensor("labels", labels)
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if labels.shape != source.shape[:-1]:
        raise ValueError(f"labels must have shape {source_name}.shape[:-1] = {tuple(source.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    if labels.device != source.device:
        raise ValueError(f"labels are on {labels.device} but {source_name} on {source.device}")
    temperature = real_number("temperature", temperature, above=0)
    ignore_index = ignore_index_value(ignore_index)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    one_of("impl", impl, IMPLS)
    return temperature, ignore_index


def _use_triton(impl: str, logits: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether this call runs the Triton kernel (``impl="triton"`` refuses what it cannot take)."""
    if impl == "torch":
        return False
    reason = _triton_unavailable_reason(logits)
    if impl == "triton":
        if group is not None:
            raise ValueError("impl='triton' does not support vocab_parallel_group; use impl='torch'")
        if reason:
            raise RuntimeError(f"impl='triton' is unavailable: {reason}")
        return True
    return reason is None and group is None


def _triton_unavailable_reason(logits: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take these logits, or None when it can."""
    if not logits.is_cuda:
        return f"logits are on {logits.device}, the kernel needs a CUDA device"
    if logits.dtype == torch.float64:
        return "the kernel reads bf16/fp16/fp32 logits; float64 runs on impl='torch'"
    try:
        _triton_stats()
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return None


@functools.cache
def _triton_stats():
    """The kernel module (imports triton; cached: the import statement costs host time per call)."""
    from .kernels import triton_stats

    return triton_stats


def _row_chunks(x: torch.Tensor, chunk_size: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(flat_rows, [n <= chunk_size, V] rows)`` of ``x[..., V]`` in order: views, or one chunk's copy at a time."""
    n_rows = math.prod(x.shape[:-1])
    try:
        flat = x.view(-1, x.shape[-1])
    except RuntimeError:
        flat = None
    for lo in range(0, n_rows, chunk_size):
        hi = min(lo + chunk_size, n_rows)
        if flat is not None:
            yield slice(lo, hi), flat[lo:hi]
        else:
            idx = torch.arange(lo, hi, device=x.device)
            yield slice(lo, hi), x[torch.unravel_index(idx, x.shape[:-1])]


def _moments_torch(rows: torch.Tensor, labels: torch.Tensor, temperature: float, ignore_index: int, acc: torch.dtype,
                   group: dist.ProcessGroup | None, vocab_start: int) -> tuple[torch.Tensor, ...]:
    """logp, H, S*, E_p[S] and the unscaled row max of one ``[n, V]`` chunk, the second sweep centred on E_p[u]."""
    z = rows.to(acc, copy=True)
    m = z.amax(dim=-1)
    if group is not None:
        # NaN / +inf rows become +inf so that every rank of the group sees the same bad row.
        m = torch.where(torch.isnan(m), torch.full_like(m, math.inf), m)
        m = all_reduce(m, group, dist.ReduceOp.MAX)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z.sub_(m_safe[:, None])
    if temperature != 1.0:
        z.div_(temperature)
    k = labels.to(torch.int64) - vocab_start
    here = (k >= 0) & (k < z.shape[-1]) & (labels != ignore_index)
    u_k = torch.where(here, z.gather(-1, torch.where(here, k, 0)[:, None])[:, 0], torch.zeros_like(m))
    z.clamp_(min=_NEG_CLAMP)
    e = torch.exp(z)
    w = torch.mul(e, z)
    s0, s1 = all_reduce(torch.stack([e.sum(-1), w.sum(-1)]), group)
    ubar = s1 / s0
    z.sub_(ubar[:, None])  # v = u - ubar
    v_k = torch.where(here, u_k - ubar, u_k)
    torch.exp(z, out=e)
    torch.mul(e, z, out=w)
    sums = [e.sum(-1), w.sum(-1), w.mul_(e).sum(-1), e.square_().sum(-1), v_k]
    s0, s1, s3, s2, v_k = all_reduce(torch.stack(sums), group)
    del z, e, w
    log_s0 = torch.log(s0)
    vbar = s1 / s0
    entropy = log_s0 - vbar
    logp = v_k - log_s0
    p_k = logp.exp()
    s_star = torch.where(p_k > 0, p_k * (entropy + logp), torch.zeros_like(p_k))
    s_expected = (s3 - s2 * vbar) / (s0 * s0)
    return logp, entropy, s_star, s_expected, m
