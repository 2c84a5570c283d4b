"""``check="deferred"`` on a CUDA device (``pytest -m gpu``): no wait, no synchronisation, and every fault raised.

Skipped, with that reason, where there is no CUDA device or no Triton (CPU CI); tests/test_deferred.py checks the
same semantics on CPU and under Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import entropy_discriminator as ed
from entropy_discriminator import deferred

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu tests/gpu on a CUDA machine)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


@pytest.fixture(autouse=True)
def _empty_queue():
    yield
    try:
        ed.raise_deferred()
    finally:
        assert deferred.pending() == 0


def _inputs(seed: int, n: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(n, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    return logits, torch.randint(0, v, (n,), device="cuda", generator=g)


def _no_sync(fn) -> None:
    """Run ``fn`` (after a warm-up) with torch's sync debug mode at "error" and ``HostReport.wait`` forbidden."""
    from entropy_discriminator.kernels._host_report import HostReport

    fn()
    ed.raise_deferred()
    torch.cuda.synchronize()
    wait = HostReport.wait
    HostReport.wait = lambda self: pytest.fail("a deferred call waited for its kernel")
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        HostReport.wait = wait


@pytest.mark.parametrize("n", [64, 2048])  # split-V and one program per row
def test_deferred_calls_neither_wait_nor_synchronise(n):
    logits, labels = _inputs(n, n, 151936)
    _no_sync(lambda: ed.token_stats(logits, labels, check="deferred"))
    hidden = torch.randn(n, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(5000, 256, device="cuda", dtype=torch.bfloat16) * 0.1
    _no_sync(lambda: ed.token_stats_from_hidden(hidden, weight, labels % 5000, check="deferred"))


def test_deferred_bits_equal_the_waiting_calls_and_faults_are_raised():
    logits, labels = _inputs(1, 2048, 151936)
    want = ed.token_stats(logits, labels)
    got = ed.token_stats(logits, labels, check="deferred")
    for name in ("logp", "entropy", "s_star", "s_expected", "s_centered", "valid"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    ed.raise_deferred()
    for fault, match in (("label", r"got \[151936\]"), ("nan", r"NaN or \+inf"), ("masked", "every entry -inf")):
        bad_logits, bad_labels = logits.clone(), labels.clone()
        if fault == "label":
            bad_labels[700] = 151936
        elif fault == "nan":
            bad_logits[700, 3] = math.nan
        else:
            bad_logits[700] = -math.inf
        stats = ed.token_stats(bad_logits, bad_labels, check="deferred")
        assert torch.isnan(stats.entropy[700]) and not torch.isnan(stats.entropy[:700]).any()
        with pytest.raises(ValueError, match=match):
            for _ in range(3):  # later calls raise it once its counts have arrived; raise_deferred waits for them
                ed.token_stats(logits, labels, check="deferred")
            ed.raise_deferred()
        ed.raise_deferred()  # what stayed queued is clean


def test_many_calls_stay_bounded_and_a_side_stream_is_waited_for():
    logits, labels = _inputs(2, 512, 32000)
    for _ in range(5 * deferred.MAX_PENDING):
        ed.token_stats(logits, labels, check="deferred")
        assert deferred.pending() <= deferred.MAX_PENDING
    ed.raise_deferred()
    side = torch.cuda.Stream()
    bad = labels.clone()
    bad[3] = -7
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: the counts arrive late
        ed.token_stats(logits, bad, check="deferred")
    assert deferred.pending() == 1
    with pytest.raises(ValueError, match=r"got \[-7\]"):
        ed.raise_deferred()  # from the default stream: waits for the side stream's kernel
