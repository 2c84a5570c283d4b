"""The entropy law for the optimizer used (entropy_discriminator.law) against plain float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import entropy_discriminator as ed
from entropy_discriminator import law

OPTIMIZERS = {
    "adam": lambda ps, lr, wd: torch.optim.Adam(ps, lr=lr, weight_decay=wd),
    "adamw": lambda ps, lr, wd: torch.optim.AdamW(ps, lr=lr, weight_decay=wd),
    "adam_amsgrad": lambda ps, lr, wd: torch.optim.Adam(ps, lr=lr, weight_decay=wd, amsgrad=True, betas=(0.8, 0.95)),
    "adam_maximize": lambda ps, lr, wd: torch.optim.Adam(ps, lr=lr, weight_decay=wd, maximize=True),
    "sgd": lambda ps, lr, wd: torch.optim.SGD(ps, lr=lr, weight_decay=wd),
    "sgd_momentum": lambda ps, lr, wd: torch.optim.SGD(ps, lr=lr, momentum=0.9, dampening=0.1, weight_decay=wd),
    "sgd_nesterov": lambda ps, lr, wd: torch.optim.SGD(ps, lr=lr, momentum=0.8, nesterov=True, weight_decay=wd),
}


class TinyNet(torch.nn.Module):
    """Embedding -> tanh MLP -> logits [B, T, V] (float64), a network whose logits share parameters."""

    def __init__(self, vocab: int, dim: int = 6) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.hid = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, vocab)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hid(self.emb(tokens))))


def _batch(seed: int, b: int = 5, t: int = 4, vocab: int = 7):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, t), generator=gen)
    labels = torch.randint(0, vocab, (b, t), generator=gen)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    valid = torch.rand(b, t, generator=gen) > 0.25
    valid[0, 0] = True
    return tokens, labels, adv, valid


def _pg_loss(logits, labels, adv, valid, temperature):
    """``-Σ_t ω_t log softmax(z_t / T)[k_t]`` with ``ω_t = A_t valid_t / n``: returns (loss, ω)."""
    logp = torch.log_softmax(logits / temperature, -1).gather(-1, labels[..., None])[..., 0]
    w = adv[:, None] * valid / valid.sum()
    return -(w * logp).sum(), w


def _entropy(logits, valid, temperature):
    logp = torch.log_softmax(logits / temperature, -1)
    h = -(logp.exp() * logp).sum(-1)
    return (h * valid).sum() / valid.sum()


def _train_steps(model, opt, seed, steps, temperature):
    """``steps`` optimizer steps on fresh batches (builds momentum / second moments)."""
    for i in range(steps):
        tokens, labels, adv, valid = _batch(seed * 100 + i, vocab=model.out.out_features)
        loss, _ = _pg_loss(model(tokens), labels, adv, valid, temperature)
        opt.zero_grad()
        loss.backward()
        opt.step()


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), seed=st.integers(0, 10_000), prior=st.integers(0, 3),
       wd=st.sampled_from([0.0, 0.05]))
def test_analytic_step_equals_the_lookahead_step(name, seed, prior, wd):
    torch.manual_seed(seed)
    model = TinyNet(7)
    opt = OPTIMIZERS[name](list(model.parameters()), 0.01, wd)
    _train_steps(model, opt, seed, prior, 1.0)
    tokens, labels, adv, valid = _batch(seed + 7)
    loss, _ = _pg_loss(model(tokens), labels, adv, valid, 1.0)
    opt.zero_grad()
    loss.backward()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    state_before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state_dict()["state"].get(0, {}).items()}
    analytic = law.optimizer_step_delta(opt, params, route="analytic")
    look = law.optimizer_step_delta(opt, params, route="lookahead")
    for a, b in zip(analytic, look):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-14)
    for p, b in zip(params, before):  # nothing changed
        assert torch.equal(p.detach(), b)
    for k, v in opt.state_dict()["state"].get(0, {}).items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(state_before[k]))
    opt.step()  # and the real step is the one predicted
    for p, b, d in zip(params, before, look):
        torch.testing.assert_close(p.detach() - b, d, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum"])
def test_step_entropy_change_is_first_order(name):
    """realised - predicted shrinks ~4x when the learning rate halves (the prediction is exact to first order)."""
    errors = []
    for lr in (4e-3, 2e-3, 1e-3):
        torch.manual_seed(3)
        model = TinyNet(7)
        opt = OPTIMIZERS[name](list(model.parameters()), lr, 0.01)
        _train_steps(model, opt, 3, 2, 0.7)
        tokens, labels, adv, valid = _batch(99)
        logits = model(tokens)
        h0 = _entropy(logits, valid, 0.7)
        gh = torch.autograd.grad(h0, list(model.parameters()), retain_graph=True)
        loss, _ = _pg_loss(logits, labels, adv, valid, 0.7)
        opt.zero_grad()
        loss.backward()
        pred = law.step_entropy_change(opt, list(model.parameters()), gh)
        opt.step()
        with torch.no_grad():
            real = float(_entropy(model(tokens), valid, 0.7) - h0)
        errors.append(abs(real - pred))
        assert pred != 0 and math.copysign(1, pred) == math.copysign(1, real)
    assert 2.5 < errors[0] / errors[1] < 6 and 2.5 < errors[1] / errors[2] < 6


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([1.0, 0.5, 1.7]), lr=st.sampled_from([0.3, 1.0]))
def test_tabular_sgd_terms_are_corollary_4(seed, temperature, lr):
    """SGD on tabular logits (each token owns z_t): c_t = -(η/N) A_t S_c,t with η = λ / (N T²)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, v = 4, 3, 6
    z = torch.nn.Parameter(torch.randn(b, t, v, generator=gen, dtype=torch.float64) * 2)
    z.data[0, 0, 2] = -math.inf  # a masked-out vocabulary entry
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[0, 0] = 1
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    valid = torch.rand(b, t, generator=gen) > 0.3
    valid[0, 0] = True
    opt = torch.optim.SGD([z], lr=lr)
    n = float(valid.sum())
    w = adv[:, None] * valid / n
    res = law.token_terms(opt, {"z": z}, lambda p: p["z"], labels, w, valid, temperature=temperature,
                          preconditioner="step", grads=[torch.zeros_like(z)])
    stats = ed.token_stats(z.detach(), labels, temperature=temperature)
    eta = lr / (n * temperature**2)
    expected = torch.where(valid, -(eta / n) * adv[:, None] * stats.s_centered.double(), 0.0)
    torch.testing.assert_close(res.terms, expected, rtol=1e-10, atol=1e-15)
    assert res.carry == 0.0
    # and the sum is batch_entropy_change's "mean" form
    total = ed.batch_entropy_change(adv, stats.s_centered, valid, lr=eta, form="mean")
    assert res.predicted == pytest.approx(total, rel=1e-10, abs=1e-15)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["adam", "adamw", "sgd_momentum", "sgd_nesterov", "adam_amsgrad"]),
       seed=st.integers(0, 10_000), temperature=st.sampled_from([1.0, 0.6]), wd=st.sampled_from([0.0, 0.1]),
       prior=st.integers(0, 3))
