"""Host-mapped words through which a kernel hands its error counters to the calling thread.

The kernel's last program stores the counters into pinned, UVA-mapped host memory as 64-bit words
``(seq << 32) | count``, then a summary word ``(seq << 32) | (any count non-zero)``; the host polls the summary word
until it carries its call's ``seq`` (no device-to-host copy, ~25 us at N = 256 on an H100; a stale word is never
taken for the answer).  Each thread owns one :class:`HostReport` and a pool of spares for deferred checks
(:func:`spare_report`).
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from ._reduce import ERR_WORDS

#: The wait: a tight poll for SPIN_SECONDS, then polls with ``time.sleep(0)`` until YIELD_SECONDS, then a
#: synchronize (benchmarks/RESULTS.md).
SPIN_SECONDS = 5e-3
YIELD_SECONDS = 5e-2
_SEQ_LIMIT = 2**31 - 1

#: What :meth:`HostReport.wait` returns for a call without a bad row.
NO_FAULTS = (0,) * ERR_WORDS


class HostReport:
    """``ERR_WORDS + 1`` int64 words of pinned host memory, written by one kernel per call (module docstring)."""

    def __init__(self, pinned: bool) -> None:
        self.words = torch.zeros(ERR_WORDS + 1, dtype=torch.int64, pin_memory=pinned)
        self._view = self.words.numpy()  # the same memory; tolist() reads it afresh every time
        # the summary word through ctypes: a fresh 8-byte load per ``.value`` (~0.1 us)
        self._summary = ctypes.c_int64.from_address(self.words.data_ptr() + 8 * ERR_WORDS)
        self.seq = 0
        self._clean = 0  # the summary word of the armed call if no row is bad
        self.device: torch.device | None = None
        self.stream: torch.cuda.Stream | None = None  # set by a deferred check: the stream it launched on
        self.busy = False

    def arm(self, device: torch.device | None) -> int:
        """The tag (1 .. 2**31 - 1, never the previous one) the next kernel, on ``device``'s current stream, writes;
        ``device`` None or not CUDA: the interpreter, whose kernel has written its words when the launch returns."""
        self.seq = self.seq % _SEQ_LIMIT + 1
        self._clean = self.seq << 32
        self.device = device if device is not None and device.type == "cuda" else None
        self.stream = None
        self.busy = True
        return self.seq

    def poll(self) -> tuple[int, ...] | None:
        """What :meth:`wait` returns, if the armed kernel has written its words; else None, without waiting."""
        word = self._summary.value
        if word == self._clean or self.device is None or word >> 32 == self.seq and self._counts() is not None:
            return self.wait()
        return None

    def wait(self) -> tuple[int, ...]:
        """Block until the armed kernel has written its words; return the ``ERR_WORDS`` counts (:data:`NO_FAULTS`
        when no row was bad).  Checks the stream every 256 polls (errors raise there; a finished stream ends the
        wait); an interrupted wait synchronises the stream before the exception propagates."""
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
        """The counters if every word carries this call's tag, else None."""
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
    _local.__dict__.setdefault("spares", []).append(report)


def host_report() -> HostReport:
    """This thread's pinned report (a fresh one while it is in use)."""
    rep = getattr(_local, "report", None)
    if rep is None:
        rep = _local.report = _new_report()
    elif rep.busy:
        return _new_report()
    return rep
