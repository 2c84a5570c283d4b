"""Compiled Triton kernels on a CUDA device against the float64 reference (``pytest -m gpu``).

Skipped, with that reason, where there is no CUDA device or no Triton (CPU CI); run through the
device tool: ``python -m pytest -m gpu tests/gpu``.  Outputs are poisoned (the allocator's cache is
filled with NaN) before every kernel run, so an unwritten element fails the comparison.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
import torch
from fused_guard import only_fused_kernel
from reference import reference_token_stats

import entropy_discriminator as ed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu tests/gpu on a CUDA machine)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

# The accuracy targets on bf16 inputs (max abs error against float64).
TOL = {"logp": 2e-5, "entropy": 5e-5, "s_star": 5e-5, "s_expected": 5e-5, "s_centered": 5e-5}
FIELDS = tuple(TOL)


def poison(n: int) -> None:
    """Fill the caching allocator with NaN blocks of the sizes the kernels will ask for."""
    blocks = [torch.full((n * k,), math.nan, device="cuda") for k in (1, 1, 1, 1, 1, 1, 6, 8, 16, 32) for _ in range(2)]
    torch.cuda.synchronize()
    del blocks


def make_logits(seed: int, n: int, v: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(n, v, device="cuda", generator=g) * 3
    if kind == "peaked":
        z[torch.arange(n, device="cuda"), torch.randint(0, v, (n,), device="cuda", generator=g)] = 60.0
    elif kind == "flat":
        z = torch.full_like(z, -2.5)
    elif kind == "masked":
        z = z.masked_fill(torch.rand(n, v, device="cuda", generator=g) < 0.7, -math.inf)
        z[:, 1] = 0.0
    return z.to(dtype)


def make_labels(seed: int, n: int, v: int, ignore_frac: float = 0.15) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[torch.rand(n, device="cuda", generator=g) < ignore_frac] = -100
    return labels


def check(stats: ed.TokenStats, logits: torch.Tensor, labels: torch.Tensor, temperature: float, scale: float = 1.0) -> None:
    ref = reference_token_stats(logits.double(), labels, temperature)
    for name in FIELDS:
        got = getattr(stats, name)
        assert got.dtype == torch.float32
        assert not torch.isnan(got).any(), f"{name}: NaN (unwritten or wrong)"
        got, want = got.double(), ref[name]
        same_inf = torch.isinf(got) & (got == want)
        err = float(torch.where(same_inf, torch.zeros_like(got), (got - want).abs()).max())
        assert err <= TOL[name] * scale, (name, err)
    assert torch.equal(stats.valid, labels != -100)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["normal", "peaked", "flat", "masked"])
@pytest.mark.parametrize(("n", "v"), [(1, 1000), (3, 151936), (257, 32000), (1000, 4097)])
def test_kernel_matches_float64_reference(n, v, dtype, kind):
    logits = make_logits(n + v, n, v, dtype, kind)
    labels = make_labels(n, n, v)
    for temperature in (1.0, 0.6):
        poison(n)
        stats = ed.token_stats(logits, labels, temperature=temperature, impl="triton")
        check(stats, logits, labels, temperature)


@pytest.mark.parametrize("n", [5, 300])
def test_vocabulary_256000(n):
    logits = make_logits(11, n, 256000, torch.bfloat16, "normal")
    labels = make_labels(11, n, 256000)
    poison(n)
    check(ed.token_stats(logits, labels, impl="triton"), logits, labels, 1.0)


def test_auto_picks_the_kernel_and_agrees_with_torch_path():
    logits = make_logits(5, 64, 50000, torch.bfloat16, "normal")
    labels = make_labels(5, 64, 50000)
    a = ed.token_stats(logits, labels)  # auto -> triton on CUDA
    b = ed.token_stats(logits, labels, impl="torch")
    for name in FIELDS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-4, atol=3e-5)


def test_non_contiguous_batch_time_view():
    full = make_logits(3, 4 * 33, 32768, torch.bfloat16, "normal").view(4, 33, 32768)
    logits = full[:, :-1]  # [4, 32, V]: the one-token shift, not viewable as [128, V]
    labels = make_labels(3, 4 * 32, 32768).view(4, 32)
    poison(128)
    stats = ed.token_stats(logits, labels, impl="triton")
    assert stats.entropy.shape == (4, 32)
    # The view is read in place (two strided row levels, one launch), the copy as [128, V]: the
    # same programs over the same bytes, so the same bits.
    flat_stats = ed.token_stats(logits.reshape(-1, 32768), labels.reshape(-1), impl="triton")
    for name in FIELDS:
        assert torch.equal(getattr(stats, name).reshape(-1), getattr(flat_stats, name)), name
    flat = ed.TokenStats(**{f: getattr(stats, f).reshape(-1) for f in (*FIELDS, "valid")})
    check(flat, logits.reshape(-1, 32768), labels.reshape(-1), 1.0)


def test_deterministic_bits_with_and_without_split():
    from entropy_discriminator.kernels.triton_stats import token_stats_triton

    logits = make_logits(9, 200, 151936, torch.bfloat16, "normal")
    labels = make_labels(9, 200, 151936)
    for split in (1, 7):
        cfg = {"block": 4096, "num_warps": 8, "stages": 2, "split": split}
        runs = [token_stats_triton(logits, labels, 1.0, -100, config=cfg) for _ in range(3)]
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert torch.equal(a, b)
    auto = [token_stats_triton(logits, labels, 1.0, -100) for _ in range(2)]  # split-V chosen for N=200
    for a, b in zip(*auto):
        assert torch.equal(a, b)


def test_nan_and_all_masked_rows_raise():
    logits = make_logits(1, 4, 5000, torch.bfloat16, "normal")
    labels = torch.tensor([0, 1, 2, 3], device="cuda")
    bad = logits.clone()
    bad[2, 17] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        ed.token_stats(bad, labels, impl="triton")
    bad = logits.clone()
    bad[1] = -math.inf
    with pytest.raises(ValueError, match="-inf"):
        ed.token_stats(bad, labels, impl="triton")
    labels[1] = -100  # an ignored all -inf row is fine
    ed.token_stats(bad, labels, impl="triton")


def _first_sync(fn) -> str | None:
    """Source line of the first synchronising torch operation of ``fn`` (after a warm-up call),
    or None: torch's sync debug mode set to "error" raises there."""
    import traceback

    fn()  # compile and cache first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        assert "synchroniz" in str(exc), exc
        return traceback.extract_tb(exc.__traceback__)[-1].line
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def test_public_call_waits_once_at_the_end_and_check_false_never(monkeypatch):
    """check=False: no synchronising operation and no wait.  The default: one wait on the host
    words the kernel writes (``HostReport.wait``, the last call before ``return`` on valid data);
    a synchronising torch operation, if any, is that wait's fallback ``stream.synchronize()``.
    ``token_stats_from_hidden`` reads its counters once with ``tolist()``."""
    from entropy_discriminator.hidden import token_stats_from_hidden
    from entropy_discriminator.kernels._host_report import HostReport

    waits = []
    wait = HostReport.wait
    monkeypatch.setattr(HostReport, "wait", lambda self: waits.append(1) or wait(self))
    for n in (64, 3000):  # split-V and one program per row
        logits = make_logits(n, n, 20000, torch.bfloat16, "normal")
        labels = make_labels(n, n, 20000)
        assert _first_sync(lambda: ed.token_stats(logits, labels, check=False)) is None
        assert waits == []
        line = _first_sync(lambda: ed.token_stats(logits, labels))
        assert line is None or line.endswith(".synchronize()"), line  # HostReport.wait's fallback
        assert len(waits) == 2  # the warm-up call and the checked one
        waits.clear()
    hidden = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(5000, 256, device="cuda", dtype=torch.bfloat16) * 0.1
    labels = make_labels(3, 100, 5000)
    assert _first_sync(lambda: token_stats_from_hidden(hidden, weight, labels, check=False)) is None
    assert _first_sync(lambda: token_stats_from_hidden(hidden, weight, labels)).startswith("errors = out.errors.tolist()")


