"""``check="deferred"``: the same faults as the waiting check, raised later, never lost.

The torch-path tests run everywhere.  The Triton-path tests need Triton and ``TRITON_INTERPRET=1`` or a CUDA device
(``nox -s kernels``); the core session skips them with that reason.  tests/gpu/test_gpu_deferred.py checks on a
GPU that a deferred call does not synchronise.
"""

from __future__ import annotations

import importlib.util
import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import entropy_discriminator as ed
from entropy_discriminator import deferred, kernels

FIELDS = ("logp", "entropy", "s_star", "s_expected", "s_centered")
TRITON = importlib.util.find_spec("triton") is not None and (kernels.interpreting() or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(not TRITON, reason="needs triton with TRITON_INTERPRET=1 or a CUDA device (nox -s kernels)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _public_triton_on_interpreter(monkeypatch):
    """Under Triton's interpreter the public call's Triton path takes CPU tensors (the interpreter runs the kernel
    on them); only the device test of ``stats._triton_unavailable_reason`` is bypassed."""
    if TRITON and not torch.cuda.is_available():
        from entropy_discriminator import stats

        reason = stats._triton_unavailable_reason
        monkeypatch.setattr(stats, "_triton_unavailable_reason",
                            lambda logits: None if logits.dtype != torch.float64 else reason(logits))


@pytest.fixture(autouse=True)
def _empty_queue():
    """Each test starts and ends with no deferred check of this thread left unread."""
    try:
        ed.raise_deferred()
    except ValueError:
        pass
    yield
    try:
        ed.raise_deferred()
    except ValueError:
        pass
    assert deferred.pending() == 0


def _logits(seed: int, n: int, v: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(dtype).to(device)


def _labels(seed: int, n: int, v: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def _assert_same(a: ed.TokenStats, b: ed.TokenStats, rows: torch.Tensor | slice = slice(None)) -> None:
    for name in (*FIELDS, "valid"):
        assert torch.equal(getattr(a, name)[rows], getattr(b, name)[rows]), name


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_clean_input_gives_the_waiting_checks_bits_and_leaves_nothing(impl):
    logits, labels = _logits(0, 40, 300, torch.bfloat16, DEV), _labels(1, 40, 300, DEV)
    labels[5] = -100
    want = ed.token_stats(logits, labels, impl=impl)
    got = ed.token_stats(logits, labels, impl=impl, check="deferred")
    _assert_same(got, want)
    ed.raise_deferred()  # waits; nothing to raise
    assert deferred.pending() == 0


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("fault, match", [("label", r"labels must lie in \[0, 300\).*; got \[300\]"),
                                          ("nan", "NaN or \\+inf in 1 counted row"),
                                          ("masked", "every entry -inf at 1 counted position")])
def test_a_fault_returns_nan_rows_then_raises_at_the_next_call(impl, fault, match):
    logits, labels = _logits(2, 12, 300, torch.float32, DEV), _labels(3, 12, 300, DEV)
    if fault == "label":
        labels[4] = 300
    elif fault == "nan":
        logits[4, 7] = math.nan
    else:
        logits[4] = -math.inf
    good = torch.arange(12, device=DEV) != 4
    want = ed.token_stats(logits[good], labels[good], impl=impl, check=False)
    stats = ed.token_stats(logits, labels, impl=impl, check="deferred")  # returns without raising
    for name in FIELDS:
        assert torch.isnan(getattr(stats, name)[4]), name
    _assert_same(ed.TokenStats(*(getattr(stats, f)[good] for f in (*FIELDS, "valid"))), want)
    assert deferred.pending() == 1
    with pytest.raises(ValueError, match=match) as info:
        fresh = _logits(4, 3, 300, torch.float32, DEV)
        ed.token_stats(fresh, _labels(5, 3, 300, DEV), impl=impl)
        ed.raise_deferred()  # where the counts had not arrived before that call
    assert "deferred check of an earlier token_stats call" in str(info.value)
    assert deferred.pending() == 0
    ed.token_stats(fresh, _labels(5, 3, 300, DEV), impl=impl, check="deferred")  # the fault is raised once only
    ed.raise_deferred()


def test_raise_deferred_raises_the_first_fault_and_keeps_the_rest_queued():
    logits = _logits(6, 4, 50)
    bad_label, bad_logit = _labels(7, 4, 50), logits.clone()
    bad_label[0] = -3
    bad_logit[1, 1] = math.inf
    # deferred calls on the CPU have their counts at once, so the second call raises the first one's fault
    ed.token_stats(logits, bad_label, check="deferred")
    with pytest.raises(ValueError, match=r"got \[-3\]"):
        ed.token_stats(bad_logit, _labels(7, 4, 50), check="deferred")
    assert deferred.pending() == 0  # it raised before queueing its own check
    ed.token_stats(bad_logit, _labels(7, 4, 50), check="deferred")
    assert deferred.pending() == 1
    with pytest.raises(ValueError, match=r"\+inf"):
        ed.raise_deferred()
    ed.raise_deferred()  # a no-op now


def test_from_hidden_defers_too():
    hidden, weight = _logits(8, 10, 16), _logits(9, 70, 16) * 0.2
    labels = _labels(10, 10, 70)
    want = ed.token_stats_from_hidden(hidden, weight, labels)
    _assert_same(ed.token_stats_from_hidden(hidden, weight, labels, check="deferred"), want)
    labels[9] = 70
    stats = ed.token_stats_from_hidden(hidden, weight, labels, check="deferred")
    assert torch.isnan(stats.entropy[9]) and not torch.isnan(stats.entropy[:9]).any()
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 70\).*; got \[70\]"):
        ed.raise_deferred()


def test_checks_are_per_thread():
    labels = _labels(11, 4, 30)
    labels[2] = 30
    ed.token_stats(_logits(12, 4, 30), labels, check="deferred")
    seen = []
    worker = threading.Thread(target=lambda: seen.append((deferred.pending(), ed.raise_deferred())))
    worker.start()
    worker.join()
    assert seen == [(0, None)]  # the other thread has nothing pending and raises nothing
    with pytest.raises(ValueError, match="labels"):
        ed.raise_deferred()


def test_empty_batch_queues_nothing_and_bad_modes_are_refused():
    ed.token_stats(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), check="deferred")
    assert deferred.pending() == 0
    for bad in ("Deferred", 1, None, "true"):
        with pytest.raises(TypeError, match="check must be True, False or 'deferred'"):
            ed.token_stats(_logits(0, 2, 5), _labels(0, 2, 5), check=bad)
        with pytest.raises(TypeError, match="check must be True, False or 'deferred'"):
            ed.token_stats_from_hidden(_logits(0, 2, 5), _logits(1, 7, 5), _labels(0, 2, 7), check=bad)


@settings(max_examples=25, deadline=None)
@given(arrived=st.lists(st.booleans(), min_size=1, max_size=2 * deferred.MAX_PENDING), bad=st.data())
def test_queue_reads_in_order_up_to_the_first_unarrived_and_bounds_its_length(arrived, bad):
    """The queue alone, with checks whose counts arrive when the test says: the non-waiting read stops at the first
    check still running; a full queue waits for its oldest; a fault is raised once, in queue order."""
    faulty = bad.draw(st.lists(st.booleans(), min_size=len(arrived), max_size=len(arrived)))
    log: list[tuple[str, int]] = []

    def explain(i: int):
        def raise_it(counts):
            raise ValueError(f"fault {i}")
        return raise_it

    raised: list[int] = []
    for i, (here, f) in enumerate(zip(arrived, faulty)):
        counts = (1, 0, 0, 0) if f else (0, 0, 0, 0)
        try:
            deferred.resolve_ready(make_room=True)  # as a deferred call does before its work
        except ValueError as err:
            raised.append(int(str(err).split()[1]))
        try:
            deferred.defer(poll=(lambda c=counts, h=here: c if h else None),
                           wait=(lambda c=counts, i=i: log.append(("wait", i)) or c),
                           explain=explain(i), done=(lambda i=i: log.append(("done", i))), call="probe")
        except ValueError as err:
            raised.append(int(str(err).split()[1]))
        assert deferred.pending() <= deferred.MAX_PENDING
        try:
            deferred.resolve_ready()
        except ValueError as err:
            raised.append(int(str(err).split()[1]))
    before_drain = [i for kind, i in log if kind == "wait"]
    while deferred.pending():
        try:
            ed.raise_deferred()
        except ValueError as err:
            raised.append(int(str(err).split()[1]))
    assert raised == [i for i, f in enumerate(faulty) if f]  # every fault once, in call order
    assert [i for kind, i in log if kind == "done"] == list(range(len(arrived)))  # every check read, in order
    # before raise_deferred, a check is waited for only when the queue is full and its counts have not arrived
    assert all(not arrived[i] for i in before_drain)
    if len(arrived) <= deferred.MAX_PENDING:
        assert before_drain == []


@needs_triton
def test_triton_deferred_reports_come_back_to_the_pool():
    """A deferred Triton call uses a spare report of the thread's pool and returns it once read; a clean call's
    report is not the thread's waiting one (so a checked call in between cannot overwrite its words)."""
    from entropy_discriminator.kernels import _host_report

    logits, labels = _logits(13, 6, 200, torch.bfloat16, DEV), _labels(14, 6, 200, DEV)
    ed.token_stats(logits, labels, impl="triton", check="deferred")
    ed.raise_deferred()
    spares = list(getattr(_host_report._local, "spares", []))
    assert len(spares) >= 1 and all(s is not _host_report.host_report() for s in spares)
    for _ in range(3):
        ed.token_stats(logits, labels, impl="triton", check="deferred")
        ed.token_stats(logits, labels, impl="triton")  # a waiting call in between
    ed.raise_deferred()
    assert len(_host_report._local.spares) <= len(spares) + 3


@needs_triton
def test_triton_overflow_is_raised_not_recomputed_when_deferred():
    logits = torch.zeros(3, 40, device=DEV)
    logits[1, 5] = 3.0e38
    labels = torch.tensor([1, 5, 2], device=DEV)
    ed.token_stats(logits, labels)  # the waiting call recomputes the overflowing row on the torch path
    stats = ed.token_stats(logits, labels, check="deferred")
    assert torch.isnan(stats.entropy[1])
    with pytest.raises(ValueError, match="overflow float32"):
        ed.raise_deferred()