def test_terms_and_carry_sum_to_the_exact_prediction(name, seed, temperature, wd, prior):
    torch.manual_seed(seed)
    model = TinyNet(7)
    opt = OPTIMIZERS[name](list(model.parameters()), 0.01, wd)
    _train_steps(model, opt, seed, prior, temperature)
    tokens, labels, adv, valid = _batch(seed + 1)
    logits = model(tokens)
    loss, w = _pg_loss(logits, labels, adv, valid, temperature)
    params = list(model.parameters())
    gh = torch.autograd.grad(_entropy(logits, valid, temperature), params, retain_graph=True)
    opt.zero_grad()
    loss.backward()
    exact = law.step_entropy_change(opt, params, gh, route="lookahead")
    named = dict(model.named_parameters())
    res = law.token_terms(opt, named, lambda p: torch.func.functional_call(model, p, (tokens,)), labels, w.detach(),
                          valid, temperature=temperature, preconditioner="step")
    assert res.predicted == pytest.approx(exact, rel=1e-8, abs=1e-14)
    assert bool((res.terms[~valid] == 0).all())


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adams_first_step_is_not_split_over_tokens(name):
    """No second moment yet: the step is lr ĝ/(|ĝ|+ε) per element, so the terms are 0 and the carry is the exact
    prediction; from the second step on the terms are not 0.  The autopilot, given those terms, drops nothing."""
    torch.manual_seed(4)
    model = TinyNet(7)
    opt = OPTIMIZERS[name](list(model.parameters()), 0.01, 0.0)
    named = dict(model.named_parameters())
    params = list(named.values())
    for step in range(2):
        tokens, labels, adv, valid = _batch(40 + step)
        logits = model(tokens)
        loss, w = _pg_loss(logits, labels, adv, valid, 1.0)
        gh = torch.autograd.grad(_entropy(logits, valid, 1.0), params, retain_graph=True)
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        res = law.token_terms(opt, named, lambda p: torch.func.functional_call(model, p, (tokens,)), labels,
                              w.detach(), valid, grads=grads, entropy_grads=gh)
        opt.zero_grad()
        loss.backward()
        exact = law.step_entropy_change(opt, params, gh, route="lookahead")
        assert res.predicted == pytest.approx(exact, rel=1e-8, abs=1e-14)
        if step == 0:
            assert bool((res.terms == 0).all()) and res.carry == pytest.approx(exact, rel=1e-8, abs=1e-14)
            stats = ed.token_stats(logits.detach(), labels)
            pilot = ed.EntropyAutopilot(float(stats.entropy[valid].mean()) + 0.3, sides="both", max_frac=0.5)
            out = pilot.step(adv, s_centered=stats.s_centered, entropy=stats.entropy, valid=valid, terms=res.terms,
                             carry=res.carry)
            assert out.dropped_frac == 0 and bool(out.keep[valid].all())
            assert out.predicted_dh_after == pytest.approx(exact, rel=1e-8, abs=1e-14)
        else:
            assert float(res.terms.abs().sum()) > 0
        opt.step()
    lin = law.linearise_step(torch.optim.Adam(params, lr=0.01), params, grads=grads)
    with pytest.raises(ValueError, match="grads: this step's loss gradient is needed"):
        lin.direction(gh)


