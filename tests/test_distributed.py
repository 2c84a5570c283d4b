"""2- and 3-process gloo runs on CPU equal one process on the concatenated batch.

Shards are uneven and one is empty; the keep-masks, counts and percentiles must be identical, the
float metrics equal to float64 rounding (sums are added in another order).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import entropy_discriminator as ed

B, T, V = 8, 13, 37
SHARDS = {2: [2, 6], 3: [3, 0, 5]}  # rows per rank
VOCAB_SHARDS = {2: [20, 17], 3: [10, 15, 12]}


def full_batch():
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(B, T, V, generator=g) * 3
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, -3:] = -100  # padding
    seq_adv = torch.randn(B, generator=g)
    tok_adv = torch.randn(B, T, generator=g)
    ratio = 1 + 0.2 * torch.rand(B, T, generator=g)
    return logits, labels, seq_adv, tok_adv, ratio


def compute(logits, labels, seq_adv, tok_adv, ratio, group):
    """Everything a training step computes, over ``group`` (None: one process)."""
    stats = ed.token_stats(logits, labels)
    out = {"stats": stats}
    masks = {
        "b_seq": ed.clip_b_mask(stats.s_star, seq_adv, stats.valid, mu_low=0.7, sides="both", process_group=group),
        "b_tok": ed.clip_b_mask(stats.s_star, tok_adv, stats.valid, mu_low=0.5, mu_high=1.0, process_group=group),
        "v_cap": ed.clip_v_mask(stats.s_centered, seq_adv, stats.valid, mu_low=0.3, max_frac=0.02, process_group=group),
        "v_tok": ed.clip_v_mask(stats.s_centered, tok_adv, stats.valid, mu_low=1.0, max_frac=None, process_group=group),
    }
    out["masks"] = masks
    mon = ed.EntropyMonitor(process_group=group)
    out["metrics"] = mon.from_stats(stats, advantages=seq_adv, mask=masks["v_cap"], ratio=ratio, lr=0.5)
    out["realised"] = mon.realised(stats.entropy, stats.entropy * 0.9, stats.valid)
    out["dh"] = ed.batch_entropy_change(tok_adv, stats.s_centered, stats.valid, lr=0.5, ratio=ratio, process_group=group)
    return out


def _worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logits, labels, seq_adv, tok_adv, ratio = full_batch()
        lo = sum(SHARDS[world][:rank])
        rows = slice(lo, lo + SHARDS[world][rank])
        res = compute(logits[rows], labels[rows], seq_adv[rows], tok_adv[rows], ratio[rows], dist.group.WORLD)
        v_lo = sum(VOCAB_SHARDS[world][:rank])
        v_rows = slice(v_lo, v_lo + VOCAB_SHARDS[world][rank])
        vp = ed.token_stats(logits[..., v_rows], labels, vocab_parallel_group=dist.group.WORLD, vocab_start_index=v_lo)
        torch.save({"res": res, "vp": vp}, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_batch_equals_one_process(world, tmp_path):
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    logits, labels, seq_adv, tok_adv, ratio = full_batch()
    single = compute(logits, labels, seq_adv, tok_adv, ratio, None)

    for name, want in single["masks"].items():
        got_keep = torch.cat([p["res"]["masks"][name].keep for p in parts])
        assert torch.equal(got_keep, want.keep), name
        assert want.n_clipped > 0, f"{name}: the case must clip something to be a test"
        for p in parts:
            got = p["res"]["masks"][name]
            assert (got.n_valid, got.n_clipped, got.n_clipped_pos, got.n_clipped_neg, got.capped) == (
                want.n_valid, want.n_clipped, want.n_clipped_pos, want.n_clipped_neg, want.capped
            ), name
            assert got.std == pytest.approx(want.std, rel=1e-12) and got.center == pytest.approx(want.center, rel=1e-12)
    assert single["masks"]["v_cap"].capped

    for p in parts:
        got = p["res"]["metrics"]
        assert set(got) == set(single["metrics"])
        for key, value in single["metrics"].items():
            if re.search(r"/p\d+$|tokens/|n_clipped", key):
                assert got[key] == value, key
            else:
                assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-15), key
        assert p["res"]["realised"] == pytest.approx(single["realised"], rel=1e-12)
        assert p["res"]["dh"] == pytest.approx(single["dh"], rel=1e-10)

    for p in parts:  # vocabulary-parallel statistics equal the full-vocabulary ones on every rank
        for name in ("logp", "entropy", "s_star", "s_expected", "s_centered"):
            torch.testing.assert_close(getattr(p["vp"], name), getattr(single["stats"], name), atol=2e-6, rtol=1e-5)
        assert math.isfinite(float(p["vp"].s_centered.sum()))


# ---- a bad input on one rank: every rank raises the same error, promptly ----------------------------

FAIL_TIMEOUT_S = 60  # the backend's timeout; a rank left waiting in a collective would take this long


def _one_rank_bad_cases(rank: int):
    """``(name, call)`` pairs; only rank 1 passes a bad value (a NaN, a wrong shape, a bad number)."""
    g = torch.Generator().manual_seed(7 + rank)
    s = torch.randn(3, 5, generator=g)
    valid = torch.ones(3, 5, dtype=torch.bool)
    adv = torch.randn(3, generator=g)
    nan = s.clone()
    if rank == 1:
        nan[2, 4] = float("nan")
    short_adv = adv[:2] if rank == 1 else adv
    mu = -1.0 if rank == 1 else 1.0
    bad_valid = torch.full((3, 5), 2 if rank == 1 else 1)
    group = dist.group.WORLD
    mon = ed.EntropyMonitor(process_group=group)
    mask = ed.clip_b_mask(s, adv, valid)
    if rank == 1:  # torch itself fails on this rank (NotImplementedError: no data to copy)
        mask = dataclasses.replace(mask, keep=torch.ones(3, 5, dtype=torch.bool, device="meta"))
    return [
        ("clip_b nan", lambda: ed.clip_b_mask(nan, adv, valid, process_group=group)),
        ("clip_v shape", lambda: ed.clip_v_mask(s, short_adv, valid, process_group=group)),
        ("clip_v mu", lambda: ed.clip_v_mask(s, adv, valid, mu_low=mu, process_group=group)),
        ("clip_b valid", lambda: ed.clip_b_mask(s, adv, bad_valid, process_group=group)),
        ("monitor nan entropy", lambda: mon(entropy=nan.abs(), valid=valid, advantages=adv)),
        ("monitor nan s_centered", lambda: mon(entropy=s.abs(), valid=valid, advantages=adv, s_centered=nan)),
        ("monitor shape", lambda: mon(entropy=s.abs(), valid=valid, advantages=short_adv, s_star=s)),
        ("monitor lr", lambda: mon(entropy=s.abs(), valid=valid, advantages=adv, s_centered=s, lr=math.nan if rank else 0.1)),
        ("monitor torch error", lambda: mon(entropy=s.abs(), valid=valid, mask=mask)),
        ("realised nan", lambda: mon.realised(s, nan, valid)),
        ("dynamics nan", lambda: ed.batch_entropy_change(adv, nan, valid, lr=0.1, process_group=group)),
        ("dynamics shape", lambda: ed.batch_entropy_change(short_adv, s, valid, lr=0.1, process_group=group)),
    ]


def _run_bad_cases(rank: int) -> dict:
    """Each case's ``(exception type, message, seconds)``, and the agreed count of a good call after it."""
    import time

    out = {}
    for name, call in _one_rank_bad_cases(rank):
        start = time.perf_counter()
        try:
            call()
            out[name] = ("no error", "", time.perf_counter() - start)
        except (ValueError, TypeError, RuntimeError) as exc:
            out[name] = (type(exc).__name__, str(exc), time.perf_counter() - start)
        # the ranks are still in step: a good call afterwards agrees everywhere
        ok = ed.clip_b_mask(torch.ones(2, 2) * rank, torch.ones(2), torch.ones(2, 2), process_group=dist.group.WORLD)
        out[name + " then"] = ok.n_valid
    return out


