"""Checks that do not wait: ``token_stats(..., check="deferred")`` and :func:`raise_deferred`.

A waiting check (``check=True``) holds the host until the kernel has counted the bad rows (labels out of range, NaN
or ``+inf`` logits, rows of ``-inf``, fp32 overflow): at small N that one wait costs more than the kernel
(benchmarks/RESULTS.md).  A deferred check launches the same kernel, which writes the same counts to pinned host
memory, and returns at once; a bad row's statistics read NaN meanwhile, as with ``check=False``.  The counts are read,
and the ``ValueError`` the waiting check names is raised (the argument and the count, plus which earlier call), by
the first of:

* the next ``token_stats`` / ``token_stats_from_hidden`` call of the same thread, for every earlier call whose counts
  have arrived (it never waits for one still running);
* :func:`raise_deferred`, which waits for every deferred check of the thread: call it before acting on the host on
  what the statistics decided (before ``optimizer.step()``, say);
* a deferred call finding :data:`MAX_PENDING` checks still unread: it waits for the oldest, before its own work.

Each thread keeps its own pending checks, oldest first.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Deferred checks one thread may leave unread; the next deferred call waits for the oldest.
MAX_PENDING = 16
def check_mode(check: object) -> bool | str:
    """``check`` if it is ``True`` (wait for the counts), ``"deferred"`` (this module) or ``False`` (skip them: bad
    rows read NaN), else ``TypeError`` naming it."""
    if check is True or check is False or check == "deferred":
        return check  # type: ignore[return-value]
    raise TypeError(f"check must be True, False or 'deferred', got {check!r}")


@dataclass
class _Pending:
    """One deferred check: ``poll()`` gives the counts once they have arrived (else None), ``wait()`` blocks for
    them; ``explain(counts)`` raises the ``ValueError`` they name; ``done()`` hands the buffers back."""

    poll: Callable[[], tuple[int, ...] | None]
    wait: Callable[[], tuple[int, ...]]
    explain: Callable[[tuple[int, ...]], None]
    done: Callable[[], None]
    call: str


_local = threading.local()


def _queue() -> deque[_Pending]:
    queue = getattr(_local, "pending", None)
    if queue is None:
        queue = _local.pending = deque()
    return queue


def defer(poll: Callable[[], tuple[int, ...] | None], wait: Callable[[], tuple[int, ...]],
          explain: Callable[[tuple[int, ...]], None], done: Callable[[], None], call: str) -> None:
    """Queue a check of this thread (the functions of :class:`_Pending`; ``call`` names the function for the
    message).  Callers first make room with ``resolve_ready(make_room=True)``, before their work."""
    _queue().append(_Pending(poll, wait, explain, done, call))


def resolve_ready(make_room: bool = False) -> None:
    """Raise what the oldest deferred checks of this thread whose counts have arrived found, without waiting (the
    queue is read in order up to the first one still running); with ``make_room``, then wait for the oldest while
    :data:`MAX_PENDING` are queued.  Cheap when nothing is pending: one lookup."""
    queue = getattr(_local, "pending", None)
    if queue:
        _resolve(queue, block=False, limit=len(queue))
        while make_room and len(queue) >= MAX_PENDING:
            _resolve(queue, block=True, limit=1)


def raise_deferred() -> None:
    """Wait for every deferred check of this thread (``check="deferred"``) and raise the ``ValueError`` of the first
    one that found a bad row (its argument and count, as the waiting check names them); the checks after it stay
    queued.  A no-op when none is pending."""
    queue = getattr(_local, "pending", None)
    if queue:
        _resolve(queue, block=True, limit=len(queue))


def pending() -> int:
    """How many deferred checks of this thread are still unread."""
    return len(getattr(_local, "pending", ()))


def _resolve(queue: deque[_Pending], *, block: bool, limit: int) -> None:
    for _ in range(limit):
        if not queue:
            return
        item = queue[0]
        counts = item.wait() if block else item.poll()
        if counts is None:
            return
        queue.popleft()
        item.done()
        if any(counts):
            try:
                item.explain(counts)
            except ValueError as err:
                raise ValueError(f"{err} (found by the deferred check of an earlier {item.call} call)") from None


def _event_counts(counts: torch.Tensor) -> tuple[Callable[[], tuple[int, ...] | None], Callable[[], tuple[int, ...]]]:
    """``(poll, wait)`` over an int device tensor of counts: copied without waiting into pinned memory behind an
    event on the current stream (CUDA), or read at once (any other device)."""
    if counts.device.type != "cuda":
        values = tuple(counts.tolist())
        return (lambda: values), (lambda: values)
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(counts.device))

    def wait() -> tuple[int, ...]:
        event.synchronize()
        return tuple(host.tolist())

    return (lambda: wait() if event.query() else None), wait


def defer_counts(counts: torch.Tensor, explain: Callable[[tuple[int, ...]], None], call: str) -> None:
    """Queue the check of an int device tensor of fault counts (:func:`_event_counts`)."""
    poll, wait = _event_counts(counts)
    defer(poll, wait, explain, lambda: None, call)
