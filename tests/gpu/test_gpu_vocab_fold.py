"""VocabFold's Triton kernel on CUDA tiles: the float64 statistics of the whole rows (bf16/fp32,
peaked and flat rows, -inf entries, tiles that do not divide the rows or the vocabulary)."""

from __future__ import annotations

import math

import pytest
import torch

from test_vocab_fold import check_against_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("peaked", [True, False])
def test_triton_fold_matches_float64_reference(dtype, peaked):
    g = torch.Generator().manual_seed(int(peaked) * 7 + (dtype == torch.float32))
    n, v = 300, 5003
    x = torch.randn(n, v, generator=g) * (8.0 if peaked else 0.05)
    labels = torch.randint(0, v, (n,), generator=g)
    drop = torch.rand(n, v, generator=g) < 0.2
    drop[torch.arange(n), labels] = False
    x = x.masked_fill(drop, -math.inf).to(dtype).cuda()
    check_against_reference(x, labels.cuda(), 128, 2000, 0.7, 1.0, impl="triton")
