"""The first-order entropy law for the optimizer actually used: ``ΔH_B ≈ ∇θH_B · Δθ`` (docs/law.md), ``H_B`` the
mean entropy of this batch's tokens and ``Δθ`` the step the optimizer is about to take.  :func:`token_terms` splits
it over tokens, :func:`step_entropy_curvature` and :func:`logit_step_entropy_change` go beyond first order along the
same ``Δθ``, and :class:`Calibration` puts Corollary 4's cheap score in nats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._checks import as_valid_mask, one_of, real_number, require_float, require_shape, require_tensor

#: Routes of :func:`optimizer_step_delta` / :func:`step_entropy_change`.
ROUTES = ("auto", "analytic", "lookahead")
#: Preconditioners of :func:`linearise_step`: this step's (needs the gradient) or the last step's (before backward).
PRECONDITIONERS = ("step", "state")
#: Version of :meth:`Calibration.state_dict`'s layout.
CALIBRATION_VERSION = 1


def _analytic_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """``"adam"`` (Adam, AdamW), ``"sgd"`` or None (no closed form here)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):  # AdamW subclasses Adam from torch 2.6 on
        return "adam"
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    return None


def _groups_of(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """The param group of each of ``params``; ``ValueError`` for a parameter the optimizer does not hold."""
    where = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for i, p in enumerate(params):
        if id(p) not in where:
            raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) is not a parameter of the optimizer")
    return [where[id(p)] for p in params]


def _params(params: object) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor) or not isinstance(params, Sequence):
        raise TypeError(f"params must be a sequence of tensors (e.g. list(model.parameters())), got {type(params).__name__}")
    for i, p in enumerate(params):
        require_tensor(f"params[{i}]", p)
    return list(params)


