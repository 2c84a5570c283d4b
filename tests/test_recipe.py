"""``mu_for_share``: the mu it returns makes the real masks clip the count a float64 reference says is reachable and
nearest the target; bad targets are refused by name; ``suggest-mu`` reads a saved batch."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import entropy_discriminator as ed
from entropy_discriminator.__main__ import main
from entropy_discriminator.recipe import load_batch

MASKS = {"clip_b": ed.clip_b_mask, "clip_v": ed.clip_v_mask}
SIGN = {"negative": -1, "positive": 1}


def reference_count(scores, advantages, valid, method, sides, target) -> tuple[int, int, float, float]:
    """Float64 reference: (count nearest target * n among the reachable ones, ties to fewer; the count mu = 0 clips;
    centre; sigma), from the definition of the masks (population mean / std over the valid tokens)."""
    x = scores.double().numpy()
    v = valid.bool().numpy()
    a = np.broadcast_to(advantages.double().numpy().reshape(advantages.shape + (1,) * (x.ndim - advantages.ndim)), x.shape)
    vals = x[v]
    n = vals.size
    center = vals.mean() if method == "clip_b" else 0.0
    sigma = math.sqrt(((vals - vals.mean()) ** 2).mean())
    side = (a != 0) if sides == "both" else (np.sign(a) == SIGN[sides])
    below = np.sort(x[v & side & (x < center)])
    reachable = {0, below.size} | {c for c in range(1, below.size) if below[c - 1] < below[c]}
    if sigma <= 1e-12:
        reachable = {0}
    wanted = Fraction(repr(target)) * n
    best = min(reachable, key=lambda c: (abs(c - wanted), c))
    return best, max(reachable), center, sigma


@st.composite
def batches(draw):
    rows, cols = draw(st.integers(1, 12)), draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    tied = draw(st.booleans())  # integer-valued scores: many ties
    scores = (torch.randint(-3, 4, (rows, cols), generator=g).double() if tied else
              torch.randn(rows, cols, generator=g, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 30.0])))
    per_token = draw(st.booleans())
    adv_shape = (rows, cols) if per_token else (rows,)
    advantages = torch.randint(-2, 3, adv_shape, generator=g).double()  # zeros included: never clipped
    valid = torch.rand(rows, cols, generator=g) < draw(st.sampled_from([0.5, 1.0]))
    return scores.to(dtype), advantages, valid


@settings(max_examples=150, deadline=None)
@given(batch=batches(), method=st.sampled_from(["clip_b", "clip_v"]), sides=st.sampled_from(["negative", "positive", "both"]),
       target=st.floats(0.001, 0.6))
def test_mu_reproduces_the_reference_count_with_the_real_mask(batch, method, sides, target):
    scores, advantages, valid = batch
    if not valid.any():
        return
    best, most, _, _ = reference_count(scores, advantages, valid, method, sides, target)
    n = int(valid.sum())
    if target > most / n:
        with pytest.raises(ValueError, match="target_share must be at most"):
            ed.mu_for_share(scores, advantages, valid, target_share=target, method=method, sides=sides)
        return
    found = ed.mu_for_share(scores, advantages, valid, target_share=target, method=method, sides=sides)
    assert found.n_clipped == best, (found, best)
    assert found.n_valid == n and found.share == best / n and found.max_share == most / n
    assert found.mu >= 0 and math.isfinite(found.mu)
    real = MASKS[method](scores, advantages, valid, mu_low=found.mu, sides=sides)
    assert real.n_clipped == found.n_clipped


def test_a_typical_batch_hits_the_target_exactly():
    """Continuous scores, 1000 valid tokens: 2 % is 20 tokens, and both masks clip exactly 20 with the returned mu."""
    g = torch.Generator().manual_seed(1)
    scores, advantages = torch.randn(50, 20, generator=g), torch.randn(50, generator=g)
    valid = torch.ones(50, 20, dtype=torch.bool)
    for method, mask in MASKS.items():
        found = ed.mu_for_share(scores, advantages, valid, target_share=0.02, method=method)
        assert (found.n_clipped, found.share) == (20, 0.02)
        assert mask(scores, advantages, valid, mu_low=found.mu).n_clipped == 20
        assert len(repr(found.mu)) <= 8  # the shortest decimal in the interval, not a 17-digit float


def test_ties_pick_the_nearest_reachable_count():
    """Scores -2 (x3), -1 (x3) and 0 .. at target 2 of 12: 3 is reachable, 2 is not; nearest is 3 (|3-2| < |0-2|)."""
    scores = torch.tensor([[-2.0, -2.0, -2.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]])
    advantages = torch.full((1,), -1.0)
    valid = torch.ones_like(scores, dtype=torch.bool)
    found = ed.mu_for_share(scores, advantages, valid, target_share=2 / 12, method="clip_v")
    assert found.n_clipped == 3
    assert ed.clip_v_mask(scores, advantages, valid, mu_low=found.mu).n_clipped == 3


@pytest.mark.parametrize("target", [0, 1, -0.1, 1.5, float("nan"), float("inf")])
def test_targets_outside_the_open_unit_interval_are_refused_by_name(target):
    with pytest.raises(ValueError, match="target_share"):
        ed.mu_for_share(torch.randn(4, 4), torch.randn(4), torch.ones(4, 4), target_share=target)


def test_bad_arguments_are_refused_by_name():
    scores, adv, valid = torch.randn(4, 4), torch.randn(4), torch.ones(4, 4)
    with pytest.raises(TypeError, match="target_share"):
        ed.mu_for_share(scores, adv, valid, target_share="0.1")
    with pytest.raises(ValueError, match="method"):
        ed.mu_for_share(scores, adv, valid, target_share=0.1, method="clip_x")
    with pytest.raises(ValueError, match="sides"):
        ed.mu_for_share(scores, adv, valid, target_share=0.1, sides="neg")
    with pytest.raises(ValueError, match="valid marks no token"):
        ed.mu_for_share(scores, adv, torch.zeros(4, 4), target_share=0.1)
    with pytest.raises(ValueError, match="target_share must be at most 0 "):  # no negative advantage: nothing to clip
        ed.mu_for_share(scores, adv.abs() + 1, valid, target_share=0.1)
    with pytest.raises(ValueError, match="s_star"):  # the masks' own checks apply (NaN at a valid position)
        ed.mu_for_share(torch.full((4, 4), float("nan")), adv, valid, target_share=0.1)


def test_suggest_mu_reads_a_saved_batch(tmp_path, capsys):
    g = torch.Generator().manual_seed(2)
    s_star, s_c = torch.randn(32, 8, generator=g), torch.randn(32, 8, generator=g)
    adv, valid = torch.randn(32, generator=g), torch.rand(32, 8, generator=g) < 0.9
    path = ed.save_batch(tmp_path / "batch.pt", s_star=s_star, s_centered=s_c, advantages=adv, valid=valid)
    assert all(torch.equal(a, b) for a, b in zip(load_batch(path).values(), (s_star, s_c, adv, valid)))
    assert main(["suggest-mu", "--batch", str(path), "--target-share", "0.05"]) == 0
    out = capsys.readouterr().out
    for method, scores in (("clip_b", s_star), ("clip_v", s_c)):
        mu = ed.mu_for_share(scores, adv, valid, target_share=0.05, method=method).mu
        assert f"{method}: mu_low {mu:g} clips" in out
    assert main(["suggest-mu", "--batch", str(path), "--target-share", "0.99"]) == 2
    assert "target_share must be at most" in capsys.readouterr().err
    torch.save({"s_star": s_star}, tmp_path / "partial.pt")
    assert main(["suggest-mu", "--batch", str(tmp_path / "partial.pt")]) == 2
    assert "lacks s_centered, advantages, valid" in capsys.readouterr().err
    assert main(["suggest-mu", "--batch", str(path), "--target-share", "1"]) == 2
    assert main(["suggest-mu", "--batch", str(tmp_path / "missing.pt")]) == 2
    assert "no such file" in capsys.readouterr().err