def _bad_rank_worker(rank: int, world: int, port: int, path: str) -> None:
    import datetime
    import gc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=FAIL_TIMEOUT_S))
    try:
        torch.save(_run_bad_cases(rank), f"{path}/bad{rank}.pt")
    finally:
        # No reference to the group may outlive it: gloo aborts the process ("terminate called
        # without an active exception") when a group object is freed at interpreter exit.
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.distributed
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank(tmp_path):
    mp.spawn(_bad_rank_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"bad{r}.pt", weights_only=False) for r in range(2))
    needles = {"clip_b nan": "s_star contains NaN", "clip_v shape": "advantages", "clip_v mu": "mu_low",
               "clip_b valid": "valid must hold only 0 and 1", "monitor nan entropy": "entropy contains NaN",
               "monitor nan s_centered": "s_centered contains NaN", "monitor shape": "advantages", "monitor lr": "lr",
               "monitor torch error": "meta",
               "realised nan": "entropy_after contains NaN", "dynamics nan": "s_centered contains NaN",
               "dynamics shape": "advantages"}
    assert set(needles) | {k + " then" for k in needles} == set(r0)
    for name, needle in needles.items():
        (kind0, msg0, t0), (kind1, msg1, t1) = r0[name], r1[name]
        assert kind0 == kind1 != "no error", name
        assert msg0 == msg1 and needle in msg0, (name, msg0, msg1)
        assert max(t0, t1) < 10, f"{name}: {t0:.1f} s / {t1:.1f} s, a rank waited in a collective"
        assert r0[name + " then"] == r1[name + " then"] == 8