def _aligned(name: str, values: object, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """``values`` as a list aligned with ``params`` (None entries allowed), shapes checked."""
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of tensors aligned with params, got {type(values).__name__}")
    if len(values) != len(params):
        raise ValueError(f"{name} has {len(values)} entries, params {len(params)}")
    for i, (v, p) in enumerate(zip(values, params)):
        if v is not None:
            require_float(f"{name}[{i}]", v)
            require_shape(f"{name}[{i}]", v, p.shape, f"params[{i}]")
    return list(values)


@dataclass(frozen=True)
class StepLinearisation:
    """The optimizer's next step as an affine map of this step's loss gradient: ``Δθ_p = scale_p ⊙ g_p + carry_p``.

    ``scale`` (``P``) and ``carry``: one float64 tensor per parameter of ``params``, of its shape, zero for a
    parameter the step leaves alone.  ``formed``: per parameter, False on Adam's first step (``Δθ = -lr ĝ / (|ĝ| + ε)``
    element by element, not additive over tokens), else True.
    """

    params: tuple[torch.Tensor, ...]
    scale: tuple[torch.Tensor, ...]
    carry: tuple[torch.Tensor, ...]
    formed: tuple[bool, ...]

    def delta(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """``Δθ_p = scale_p ⊙ g_p + carry_p`` (float64; a None gradient counts as zero)."""
        gs = _aligned("grads", grads, list(self.params))
        return [c if g is None else s * g.to(torch.float64) + c for g, s, c in zip(gs, self.scale, self.carry)]

    def direction(self, entropy_grads: Sequence[torch.Tensor | None],
                  grads: Sequence[torch.Tensor | None] | None = None) -> tuple[list[torch.Tensor], float]:
        """``(w, carry)``: ``w_p = scale_p ⊙ ∇_p H_B`` (float64, the tangent of :func:`logit_tangents`) and
        ``carry = Σ_p ∇_p H_B · carry_p``; where not ``formed``, ``w_p = 0`` and the carry takes ``∇_p H_B · Δθ_p(g)``
        with ``g`` = ``grads`` (then required)."""
        gs = _aligned("entropy_grads", entropy_grads, list(self.params))
        if not all(self.formed):
            if grads is None:
                raise ValueError("grads: this step's loss gradient is needed where the preconditioner is not formed "
                                 "(Adam's first step), to put that step's change in the carry")
            deltas = self.delta(grads)
        w, carry = [], 0.0
        for i, (g, s, c, formed) in enumerate(zip(gs, self.scale, self.carry, self.formed)):
            g64 = torch.zeros_like(s) if g is None else g.detach().to(torch.float64)
            w.append(s * g64 if formed else torch.zeros_like(s))
            carry += float((g64 * (c if formed else deltas[i])).sum())
        return w, carry


def linearise_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *,
                   grads: Sequence[torch.Tensor | None] | None = None, preconditioner: str = "step",
                   grad_scale: float = 1.0) -> StepLinearisation:
    """Closed form of the next step of ``torch.optim.Adam`` / ``AdamW`` / ``SGD`` (read, nothing changed).

    Adam (step ``t`` = stored step + 1, ``ĝ = s g`` with ``s = grad_scale``; ``+ λθ`` in ``ĝ`` for Adam's L2
    weight decay, ``-lr λ θ`` in the carry for AdamW's decoupled one)::

        v' = β2 v + (1 - β2) ĝ²     (amsgrad: max with the stored maximum)
        D  = lr / ((1 - β1^t) (sqrt(v' / (1 - β2^t)) + eps))
        Δθ = -D ((1 - β1) ĝ + β1 m)   ->   scale = -D (1 - β1) s,   carry = -D β1 m [- D (1 - β1) λ θ | - lr λ θ]

    SGD (momentum μ, dampening d, nesterov): ``buf' = μ buf + (1 - d) ĝ`` (``= ĝ`` on the first step),
    ``Δθ = -lr (ĝ + μ buf')`` with nesterov else ``-lr buf'``.  ``maximize`` flips ``g``.

    Args:
        params: parameters of ``optimizer`` (any subset, any order); the result is aligned with them.
        grads: this step's loss gradients aligned with ``params`` (default: each ``p.grad``; None: the step
            leaves ``p`` alone, as torch does, unless ``preconditioner="state"``).
        preconditioner: ``"step"`` (Adam's ``v'`` with this step's gradient) or ``"state"`` (before the backward:
            the last step's ``v̂ = v / (1 - β2^(t-1))`` stands in for ``v' / (1 - β2^t)``; every parameter is
            assumed to get a gradient; a parameter without Adam state yet raises ``ValueError``).
        grad_scale: factor the gradient is multiplied by before the step (gradient-norm clipping), ``> 0``.

    Returns :class:`StepLinearisation` (float64); ``TypeError`` for another optimizer (use ``route="lookahead"``).
    """
    kind = _analytic_kind(optimizer)
    if kind is None:
        raise TypeError(f"optimizer: no closed form for {type(optimizer).__name__} (Adam, AdamW and SGD have one); "
                        "use optimizer_step_delta(..., route='lookahead')")
    one_of("preconditioner", preconditioner, PRECONDITIONERS)
    s = real_number("grad_scale", grad_scale, above=0)
    ps = _params(params)
    groups = _groups_of(optimizer, ps)
    gs = [p.grad for p in ps] if grads is None else _aligned("grads", grads, ps)
    rows = []  # (scale, carry, formed) per parameter
    for i, (p, g, group) in enumerate(zip(ps, gs, groups)):
        theta = p.detach().to(torch.float64)
        zero = torch.zeros_like(theta)
        if g is None and preconditioner == "step":
            rows.append((zero, zero, True))
            continue
        state = optimizer.state.get(p, {})
        sign = -1.0 if group.get("maximize", False) else 1.0
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        if kind == "sgd":
            mu, damp, nesterov = float(group["momentum"]), float(group["dampening"]), bool(group["nesterov"])
            buf = state.get("momentum_buffer")
            if mu == 0:
                a, b = 1.0, 0.0
            elif buf is None:  # the first step sets buf = ĝ
                a, b = (1.0 + mu if nesterov else 1.0), 0.0
            else:
                a, b = ((1.0 + mu * (1 - damp)) if nesterov else (1 - damp)), (mu * mu if nesterov else mu)
            c = -lr * a * wd * theta if wd else zero
            if b:
                c = c - lr * b * buf.detach().to(torch.float64)
            rows.append((torch.full_like(theta, -lr * a * sign * s), c, True))
            continue
        beta1, beta2 = (float(x) for x in group["betas"])
        eps, amsgrad = float(group["eps"]), bool(group.get("amsgrad", False))
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
        step = float(state["step"]) if "step" in state else 0.0
        m = state["exp_avg"].detach().to(torch.float64) if "exp_avg" in state else zero
        v = state["exp_avg_sq"].detach().to(torch.float64) if "exp_avg_sq" in state else zero
        t = step + 1
        if preconditioner == "state":
            if step == 0:
                raise ValueError(f"params[{i}]: preconditioner='state' needs the optimizer's state, which the first "
                                 "step does not have yet; pass this step's gradient (grads=..., preconditioner='step')")
            v_new = v if not amsgrad else torch.maximum(v, state["max_exp_avg_sq"].detach().to(torch.float64))
            vhat = v_new / (1 - beta2**step)
        else:
            ghat = sign * s * g.detach().to(torch.float64) + (wd * theta if wd and not decoupled else 0.0)
            v_new = beta2 * v + (1 - beta2) * ghat * ghat
            if amsgrad and "max_exp_avg_sq" in state:
                v_new = torch.maximum(state["max_exp_avg_sq"].detach().to(torch.float64), v_new)
            vhat = v_new / (1 - beta2**t)
        d = lr / ((1 - beta1**t) * (vhat.sqrt() + eps))
        c = -d * beta1 * m
        if wd and decoupled:
            c = c - lr * wd * theta
        elif wd:
            c = c - d * (1 - beta1) * wd * theta
        rows.append((-d * (1 - beta1) * sign * s, c, step > 0))
    return StepLinearisation(tuple(ps), *(tuple(row[k] for row in rows) for k in range(3)))


def optimizer_step_delta(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *,
                         route: str = "auto") -> list[torch.Tensor]:
    """``Δθ`` of each of ``params`` in the step ``optimizer.step()`` would take now (float64; nothing changes), read
    after the backward (and any clipping): ``route`` ``"analytic"`` (:func:`linearise_step` with each ``p.grad``),
    ``"lookahead"`` (any optimizer without a closure: step, measure, restore parameters and state exactly) or
    ``"auto"`` (analytic where available)."""
    one_of("route", route, ROUTES)
    ps = _params(params)
    _groups_of(optimizer, ps)
    if route == "analytic" or (route == "auto" and _analytic_kind(optimizer) is not None):
        return linearise_step(optimizer, ps).delta([p.grad for p in ps])
    return _lookahead(optimizer, ps)


def _lookahead(optimizer: torch.optim.Optimizer, ps: list[torch.Tensor]) -> list[torch.Tensor]:
    """Step on the real parameters, read ``Δθ``, restore every parameter and the optimizer state."""
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    saved_params = {p: p.detach().clone() for p in everything}
    saved_state = {p: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in optimizer.state[p].items()}
                   for p in everything if p in optimizer.state}
    with torch.no_grad():
        optimizer.step()
        delta = [p.detach().to(torch.float64) - saved_params[p].to(torch.float64) for p in ps]
        for p, old in saved_params.items():
            p.copy_(old)
    for p in everything:
        optimizer.state.pop(p, None)
    optimizer.state.update(saved_state)
    return delta


