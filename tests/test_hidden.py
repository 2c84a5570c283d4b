"""token_stats_from_hidden (torch path, CPU) against the float64 reference of the full logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_token_stats
from rounding_reference import exact_problem, rounded_reference

from entropy_discriminator.hidden import token_stats_from_hidden

FIELDS = ("logp", "entropy", "s_star", "s_expected", "s_centered")


def _problem(seed: int, n: int, h: int, v: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 4).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.25] = -100
    return hidden, weight, b, labels


@pytest.mark.parametrize(
    ("n", "h", "v", "dtype", "bias", "temperature", "chunk"),
    [
        (33, 16, 500, torch.float32, False, 1.0, None),
        (33, 16, 500, torch.bfloat16, True, 0.7, 4),
        (10, 8, 3, torch.float16, True, 1.5, 1),
        (0, 8, 50, torch.float32, False, 1.0, None),
    ],
)
def test_torch_path_matches_reference_on_materialised_logits(n, h, v, dtype, bias, temperature, chunk):
    hidden, weight, b, labels = _problem(n + v, n, h, v, dtype, bias)
    stats = token_stats_from_hidden(
        hidden, weight, labels, bias=b, temperature=temperature, chunk_size=chunk, impl="torch"
    )
    logits = hidden.double() @ weight.double().T + (b.double() if bias else 0.0)
    ref = reference_token_stats(logits, labels, temperature)
    for name in FIELDS:
        got = getattr(stats, name)
        assert got.dtype == torch.float32 and got.shape == labels.shape
        err = (got.double() - ref[name]).abs()
        assert err.numel() == 0 or float(err.max()) <= 3e-5, name
    assert torch.equal(stats.valid, labels != -100)


def test_leading_dimensions_are_kept():
    hidden, weight, _, labels = _problem(1, 12, 8, 40, torch.float32, False)
    stats = token_stats_from_hidden(hidden.view(3, 4, 8), weight, labels.view(3, 4), chunk_size=5)
    flat = token_stats_from_hidden(hidden, weight, labels)
    assert stats.entropy.shape == (3, 4)
    torch.testing.assert_close(stats.entropy.reshape(-1), flat.entropy)


def test_chunking_never_materialises_more_than_chunk_rows(monkeypatch):
    import entropy_discriminator.hidden as hidden_mod

    seen = []
    real_linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        seen.append(x.shape[0])
        return real_linear(x, w, b)

    monkeypatch.setattr(hidden_mod.torch.nn.functional, "linear", spy)
    hidden, weight, _, labels = _problem(2, 23, 8, 40, torch.float32, False)
    token_stats_from_hidden(hidden, weight, labels, chunk_size=6)
    assert seen == [6, 6, 6, 5]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"weight": torch.zeros(5, 7)}, ValueError, "weight"),
        ({"labels": torch.zeros(3, dtype=torch.int64)}, ValueError, "labels"),
        ({"labels": torch.full((4,), 5)}, ValueError, r"\[0, 5\)"),
        ({"labels": torch.zeros(4)}, TypeError, "labels"),
        ({"bias": torch.zeros(4)}, ValueError, "bias"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"impl": "cuda"}, ValueError, "impl"),
        ({"impl": "triton"}, RuntimeError, "CUDA"),
        ({"hidden": torch.zeros(4, 8, dtype=torch.int32)}, TypeError, "hidden"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, exc, match):
    args = {"hidden": torch.zeros(4, 8), "weight": torch.zeros(5, 8), "labels": torch.zeros(4, dtype=torch.int64)}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        token_stats_from_hidden(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def test_nan_hidden_state_is_rejected():
    hidden, weight, _, labels = _problem(3, 4, 8, 20, torch.float32, False)
    labels[:] = 1
    hidden[2, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        token_stats_from_hidden(hidden, weight, labels)


# ------------------------------------------------------------------------------ logits rounding


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 40),
    h=st.integers(1, 48),
    v=st.integers(2, 300),
    in_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    logits_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    scale=st.sampled_from([2.0**-6, 1.0, 4.0]),  # flat, moderate and peaked rows
    t_low=st.booleans(),
    neg_inf=st.booleans(),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    chunk=st.sampled_from([None, 1, 7]),
)
def test_rounded_logits_match_float64_reference(seed, n, h, v, in_dtype, logits_dtype, scale, t_low, neg_inf,
                                                temperature, chunk):
    hidden, weight, bias, labels = exact_problem(seed, n, h, v, in_dtype, scale, neg_inf)
    stats = token_stats_from_hidden(
        hidden, weight, labels, bias=bias, temperature=temperature, chunk_size=chunk, impl="torch",
        logits_dtype=logits_dtype, temperature_in_logits_dtype=t_low,
    )
    ref = rounded_reference(hidden, weight, bias, labels, temperature, logits_dtype, t_low)
    for name in FIELDS:
        err = (getattr(stats, name).double() - ref[name]).abs()
        assert float(err.max()) <= 3e-5 * max(1.0, float(ref["entropy"].abs().max())), name
    assert torch.equal(stats.valid, labels != -100)


def test_rounding_changes_the_statistics_it_should():
    """The option is not a no-op: unrounded statistics of peaked bf16 logits miss the reference."""
    hidden, weight, bias, labels = exact_problem(3, 64, 48, 257, torch.bfloat16, 4.0, False)
    ref = rounded_reference(hidden, weight, bias, labels, 0.7, torch.bfloat16, False)
    plain = token_stats_from_hidden(hidden, weight, labels, bias=bias, temperature=0.7, impl="torch")
    assert float((plain.logp.double() - ref["logp"]).abs().max()) > 1e-3


def test_fp32_logits_dtype_is_the_unrounded_path():
    hidden, weight, bias, labels = _problem(5, 20, 16, 90, torch.float32, True)
    a = token_stats_from_hidden(hidden, weight, labels, bias=bias, temperature=0.9, impl="torch")
    b = token_stats_from_hidden(hidden, weight, labels, bias=bias, temperature=0.9, impl="torch",
                                logits_dtype=torch.float32, temperature_in_logits_dtype=True)
    for name in FIELDS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logits_dtype": torch.float64}, "logits_dtype"),
        ({"logits_dtype": "bf16"}, "logits_dtype"),
        ({"temperature_in_logits_dtype": True}, "temperature_in_logits_dtype"),
        ({"logits_dtype": torch.bfloat16, "temperature_in_logits_dtype": 1}, "temperature_in_logits_dtype"),
    ],
)
def test_bad_rounding_arguments_name_the_argument(kwargs, match):
    hidden, weight, _, labels = _problem(0, 4, 8, 10, torch.float32, False)
    with pytest.raises(ValueError, match=match):
        token_stats_from_hidden(hidden, weight, labels, **kwargs)