def _line_entropy(model, tokens, valid, temperature, delta, eps):
    """``H_B(θ + eps Δθ)`` in float64 (the reference of the second-order term)."""
    named = {k: v.detach().double() + eps * d.double() for (k, v), d in zip(model.named_parameters(), delta)}
    with torch.no_grad():
        return float(_entropy(torch.func.functional_call(model.double(), named, (tokens,)).double(), valid, temperature))


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(["adam", "adamw", "sgd_momentum"]), seed=st.integers(0, 10_000),
       temperature=st.sampled_from([1.0, 0.6]), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_second_order_term_is_half_the_curvature_along_the_step(name, seed, temperature, dtype):
    """``step_entropy_curvature`` = ½ d²/dε² H_B(θ + εΔθ) at 0, against a float64 central difference."""
    torch.manual_seed(seed)
    model = TinyNet(7)
    opt = OPTIMIZERS[name](list(model.parameters()), 0.05, 0.01)
    _train_steps(model, opt, seed, 2, temperature)
    tokens, labels, adv, valid = _batch(seed + 3)
    loss, _ = _pg_loss(model(tokens), labels, adv, valid, temperature)
    opt.zero_grad()
    loss.backward()
    delta = law.optimizer_step_delta(opt, list(model.parameters()))
    eps = 1e-3
    f = [_line_entropy(model, tokens, valid, temperature, delta, e) for e in (-eps, 0.0, eps)]
    reference = 0.5 * (f[0] - 2 * f[1] + f[2]) / eps**2
    model.to(dtype)
    named = dict(model.named_parameters())
    got = law.step_entropy_curvature(lambda p: torch.func.functional_call(model, p, (tokens,)), named,
                                     dict(zip(named, delta)), valid, temperature=temperature)
    tol = 1e-6 if dtype == torch.float64 else 2e-3
    assert got == pytest.approx(reference, rel=tol, abs=tol * 1e-3)