def test_direct_launches_are_the_kernels_triton_would_launch(monkeypatch):
    """kernels/_launch.py: for calls that differ in logits dtype, label dtype, pointer alignment,
    split-V or not, ignore_index class and host report, (1) the direct launch gives the bits and
    counters of Triton's own launch path; (2) once every class is cached, no call reaches Triton's
    path; (3) each cached kernel is the very object Triton's cache holds under Triton's own key for
    that call (computed with Triton's binder), so the key is never coarser than Triton's."""
    import triton
    from triton.runtime.jit import compute_cache_key

    from entropy_discriminator.kernels import triton_stats
    from entropy_discriminator.kernels.triton_stats import HostReport, token_stats_triton

    launcher = triton_stats._LAUNCHER
    assert launcher.enabled == triton.__version__.startswith("3.6.")
    if not launcher.enabled:
        pytest.skip(f"direct launches are off for Triton {triton.__version__}")
    v = 9000
    cases = []
    for n in (3, 700):  # split-V, one program per row
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            base = make_logits(n, n * v + 8, 1, dtype, "normal").view(-1)
            for offset in (0, 1):  # 16-byte aligned rows or not
                logits = base[offset : offset + n * v].view(n, v)
                for label_dtype in (torch.int64, torch.int32):
                    labels = make_labels(n, n, v).to(label_dtype)
                    labels[1] = v + 3  # a bad label (more where ignore_index leaves -100 counted): counters come back too
                    for ignore_index in (-100, 16, 1):
                        cases.append((logits, labels, ignore_index))
    report = HostReport(pinned=True)

    def run_all(order):
        results = {}
        for i in order:
            logits, labels, ignore_index = cases[i]
            for use_report in (False, True):
                out = token_stats_triton(logits, labels, 0.7, ignore_index, report=report if use_report else None)
                counters = list(report.wait()) if use_report else out.errors.tolist()
                results[i, use_report] = ([t.clone() for t in out], counters)
        return results

    monkeypatch.setattr(launcher, "enabled", False)
    want = run_all(range(len(cases)))
    monkeypatch.setattr(launcher, "enabled", True)
    launcher.clear()
    calls = []
    launch = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda *a: calls.append(a) or launch(*a))
    run_all(range(len(cases)))  # fills the cache through Triton's path

    class NoTritonPath:  # Triton's launch path fails from here on
        pre_run_hooks: list = []

        def __getitem__(self, grid):
            raise AssertionError("a cached class went through Triton's launch path")

    monkeypatch.setattr(launcher, "fn", NoTritonPath())
    got = run_all(reversed(range(len(cases))))
    for key, (outs, counters) in want.items():
        g_outs, g_counters = got[key]
        assert g_counters == counters and counters[0] >= 1 and counters[1:] == [0, 0, 0], key
        for a, b in zip(outs, g_outs):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), key
    kernel = triton_stats._stats_kernel
    kernel_cache, key_cache, _, _, binder = kernel.device_caches[torch.cuda.current_device()]
    classes = set()
    for grid, args, consts, num_warps, device in calls:
        _, spec, options = binder(
            *args, **dict(consts), num_warps=num_warps, debug=kernel.debug or triton.knobs.runtime.debug,
            instrumentation_mode=triton.knobs.compilation.instrumentation_mode,
        )  # fmt: skip
        ours, _ = launcher._compiled[launcher.key(args, consts, num_warps, device)]
        assert ours is kernel_cache[compute_cache_key(key_cache, spec, options)]
        classes.add(launcher.key(args, consts, num_warps, device))
    assert len(classes) >= 2 * 3 * 2 * 2 * 2  # split x dtype x alignment x label dtype x report, at least


