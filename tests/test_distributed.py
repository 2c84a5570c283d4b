"""2- and 3-process gloo runs on CPU equal one process on the concatenated batch.

Shards are uneven and one is empty; the keep-masks, counts and percentiles must be identical, the
float metrics equal to float64 rounding (sums are added in another order).
"""

from __future__ import annotations

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
