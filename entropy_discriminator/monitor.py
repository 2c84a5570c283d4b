"""Entropy-dynamics metrics with stable names, merged across ranks by sums and counts."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ._checks import (DataChecks, broadcast_advantages, exact_fraction, real_number, require_float, require_shape,
                      require_tensor, valid_mask, valid_within)
from .distributed import Group, kth_smallest, reduce_or_raise
from .masks import MaskResult
from .stats import TokenStats, field_of


class EntropyMonitor:
    """Turns one batch's per-token tensors into a flat ``dict[str, float]`` under ``prefix`` (docs/api.md, "Metrics":
    global sums and counts over ``process_group``, the same keys for every batch, NaN for a mean over no token).
    ``cov/adv_s_centered`` is ``Cov_B(A, r S_c)``, ``delta_entropy/predicted`` ``-lr * Cov_B(A, r S_c)``."""

    def __init__(self, *, prefix: str = "entropy_disc/", percentiles: Sequence[float] = (10, 50, 90, 99),
                 process_group: Group = None) -> None:
        self.prefix = prefix
        self.percentiles = percentiles
        self.process_group = process_group

    @property
    def prefix(self) -> str:
        """The start of every metric name; checked whenever set."""
        return self._prefix

    @prefix.setter
    def prefix(self, prefix: str) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        self._prefix = prefix

    @property
    def percentiles(self) -> tuple[float, ...]:
        """The logged percentiles, each in ``(0, 100]``; checked (and their ranks recomputed) whenever set."""
        return self._percentiles

    @percentiles.setter
    def percentiles(self, percentiles: Sequence[float]) -> None:
        if isinstance(percentiles, (str, bytes)) or not isinstance(percentiles, Iterable):
            raise TypeError(f"percentiles must be a sequence of numbers in (0, 100], e.g. (10, 50, 90), got "
                            f"{percentiles!r} ({type(percentiles).__name__})")
        values = list(percentiles)
        self._percentiles = tuple(real_number("percentiles", q, above=0, maximum=100) for q in values)
        self._ranks = tuple(exact_fraction(q) / 100 for q in values)

    def percentile_ranks(self, n: int) -> list[int]:
        """Nearest-rank order statistics of the percentiles for ``n`` values: ``ceil(q/100 * n)`` clamped to
        ``[1, n]``, in exact arithmetic on the decimal each ``q`` was written as (p99.9 of 1000 is the 999th)."""
        return [min(max(math.ceil(r * n), 1), n) for r in self._ranks]

    def __call__(self, *, entropy: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor | None = None,
                 s_star: torch.Tensor | None = None, s_centered: torch.Tensor | None = None,
                 mask: MaskResult | None = None, ratio: torch.Tensor | None = None, lr: float | None = None,
                 scale: float | None = None) -> dict[str, float]:
        """Metrics of one batch; float tensors of ``entropy``'s shape (``advantages`` may be ``[B]``).

        ``mask``: computed on this batch over the same valid tokens (else ``ValueError``) and ``process_group``;
        ``ratio``: ``pi / pi_sample`` per token (finite, >= 0), weighting ``S_c`` off-policy; ``lr`` (finite, >= 0):
        gives ``delta_entropy/predicted``; ``scale`` (``kappa`` of a :class:`~entropy_discriminator.law.Calibration`,
        > 0, needs ``lr``): ``-kappa lr Cov_B`` in nats, logged as ``delta_entropy/scale``.  NaN / inf at a valid
        position raises ``ValueError`` naming the tensor, on every rank.  Two host synchronisations.
        """
        return self._metrics(None, entropy=entropy, valid=valid, advantages=advantages, s_star=s_star,
                             s_centered=s_centered, mask=mask, ratio=ratio, lr=lr, scale=scale)

    def _metrics(self, within: torch.Tensor | None, *, entropy: torch.Tensor, valid: torch.Tensor,
                 advantages: torch.Tensor | None, s_star: torch.Tensor | None, s_centered: torch.Tensor | None,
                 mask: MaskResult | None, ratio: torch.Tensor | None, lr: float | None,
                 scale: float | None) -> dict[str, float]:
        """:meth:`__call__` counting only the positions of ``valid`` inside ``within`` (a TokenStats' ``valid``)."""
        group = self.process_group
        has_adv, has_cov = advantages is not None, advantages is not None and s_centered is not None
        optional = (has_adv, s_star is not None, s_centered is not None, ratio is not None)
        n_checks = 2 + sum(optional) + optional[3]  # ratio: finite and >= 0
        size = n_checks + 2 + 4 * has_adv + 2 * optional[1] + 2 * optional[2] + 2 * (mask is not None) + 3 * has_cov

        def local() -> tuple[torch.Tensor, tuple]:
            lr_value = None if lr is None else real_number("lr", lr, minimum=0)
            if scale is not None:
                if lr is None:
                    raise ValueError("scale calibrates the prediction -lr Cov_B: give lr with it")
                lr_value *= real_number("scale", scale, above=0)
            require_float("entropy", entropy)
            shape = entropy.shape
            checks = DataChecks()
            valid_b = valid_mask(valid_within(valid, within), shape, checks)
            h = self._masked("entropy", entropy, shape, valid_b)
            h_sum = h.sum()
            checks.finite("entropy", entropy, valid_b, witness=h_sum)
            parts = [valid_b.sum().to(torch.float64), h_sum]
            if advantages is not None:
                adv = broadcast_advantages(advantages, shape).to(entropy.device)
                a = torch.where(valid_b, adv, 0.0)
                a_sum = a.sum()
                checks.finite("advantages", adv, valid_b, witness=a_sum)
                for sel in (a > 0, a < 0):
                    parts += [sel.sum().to(torch.float64), torch.where(sel, h, 0.0).sum()]
            masked, sums = {}, {}
            for name, t in (("s_star", s_star), ("s_centered", s_centered), ("ratio", ratio)):
                if t is not None:
                    masked[name] = x = self._masked(name, t, shape, valid_b)
                    sums[name] = x.sum()
                    checks.finite(name, t, valid_b, witness=sums[name])
                    if name != "ratio":
                        parts += [sums[name], (x * x).sum()]
            if "ratio" in masked:  # r = pi / pi_sample: a negative one flips the sign of its token's term
                checks.count("ratio must be >= 0 (pi / pi_sample); negative at {} valid position(s)",
                             (masked["ratio"] < 0).sum())
            if mask is not None:
                keep = require_tensor("mask.keep", getattr(mask, "keep", None))
                require_shape("mask.keep", keep, shape, "entropy")
                kept = valid_b & keep.to(entropy.device)
                parts += [torch.where(kept, h, 0.0).sum(), kept.sum().to(torch.float64)]
            if has_cov:  # sums of a, y = r * S_c and a * y over the valid tokens (zero elsewhere)
                y = masked["s_centered"] * masked["ratio"] if "ratio" in masked else masked["s_centered"]
                parts += [a_sum, y.sum() if "ratio" in masked else sums["s_centered"], (a * y).sum()]
            payload = torch.stack([*checks.witnesses(), *parts])
            return payload, (checks, valid_b, lr_value)

        values, (checks, valid_b, lr_value) = reduce_or_raise(local, size, group)
        checks.verdict(values[:n_checks], group)
        total = iter(values[n_checks:])
        n, h_sum = next(total), next(total)
        out: dict[str, float] = {"tokens/valid": n, "entropy/mean": _ratio(h_sum, n)}
        values = kth_smallest(entropy, self.percentile_ranks(int(n)), group, where=valid_b) if n > 0 else None
        for i, q in enumerate(self.percentiles):
            out[f"entropy/p{q:g}"] = math.nan if values is None else values[i]
        if has_adv:
            for side in ("pos", "neg"):
                count, h_side = next(total), next(total)
                out[f"tokens/adv_{side}"] = count
                out[f"entropy/mean_adv_{side}"] = _ratio(h_side, count)
        for name, t in (("s_star", s_star), ("s_centered", s_centered)):
            if t is not None:
                s1, s2 = next(total), next(total)
                mean = _ratio(s1, n)
                out[f"{name}/mean"] = mean
                out[f"{name}/std"] = math.sqrt(max(s2 / n - mean * mean, 0.0)) if n > 0 else math.nan
        if mask is not None:
            if getattr(mask, "n_valid", n) != n:
                raise ValueError(f"mask was computed over {mask.n_valid} valid token(s), these statistics count "
                                 f"{int(n)}: build the mask over the same tokens (pass the TokenStats to clip_b_mask / "
                                 "clip_v_mask, or a response mask intersected with stats.valid)")
            h_kept, n_kept = next(total), next(total)
            out.update({"clip/frac": mask.clip_frac, "clip/n_clipped": mask.n_clipped,
                        "clip/capped": float(mask.capped),
                        "clip/frac_adv_pos": mask.n_clipped_pos / mask.n_valid_pos if mask.n_valid_pos else 0.0,
                        "clip/frac_adv_neg": mask.n_clipped_neg / mask.n_valid_neg if mask.n_valid_neg else 0.0})
            for key, value in (("clip/threshold_low", mask.lower), ("clip/threshold_high", mask.upper)):
                if math.isfinite(value):
                    out[key] = value
            out["entropy/kept_mean"] = _ratio(h_kept, n_kept)
            out["entropy/clipped_mean"] = _ratio(h_sum - h_kept, n - n_kept)
        if has_cov:
            s_a, s_y, s_ay = next(total), next(total), next(total)
            cov = s_ay / n - (s_a / n) * (s_y / n) if n > 0 else math.nan
            out["cov/adv_s_centered"] = cov
            if lr_value is not None:
                out["delta_entropy/predicted"] = -lr_value * cov
                if scale is not None:
                    out["delta_entropy/scale"] = float(scale)
        return {self.prefix + k: float(v) for k, v in out.items()}

    def from_stats(self, stats: TokenStats, advantages: torch.Tensor | None = None, mask: MaskResult | None = None,
                   ratio: torch.Tensor | None = None, lr: float | None = None, scale: float | None = None, *,
                   valid: torch.Tensor | None = None) -> dict[str, float]:
        """:meth:`__call__` on the fields of a :class:`~entropy_discriminator.TokenStats`; ``valid`` (bool or 0/1 of
        the statistics' shape, e.g. a response mask) narrows the tokens counted to those valid in both."""
        if not isinstance(stats, TokenStats):
            raise TypeError(f"stats must be a TokenStats (from entropy_discriminator.token_stats), got "
                            f"{type(stats).__name__}; for separate tensors call the monitor itself")
        return self._metrics(stats.valid, entropy=stats.entropy, valid=stats.valid if valid is None else valid,
                             advantages=advantages, s_star=stats.s_star, s_centered=stats.s_centered, mask=mask,
                             ratio=ratio, lr=lr, scale=scale)

    def realised(self, entropy_before: torch.Tensor | TokenStats, entropy_after: torch.Tensor | TokenStats,
                 valid: torch.Tensor) -> dict[str, float]:
        """``delta_entropy/realised`` = mean(H after) - mean(H before) over the valid tokens of all ranks (``NaN``
        for none): the same tokens' entropies (one shape), or their ``TokenStats`` (then valid in both counts)."""
        entropy_before, before_valid = field_of(entropy_before, "entropy")
        entropy_after, after_valid = field_of(entropy_after, "entropy")

        def local() -> tuple[torch.Tensor, DataChecks]:
            require_float("entropy_before", entropy_before)
            require_float("entropy_after", entropy_after)
            require_shape("entropy_after", entropy_after, entropy_before.shape, "entropy_before")
            checks = DataChecks()
            counted = valid_within(valid_within(valid, before_valid), after_valid)
            valid_b = valid_mask(counted, entropy_before.shape, checks)
            checks.finite("entropy_before", entropy_before, valid_b)
            checks.finite("entropy_after", entropy_after, valid_b)
            diff = torch.where(valid_b, entropy_after.to(torch.float64) - entropy_before.to(torch.float64), 0.0)
            return torch.stack([*checks.witnesses(), valid_b.sum().to(torch.float64), diff.sum()]), checks

        values, checks = reduce_or_raise(local, 5, self.process_group)
        checks.verdict(values[:3], self.process_group)
        n, s = values[3:]
        return {self.prefix + "delta_entropy/realised": _ratio(s, n)}

    @staticmethod
    def _masked(name: str, t: object, shape: torch.Size, valid: torch.Tensor) -> torch.Tensor:
        """float64 ``t`` with zeros at the invalid positions, after checking its dtype and shape."""
        require_float(name, t)
        require_shape(name, t, shape, "entropy")
        return torch.where(valid, t.to(torch.float64), 0.0)


def _ratio(total: float, count: float) -> float:
    """``total / count``, NaN when ``count`` is 0 (a mean over no token is undefined)."""
    return total / count if count > 0 else math.nan