def test_checked_calls_on_other_streams_and_threads_get_their_own_counts():
    """The per-stream workspace and the per-thread host words: checked calls alternating between
    two non-default streams, and four threads each on its own stream, raise exactly for the
    batches with a bad label."""
    import threading

    logits = make_logits(7, 300, 9000, torch.bfloat16, "normal")
    labels = make_labels(7, 300, 9000, ignore_frac=0.0)
    bad = labels.clone()
    bad[5] = 9000
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for i in range(12):
        with torch.cuda.stream(streams[i % 2]):
            if i % 3 == 0:
                with pytest.raises(ValueError, match=r"got \[9000\]"):
                    ed.token_stats(logits, bad)
            else:
                assert not torch.isnan(ed.token_stats(logits, labels).logp).any()
    wrong = []

    def worker(k: int) -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            for i in range(20):
                is_bad = (i + k) % 3 == 0
                try:
                    ed.token_stats(logits, bad if is_bad else labels)
                    raised = False
                except ValueError:
                    raised = True
                if raised != is_bad:
                    wrong.append((k, i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.parametrize("n", [6, 3000])
def test_bad_rows_raise_in_order_or_read_nan_without_check(n):
    from entropy_discriminator.hidden import token_stats_from_hidden

    logits = make_logits(n, n, 9000, torch.bfloat16, "normal")
    labels = make_labels(n, n, 9000, ignore_frac=0.0)
    logits[1, 17] = math.nan
    logits[2] = -math.inf
    labels[4] = 9000
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 9000\) or equal ignore_index=-100; got \[9000\]"):
        ed.token_stats(logits, labels)
    stats = ed.token_stats(logits, labels, check=False)
    bad = torch.zeros(n, dtype=torch.bool, device="cuda")
    bad[[1, 2, 4]] = True
    for name in FIELDS:
        got = getattr(stats, name)
        assert torch.isnan(got[bad]).all() and not torch.isnan(got[~bad]).any(), name
    labels[4] = 0
    with pytest.raises(ValueError, match="logits contain NaN or \\+inf in 1 counted row"):
        ed.token_stats(logits, labels)
    logits[1, 17] = 0.0
    with pytest.raises(ValueError, match="every entry -inf at 1 counted position"):
        ed.token_stats(logits, labels)
    hidden = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[0, 300\).*got \[300\]"):
        token_stats_from_hidden(hidden, weight, torch.tensor([0, 1, 2, 300, 4, 5, 6, 7], device="cuda"))


def test_overflowing_scale_falls_back_to_torch_or_is_named():
    """fp32 logits of 3e38 at T = 0.5: the kernel's base-2 scaling overflows;
    ``auto`` recomputes on the torch path (exact), ``triton`` names the overflow."""
    logits = make_logits(2, 8, 1000, torch.float32, "normal")
    logits[:, 5] = 3e38
    logits[3] = torch.linspace(-3e38, -2.9e38, 1000, device="cuda")
    labels = torch.full((8,), 5, device="cuda")
    labels[3] = 999  # its max: other labels' log p (~-6e38 / T) are not fp32 numbers
    stats = ed.token_stats(logits, labels, temperature=0.5)
    check(stats, logits, labels, 0.5)
    with pytest.raises(ValueError, match="overflow"):
        ed.token_stats(logits, labels, temperature=0.5, impl="triton")


@pytest.mark.parametrize(
    ("n", "h", "v", "dtype", "bias", "temperature"),
    [
        (300, 256, 5000, torch.bfloat16, False, 1.0),
        (129, 200, 3001, torch.bfloat16, True, 0.7),  # ragged N, V and H
        (64, 128, 2000, torch.float16, False, 1.0),
        (40, 96, 1000, torch.float32, True, 1.3),
        (33, 100, 777, torch.bfloat16, True, 1.0),  # H % 8 != 0: no TMA, the pointer kernel runs
        (512, 2048, 151936, torch.bfloat16, False, 1.0),
    ],
)
def test_fused_from_hidden_matches_float64(n, h, v, dtype, bias, temperature):
    from entropy_discriminator.hidden import token_stats_from_hidden

    g = torch.Generator(device="cuda").manual_seed(n + h)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * (4 / h**0.5)).to(dtype)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    labels = make_labels(n, n, v)
    poison(n)
    stats = token_stats_from_hidden(hidden, weight, labels, bias=b, temperature=temperature, impl="triton")
    logits = hidden.double() @ weight.double().T + (b.double() if bias else 0.0)
    # The tensor cores' fp32 accumulation over H products errs by ~1e-5 of |z| (|z| up to ~20
    # here): 9e-5 in logp seen at H=3584 (bf16 logits from cuBLAS err by 4e-2).
    check(stats, logits, labels, temperature, scale=5.0)
    again = token_stats_from_hidden(hidden, weight, labels, bias=b, temperature=temperature, impl="triton")
    assert torch.equal(again.s_centered, stats.s_centered)


