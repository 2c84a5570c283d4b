"""Checks that do not wait: ``token_stats(..., check="deferred")`` and :func:`raise_deferred` (docs/performance.md).

A deferred check counts the same bad rows as ``check=True`` without the host waiting for the counts (bad rows read
NaN meanwhile); the waiting check's ``ValueError``, naming the earlier call, is raised by the first of: the thread's
next ``token_stats`` / ``token_stats_from_hidden`` call (for the checks whose counts have arrived),
:func:`raise_deferred` (which waits for all), or a deferred call finding :data:`MAX_PENDING` unread (it waits for
the oldest).  Each thread keeps its own pending checks, oldest first.
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
    """``check`` if it is ``True``, ``False`` or ``"deferred"``, else ``TypeError`` naming it."""
    if check is True or check is False or check == "deferred":
        return check  # type: ignore[return-value]
    raise TypeError(f"check must be True, False or 'deferred', got {check!r}")


@dataclass
class _Pending:
    """One queued check: ``poll`` / ``wait`` for its counts, ``explain`` raises, ``done`` hands buffers back."""

    poll: Callable[[], tuple[int, ...] | None]
    wait: Callable[[], tuple[int, ...]]
    explain: Callable[[tuple[int, ...]], None]
    done: Callable[[], None]
    call: str


_local = threading.local()


def defer(poll: Callable[[], tuple[int, ...] | None], wait: Callable[[], tuple[int, ...]],
          explain: Callable[[tuple[int, ...]], None], done: Callable[[], None], call: str) -> None:
    """Queue a check of this thread (:class:`_Pending`; ``call`` names the function); callers first make room with
    ``resolve_ready(make_room=True)``."""
    if getattr(_local, "pending", None) is None:
        _local.pending = deque()
    _local.pending.append(_Pending(poll, wait, explain, done, call))


def resolve_ready(make_room: bool = False) -> None:
    """Raise what this thread's oldest checks whose counts have arrived found, in order, without waiting; with
    ``make_room``, then wait for the oldest while :data:`MAX_PENDING` are queued."""
    queue = getattr(_local, "pending", None)
    if queue:
        _resolve(queue, block=False, limit=len(queue))
        while make_room and len(queue) >= MAX_PENDING:
            _resolve(queue, block=True, limit=1)


def raise_deferred() -> None:
    """Wait for every deferred check of this thread and raise the ``ValueError`` of the first that found a bad row
    (the checks after it stay queued); a no-op when none is pending."""
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


def defer_counts(counts: torch.Tensor, explain: Callable[[tuple[int, ...]], None], call: str) -> None:
    """Queue the check of an int device tensor of fault counts: a pinned copy behind an event (CUDA), else read now."""
    if counts.device.type != "cuda":
        values = tuple(counts.tolist())
        defer(lambda: values, lambda: values, explain, lambda: None, call)
        return
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(counts.device))

    def wait() -> tuple[int, ...]:
        event.synchronize()
        return tuple(host.tolist())

    defer(lambda: wait() if event.query() else None, wait, explain, lambda: None, call)
