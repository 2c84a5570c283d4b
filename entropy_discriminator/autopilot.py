"""Entropy autopilot: each step, drop the fewest tokens so that the predicted entropy change meets a target.

The paper's first-order law (Corollaries 4 and 4.1) writes the change of the batch-mean token
entropy after one policy-gradient step as a sum of per-token terms.  The autopilot (issue 23)
sets a desired change for the step from the measured entropy (a feedback law toward a user
target) and drops, from the loss, the tokens with the largest entropy-*decreasing* terms until
the predicted change of the kept tokens reaches it.  See docs/autopilot.md.

Estimator
---------
Per valid token ``t`` of the whole batch (all ranks of the process group), with ``a_t = A_t``,
``y_t = r_t * S_c,t`` (``r = pi / pi_sample``, 1 on-policy), ``N`` the number of valid tokens::

    form="cov"  (Cor. 4 / 4.1):  c_t = -(eta / N) * (a_t - a_bar) * (y_t - y_bar)
    form="mean" (eq. 23):        c_t = -(eta / N) * a_t * y_t        (Theorem 2's own term)

``a_bar`` and ``y_bar`` are the means over all ``N`` valid tokens.  Over the full batch the terms
sum to :func:`~entropy_discriminator.batch_entropy_change` (``-eta Cov_B(A, r S_c)`` for
``"cov"``).  Dropping a set ``D`` the way ``apply_keep_mask(mode="zero_pg")`` does (a dropped
token loses its policy-gradient term, the loss normaliser stays ``N``) gives the prediction::

    P(D) = P_0 - sum_{t in D} c_t,      P_0 = -eta * (S_ay / N - (S_a / N) (S_y / N))   ("cov")
                                        P_0 = -eta * S_ay / N                           ("mean")

with ``N``, ``a_bar`` and ``y_bar`` those of the *full* batch (the centring is Corollary 2's
noise correction, held fixed so that the prediction stays a sum of per-token terms and the
selection below is exact).  ``P(D)`` is the first-order change of the mean entropy over all ``N``
tokens; in the tabular case with ``form="mean"`` it is exact to ``O(eta^2)``.  Under
``mode="drop_token"`` the kept tokens' steps grow by ``N / (N - |D|)`` (at most ``1 / (1 -
max_frac)``), a gain error the feedback law absorbs (docs/autopilot.md).

Selection
---------
Candidates: valid tokens whose advantage has a sign allowed by ``sides`` (zero-advantage tokens
never) and whose term is entropy-decreasing, ``c_t < 0``.  They are ordered by ``c_t`` ascending
(most decreasing first), ties by the smaller flat position in the concatenated batch; ``L = min(
#candidates, cap_limit(max_frac, N))``.  With ``P_j = P_0 + cumsum(-c_(1), ..., -c_(L))[j]`` (one
float64 ``torch.cumsum`` over the ordered list, the same array on every rank), the first ``j*``
candidates are dropped::

    j* = 0                                 if P_0 >= target
    j* = min{ j in 1..L : P_j >= target }  if that set is not empty
    j* = L                                 otherwise (the cap, or the candidates, ran out)

Across ranks each rank sends its own first ``L`` candidates (the global first ``L`` are among
them) with one ``all_gather``: the selection equals the one-process selection on the
concatenated batch (up to the float64 rounding of the all-reduced sums, as for the masks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._checks import (
    DataChecks,
    broadcast_advantages,
    integer,
    one_of,
    real_number,
    require_float,
    require_shape,
    valid_mask,
)
from .distributed import Group, _lexsort_desc, all_gather_cat, reduce_or_raise
from .dynamics import FORMS, covariance_terms
from .masks import SIDES, MaskResult, cap_limit
from .stats import TokenStats

#: Prefix of :meth:`AutopilotResult.metrics`' keys.
AUTOPILOT_PREFIX = "entropy_disc/autopilot/"
#: Proportional gain ``k`` of the feedback law: the error shrinks by ``1 - k`` per step when the law holds.
DEFAULT_GAIN = 0.5
#: Largest desired entropy change of one step, in nats/token, either direction.
DEFAULT_MAX_STEP = 0.02
#: Default cap on the dropped share of the valid tokens.
DEFAULT_MAX_FRAC = 0.05
#: Version of :meth:`EntropyAutopilot.state_dict`'s layout.
STATE_VERSION = 1
_NO_POSITION = float(2**53)  # padding position: after every real one (positions are exact in float64 below 2**53)


@dataclass(frozen=True)
class AutopilotResult:
    """The autopilot's keep-mask for one batch and the numbers behind it (all global over the group).

    ``mask`` is a :class:`~entropy_discriminator.MaskResult` with ``method="autopilot"``:
    ``keep`` (bool, the scores' shape, True where the token stays, invalid positions True) goes to
    :func:`~entropy_discriminator.apply_keep_mask`; ``center``/``std`` are 0 and the thresholds
    infinite (the autopilot has no threshold in score units); ``capped`` is True when the target
    was not met and more candidates than the cap existed.

    ``entropy``: measured batch-mean token entropy ``H_t`` (nats/token, NaN when not given or no
    valid token); ``target_entropy``: ``H*_t`` of the law (NaN outside the controller);
    ``target_dh``: the desired change of this step (NaN for an empty batch);
    ``predicted_dh_before`` / ``_after``: ``P_0`` and ``P(D)`` of the module docstring.
    """

    mask: MaskResult
    entropy: float
    target_entropy: float
    target_dh: float
    predicted_dh_before: float
    predicted_dh_after: float

    @property
    def keep(self) -> torch.Tensor:
        """``mask.keep``."""
        return self.mask.keep

    @property
    def dropped_frac(self) -> float:
        """Dropped share of the valid tokens (0 for an empty batch)."""
        return self.mask.clip_frac

    def metrics(self) -> dict[str, float]:
        """The step's numbers under ``entropy_disc/autopilot/*`` (the same keys on every batch)."""
        values = {
            "entropy": self.entropy,
            "target_entropy": self.target_entropy,
            "target_dh": self.target_dh,
            "predicted_dh_before": self.predicted_dh_before,
            "predicted_dh_after": self.predicted_dh_after,
            "dropped_frac": self.dropped_frac,
            "n_dropped": self.mask.n_clipped,
            "capped": float(self.mask.capped),
        }
        return {AUTOPILOT_PREFIX + k: float(v) for k, v in values.items()}


def autopilot_mask(
    s_centered: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    lr: float,
    target_dh: float,
    ratio: torch.Tensor | None = None,
    max_frac: float | None = DEFAULT_MAX_FRAC,
    sides: str = "negative",
    form: str = "cov",
    process_group: Group = None,
) -> AutopilotResult:
    """Drop the fewest tokens so that the predicted entropy change of the kept ones is ``>= target_dh``.

    The estimator and the selection rule are in the module docstring; this is the selection for a
    given target (the :class:`EntropyAutopilot` sets the target by feedback).

    Args:
        s_centered: ``S_c = S* - E_p[S]``, ``[B, T]`` (or any shape), any float dtype (read as float64).
        advantages: ``[B]`` per sequence or per token with ``s_centered``'s shape.
        valid: bool or 0/1 tensor of ``s_centered``'s shape.
        lr: ``eta`` of ``alpha = eta * r * A`` (a finite real > 0, see
            :func:`~entropy_discriminator.batch_entropy_change`).
        target_dh: the desired predicted change (nats/token), a finite real.
        ratio: ``r = pi / pi_sample`` per token, ``s_centered``'s shape (None: 1).
        max_frac: cap on the dropped share (:func:`~entropy_discriminator.masks.cap_limit`,
            ``floor(max_frac * N)`` tokens; None: no cap).
        sides: advantage sign whose tokens may be dropped: ``negative``, ``positive`` or ``both``.
        form: ``"cov"`` (default, Corollaries 4 / 4.1) or ``"mean"`` (eq. 23).
        process_group: everything is global over this group; a bad argument or value on one rank
            raises the same ``ValueError`` / ``TypeError`` on every rank.

    Returns:
        :class:`AutopilotResult` (``entropy`` and ``target_entropy`` NaN).  An empty batch keeps
        everything with ``P_0 = P(D) = 0``.
    """
    target = real_number("target_dh", target_dh)
    return _select(
        s_centered, advantages, valid, None, lr=lr, ratio=ratio, max_frac=max_frac, sides=sides, form=form,
        process_group=process_group, law=lambda h: (math.nan, target),
    )


def _select(
    s_centered: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    lr: float,
    ratio: torch.Tensor | None,
    max_frac: float | None,
    sides: str,
    form: str,
    process_group: Group,
    law: Callable[[float], tuple[float, float]],
) -> AutopilotResult:
    """The selection of the module docstring; ``law(H_t)`` gives ``(H*_t, target_dh)`` once ``H_t`` is reduced.

    Collectives: one all-reduce of the checks and sums; when something must be dropped, one
    all-gather of the per-rank counts and one of the candidates (``[L, 3]`` float64 per rank).
    """
    n_checks = 3 + (ratio is not None) + (entropy is not None)

    def local() -> tuple[torch.Tensor, tuple]:
        eta = real_number("lr", lr, above=0)
        if max_frac is not None:
            real_number("max_frac", max_frac, minimum=0, maximum=1)
        one_of("sides", sides, SIDES)
        one_of("form", form, FORMS)
        require_float("s_centered", s_centered)
        shape = s_centered.shape
        checks = DataChecks()
        valid_b = valid_mask(valid, shape, checks)
        a = broadcast_advantages(advantages, shape).to(s_centered.device)
        y = s_centered.to(torch.float64)
        if ratio is not None:
            require_float("ratio", ratio)
            require_shape("ratio", ratio, shape, "s_centered")
            checks.finite("ratio", ratio, valid_b)
            y = y * ratio.to(device=y.device, dtype=torch.float64)
        checks.finite("s_centered", s_centered, valid_b)
        terms = covariance_terms(a, y, valid_b)
        checks.finite("advantages", a, valid_b, witness=terms[1])
        h_sum = torch.zeros((), dtype=torch.float64, device=y.device)
        if entropy is not None:
            require_float("entropy", entropy)
            require_shape("entropy", entropy, shape, "s_centered")
            h_sum = torch.where(valid_b, entropy.to(device=y.device, dtype=torch.float64), 0.0).sum()
            checks.finite("entropy", entropy, valid_b, witness=h_sum)
        pos, neg = valid_b & (a > 0), valid_b & (a < 0)
        counts = [pos.sum().to(torch.float64), neg.sum().to(torch.float64)]
        payload = torch.cat([torch.stack(checks.witnesses()), terms, torch.stack([h_sum, *counts])])
        return payload, (checks, eta, valid_b, a, y, pos, neg)

    values, (checks, eta, valid_b, a, y, pos, neg) = reduce_or_raise(local, n_checks + 7, process_group)
    checks.verdict(values[:n_checks], process_group)
    n, s_a, s_y, s_ay, h_sum, n_pos, n_neg = values[n_checks:]
    nothing = torch.zeros_like(valid_b)
    if n == 0:
        return _result(nothing, 0, 0, 0, 0, 0, False, math.nan, math.nan, math.nan, 0.0, 0.0)
    h = h_sum / n if entropy is not None else math.nan
    h_target, target = law(h)
    a_bar, y_bar = (s_a / n, s_y / n) if form == "cov" else (0.0, 0.0)
    p0 = -eta * (s_ay / n - a_bar * y_bar)
    limit = cap_limit(max_frac, int(n))
    if p0 >= target:
        return _result(nothing, n, n_pos, n_neg, 0, 0, False, h, h_target, target, p0, p0)

    c = -(eta / n) * ((a - a_bar) * (y - y_bar))
    eligible = {"negative": neg, "positive": pos, "both": pos | neg}[sides]
    flat = (eligible & (c < 0)).reshape(-1)
    idx = torch.nonzero(flat).reshape(-1)
    n_local = idx.numel() if limit is None else min(limit, idx.numel())
    sizes = all_gather_cat(torch.tensor([[flat.numel(), n_local, idx.numel()]], device=idx.device), process_group)
    rank = 0 if process_group is None else dist.get_rank(process_group)
    offset = int(sizes[:rank, 0].sum())
    k_pad, n_cand = int(sizes[:, 1].max()), int(sizes[:, 2].sum())
    limit = n_cand if limit is None else min(limit, n_cand)

    position = idx + offset
    score = -c.reshape(-1)[idx]  # > 0: how much dropping the token raises the prediction
    order = _lexsort_desc(score, position)[:n_local]
    is_pos = pos.reshape(-1)[idx[order]].to(torch.float64)
    rows = torch.stack([score[order], position[order].to(torch.float64), is_pos], 1)
    if k_pad > n_local:
        filler = torch.tensor([[-math.inf, _NO_POSITION, 0.0]], dtype=torch.float64, device=rows.device)
        rows = torch.cat([rows, filler.expand(k_pad - n_local, 3)])
    everyone = all_gather_cat(rows, process_group) if k_pad else rows
    ranked = everyone[_lexsort_desc(everyone[:, 0], everyone[:, 1].to(torch.int64))[:limit]]
    predicted = p0 + torch.cumsum(ranked[:, 0], 0)  # P_1 .. P_L
    meets = predicted >= target
    met = bool(meets.any())
    j = int(torch.argmax(meets.to(torch.int8))) + 1 if met else limit
    chosen = ranked[:j]
    dropped = torch.zeros_like(flat)
    dropped[idx[torch.isin(position, chosen[:, 1].to(torch.int64))]] = True
    n_drop_pos = int(chosen[:, 2].sum())
    capped = not met and n_cand > limit
    after = float(predicted[j - 1]) if j else p0
    dropped = dropped.reshape(valid_b.shape)
    return _result(dropped, n, n_pos, n_neg, j, n_drop_pos, capped, h, h_target, target, p0, after)


def _result(
    dropped: torch.Tensor,
    n: float,
    n_pos: float,
    n_neg: float,
    n_drop: int,
    n_drop_pos: int,
    capped: bool,
    h: float,
    h_target: float,
    target: float,
    before: float,
    after: float,
) -> AutopilotResult:
    """An :class:`AutopilotResult` whose ``MaskResult`` keeps every token but ``dropped`` (counts are global)."""
    mask = MaskResult(
        keep=~dropped, method="autopilot", center=0.0, std=0.0, lower=-math.inf, upper=math.inf,
        n_valid=int(n), n_valid_pos=int(n_pos), n_valid_neg=int(n_neg), n_clipped=n_drop,
        n_clipped_pos=n_drop_pos, n_clipped_neg=n_drop - n_drop_pos, capped=capped,
    )  # fmt: skip
    return AutopilotResult(mask, h, h_target, target, before, after)


class EntropyAutopilot:
    """Feedback controller holding the batch-mean token entropy at a target by dropping tokens.

    Law (step ``t`` = number of non-empty batches seen before this one; ``H_t`` the measured
    batch-mean entropy of this batch, ``H_0`` that of the first)::

        H*_t = H_0                                     target_entropy="hold"
        H*_t = H_end                                   target_entropy=H_end, decay_steps=None
        H*_t = H_0 + (H_end - H_0) * min(t, D) / D     target_entropy=H_end, decay_steps=D
        target_dh_t = clip((H*_{t+1} - H*_t) - gain * (H_t - H*_t), -max_step, max_step)

    and :func:`autopilot_mask` with ``target_dh_t`` selects the tokens to drop.  If the realised
    change equals ``g`` times the prediction and the prediction meets the target, the error
    ``e_t = H_t - H*_t`` obeys ``e_{t+1} = (1 - g * gain) e_t``: it converges for
    ``0 < g * gain < 2`` and without changing sign for ``g * gain <= 1``; the default gain 0.5
    keeps that for a step size ``lr`` off by up to 2x (and stable up to 4x).  The controller
    only drops tokens, so it can slow or reverse a decrease of entropy but never lowers it: above
    the target with a predicted increase it drops nothing.  No integral term: the actuator is
    saturated (cap, one direction) much of the time, where an integrator would wind up.

    Args:
        target_entropy: ``"hold"`` (hold ``H_0``) or ``H_end`` in nats/token (a finite real >= 0).
        decay_steps: ramp linearly from ``H_0`` to ``H_end`` over this many steps (int >= 1;
            only with a number ``target_entropy``).
        gain: ``k`` in ``(0, 1]``.
        max_step: the band of ``target_dh`` (nats/token per step, > 0, ``inf`` allowed).
        max_frac, sides, form, process_group: as in :func:`autopilot_mask`.

    The controller's memory (``step``, ``H_0``) is :meth:`state_dict`; restoring it continues
    the run bit for bit.  Every rank holds the same state (the entropy is reduced globally).
    """

    def __init__(
        self,
        target_entropy: float | str = "hold",
        *,
        decay_steps: int | None = None,
        gain: float = DEFAULT_GAIN,
        max_step: float = DEFAULT_MAX_STEP,
        max_frac: float | None = DEFAULT_MAX_FRAC,
        sides: str = "negative",
        form: str = "cov",
        process_group: Group = None,
    ) -> None:
        if isinstance(target_entropy, str):
            one_of("target_entropy", target_entropy, ("hold",))
            self.target_entropy: float | None = None
        else:
            self.target_entropy = real_number("target_entropy", target_entropy, minimum=0)
        if decay_steps is not None:
            if self.target_entropy is None:
                raise ValueError("decay_steps needs a number target_entropy (a ramp from H_0 to it), not 'hold'")
            decay_steps = integer("decay_steps", decay_steps, minimum=1)
        self.decay_steps = decay_steps
        self.gain = real_number("gain", gain, above=0, maximum=1)
        self.max_step = real_number("max_step", max_step, finite=False, above=0)
        if max_frac is not None:
            real_number("max_frac", max_frac, minimum=0, maximum=1)
        self.max_frac = max_frac
        self.sides = one_of("sides", sides, SIDES)
        self.form = one_of("form", form, FORMS)
        self.process_group = process_group
        self.step_count = 0
        self.h_start: float | None = None

    def target_entropy_at(self, step: int, h_start: float) -> float:
        """``H*_step`` of the law, given the starting entropy ``H_0 = h_start``."""
        if self.target_entropy is None:
            return h_start
        if self.decay_steps is None:
            return self.target_entropy
        return h_start + (self.target_entropy - h_start) * (min(step, self.decay_steps) / self.decay_steps)

    def _law(self, h: float) -> tuple[float, float]:
        """``(H*_t, target_dh_t)`` of the class docstring for the measured ``H_t = h`` (``H_0 = h`` on the first batch)."""
        h_start = h if self.h_start is None else self.h_start
        now, nxt = self.target_entropy_at(self.step_count, h_start), self.target_entropy_at(self.step_count + 1, h_start)
        desired = (nxt - now) - self.gain * (h - now)
        return now, min(max(desired, -self.max_step), self.max_step)

    def step(
        self,
        advantages: torch.Tensor,
        *,
        s_centered: torch.Tensor,
        entropy: torch.Tensor,
        valid: torch.Tensor,
        lr: float,
        ratio: torch.Tensor | None = None,
    ) -> AutopilotResult:
        """One batch: measure ``H_t``, set ``target_dh_t`` by the law, select the tokens to drop.

        Call once per training batch, before the update, every rank in the same order.
        ``entropy``: per-token entropy (nats), ``s_centered``'s shape; the other arguments as in
        :func:`autopilot_mask`.  Advances the state (``step`` + 1, ``H_0`` on the first batch)
        unless the batch has no valid token, which is a no-op (everything kept, state unchanged).
        """
        res = _select(
            s_centered, advantages, valid, entropy, lr=lr, ratio=ratio, max_frac=self.max_frac, sides=self.sides,
            form=self.form, process_group=self.process_group, law=self._law,
        )  # fmt: skip
        if res.mask.n_valid:
            if self.h_start is None:
                self.h_start = res.entropy
            self.step_count += 1
        return res

    def from_stats(
        self, stats: TokenStats, advantages: torch.Tensor, *, lr: float, ratio: torch.Tensor | None = None
    ) -> AutopilotResult:
        """:meth:`step` on the fields of a :class:`~entropy_discriminator.TokenStats`."""
        return self.step(
            advantages, s_centered=stats.s_centered, entropy=stats.entropy, valid=stats.valid, lr=lr, ratio=ratio
        )

    def state_dict(self) -> dict[str, Any]:
        """The controller's memory as plain Python values: ``{"version", "step", "h_start"}`` (picklable)."""
        return {"version": STATE_VERSION, "step": self.step_count, "h_start": self.h_start}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` / ``TypeError`` naming the bad entry."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping from state_dict(), got {type(state).__name__}")
        if set(state) != {"version", "step", "h_start"}:
            raise ValueError(f"state must have the keys ['h_start', 'step', 'version'], got {sorted(map(str, state))}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"state['version'] must be {STATE_VERSION}, got {state['version']!r}")
        step = integer("state['step']", state["step"], minimum=0)
        h_start = state["h_start"]
        if h_start is not None:
            h_start = real_number("state['h_start']", h_start, minimum=0)
        if (step == 0) != (h_start is None):
            raise ValueError(f"state['h_start'] must be None exactly when state['step'] is 0, got {state!r}")
        self.step_count, self.h_start = step, h_start