def check_rows(stats, idx: torch.Tensor, ref: dict, labels: torch.Tensor, scale: float) -> None:
    """The statistics of rows ``idx`` against their float64 reference ``ref``, ``valid`` of every row."""
    for name in FIELDS:
        got = getattr(stats, name)[idx].double()
        assert not torch.isnan(got).any(), f"{name}: NaN (unwritten or wrong)"
        want = ref[name].to(got.device)
        same_inf = torch.isinf(got) & (got == want)
        err = float(torch.where(same_inf, torch.zeros_like(got), (got - want).abs()).max())
        assert err <= TOL[name] * scale, (name, err)
    assert torch.equal(stats.valid, labels != -100)


@pytest.mark.parametrize(
    ("n", "h", "v", "dtype", "bias", "cfg", "rows_per_launch"),
    [
        (1000, 896, 20000, torch.bfloat16, False, {"chunks": 7}, None),
        (777, 200, 3001, torch.bfloat16, True, {"chunks": 3, "group_rows": 2}, 256),  # ragged N, V and H
        (600, 512, 9001, torch.float16, True, {"stages": 4, "branch": 0}, None),
        (300, 256, 5000, torch.bfloat16, True, {"flatten": 0, "group_rows": 1}, None),
        (129, 64, 2000, torch.float16, False, {"bn": 128, "num_warps": 4}, None),
        (40, 128, 70000, torch.bfloat16, True, {}, None),  # one row block: the plan splits V over the SMs
    ],
)
def test_fused_stream_kernel_plans_match_float64(monkeypatch, n, h, v, dtype, bias, cfg, rows_per_launch):
    from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton

    only_fused_kernel(monkeypatch, "stream")
    g = torch.Generator(device="cuda").manual_seed(n + h)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * (4 / h**0.5)).to(dtype)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    labels = make_labels(n, n, v)
    poison(n)
    stats = token_stats_fused_triton(hidden, weight, labels, b, 0.9, -100, config={"gluon": 0, **cfg},
                                     rows_per_launch=rows_per_launch)  # fmt: skip
    check(stats, hidden.double() @ weight.double().T + (b.double() if bias else 0.0), labels, 0.9, scale=5.0)


