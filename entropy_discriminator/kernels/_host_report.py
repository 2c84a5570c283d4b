"""Host-mapped words through which a kernel hands its error counters to the calling thread.

A checked call (``token_stats(..., check=True)``) waits for its kernel once; reading device counters back would add
a copy (~25 us at N = 256 on an H100).  Instead the kernel's last program stores the counters straight into pinned,
UVA-mapped host memory, each as one 64-bit word ``(seq << 32) | count``, then a summary word
``(seq << 32) | (any count non-zero)``.  The host polls the summary word until it carries its call's ``seq`` and
reads the counters only when some row was bad: no CUDA copy, no fence, and a stale word is never taken for the
answer.  Each thread owns one :class:`HostReport` (a report still in use, e.g. by a re-entrant call, is never handed
out again) and a pool of spare ones for deferred checks (:func:`spare_report`, ``entropy_discriminator.deferred``),
which read the words later with :meth:`HostReport.poll`; an interrupted wait synchronises the stream before the
exception propagates.
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from ._reduce import ERR_WORDS

#: How the host waits for the words: a tight poll for SPIN_SECONDS, then polls with ``time.sleep(0)`` between them
#: (the GIL released at each) until YIELD_SECONDS, then ``stream.synchronize()``.  The spin is what CUDA's own
#: synchronisation does while CPU cores outnumber GPUs; yielding early can give the core away for a scheduler time
#: slice, and a synchronisation's wake-up takes 0.1-0.2 ms, a polled word a microsecond (benchmarks/RESULTS.md,
#: "direct launches and the wait's spin").
SPIN_SECONDS = 5e-3
YIELD_SECONDS = 5e-2
_SEQ_LIMIT = 2**31 - 1


#: What :meth:`HostReport.wait` returns for a call without a bad row.
NO_FAULTS = (0,) * ERR_WORDS


class HostReport:
    """``ERR_WORDS + 1`` int64 words of pinned host memory, written by one kernel per call: the
    counters, then a summary word ``(seq << 32) | (any counter non-zero)``."""

    def __init__(self, pinned: bool) -> None:
        self.words = torch.zeros(ERR_WORDS + 1, dtype=torch.int64, pin_memory=pinned)
        self._view = self.words.numpy()  # the same memory; tolist() reads it afresh every time
        # The summary word alone, read through ctypes (a fresh 8-byte load per ``.value``, ~0.1 us):
        # all that a call without a bad row reads.
        self._summary = ctypes.c_int64.from_address(self.words.data_ptr() + 8 * ERR_WORDS)
        self.seq = 0
        self._clean = 0  # the summary word of the armed call if no row is bad
        self.device: torch.device | None = None
        self.stream: torch.cuda.Stream | None = None  # set by a deferred check: the stream it launched on
        self.busy = False

    def arm(self, device: torch.device | None) -> int:
        """The tag the next kernel, launched on ``device``'s current stream, writes (1 .. 2**31 - 1,
        never the previous one's); ``device`` None or not CUDA: the kernel runs on the host
        (Triton's interpreter) and has written its words when the launch returns."""
        self.seq = self.seq % _SEQ_LIMIT + 1
        self._clean = self.seq << 32
        self.device = device if device is not None and device.type == "cuda" else None
        self.stream = None
        self.busy = True
        return self.seq

    def poll(self) -> tuple[int, ...] | None:
        """What :meth:`wait` returns, if the armed kernel has written its words; else None, without waiting."""
        word = self._summary.value
        if word == self._clean:
            self.busy = False
            return NO_FAULTS
        if self.device is None or word >> 32 == self.seq and self._counts() is not None:
            return self.wait()
        return None

    def wait(self) -> tuple[int, ...]:
        """Block until the armed kernel has written its words; return the ``ERR_WORDS`` counts (:data:`NO_FAULTS`
        when no row was bad).  Polls the summary word (no CUDA call; :data:`SPIN_SECONDS`) until it carries this
        call's tag, then, if some row was bad, every counter word once it carries the tag.  Checks the stream every
        256 polls (errors raise there; a finished stream ends the wait).  The one host synchronisation of a checked
        call."""
        if self._summary.value == self._clean:  # the common case, kept to one load and one compare
            self.busy = False
            return NO_FAULTS
        return self._wait()

    def _wait(self) -> tuple[int, ...]:
        clean, summary, stream = self._clean, self._summary, None
        try:
            polls = 0
            start = time.perf_counter()
            while True:
                word = summary.value
                if word == clean:
                    return NO_FAULTS
                if word >> 32 == self.seq:
                    counts = self._counts()
                    if counts is not None:
                        return counts
                polls += 1
                if self.device is None:  # interpreter: the kernel ran on the host and has returned
                    break
                if polls % 256 == 0:
                    # the stream the kernel was launched on: the call has not left it since
                    stream = stream or self.stream or torch.cuda.current_stream(self.device)
                    if stream.query():
                        break
                    waited = time.perf_counter() - start
                    if waited > YIELD_SECONDS:
                        stream.synchronize()
                        break
                    if waited > SPIN_SECONDS:
                        time.sleep(0)
            if summary.value == clean:
                return NO_FAULTS
            counts = self._counts()
            if counts is not None:
                return counts
            raise RuntimeError("the statistics kernel finished without reporting its error counters")
        except BaseException:
            if self.device is not None:  # no kernel may write into this report once the call has left
                (self.stream or torch.cuda.current_stream(self.device)).synchronize()
            raise
        finally:
            self.busy = False

    def _counts(self) -> tuple[int, ...] | None:
        """The counters if every word carries this call's tag (words are ``(seq << 32) | count``,
        seq in [1, 2**31)), else None."""
        words = self._view.tolist()
        if min(words) >> 32 == self.seq == max(words) >> 32:
            return tuple(w & 0xFFFFFFFF for w in words[:ERR_WORDS])
        return None


_local = threading.local()


def _new_report() -> HostReport:
    """A report in pinned memory (plain memory where CUDA is absent: Triton's interpreter)."""
    return HostReport(pinned=torch.cuda.is_available())


def spare_report() -> HostReport:
    """A pinned report of this thread's pool for a deferred check; :func:`return_report` gives it back."""
    spares = getattr(_local, "spares", None)
    return spares.pop() if spares else _new_report()


def return_report(report: HostReport) -> None:
    """Give a report whose words have been read back to this thread's pool."""
    spares = getattr(_local, "spares", None)
    if spares is None:
        spares = _local.spares = []
    spares.append(report)


def host_report() -> HostReport:
    """This thread's pinned report (a fresh one while it is in use)."""
    rep = getattr(_local, "report", None)
    if rep is None:
        rep = _local.report = _new_report()
    elif rep.busy:
        return _new_report()
    return rep
