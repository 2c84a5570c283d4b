"""Entropy autopilot: each step, drop the fewest tokens so that the predicted entropy change meets a target
(docs/autopilot.md: the per-token terms, the selection rule across ranks and the feedback law).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._checks import DataChecks, integer, one_of, real_number, require_float, require_shape, valid_mask
from .distributed import Group, all_gather_cat, ranked_rows, reduce_or_raise
from .dynamics import FORMS, _weighted_terms
from .law import Calibration
from .masks import SIDES, MaskResult, cap_limit
from .stats import TokenStats

#: Prefix of :meth:`AutopilotResult.metrics`' keys.
AUTOPILOT_PREFIX = "entropy_disc/autopilot/"
#: Gain ``k`` of the feedback law: with Adam (``beta1 = 0.9``) the error's projected rest point moves by
#: ``k / (1 - beta1)`` of the error per step, a half (docs/autopilot.md); a twentieth for SGD without momentum.
DEFAULT_GAIN = 0.05
#: Largest desired entropy change of one step, in nats/token, either direction.
DEFAULT_MAX_STEP = 0.02
#: Default cap on the dropped share of the valid tokens.
DEFAULT_MAX_FRAC = 0.05
#: Weight of the new measurement in the smoothed entropy reading (1: no smoothing).
DEFAULT_SMOOTHING = 0.2
#: Version of :meth:`EntropyAutopilot.state_dict`'s layout.
STATE_VERSION = 2
_SETTINGS = ("target_entropy", "decay_steps", "gain", "max_step", "max_frac", "sides", "form", "smoothing")


@dataclass(frozen=True)
class AutopilotResult:
    """The autopilot's keep-mask for one batch and the numbers behind it (all global over the group).

    ``mask``: a ``MaskResult`` with ``method="autopilot"`` (``keep`` True where the token stays and where invalid;
    ``capped``: the target was not met and candidates beyond the cap existed).  ``entropy``: the measured ``H_t``
    (NaN when not given or no valid token); ``entropy_smoothed`` / ``target_entropy``: ``Ĥ_t`` / ``H*_t`` (NaN
    outside the controller); ``target_dh`` (NaN for an empty batch); ``predicted_dh_before`` / ``_after``: ``P_0`` /
    ``P(D)``; ``scale``: ``kappa`` (NaN when ``terms`` were given).
    """

    mask: MaskResult
    entropy: float
    target_entropy: float
    target_dh: float
    predicted_dh_before: float
    predicted_dh_after: float
    entropy_smoothed: float = math.nan
    scale: float = math.nan

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
        values = {"entropy": self.entropy, "entropy_smoothed": self.entropy_smoothed,
                  "target_entropy": self.target_entropy, "target_dh": self.target_dh,
                  "predicted_dh_before": self.predicted_dh_before, "predicted_dh_after": self.predicted_dh_after,
                  "scale": self.scale, "dropped_frac": self.dropped_frac, "n_dropped": self.mask.n_clipped,
                  "capped": float(self.mask.capped)}
        return {AUTOPILOT_PREFIX + k: float(v) for k, v in values.items()}


def autopilot_mask(s_centered: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, *, lr: float | None = None,
                   target_dh: float, ratio: torch.Tensor | None = None, max_frac: float | None = DEFAULT_MAX_FRAC,
                   sides: str = "negative", form: str = "cov", terms: torch.Tensor | None = None, carry: float = 0.0,
                   scale: float = 1.0, process_group: Group = None) -> AutopilotResult:
    """Drop the fewest tokens so that the step's predicted entropy change ``P(D) = carry + Σ_t c_t - Σ_{t∈D} c_t``
    meets ``target_dh``: of the valid tokens (``N`` over the group) whose ``c_t`` moves ``P`` toward it and whose
    advantage sign ``sides`` allows, the shortest prefix by ``|c_t|`` descending, at most ``cap_limit(max_frac, N)``.
    ``c_t`` is the law's ``terms`` (:func:`~entropy_discriminator.law.token_terms`) or the cheap score
    ``-scale (lr / N) (a_t - a_bar) (y_t - y_bar)``, ``a = A``, ``y = r S_c`` (``form="mean"``: ``a_bar = y_bar = 0``).
    (docs/autopilot.md); :class:`EntropyAutopilot` sets the target by feedback.

    Args:
        s_centered (a tensor here), advantages, valid, ratio: as in :func:`~entropy_discriminator.batch_entropy_change`.
        lr: ``eta`` of the cheap score (a finite real > 0; required without ``terms``, ignored with them).
        target_dh: the desired predicted change (nats/token), a finite real.
        max_frac: cap on the dropped share (``floor(max_frac * N)`` tokens, :func:`~.masks.cap_limit`; None: none).
        sides: advantage sign whose tokens may be dropped: ``negative``, ``positive`` or ``both``.
        form: ``"cov"`` or ``"mean"``, for the cheap score.
        terms: the law's ``c_t``, float, ``s_centered``'s shape, finite at valid positions; None: the cheap score.
        carry: the law's carry (the same number on every rank; only with ``terms``).
        scale: ``kappa`` of the cheap score (a finite real > 0; only without ``terms``).
        process_group: everything is global over this group; a bad value on one rank raises on every rank.

    Returns :class:`AutopilotResult` (``entropy``, ``entropy_smoothed``, ``target_entropy`` NaN); an empty batch
    keeps everything with ``P_0 = P(D) = 0``.
    """
    target = real_number("target_dh", target_dh)
    return _select(s_centered, advantages, valid, None, lr=lr, ratio=ratio, max_frac=max_frac, sides=sides, form=form,
                   terms=terms, carry=carry, scale=scale, process_group=process_group,
                   law=lambda h: (math.nan, math.nan, target))  # fmt: skip


def fixed_share_mask(s_centered: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, *, share: float,
                     raise_entropy: bool = True, lr: float = 1.0, ratio: torch.Tensor | None = None,
                     sides: str = "negative", form: str = "cov", terms: torch.Tensor | None = None, carry: float = 0.0,
                     scale: float = 1.0, process_group: Group = None) -> AutopilotResult:
    """Drop a fixed share of the tokens every step, the autopilot's selection without its feedback (the control
    that isolates the controller): ``autopilot_mask(..., target_dh=±inf by raise_entropy, max_frac=share)``.

    Args:
        share: the dropped share of the ``N`` valid tokens, a real in [0, 1] (0 drops nothing).
        raise_entropy: drop the entropy-lowering tokens (True, the remedy for collapse) or the raising ones.
        lr: ``eta`` of the cheap score (a finite real > 0): it scales ``predicted_dh_*`` only, never the selection.
        The rest as in :func:`autopilot_mask`.

    Returns :class:`AutopilotResult` with ``target_dh`` = +inf or -inf; ``capped`` tells that candidates were left.
    """
    if share is None:
        raise TypeError("share must be a real number in [0, 1], got None")
    target = math.inf if raise_entropy else -math.inf
    return _select(s_centered, advantages, valid, None, lr=lr, ratio=ratio, max_frac=share, sides=sides, form=form,
                   terms=terms, carry=carry, scale=scale, process_group=process_group,
                   law=lambda h: (math.nan, math.nan, target), cap_name="share")  # fmt: skip


def _select(s_centered: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, entropy: torch.Tensor | None, *,
            lr: float | None, ratio: torch.Tensor | None, max_frac: float | None, sides: str, form: str,
            terms: torch.Tensor | None, carry: float, scale: float, process_group: Group,
            law: Callable[[float], tuple[float, float, float]], cap_name: str = "max_frac") -> AutopilotResult:
    """:func:`autopilot_mask`'s selection; ``law(H_t) -> (Ĥ_t, H*_t, target_dh)``; ``cap_name`` names ``max_frac``."""
    n_checks = 3 + (ratio is not None) * 2 + (entropy is not None) + (terms is not None)

    def local() -> tuple[torch.Tensor, tuple]:
        if terms is None:
            if lr is None:
                raise ValueError("lr is required for the cheap score (no terms given): a finite real > 0")
            eta = real_number("lr", lr, above=0)
            kappa = real_number("scale", scale, above=0)
            if carry != 0:
                raise ValueError(f"carry is the law's, given with terms only; got {carry!r} without terms")
        else:
            eta, kappa = math.nan, math.nan
            real_number("carry", carry)
        if max_frac is not None:
            real_number(cap_name, max_frac, minimum=0, maximum=1)
        one_of("sides", sides, SIDES)
        one_of("form", form, FORMS)
        require_float("s_centered", s_centered)
        checks = DataChecks()
        valid_b = valid_mask(valid, s_centered.shape, checks)
        a, y, sums = _weighted_terms(advantages, s_centered, valid_b, ratio, checks)

        def per_token(name: str, x: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
            """``x`` in float64, 0 where invalid, and its sum (0 for None), checked finite at valid positions."""
            if x is None:
                return None, torch.zeros((), dtype=torch.float64, device=y.device)
            require_float(name, x)
            require_shape(name, x, s_centered.shape, "s_centered")
            x64 = torch.where(valid_b, x.to(device=y.device, dtype=torch.float64), 0.0)
            total = x64.sum()
            checks.finite(name, x, valid_b, witness=total)
            return x64, total

        _, h_sum = per_token("entropy", entropy)
        c, c_sum = per_token("terms", terms)
        pos, neg = valid_b & (a > 0), valid_b & (a < 0)
        counts = [pos.sum().to(torch.float64), neg.sum().to(torch.float64)]
        payload = torch.cat([torch.stack(checks.witnesses()), sums, torch.stack([h_sum, c_sum, *counts])])
        return payload, (checks, eta, kappa, valid_b, a, y, c, pos, neg)

    values, (checks, eta, kappa, valid_b, a, y, c, pos, neg) = reduce_or_raise(local, n_checks + 8, process_group)
    checks.verdict(values[:n_checks], process_group)
    n, s_a, s_y, s_ay, h_sum, c_sum, n_pos, n_neg = values[n_checks:]
    nothing = torch.zeros_like(valid_b)
    if n == 0:
        return _result(nothing, 0, 0, 0, 0, 0, False, math.nan, math.nan, math.nan, math.nan, 0.0, 0.0, kappa)
    h = h_sum / n if entropy is not None else math.nan
    h_read, h_target, target = law(h)
    if c is None:
        a_bar, y_bar = (s_a / n, s_y / n) if form == "cov" else (0.0, 0.0)
        p0 = -kappa * eta * (s_ay / n - a_bar * y_bar)
        c = -(kappa * eta / n) * ((a - a_bar) * (y - y_bar))
    else:
        p0 = float(carry) + float(c_sum)
    limit = cap_limit(max_frac, int(n))
    if p0 == target:
        return _result(nothing, n, n_pos, n_neg, 0, 0, False, h, h_read, h_target, target, p0, p0, kappa)

    raise_ = target > p0  # drop entropy-decreasing tokens (c < 0) to raise P, else entropy-increasing ones
    eligible = {"negative": neg, "positive": pos, "both": pos | neg}[sides]
    flat = (eligible & valid_b & ((c < 0) if raise_ else (c > 0))).reshape(-1)
    idx = torch.nonzero(flat).reshape(-1)
    n_local = idx.numel() if limit is None else min(limit, idx.numel())
    sizes = all_gather_cat(torch.tensor([[flat.numel(), n_local, idx.numel()]], device=idx.device), process_group)
    rank = 0 if process_group is None else dist.get_rank(process_group)
    offset = int(sizes[:rank, 0].sum())
    k_pad, n_cand = int(sizes[:, 1].max()), int(sizes[:, 2].sum())
    limit = n_cand if limit is None else min(limit, n_cand)

    score = c.reshape(-1)[idx].abs()  # > 0: how far dropping the token moves the prediction toward the target
    ranked = ranked_rows(score, idx + offset, limit, process_group, pos.reshape(-1)[idx], pad=k_pad)
    sign = 1.0 if raise_ else -1.0
    predicted = p0 + sign * torch.cumsum(ranked[:, 0], 0)  # P_1 .. P_L
    meets = (predicted >= target) if raise_ else (predicted <= target)
    met = bool(meets.any())
    j = int(torch.argmax(meets.to(torch.int8))) + 1 if met else limit
    chosen = ranked[:j]
    dropped = torch.zeros_like(flat)
    dropped[idx[torch.isin(idx + offset, chosen[:, 1].to(torch.int64))]] = True
    n_drop_pos = int(chosen[:, 2].sum())
    capped = not met and n_cand > limit
    after = float(predicted[j - 1]) if j else p0
    dropped = dropped.reshape(valid_b.shape)
    return _result(dropped, n, n_pos, n_neg, j, n_drop_pos, capped, h, h_read, h_target, target, p0, after, kappa)


def _result(dropped: torch.Tensor, n: float, n_pos: float, n_neg: float, n_drop: int, n_drop_pos: int, capped: bool,
            h: float, h_read: float, h_target: float, target: float, before: float, after: float,
            kappa: float) -> AutopilotResult:
    """An :class:`AutopilotResult` whose ``MaskResult`` keeps every token but ``dropped`` (counts are global)."""
    mask = MaskResult(keep=~dropped, method="autopilot", center=0.0, std=0.0, lower=-math.inf, upper=math.inf,
                      n_valid=int(n), n_valid_pos=int(n_pos), n_valid_neg=int(n_neg), n_clipped=n_drop,
                      n_clipped_pos=n_drop_pos, n_clipped_neg=n_drop - n_drop_pos, capped=capped)  # fmt: skip
    return AutopilotResult(mask, h, h_target, target, before, after, h_read, kappa)


class EntropyAutopilot:
    """Feedback controller holding the batch-mean token entropy at a target by dropping tokens: each step
    :func:`autopilot_mask` with ``target_dh_t`` of the law (docs/autopilot.md)::

        Ĥ_0 = H_0,   Ĥ_t = (1 - s) (Ĥ_{t-1} + P_{t-1}) + s H_t        (the smoothed reading, s = smoothing)
        H*_t = H_0 | H_end | H_0 + (H_end - H_0) min(t, D) / D       "hold" | target_entropy=H_end | with decay_steps=D
        target_dh_t = clip((H*_{t+1} - H*_t) - gain (Ĥ_t - H*_t), -max_step, max_step)

    with step ``t`` the non-empty batches seen before this one, ``H_t`` its measured entropy, ``H_0`` the first's,
    ``P_{t-1}`` the previous ``predicted_dh_after``.  ``target_entropy``: ``"hold"`` or ``H_end`` (nats/token, a
    finite real >= 0, at most ``log(vocab_size)`` when that int >= 2 is given); ``decay_steps`` ``D``: int >= 1, with
    a number target; ``gain`` and ``smoothing`` in ``(0, 1]``; ``max_step`` > 0 (``inf`` allowed); the rest as in
    :func:`autopilot_mask`.  :meth:`state_dict` holds the controller's memory; restoring it continues bit for bit.
    """

    def __init__(self, target_entropy: float | str = "hold", *, decay_steps: int | None = None,
                 gain: float = DEFAULT_GAIN, max_step: float = DEFAULT_MAX_STEP,
                 max_frac: float | None = DEFAULT_MAX_FRAC, sides: str = "negative", form: str = "cov",
                 smoothing: float = DEFAULT_SMOOTHING, vocab_size: int | None = None,
                 process_group: Group = None) -> None:
        if isinstance(target_entropy, str):
            one_of("target_entropy", target_entropy, ("hold",))
            self.target_entropy: float | None = None
        else:
            self.target_entropy = real_number("target_entropy", target_entropy, minimum=0)
        if vocab_size is not None:
            vocab_size = integer("vocab_size", vocab_size, minimum=2)
            if self.target_entropy is not None and self.target_entropy > math.log(vocab_size):
                raise ValueError(f"target_entropy {self.target_entropy:g} nats is above log(vocab_size) = "
                                 f"{math.log(vocab_size):.4g}, the largest entropy a distribution over the "
                                 "vocabulary can have")
        self.vocab_size = vocab_size
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
        self.smoothing = real_number("smoothing", smoothing, above=0, maximum=1)
        self.process_group = process_group
        self.calibration = Calibration()
        self.step_count = 0
        self.h_start: float | None = None
        self.h_smooth: float | None = None
        self.last_predicted = 0.0

    def settings(self) -> dict[str, Any]:
        """The settings a saved state must match (plain Python values)."""
        return {name: getattr(self, name) for name in _SETTINGS}

    def target_entropy_at(self, step: int, h_start: float) -> float:
        """``H*_step`` of the law, given the starting entropy ``H_0 = h_start``."""
        if self.target_entropy is None:
            return h_start
        if self.decay_steps is None:
            return self.target_entropy
        return h_start + (self.target_entropy - h_start) * (min(step, self.decay_steps) / self.decay_steps)

    def _law(self, h: float) -> tuple[float, float, float]:
        """``(Ĥ_t, H*_t, target_dh_t)`` of the class docstring for the measured ``H_t = h``."""
        h_start = h if self.h_start is None else self.h_start
        read = h
        if self.h_smooth is not None:
            read = (1 - self.smoothing) * (self.h_smooth + self.last_predicted) + self.smoothing * h
        now, nxt = self.target_entropy_at(self.step_count, h_start), self.target_entropy_at(self.step_count + 1, h_start)
        desired = (nxt - now) - self.gain * (read - now)
        return read, now, min(max(desired, -self.max_step), self.max_step)

    def step(self, advantages: torch.Tensor, *, s_centered: torch.Tensor, entropy: torch.Tensor, valid: torch.Tensor,
             lr: float | None = None, ratio: torch.Tensor | None = None, terms: torch.Tensor | None = None,
             carry: float = 0.0) -> AutopilotResult:
        """One batch, once per optimizer step before it, every rank in the same order: measure ``H_t`` (``entropy``:
        per token, ``s_centered``'s shape), set ``target_dh_t`` by the law, select the tokens to drop (the cheap score
        scaled by :attr:`calibration` without ``terms``; the rest as in :func:`autopilot_mask`).  A batch without a
        valid token keeps everything and leaves the state unchanged."""
        res = _select(s_centered, advantages, valid, entropy, lr=lr, ratio=ratio, max_frac=self.max_frac,
                      sides=self.sides, form=self.form, terms=terms, carry=carry, scale=self.calibration.scale,
                      process_group=self.process_group, law=self._law)  # fmt: skip
        if res.mask.n_valid:
            if self.h_start is None:
                self.h_start = res.entropy
            self.h_smooth = res.entropy_smoothed
            self.last_predicted = res.predicted_dh_after
            self.step_count += 1
        return res

    def calibrate(self, cheap: float, exact: float) -> float:
        """Feed one same-batch pair (``-lr Cov_B(A, r S_c)``, the law's prediction) to :attr:`calibration`; returns
        the new ``kappa``."""
        return self.calibration.update(cheap, exact)

    def from_stats(self, stats: TokenStats, advantages: torch.Tensor, *, lr: float | None = None,
                   ratio: torch.Tensor | None = None, terms: torch.Tensor | None = None,
                   carry: float = 0.0) -> AutopilotResult:
        """:meth:`step` on the fields of a :class:`~entropy_discriminator.TokenStats`."""
        if not isinstance(stats, TokenStats):
            raise TypeError(f"stats must be a TokenStats (from token_stats(logits, labels)), got "
                            f"{type(stats).__name__}; with separate tensors call step(advantages, "
                            "s_centered=..., entropy=..., valid=..., lr=...)")
        return self.step(advantages, s_centered=stats.s_centered, entropy=stats.entropy, valid=stats.valid, lr=lr,
                         ratio=ratio, terms=terms, carry=carry)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "settings", "step", "h_start", "h_smooth", "last_predicted", "calibration"}``, plain Python
        values (``torch.load(weights_only=True)``-safe)."""
        return {"version": STATE_VERSION, "settings": self.settings(), "step": self.step_count,
                "h_start": self.h_start, "h_smooth": self.h_smooth, "last_predicted": self.last_predicted,
                "calibration": self.calibration.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` / ``TypeError`` naming the bad entry (another layout
        version or other settings included)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping from state_dict(), got {type(state).__name__}")
        if "version" in state and state["version"] != STATE_VERSION:
            raise ValueError(f"state['version'] is {state['version']!r}, this autopilot's is {STATE_VERSION}: the "
                             "state was saved by an earlier autopilot (another law and state layout) and cannot "
                             "continue this one; start fresh")
        keys = {"version", "settings", "step", "h_start", "h_smooth", "last_predicted", "calibration"}
        if set(state) != keys:
            raise ValueError(f"state must have the keys {sorted(keys)}, got {sorted(map(str, state))}")
        settings = state["settings"]
        if not isinstance(settings, Mapping) or set(settings) != set(_SETTINGS):
            raise ValueError(f"state['settings'] must have the keys {sorted(_SETTINGS)}, got {settings!r}")
        for name in _SETTINGS:
            if settings[name] != getattr(self, name):
                raise ValueError(f"state['settings']['{name}'] is {settings[name]!r} but this autopilot has "
                                 f"{getattr(self, name)!r}: the state was saved by a controller with other settings")
        step = integer("state['step']", state["step"], minimum=0)
        h_start = None if state["h_start"] is None else real_number("state['h_start']", state["h_start"], minimum=0)
        h_smooth = None if state["h_smooth"] is None else real_number("state['h_smooth']", state["h_smooth"])
        if (step == 0) != (h_start is None) or (h_start is None) != (h_smooth is None):
            raise ValueError(f"state['h_start'] and state['h_smooth'] must be None exactly when state['step'] is 0, got {state!r}")
        last = real_number("state['last_predicted']", state["last_predicted"])
        self.calibration.load_state_dict(state["calibration"])  # checks everything before it changes anything
        self.step_count, self.h_start, self.h_smooth, self.last_predicted = step, h_start, h_smooth, last