def step_entropy_change(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                        entropy_grads: Sequence[torch.Tensor | None], *, route: str = "auto") -> float:
    """Exact first-order change of the batch-mean entropy in the step the optimizer is about to take:
    ``Σ_p ⟨∇_p H_B, Δθ_p⟩`` (float), ``Δθ`` from :func:`optimizer_step_delta` (same ``route``), ``entropy_grads`` =
    ``torch.autograd.grad(H_B, params)`` (None entries: zero)."""
    ps = _params(params)
    hs = _aligned("entropy_grads", entropy_grads, ps)
    delta = optimizer_step_delta(optimizer, ps, route=route)
    return float(sum(float((h.detach().to(torch.float64) * d).sum()) for h, d in zip(hs, delta) if h is not None))


def batch_mean_entropy(logits: torch.Tensor, valid: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """``H_B = mean over valid tokens of H(softmax(z / T))`` (0-d float32/64, differentiable; 0 when none is valid),
    ``logits`` ``[..., V]`` (``-inf`` allowed), ``valid`` of its leading shape.  Its gradient is ``entropy_grads``."""
    require_float("logits", logits)
    t = real_number("temperature", temperature, above=0)
    v = as_valid_mask(valid, logits.shape[:-1])
    u = logits.float() / t if logits.dtype != torch.float64 else logits / t
    logp = torch.log_softmax(u, -1)
    p = logp.exp()
    h = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)  # 0 log 0 = 0, with a finite gradient
    return torch.where(v, h, torch.zeros_like(h)).sum() / v.sum().clamp_min(1)