def gluon_runs() -> bool:
    """Whether the public call runs the warp-specialised Gluon kernel below H 3072 on this GPU and Triton: the
    library's own rule (``triton_fused._gluon_ok``) for a small 16-bit head."""
    from entropy_discriminator.kernels import triton_fused

    return triton_fused._gluon_ok(torch.empty(1, 64, device="cuda", dtype=torch.bfloat16), None, None)


@pytest.mark.parametrize(
    ("n", "h", "v", "dtype", "temperature", "cfg", "rows_per_launch", "extras"),
    [
        (1000, 896, 20000, torch.bfloat16, 0.9, {"chunks": 7}, None, False),
        (777, 200, 3001, torch.bfloat16, 1.3, {"chunks": 3, "group_rows": 2}, 256, False),  # ragged N, V and H
        (600, 512, 9001, torch.float16, 0.7, {}, None, False),
        (300, 136, 5000, torch.bfloat16, 1.0, {"group_rows": 1}, None, False),
        (129, 64, 2000, torch.float16, 1.0, {}, None, False),  # one K step: consumer 1 waits for the first
        (40, 128, 70000, torch.bfloat16, 0.9, {}, None, False),  # one row block: the plan splits V over the SMs
        (3000, 2048, 151936, torch.float16, 1.0, {}, None, False),
        # extra programs on the SMs a row-order plan leaves idle (132 SMs: 4 chunks of 67 tiles, 4 extras of 8 row
        # blocks; 13 row blocks, the last ragged: extras of 7 and 6; the 0.5B head: 8 x 72 tiles, 4 extras of 4 x 18)
        (4096, 128, 70000, torch.bfloat16, 0.9, {}, None, True),
        (1600, 200, 151936, torch.float16, 1.0, {}, None, True),
        (2048, 896, 151936, torch.float16, 0.7, {}, None, True),
    ],
)
def test_gluon_kernel_plans_match_float64(monkeypatch, n, h, v, dtype, temperature, cfg, rows_per_launch, extras):
    """The warp-specialised Gluon kernel (two consumer warp groups, the second a K step behind) under the streaming
    kernel's plans (chunks, groups, row slices; ragged N, V and H; one row block; one K step), and with the extra
    programs that take the tiles past shortened chunks where a row-order plan leaves SMs idle
    (``triton_fused.row_order_extras``), matches float64."""
    from entropy_discriminator.kernels import triton_fused

    if not gluon_runs():
        pytest.skip("the Gluon kernel runs on sm_90 GPUs with Triton's Gluon")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    (_, tpc, s, g), *tail = triton_fused.stream_slices(n, v, h, 2, 128, 256, sms)
    planned = None if cfg or tail else triton_fused.row_order_extras(n, v, 128, 256, sms, tpc, s, g)
    assert (planned is not None) is extras, planned
    runs = only_fused_kernel(monkeypatch, "gluon")
    gen = torch.Generator(device="cuda").manual_seed(n + h + 1)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * (4 / h**0.5)).to(dtype)
    labels = make_labels(n, n, v)
    poison(n)
    stats = triton_fused.token_stats_fused_triton(hidden, weight, labels, None, temperature, -100, config=cfg,
                                                  rows_per_launch=rows_per_launch)  # fmt: skip
    check(stats, hidden.double() @ weight.double().T, labels, temperature, scale=5.0)
    assert runs["launches"] >= 1
    if extras:  # a bias sends the same head to the streaming kernel
        b = torch.randn(v, device="cuda", generator=gen).to(dtype)
        monkeypatch.undo()
        runs = only_fused_kernel(monkeypatch, "stream")
        stats = triton_fused.token_stats_fused_triton(hidden, weight, labels, b, temperature, -100)
        check(stats, hidden.double() @ weight.double().T + b.double(), labels, temperature, scale=5.0)
        assert runs["launches"] >= 1


