"""``stats_from_hidden`` scores only the valid completion positions (to cut the step cost): the rows of padding after
short completions are gathered out before the LM-head product, and the result equals scoring every row with the
padding ignored. Runs on the real ``GRPOTrainer`` (its LM head, temperature and precision rule)."""

from __future__ import annotations

import pytest
import torch
from _trl_harness import make_trainer, reference

import entropy_discriminator.adapters.trl._stats as ed_stats
from entropy_discriminator import token_stats_from_hidden

FIELDS = ("logp", "entropy", "s_star", "s_expected", "s_centered")


def _batch(trainer, rows: int, tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight, _ = ed_stats.lm_head(trainer)
    hidden = torch.randn(rows, tokens, weight.shape[1], generator=gen) * 3
    ids = torch.randint(weight.shape[0], (rows, tokens), generator=gen)
    lengths = torch.randint(0, tokens + 1, (rows,), generator=gen)
    lengths[0] = tokens  # one full row, and (seeded) some short and possibly empty ones
    valid = torch.arange(tokens)[None, :] < lengths[:, None]
    return hidden, ids, valid


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padding_is_not_scored_and_changes_nothing(tmp_path, monkeypatch, seed):
    trainer = make_trainer(tmp_path)
    hidden, ids, valid = _batch(trainer, rows=6, tokens=9, seed=seed)
    hidden[~valid] = float("nan")  # what a padded position holds must not matter
    seen = []

    def counting(h, *args, **kwargs):
        seen.append(h.shape[0])
        return token_stats_from_hidden(h, *args, **kwargs)

    monkeypatch.setattr(ed_stats, "token_stats_from_hidden", counting)
    stats = ed_stats.stats_from_hidden(trainer, hidden, ids, valid, chunk_size=None, impl="torch")
    assert seen == [int(valid.sum())]  # one product, over the valid rows only

    weight, bias = ed_stats.lm_head(trainer)
    logits = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    ref = reference.reference_token_stats(torch.nan_to_num(logits), ids.masked_fill(~valid, -100),
                                          temperature=trainer.temperature)
    assert torch.equal(stats.valid, valid)
    for f in FIELDS:
        got = getattr(stats, f)
        assert got.shape == valid.shape and torch.all(got[~valid] == 0), f
        assert torch.allclose(got[valid].double(), ref[f][valid], rtol=1e-5, atol=2e-6), f


def test_all_padding_gives_an_empty_batch(tmp_path):
    trainer = make_trainer(tmp_path)
    hidden, ids, valid = _batch(trainer, rows=3, tokens=4, seed=0)
    stats = ed_stats.stats_from_hidden(trainer, hidden, ids, torch.zeros_like(valid), chunk_size=None, impl="torch")
    assert not stats.valid.any() and all(torch.all(getattr(stats, f) == 0) for f in FIELDS)


def test_mismatched_shapes_are_refused(tmp_path):
    trainer = make_trainer(tmp_path)
    hidden, ids, valid = _batch(trainer, rows=3, tokens=4, seed=0)
    with pytest.raises(ValueError, match="hidden must be"):
        ed_stats.stats_from_hidden(trainer, hidden, ids[:, :3], valid, chunk_size=None, impl="torch")
    with pytest.raises(ValueError, match="hidden must be"):
        ed_stats.stats_from_hidden(trainer, hidden, ids, valid[:2], chunk_size=None, impl="torch")
