"""VocabFold: statistics folded over vocabulary tiles equal the float64 statistics of the whole rows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_token_stats

from entropy_discriminator.vocab_fold import VocabFold

FIELDS = ("logp", "entropy", "s_star", "s_expected")


def fold_in_tiles(x: torch.Tensor, labels: torch.Tensor, rows: int, cols: int, temperature: float, scale: float,
                  impl: str = "torch") -> dict[str, torch.Tensor]:
    """The statistics of ``x`` [N, V] through VocabFold, fed in [rows, cols] tiles, token chunks outer."""
    fold = VocabFold(x.shape[0], x.device, temperature=temperature, scale=scale, impl=impl)
    for r in range(0, x.shape[0], rows):
        for c in range(0, x.shape[1], cols):
            fold.fold(x[r : r + rows, c : c + cols], labels[r : r + rows], r, c)
    return dict(zip(FIELDS, fold.finish()))


def check_against_reference(x, labels, rows, cols, temperature, scale, impl="torch"):
    got = fold_in_tiles(x, labels, rows, cols, temperature, scale, impl)
    ref = reference_token_stats(x.double() * scale, labels, temperature=temperature)
    for name in FIELDS:
        r, g = ref[name].cpu(), got[name].double().cpu()
        assert torch.isfinite(g).all(), name
        # fp32 sums over V terms: ~1e-6 relative; E_p[S] and S* against their own scale (they can be ~0), plus
        # what the logp and entropy tolerances allow S* = p_k (H + log p_k) to move when H + log p_k nearly cancels
        lp, h = ref["logp"].cpu(), ref["entropy"].cpu()
        cancel = lp.exp() * 2e-5 * (2 + h.abs() + lp.abs())
        tol = 2e-5 * (1 + r.abs()) if name in ("logp", "entropy") else 2e-4 * (r.abs() + ref["s_star"].abs().cpu().max() + 1e-6) + cancel
        assert ((g - r).abs() <= tol).all(), (name, float((g - r).abs().max()))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 9), v=st.integers(2, 300), rows=st.integers(1, 5), cols=st.integers(1, 97),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]), peaked=st.booleans(), masked=st.booleans(),
    temperature=st.sampled_from([1.0, 0.7]), scale=st.sampled_from([1.0, 0.5]), seed=st.integers(0, 2**31 - 1),
)
def test_fold_matches_float64_reference(n, v, rows, cols, dtype, peaked, masked, temperature, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * (8.0 if peaked else 0.05)
    labels = torch.randint(0, v, (n,), generator=g)
    if masked:  # -inf entries (masked vocabulary), never at the label, never a whole row
        drop = torch.rand(n, v, generator=g) < 0.3
        drop[torch.arange(n), labels] = False
        x = x.masked_fill(drop, -math.inf)
    check_against_reference(x.to(dtype), labels, rows, cols, temperature, scale)


def test_fold_refuses_a_tile_outside_its_tokens():
    fold = VocabFold(4, "cpu")
    with pytest.raises(ValueError, match="does not fit 4 tokens"):
        fold.fold(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), 2, 0)
    with pytest.raises(ValueError, match="temperature"):
        VocabFold(4, "cpu", temperature=0.0)
    with pytest.raises(ValueError, match="impl"):
        VocabFold(4, "cpu", impl="cuda")