def _plain_entropy(z, valid, temperature):
    """Mean softmax entropy in float64, ``0 log 0 = 0`` (for ``-inf`` logits)."""
    p = torch.softmax(z.double() / temperature, -1)
    logp = torch.where(p > 0, torch.log(p), 0.0)
    return float(((-(p * logp).sum(-1)) * valid).sum() / valid.sum())


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([1.0, 0.6]), order=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_logit_space_change_expands_the_network_and_not_the_entropy(seed, temperature, order, dtype):
    """``H(z + δz [+ ½δ²z]) - H(z)`` with δz, δ²z the float64 central differences of the logits along Δθ."""
    torch.manual_seed(seed)
    model = TinyNet(7)
    opt = torch.optim.Adam(list(model.parameters()), lr=0.05)
    _train_steps(model, opt, seed, 2, temperature)
    tokens, labels, adv, valid = _batch(seed + 5)
    loss, _ = _pg_loss(model(tokens), labels, adv, valid, temperature)
    opt.zero_grad()
    loss.backward()
    delta = law.optimizer_step_delta(opt, list(model.parameters()))
    eps = 1e-4

    def logits_at(e):
        named = {k: v.detach() + e * d for (k, v), d in zip(model.named_parameters(), delta)}
        with torch.no_grad():
            return torch.func.functional_call(model, named, (tokens,))

    zm, z0, zp = logits_at(-eps), logits_at(0.0), logits_at(eps)
    moved = z0 + (zp - zm) / (2 * eps) + (0.5 * (zp - 2 * z0 + zm) / eps**2 if order == 2 else 0)
    reference = _plain_entropy(moved, valid, temperature) - _plain_entropy(z0, valid, temperature)
    model.to(dtype)
    named = dict(model.named_parameters())
    got = law.logit_step_entropy_change(lambda p: torch.func.functional_call(model, p, (tokens,)), named,
                                        dict(zip(named, delta)), valid, temperature=temperature, order=order)
    tol = 1e-5 if dtype == torch.float64 else 1e-3
    assert got == pytest.approx(reference, rel=tol, abs=1e-7)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([1.0, 1.7]))
