"""Masks, the autopilot's selection, monitor and dynamics on a CUDA device equal the same calls on the CPU
(``pytest -m gpu``).

The device paths (one stable sort for the capped top-k, one sort of integer keys for the
percentiles, checks folded into the first reduction) must give exactly the CPU's keep-masks,
counts and percentiles, and float metrics to float64 rounding.  Skipped where there is no CUDA
device (CPU CI); run through the device tool: ``python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import entropy_discriminator as ed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu tests/gpu on a CUDA machine)"),
]

MASK_INTS = ("n_valid", "n_valid_pos", "n_valid_neg", "n_clipped", "n_clipped_pos", "n_clipped_neg", "capped")


def batch(n: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    shape = (n // 512, 512)
    entropy = torch.rand(shape, generator=g) * 3
    entropy[0, :7] = torch.tensor([0.0, -0.0, 0.0, 1e-45, 2.5, 2.5, 2.5])  # ties, signed zero, subnormal
    out = {
        "entropy": entropy,
        "s_star": torch.randn(shape, generator=g) ** 3 * 0.05,
        "s_centered": torch.randn(shape, generator=g) ** 3 * 0.01,
        "valid": torch.rand(shape, generator=g) < 0.9,
        "adv": torch.randn(shape[0], generator=g),
        "tok_adv": torch.randn(shape, generator=g).round(),  # zeros and ties
        "ratio": 1 + 0.1 * torch.rand(shape, generator=g),
    }
    return {k: v.to(device) for k, v in out.items()}


def run_all(b: dict) -> dict:
    out = {}
    for name, adv in (("seq", b["adv"]), ("tok", b["tok_adv"])):
        out[f"b_{name}"] = ed.clip_b_mask(b["s_star"], adv, b["valid"], mu_low=1.0, sides="both")
        out[f"v_{name}"] = ed.clip_v_mask(b["s_centered"], adv, b["valid"], mu_low=0.5, max_frac=1e-3)
        out[f"v_{name}_cap0"] = ed.clip_v_mask(b["s_centered"], adv, b["valid"], mu_low=0.5, max_frac=0.0)
    mon = ed.EntropyMonitor(percentiles=(0.1, 7, 10, 50, 90, 99, 99.9, 100))
    out["metrics"] = mon(
        entropy=b["entropy"], valid=b["valid"], advantages=b["adv"], s_star=b["s_star"],
        s_centered=b["s_centered"], mask=out["v_seq"], ratio=b["ratio"], lr=0.1,
    )
    out["dh"] = ed.batch_entropy_change(b["tok_adv"], b["s_centered"], b["valid"], lr=0.1, ratio=b["ratio"])
    # the autopilot's ranked selection: the predicted change reversed, and a fixed 1 % share
    out["autopilot"] = ed.autopilot_mask(b["s_centered"], b["tok_adv"], b["valid"], lr=0.1, ratio=b["ratio"],
                                         target_dh=-out["dh"], sides="both", max_frac=None).mask
    out["fixed_share"] = ed.fixed_share_mask(b["s_centered"], b["adv"], b["valid"], share=0.01).mask
    return out


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


@pytest.mark.parametrize("n", [4096, 262144, 1048576])
def test_device_results_equal_cpu(n):
    gpu, cpu = run_all(batch(n, n, "cuda")), run_all(batch(n, n, "cpu"))
    for key, want in cpu.items():
        got = gpu[key]
        if isinstance(want, ed.MaskResult):
            assert torch.equal(got.keep.cpu(), want.keep), key
            assert all(getattr(got, f) == getattr(want, f) for f in MASK_INTS), key
            assert close(got.std, want.std) and close(got.lower, want.lower), key
        elif isinstance(want, dict):
            assert got.keys() == want.keys()
            for k, v in want.items():
                exact = re.search(r"/p[\d.]+$|tokens/|n_clipped|capped", k)
                assert (got[k] == v) if exact else close(got[k], v), (k, got[k], v)
        else:
            assert close(got, want), key
    assert cpu["v_seq"].capped and cpu["v_seq"].n_clipped == math.floor(cpu["v_seq"].n_valid / 1000)
    assert cpu["v_seq_cap0"].n_clipped == 0 and cpu["b_seq"].n_clipped > 0
    assert 0 < cpu["autopilot"].n_clipped < cpu["autopilot"].n_valid and not cpu["autopilot"].capped
    assert cpu["fixed_share"].n_clipped == math.floor(0.01 * cpu["fixed_share"].n_valid)


def test_nan_on_device_is_refused_naming_the_argument():
    b = batch(4096, 0, "cuda")
    b["s_star"][3, 5] = float("nan")
    b["valid"][3, 5] = True
    with pytest.raises(ValueError, match="s_star contains NaN or inf at 1 valid position"):
        ed.clip_b_mask(b["s_star"], b["adv"], b["valid"])
    with pytest.raises(ValueError, match="s_star contains NaN"):
        ed.EntropyMonitor()(entropy=b["entropy"], valid=b["valid"], s_star=b["s_star"])