def exact_head(seed: int, n: int, h: int, v: int, dtype: torch.dtype, neg_inf: bool):
    """A head-sized problem on the GPU whose fp32-accumulated logits are exact (hidden k/8, |k| <= 16; weight
    j/256, |j| <= 16; bias i/8: products are multiples of 2^-11 and every partial sum stays below 2^9 for H <= 4096),
    so the float64 reference rounds the very logits the kernel rounds; with ``neg_inf`` 5 % of the bias is -inf
    (never at a label)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randint(-16, 17, (n, h), device="cuda", generator=g) / 8).to(dtype)
    weight = (torch.randint(-16, 17, (v, h), device="cuda", generator=g) / 256).to(dtype)
    bias = (torch.randint(-8, 9, (v,), device="cuda", generator=g) / 8).to(dtype)
    labels = make_labels(seed, n, v)
    if neg_inf:
        bias[torch.rand(v, device="cuda", generator=g) < 0.05] = float("-inf")
        labels = torch.where((labels >= 0) & torch.isinf(bias[labels.clamp(min=0)]), 0, labels)
        bias[0] = 0.0
    return hidden, weight, bias, labels


@pytest.mark.parametrize(
    ("n", "h", "v", "dtype", "bias", "logits_dtype", "t_low", "temperature"),
    [
        (4096, 896, 151936, torch.bfloat16, False, torch.bfloat16, False, 1.0),
        (4096, 896, 151936, torch.float16, False, torch.float16, True, 0.7),
        (4096, 1536, 151936, torch.bfloat16, True, torch.bfloat16, True, 0.7),  # a bias: the streaming kernel
        (4096, 3584, 152064, torch.float16, True, torch.float16, True, 0.7),
        (4096, 3584, 152064, torch.bfloat16, True, torch.bfloat16, True, 1.3),
        (4096, 896, 151936, torch.float16, False, None, False, 1.0),
        (4096, 3584, 152064, torch.bfloat16, False, None, False, 1.0),
        (4096, 5120, 152064, torch.bfloat16, True, torch.bfloat16, True, 0.9),
        (4096, 2048, 151936, torch.float16, False, None, False, 1.0),
        # on a 132-SM H200: a body of 66 row blocks in groups of one wave, then the 62 left (stream_slices)
        (16384, 896, 151936, torch.bfloat16, False, torch.bfloat16, True, 1.3),
        (16384, 2048, 151936, torch.float16, False, None, False, 1.0),  # 99 + 29 row blocks there
    ],
)
def test_fused_stream_kernel_at_head_shapes_matches_float64(monkeypatch, n, h, v, dtype, bias, logits_dtype, t_low,
                                                            temperature):
    """The public call on Qwen2.5 head shapes runs the streaming kernel (below H 3072 on an sm_90 card the Gluon
    kernel, unless the head has a bias) with its default launches
    (:func:`stream_slices`: one, or a body and a tail) and matches float64 on 64 rows spread over the batch: with
    rounding, the float64 statistics of the rounded exact logits (the label logit as the tile rounds it); without,
    those of the unrounded logits of random inputs (fp32 accumulation over H: the tolerance of
    test_fused_from_hidden_matches_float64)."""
    from rounding_reference import rounded_reference

    from entropy_discriminator.kernels import triton_fused

    gluon = h < triton_fused.EXACT_WAVE_FROM_H and not bias and gluon_runs()
    runs = only_fused_kernel(monkeypatch, "gluon" if gluon else "stream")
    planned = []
    real_slices = triton_fused.stream_slices
    monkeypatch.setattr(triton_fused, "stream_slices", lambda *a: planned.append(real_slices(*a)) or planned[-1])
    if logits_dtype is not None:
        hidden, weight, b, labels = exact_head(n + h, n, h, v, dtype, neg_inf=bias)
        b = b if bias else None
    else:
        g = torch.Generator(device="cuda").manual_seed(n + h)
        hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
        weight = (torch.randn(v, h, device="cuda", generator=g) * (4 / h**0.5)).to(dtype)
        b, labels = None, make_labels(n, n, v)
    poison(n)
    kw = dict(bias=b, temperature=temperature, logits_dtype=logits_dtype, temperature_in_logits_dtype=t_low)
    stats = ed.token_stats_from_hidden(hidden, weight, labels, impl="triton", **kw)
    idx = torch.linspace(0, n - 1, 64, device="cuda").long()
    if logits_dtype is not None:
        ref = rounded_reference(hidden[idx], weight, b, labels[idx], temperature, logits_dtype, t_low)
        check_rows(stats, idx, ref, labels, scale=2.0)  # exact logits: fp32 sums over V alone
    else:
        ref = reference_token_stats(hidden[idx].double() @ weight.double().T, labels[idx], temperature)
        check_rows(stats, idx, ref, labels, scale=5.0)
    again = ed.token_stats_from_hidden(hidden, weight, labels, impl="triton", **kw)
    assert torch.equal(again.s_centered, stats.s_centered)
    assert len(planned) == 2 and runs["launches"] == 2 * len(planned[0])
    if n == 16384 and torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert len(planned[0]) == 2, planned[0]  # the split ran: both launches are in the rows checked


@pytest.mark.parametrize(
    ("n", "h", "v", "dtype", "bias", "logits_dtype", "rows_per_launch"),
    [
        (700, 512, 9001, torch.bfloat16, False, None, 256),
        (2048, 896, 151936, torch.bfloat16, True, torch.bfloat16, None),
        (1024, 3584, 152064, torch.float16, True, torch.float16, None),
    ],
)
def test_fused_stream_and_per_tile_kernels_agree(n, h, v, dtype, bias, logits_dtype, rows_per_launch):
    """The streaming kernel (its plan, row slices), the Gluon kernel where it runs, and the per-tile pointer kernel
    give the same statistics to fp32 rounding, the same ``valid`` and error counters."""
    from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton

    g = torch.Generator(device="cuda").manual_seed(11 + h)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * (4 / h**0.5)).to(dtype)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    labels = make_labels(n, n, v)
    kw = dict(logits_dtype=logits_dtype, rows_per_launch=rows_per_launch)
    per = token_stats_fused_triton(hidden, weight, labels, b, 0.8, -100, config={"stream": 0}, **kw)
    stream = token_stats_fused_triton(hidden, weight, labels, b, 0.8, -100, config={"stream": 1, "gluon": 0}, **kw)
    default = token_stats_fused_triton(hidden, weight, labels, b, 0.8, -100, **kw)  # the Gluon kernel below H 3072
    for other in (stream, default):  # the label logits: one kernel for all three (triton_fused._label_kernel)
        for a, c in zip(per[:5], other[:5]):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        assert torch.equal(per.valid, other.valid) and torch.equal(per.errors, other.errors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", [{"stream": 0}, {"stream": 1, "gluon": 0}, {"stream": 1}])
def test_fused_kernels_count_bad_rows_on_gpu(kernel, dtype):
    """Compiled, the kernels (per-tile, streaming, and the default: the Gluon kernel on sm_90) count all -inf rows,
    NaN / +inf rows (a NaN logit in one tile of a chunk among finite ones too: the running max propagates NaN) and
    labels outside [0, V); ignored rows stay 0."""
    from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton

    g = torch.Generator(device="cuda").manual_seed(3)
    n, h, v = 300, 64, 9001
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.3).to(dtype)
    weight[:, 0] = weight[:, 0].abs() + 0.25
    hidden[0], hidden[1] = 0.0, 0.0
    hidden[0, 0], hidden[1, 0] = -math.inf, math.inf  # every logit -inf; every logit +inf
    hidden[2, 5] = math.nan
    hidden[3, 5] = math.nan  # ignored below
    labels = make_labels(4, n, v, ignore_frac=0.0)
    labels[3], labels[4], labels[5] = -100, v, -3
    cfg = {**kernel, "chunks": 5}
    stats = token_stats_fused_triton(hidden, weight, labels, None, 1.0, -100, config=cfg)
    assert stats.errors.tolist() == [2, 2, 1, 0]
    for name in FIELDS:
        got = getattr(stats, name)
        assert torch.isnan(got[[0, 1, 2, 4, 5]]).all() and got[3] == 0 and not torch.isnan(got[6:]).any(), name
    bias = torch.zeros(v, device="cuda", dtype=dtype)
    bias[5000] = math.nan  # one NaN logit per row, mid-vocabulary
    stats = token_stats_fused_triton(hidden[6:], weight, labels[6:], bias, 1.0, -100, config=cfg)
    assert stats.errors.tolist() == [0, n - 6, 0, 0]


def test_streaming_kernel_occupancy_on_hopper():
    """The default 128 x 256 x 64 tiles (3 stages: 148 KB of shared memory) fit once per SM, 128 x 128 with 4 warps
    (98 KB) twice: the wave the plan fills (one program per SM for the default)."""
    from entropy_discriminator.kernels import triton_fused

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the streaming kernel needs Hopper or newer")
    hidden = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    weight = torch.randn(5000, 512, device="cuda").to(torch.bfloat16)
    labels = make_labels(1, 256, 5000)
    triton_fused._OCCUPANCY.clear()
    triton_fused.token_stats_fused_triton(hidden, weight, labels, None, 1.0, -100, config={"gluon": 0})
    assert list(triton_fused._OCCUPANCY.values()) == [1]
    triton_fused.token_stats_fused_triton(hidden, weight, labels, None, 1.0, -100, config={"bn": 128, "num_warps": 4})
    assert sorted(triton_fused._OCCUPANCY.values()) == [1, 2]


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 700),
    h=st.sampled_from([64, 136, 896]),
    v=st.integers(2, 5000),
    scale=st.sampled_from([2.0**-6, 1.0, 4.0]),  # flat, moderate and peaked rows
    t_low=st.booleans(),
    neg_inf=st.booleans(),
    temperature=st.sampled_from([1.0, 0.7]),
)
@example(seed=0, n=106, h=896, v=2, scale=4.0, t_low=False, neg_inf=False, temperature=0.7)  # fp32 log2(e) / T
def test_fused_kernel_rounds_bf16_logits_on_gpu(seed, n, h, v, scale, t_low, neg_inf, temperature):
    """``logits_dtype=bf16`` in the compiled kernel (streaming TMA kernel when H allows it) against the
    float64 statistics of the rounded logits (exact fp32 products: tests/rounding_reference.py), and
    at least as accurate as the chunked torch path (cuBLAS bf16 GEMM)."""
    from rounding_reference import exact_problem, rounded_reference

    hid, w, b, labels = exact_problem(seed, n, h, v, torch.bfloat16, scale, neg_inf)
    ref = rounded_reference(hid, w, b, labels, temperature, torch.bfloat16, t_low)
    kw = dict(bias=b.cuda(), temperature=temperature, logits_dtype=torch.bfloat16, temperature_in_logits_dtype=t_low)
    fast = ed.token_stats_from_hidden(hid.cuda(), w.cuda(), labels.cuda(), impl="triton", **kw)
    naive = ed.token_stats_from_hidden(hid.cuda(), w.cuda(), labels.cuda(), impl="torch", **kw)
    for name in ("logp", "entropy", "s_star", "s_expected", "s_centered"):
        err = float((getattr(fast, name).double().cpu() - ref[name]).abs().max())
        naive_err = float((getattr(naive, name).double().cpu() - ref[name]).abs().max())
        assert err <= max(3e-5, 2 * naive_err), name