def _primals_and_tangents(primals: Mapping[str, torch.Tensor], tangents: Mapping[str, torch.Tensor],
                          names: tuple[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``primals`` detached and ``tangents`` cast to their dtypes, checked to match (``names``: for the errors)."""
    prim_name, tang_name = names
    if set(primals) != set(tangents):
        raise ValueError(f"{tang_name} must have {prim_name}' keys, got {sorted(set(tangents) ^ set(primals))} differing")
    prim = {k: v.detach() for k, v in primals.items()}
    for k, v in prim.items():
        require_shape(f"{tang_name}[{k!r}]", tangents[k], v.shape, f"{prim_name}[{k!r}]")
    return prim, {k: tangents[k].detach().to(v.dtype) for k, v in prim.items()}


def logit_tangents(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], primals: Mapping[str, torch.Tensor],
                   tangents: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, δz) = (fn(θ), J_fn(θ) w)``: one forward-mode product (``torch.func.jvp``).

    ``fn(params) -> logits`` (e.g. ``lambda p: functional_call(model, p, (seq,))[:, P-1:-1]``); ``primals`` and
    ``tangents`` map the same names to tensors of equal shapes.  Attention runs SDPA's math kernel (forward mode).
    """
    prim, tang = _primals_and_tangents(primals, tangents, ("primals", "tangents"))
    with sdpa_kernel(SDPBackend.MATH):
        return torch.func.jvp(fn, (prim,), (tang,))


def step_entropy_curvature(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                           named_params: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor],
                           valid: torch.Tensor, *, temperature: float = 1.0) -> float:
    """The second-order term of the step's entropy change: ``½ Δθᵀ ∇²θH_B Δθ`` (float), forward mode over forward mode.

    ``H_B(θ)`` = :func:`batch_mean_entropy` of ``fn(θ)`` over ``valid`` at ``temperature``; ``delta`` maps each
    name of ``named_params`` to its ``Δθ`` (e.g. :func:`optimizer_step_delta`; cast to each parameter's dtype).
    """
    t = real_number("temperature", temperature, above=0)
    prim, tang = _primals_and_tangents(named_params, delta, ("named_params", "delta"))

    def slope(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.jvp(lambda q: batch_mean_entropy(fn(q), valid, temperature=t), (p,), (tang,))[1]

    with sdpa_kernel(SDPBackend.MATH):
        _, second = torch.func.jvp(slope, (prim,), (tang,))
    return 0.5 * float(second)


def logit_step_entropy_change(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                              named_params: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor],
                              valid: torch.Tensor, *, temperature: float = 1.0, order: int = 2) -> float:
    """The step's entropy change with the network expanded in the step and the entropy taken exactly (float)::

        ΔH_B ≈ H_B(z + δz [+ ½ δ²z]) - H_B(z)        order 1 [order 2]

    ``z = fn(θ)`` ``[..., V]``, ``δz = J Δθ`` and ``δ²z = Δθᵀ ∇²θz Δθ`` (per logit) along ``delta`` (as in
    :func:`step_entropy_curvature`), :func:`batch_mean_entropy` over ``valid`` at ``temperature``; no backward.
    """
    t = real_number("temperature", temperature, above=0)
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {order!r}")
    prim, tang = _primals_and_tangents(named_params, delta, ("named_params", "delta"))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        if order == 1:
            z, dz = torch.func.jvp(fn, (prim,), (tang,))
            moved = z.double() + dz.double()
        else:
            z = fn(prim)
            dz, d2z = torch.func.jvp(lambda p: torch.func.jvp(fn, (p,), (tang,))[1], (prim,), (tang,))
            moved = z.double() + dz.double() + 0.5 * d2z.double()
        before = batch_mean_entropy(z.double(), valid, temperature=t)
        after = batch_mean_entropy(torch.where(torch.isfinite(z), moved, z.double()), valid, temperature=t)
    return float(after - before)


def token_contributions(logits: torch.Tensor, tangents: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                        valid: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Per-token terms ``c_t = -(ω_t / T)(δz_{t,k} - p_t · δz_t)`` of a policy-gradient step (float64 ``[B, T]``,
    zero at invalid positions), ``p = softmax(z / T)``.

    ``logits`` ``z`` and ``tangents`` ``δz = J w`` ``[B, T, V]`` (``-inf`` logits allowed), ``labels`` ``k`` int
    ``[B, T]`` (read at valid positions only), ``weights`` ``ω_t = A_t r_t keep_t / n`` ``[B, T]`` or ``[B]`` (the
    coefficient of ``-log p_t[k]`` in the loss's gradient; 0 for a PPO-clipped token), ``valid`` ``[B, T]``.
    """
    require_float("logits", logits)
    require_float("tangents", tangents)
    require_shape("tangents", tangents, logits.shape, "logits")
    shape = logits.shape[:-1]
    t = real_number("temperature", temperature, above=0)
    v = as_valid_mask(valid, shape)
    require_tensor("labels", labels)
    require_shape("labels", labels, shape, "logits[..., 0]")
    n_vocab = logits.shape[-1]
    lab = torch.where(v, labels, torch.zeros_like(labels)).to(torch.int64)
    if bool(((lab < 0) | (lab >= n_vocab)).any()):
        raise ValueError(f"labels must lie in [0, {n_vocab}) at valid positions")
    w = require_float("weights", weights).to(device=logits.device, dtype=torch.float64)
    if w.dim() == 1 and len(shape) == 2 and w.shape[0] == shape[0]:
        w = w[:, None].expand(shape)
    require_shape("weights", w, shape, "labels")
    z, dz = logits.to(torch.float64), tangents.to(torch.float64)
    p = torch.softmax(z / t, -1)
    p_dz = torch.where(p > 0, p * dz, torch.zeros_like(dz)).sum(-1)
    dz_k = dz.gather(-1, lab[..., None])[..., 0]
    c = -(w / t) * (dz_k - p_dz)
    return torch.where(v, c, torch.zeros_like(c))


@dataclass(frozen=True)
class TokenTerms:
    """:func:`token_terms`'s result: ``terms`` (float64, the batch's shape, 0 where invalid) and ``carry`` (float);
    ``predicted = carry + terms.sum()`` is the first-order change of ``H_B`` in the step."""

    terms: torch.Tensor
    carry: float

    @property
    def predicted(self) -> float:
        """``carry + Σ_t c_t``."""
        return self.carry + float(self.terms.sum())


def token_terms(optimizer: torch.optim.Optimizer, named_params: Mapping[str, torch.Tensor],
                fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], labels: torch.Tensor, weights: torch.Tensor,
                valid: torch.Tensor, *, temperature: float = 1.0, preconditioner: str | None = None,
                grads: Sequence[torch.Tensor | None] | None = None, grad_scale: float = 1.0,
                entropy_grads: Sequence[torch.Tensor | None] | None = None) -> TokenTerms:
    """Per-token contributions to the entropy change of the optimizer's next step, and its carry: with
    ``Δθ = P ⊙ g + carry`` (:func:`linearise_step`) affine in the loss gradient ``g = Σ_t J_tᵀ ∂L/∂z_t``::

        ΔH_B ≈ ∇θH_B · carry + Σ_t c_t,        c_t = (∂L/∂z_t) · δz_t,   δz_t = J_t (P ⊙ ∇θH_B)

    ``z = fn(named_params)`` ``[B, T, V]``: one backward of ``H_B`` (:func:`batch_mean_entropy` over ``valid`` at
    ``temperature``; skipped when ``entropy_grads``, aligned with ``named_params``' values, are given),
    :func:`linearise_step` (``grads``, ``grad_scale`` as there; ``preconditioner``: ``"step"`` with ``grads``, else
    ``"state"``), one :func:`logit_tangents` of ``w = P ⊙ ∇θH_B`` and :func:`token_contributions` with ``weights``.
    A parameter whose preconditioner is not formed (Adam's first step) puts its whole change in the carry.
    ``carry + Σ c_t`` equals :func:`step_entropy_change` to rounding.
    """
    ps = list(named_params.values())
    if entropy_grads is None:
        with torch.enable_grad():
            h = batch_mean_entropy(fn(dict(named_params)), valid, temperature=temperature)
            gh = torch.autograd.grad(h, ps, allow_unused=True)
    else:
        gh = _aligned("entropy_grads", entropy_grads, ps)
    if preconditioner is None:
        preconditioner = "state" if grads is None else "step"
    lin = linearise_step(optimizer, ps, grads=grads, preconditioner=preconditioner, grad_scale=grad_scale)
    w, carry = lin.direction(gh, [p.grad for p in ps] if grads is None else grads)
    z, dz = logit_tangents(fn, named_params, dict(zip(named_params, w)))
    terms = token_contributions(z.detach(), dz.detach(), labels, weights, valid, temperature=temperature)
    return TokenTerms(terms, carry)


class Calibration:
    """The scale ``κ`` that puts Corollary 4's cheap prediction ``-lr Cov_B(A, r S_c)`` in nats: :meth:`update` with
    the cheap ``x`` and the law's ``y`` of the same batch (least squares through 0, forgetting ρ)::

        S_xy <- ρ S_xy + x y,   S_xx <- ρ S_xx + x²,   κ = S_xy / S_xx     (1 until an update with x != 0)
    """

    def __init__(self, *, forgetting: float = 0.9) -> None:
        self.forgetting = real_number("forgetting", forgetting, minimum=0, maximum=1)
        self.s_xy, self.s_xx, self.count = 0.0, 0.0, 0

    @property
    def scale(self) -> float:
        """``κ`` (1.0 before any informative update)."""
        return self.s_xy / self.s_xx if self.s_xx > 0 else 1.0

    def update(self, cheap: float, exact: float) -> float:
        """Add one calibration step (``cheap`` = ``-lr Cov_B``, ``exact`` = the law's prediction); returns ``κ``."""
        x = real_number("cheap", cheap)
        y = real_number("exact", exact)
        self.s_xy = self.forgetting * self.s_xy + x * y
        self.s_xx = self.forgetting * self.s_xx + x * x
        self.count += 1
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "forgetting", "s_xy", "s_xx", "count"}`` (plain Python values)."""
        return {"version": CALIBRATION_VERSION, "forgetting": self.forgetting, "s_xy": self.s_xy, "s_xx": self.s_xx,
                "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; refuses another version or another ``forgetting`` by name."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping from Calibration.state_dict(), got {type(state).__name__}")
        keys = {"version", "forgetting", "s_xy", "s_xx", "count"}
        if set(state) != keys:
            raise ValueError(f"state must have the keys {sorted(keys)}, got {sorted(map(str, state))}")
        if state["version"] != CALIBRATION_VERSION:
            raise ValueError(f"state['version'] must be {CALIBRATION_VERSION}, got {state['version']!r}")
        if state["forgetting"] != self.forgetting:
            raise ValueError(f"state['forgetting'] is {state['forgetting']!r} but this Calibration has {self.forgetting!r}")
        s_xx = real_number("state['s_xx']", state["s_xx"], minimum=0)
        s_xy = real_number("state['s_xy']", state["s_xy"])
        if isinstance(state["count"], bool) or not isinstance(state["count"], int) or state["count"] < 0:
            raise ValueError(f"state['count'] must be an int >= 0, got {state['count']!r}")
        self.s_xy, self.s_xx, self.count = s_xy, s_xx, state["count"]


__all__ = ["Calibration", "StepLinearisation", "TokenTerms", "batch_mean_entropy", "linearise_step",
           "logit_step_entropy_change", "logit_tangents", "optimizer_step_delta", "step_entropy_change",
           "step_entropy_curvature", "token_contributions", "token_terms"]
