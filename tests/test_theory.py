"""The paper's first-order laws, checked by finite differences and exact expectations in float64."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_entropy

import entropy_discriminator as ed


def _row(seed: int, v: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(v, generator=g, dtype=torch.float64) * 2
    k = int(torch.randint(0, v, (1,), generator=g))
    return z, k


def _second_order_ratio(predict, perturb, z, eps):
    """|actual - predicted| at eps divided by the same at eps/2: ~4 for an O(eps^2) remainder."""
    errors = []
    for e in (eps, eps / 2):
        actual = float(reference_entropy(perturb(z, e)) - reference_entropy(z))
        errors.append(abs(actual - predict(e)))
    return errors[0] / errors[1], errors


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(2, 40))
def test_theorem1_single_logit_update(seed, v):
    z, k = _row(seed, v)
    stats = ed.token_stats(z[None], torch.tensor([k]))
    e_k = torch.nn.functional.one_hot(torch.tensor(k), v).to(torch.float64)
    ratio, errors = _second_order_ratio(
        lambda e: float(ed.entropy_change_logit(e, stats.s_star)[0]), lambda z, e: z + e * e_k, z, 1e-4
    )
    if errors[0] > 1e-12:  # a vanishing second-order term leaves only rounding
        assert 3.5 < ratio < 4.5, (ratio, errors)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(2, 40), sign=st.sampled_from([-1.0, 1.0]))
def test_theorem2_policy_gradient_step(seed, v, sign):
    z, k = _row(seed, v)
    stats = ed.token_stats(z[None], torch.tensor([k]))
    p = torch.softmax(z, -1)
    e_k = torch.nn.functional.one_hot(torch.tensor(k), v).to(torch.float64)
    ratio, errors = _second_order_ratio(
        lambda a: float(ed.entropy_change_step(sign * a, stats.s_star, stats.s_expected)[0]),
        lambda z, a: z + sign * a * (e_k - p),
        z,
        1e-4,
    )
    if errors[0] > 1e-12:
        assert 3.5 < ratio < 4.5, (ratio, errors)


def test_theorem2_direction_is_the_gradient_of_log_pk():
    """The step of Theorem 2 is alpha * grad_z log p_k: autograd agrees with e_k - p."""
    z, k = _row(3, 12)
    zz = z.clone().requires_grad_(True)
    torch.log_softmax(zz, -1)[k].backward()
    p = torch.softmax(z, -1)
    torch.testing.assert_close(zz.grad, torch.nn.functional.one_hot(torch.tensor(k), 12).double() - p)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(1, 60))
def test_corollary1_expected_centred_score_is_zero(seed, v):
    z, _ = _row(seed, v)
    stats = ed.token_stats(z.expand(v, v), torch.arange(v))  # every token of one row as the sample
    p = torch.softmax(z, -1)
    assert abs(float((p * stats.s_centered).sum())) < 1e-14
    assert abs(float((p * stats.s_star).sum() - stats.s_expected[0])) < 1e-14


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(2, 60))
def test_corollary1_1_off_policy_ratio_weighted_expectation_is_zero(seed, v):
    z, _ = _row(seed, v)
    z_sample = z + torch.randn(v, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    p, p_sample = torch.softmax(z, -1), torch.softmax(z_sample, -1)
    stats = ed.token_stats(z.expand(v, v), torch.arange(v))
    r = p / p_sample
    assert abs(float((p_sample * r * stats.s_centered).sum())) < 1e-14
    # ... while the unweighted off-policy expectation is not zero in general
    unweighted = float((p_sample * stats.s_centered).sum())
    assert abs(unweighted) > 1e-14 or v < 3


def test_corollary2_batch_mean_of_centred_score_is_orders_below_s_star():
    g = torch.Generator().manual_seed(0)
    n, v = 40000, 50
    z = torch.randn(n, v, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g, dtype=torch.float64) * 6
    labels = torch.multinomial(torch.softmax(z, -1), 1, generator=g)[:, 0]  # on-policy samples
    stats = ed.token_stats(z, labels)
    mean_sc = abs(float(stats.s_centered.mean()))
    mean_s = float(stats.s_star.abs().mean())
    assert mean_sc < 1e-2 * mean_s, (mean_sc, mean_s)
    # off-policy samples from a different distribution break it: the check can fail
    off = torch.multinomial(torch.softmax(-z, -1), 1, generator=g)[:, 0]
    assert abs(float(ed.token_stats(z, off).s_centered.mean())) > 1e-2 * mean_s


def test_corollary4_tabular_batch_step_matches_first_order_prediction():
    """One SGD step on the token-mean GRPO loss with per-token logits as parameters."""
    g = torch.Generator().manual_seed(1)
    n, v, lr = 256, 20, 1e-2
    z = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    labels = torch.multinomial(torch.softmax(z, -1), 1, generator=g)[:, 0]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    zz = z.clone().requires_grad_(True)
    loss = -(adv * torch.log_softmax(zz, -1).gather(-1, labels[:, None])[:, 0]).mean()
    loss.backward()
    z_new = z - lr * zz.grad
    realised = float(reference_entropy(z_new).mean() - reference_entropy(z).mean())
    stats = ed.token_stats(z, labels)
    valid = torch.ones(n, dtype=torch.bool)
    # d loss / d z_t = -(A_t / n)(e_k - p): each token takes alpha_t = (lr / n) A_t, so eta = lr / n
    exact = ed.batch_entropy_change(adv, stats.s_centered, valid, lr=lr / n, form="mean")
    assert abs(exact - realised) < 0.02 * abs(realised), (exact, realised)
    cov = ed.batch_entropy_change(adv, stats.s_centered, valid, lr=lr / n, form="cov")
    assert abs(cov - realised) < 0.2 * abs(realised), (cov, realised)