def test_logit_space_change_is_exact_on_tabular_logits(seed, temperature):
    """Logits that are the parameters (``-inf`` entries kept): the prediction is the realised change, any step size."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64) * 3
    z[0, 0, 1] = -math.inf
    step = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64)
    valid = torch.rand(3, 4, generator=gen) > 0.3
    valid[0, 0] = True
    realised = _plain_entropy(z + step, valid, temperature) - _plain_entropy(z, valid, temperature)
    for order in (1, 2):
        got = law.logit_step_entropy_change(lambda p: p["z"], {"z": z}, {"z": step}, valid, temperature=temperature,
                                            order=order)
        assert got == pytest.approx(realised, rel=1e-10, abs=1e-12)


def test_both_orders_leave_a_third_order_remainder():
    """realised - (first + second order) shrinks ~8x when the learning rate halves."""
    errors = []
    for lr in (8e-3, 4e-3, 2e-3):
        torch.manual_seed(3)
        model = TinyNet(7)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        _train_steps(model, opt, 3, 2, 1.0)
        tokens, labels, adv, valid = _batch(99)
        logits = model(tokens)
        h0 = _entropy(logits, valid, 1.0)
        named = dict(model.named_parameters())
        gh = torch.autograd.grad(h0, list(named.values()), retain_graph=True)
        loss, _ = _pg_loss(logits, labels, adv, valid, 1.0)
        opt.zero_grad()
        loss.backward()
        delta = law.optimizer_step_delta(opt, list(named.values()))
        first = law.step_entropy_change(opt, list(named.values()), gh)
        second = law.step_entropy_curvature(lambda p: torch.func.functional_call(model, p, (tokens,)), named,
                                            dict(zip(named, delta)), valid)
        opt.step()
        with torch.no_grad():
            real = float(_entropy(model(tokens), valid, 1.0) - h0)
        errors.append(abs(real - first - second))
        assert abs(real - first - second) < abs(real - first)
    assert 5 < errors[0] / errors[1] < 11 and 5 < errors[1] / errors[2] < 11


def test_state_preconditioner_needs_state_and_is_close_to_the_step_one():
    torch.manual_seed(0)
    model = TinyNet(7)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"params\[0\]: preconditioner='state' needs the optimizer's state"):
        law.linearise_step(opt, params, preconditioner="state")
    _train_steps(model, opt, 0, 30, 1.0)
    tokens, labels, adv, valid = _batch(5)
    loss, _ = _pg_loss(model(tokens), labels, adv, valid, 1.0)
    opt.zero_grad()
    loss.backward()
    a = law.linearise_step(opt, params, preconditioner="state")
    b = law.linearise_step(opt, params)
    for sa, sb in zip(a.scale, b.scale):  # one step's gradient moves v by (1 - beta2) g^2: a small change
        assert float(((sa - sb).abs() / sb.abs()).median()) < 0.05


def test_refusals_name_the_argument():
    model = TinyNet(5)
    other = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    with pytest.raises(TypeError, match="optimizer: no closed form for RMSprop"):
        law.linearise_step(opt, list(model.parameters()))
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(2,\)\) is not a parameter of the optimizer"):
        law.optimizer_step_delta(opt, [other])
    with pytest.raises(ValueError, match="route must be one of"):
        law.optimizer_step_delta(opt, list(model.parameters()), route="guess")
    with pytest.raises(TypeError, match="params must be a sequence of tensors"):
        law.optimizer_step_delta(opt, model.parameters())
    with pytest.raises(ValueError, match=r"entropy_grads has 1 entries, params 5"):
        law.step_entropy_change(opt, list(model.parameters()), [None])
    with pytest.raises(ValueError, match="grad_scale"):
        law.linearise_step(torch.optim.SGD(model.parameters(), lr=0.1), list(model.parameters()), grad_scale=0)
    named = dict(model.named_parameters())
    with pytest.raises(ValueError, match="delta must have named_params' keys"):
        law.step_entropy_curvature(lambda p: p["out.bias"], named, {"out.bias": torch.zeros(5)}, torch.ones(5) > 0)
    with pytest.raises(ValueError, match="order must be 1 or 2"):
        law.logit_step_entropy_change(lambda p: p["z"], {"z": torch.zeros(2, 3)}, {"z": torch.zeros(2, 3)},
                                      torch.ones(2) > 0, order=3)
    z = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="labels must lie in"):
        law.token_contributions(z, z, torch.full((2, 3), 4), torch.ones(2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="weights"):
        law.token_contributions(z, z, torch.zeros(2, 3, dtype=torch.int64), torch.ones(3), torch.ones(2, 3, dtype=torch.bool))


def test_rmsprop_lookahead_matches_its_real_step():
    torch.manual_seed(1)
    model = TinyNet(5)
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5)
    _train_steps(model, opt, 1, 2, 1.0)
    tokens, labels, adv, valid = _batch(3, vocab=5)
    loss, _ = _pg_loss(model(tokens), labels, adv, valid, 1.0)
    opt.zero_grad()
    loss.backward()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    delta = law.optimizer_step_delta(opt, params)  # auto: lookahead for RMSprop
    opt.step()
    for p, b, d in zip(params, before, delta):
        torch.testing.assert_close(p.detach() - b, d, rtol=1e-12, atol=1e-15)


def test_calibration_is_least_squares_through_zero_and_round_trips():
    cal = law.Calibration(forgetting=1.0)
    assert cal.scale == 1.0
    xs, ys = [1e-6, -2e-6, 3e-6], [2e-3, -3e-3, 7e-3]
    for x, y in zip(xs, ys):
        cal.update(x, y)
    expected = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    assert cal.scale == pytest.approx(expected, rel=1e-12)
    fresh = law.Calibration(forgetting=1.0)
    fresh.load_state_dict(cal.state_dict())
    assert fresh.scale == cal.scale and fresh.count == 3
    with pytest.raises(ValueError, match=r"state\['forgetting'\] is 1.0 but this Calibration has 0.9"):
        law.Calibration().load_state_dict(cal.state_dict())
    with pytest.raises(ValueError, match="exact"):
        cal.update(1.0, math.nan)


def test_monitor_reports_the_calibrated_prediction_in_nats():
    g = torch.Generator().manual_seed(0)
    h = torch.rand(3, 4, generator=g)
    sc = torch.randn(3, 4, generator=g)
    adv = torch.randn(3, generator=g)
    valid = torch.ones(3, 4, dtype=torch.bool)
    mon = ed.EntropyMonitor()
    plain = mon(entropy=h, valid=valid, advantages=adv, s_centered=sc, lr=1e-4)
    cal = mon(entropy=h, valid=valid, advantages=adv, s_centered=sc, lr=1e-4, scale=2500.0)
    assert "entropy_disc/delta_entropy/scale" not in plain and cal["entropy_disc/delta_entropy/scale"] == 2500.0
    assert cal["entropy_disc/delta_entropy/predicted"] == pytest.approx(2500.0 * plain["entropy_disc/delta_entropy/predicted"])
    with pytest.raises(ValueError, match="give lr with it"):
        mon(entropy=h, valid=valid, advantages=adv, s_centered=sc, scale=2.0)
    with pytest.raises(ValueError, match="scale"):
        mon(entropy=h, valid=valid, advantages=adv, s_centered=sc, lr=1e-4, scale=-1.0)
