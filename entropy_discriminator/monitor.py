"""Entropy-dynamics metrics with stable names, merged across ranks by sums and counts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._checks import as_valid_mask, broadcast_advantages, require_finite, require_float
from .distributed import Group, all_reduce, kth_smallest
from .dynamics import covariance_sums
from .masks import MaskResult
from .stats import TokenStats


class EntropyMonitor:
    """Turns one batch's per-token tensors into a flat ``dict[str, float]`` under ``prefix``.

    Every mean, std and fraction is reduced from global sums and counts over the valid tokens of
    all ranks of ``process_group`` (never a mean of per-rank means); percentiles are exact order
    statistics found by bisection (no ``torch.quantile``, no gather of the values): the
    nearest-rank percentile ``q`` is the ``ceil(q/100 * n)``-th smallest valid entropy.
    Keys (``prefix`` = ``entropy_disc/``), each present when its inputs are given:

    * ``entropy/mean``, ``entropy/p10`` ... ``entropy/p99``, ``entropy/mean_adv_pos``,
      ``entropy/mean_adv_neg``, ``entropy/kept_mean``, ``entropy/clipped_mean``;
    * ``s_star/mean``, ``s_star/std``, ``s_centered/mean``, ``s_centered/std``;
    * ``clip/frac``, ``clip/frac_adv_pos``, ``clip/frac_adv_neg``, ``clip/n_clipped``,
      ``clip/threshold_low``, ``clip/threshold_high`` (finite ones), ``clip/capped``;
    * ``cov/adv_s_centered`` = ``Cov_B(A, r S_c)``; ``delta_entropy/predicted`` =
      ``-lr * Cov_B(A, r S_c)`` (Corollaries 4, 4.1); ``delta_entropy/realised`` from
      :meth:`realised`;
    * ``tokens/valid``, ``tokens/adv_pos``, ``tokens/adv_neg``.
    """

    def __init__(
        self, *, prefix: str = "entropy_disc/", percentiles: Sequence[float] = (10, 50, 90, 99), process_group: Group = None
    ) -> None:
        for q in percentiles:
            if not 0 < q <= 100:
                raise ValueError(f"percentiles must lie in (0, 100], got {q!r}")
        self.prefix = prefix
        self.percentiles = tuple(percentiles)
        self.process_group = process_group

    def __call__(
        self,
        *,
        entropy: torch.Tensor,
        valid: torch.Tensor,
        advantages: torch.Tensor | None = None,
        s_star: torch.Tensor | None = None,
        s_centered: torch.Tensor | None = None,
        mask: MaskResult | None = None,
        ratio: torch.Tensor | None = None,
        lr: float | None = None,
    ) -> dict[str, float]:
        """Metrics of one batch. Tensors share ``entropy``'s shape (``advantages`` may be ``[B]``).

        ``mask`` must have been computed on this batch (over the same ``process_group``);
        ``ratio`` (``pi / pi_sample``, per token) weights ``S_c`` in the covariance off-policy;
        ``lr`` turns the covariance into the predicted entropy change.
        """
        group = self.process_group
        require_float("entropy", entropy)
        shape = entropy.shape
        valid = as_valid_mask(valid, shape)
        require_finite("entropy", entropy, valid)
        zero = torch.zeros((), dtype=torch.float64, device=entropy.device)
        h = torch.where(valid, entropy.to(torch.float64), zero)
        parts: dict[str, torch.Tensor] = {"n": valid.sum().to(torch.float64), "h": h.sum()}
        adv = None
        if advantages is not None:
            adv = broadcast_advantages(advantages, shape).to(entropy.device)
            require_finite("advantages", adv, valid)
            for side, sel in (("pos", valid & (adv > 0)), ("neg", valid & (adv < 0))):
                parts[f"n_{side}"] = sel.sum().to(torch.float64)
                parts[f"h_{side}"] = torch.where(sel, h, zero).sum()
        for name, t in (("s_star", s_star), ("s_centered", s_centered)):
            if t is not None:
                x = self._masked(name, t, shape, valid)
                parts[f"{name}_1"], parts[f"{name}_2"] = x.sum(), (x * x).sum()
        if mask is not None:
            if mask.keep.shape != shape:
                raise ValueError(f"mask.keep must have entropy's shape {tuple(shape)}, got {tuple(mask.keep.shape)}")
            kept = valid & mask.keep
            parts["h_kept"], parts["n_kept"] = torch.where(kept, h, zero).sum(), kept.sum().to(torch.float64)
        names = list(parts)
        total = dict(zip(names, all_reduce(torch.stack([parts[k] for k in names]), group).tolist()))

        out: dict[str, float] = {}
        n = total["n"]
        out["tokens/valid"] = n
        if n > 0:
            out["entropy/mean"] = total["h"] / n
            ks = [min(max(math.ceil(q / 100 * n), 1), int(n)) for q in self.percentiles]
            values = entropy.to(torch.float32)[valid]
            for q, v in zip(self.percentiles, kth_smallest(values, ks, group)):
                out[f"entropy/p{q:g}"] = v
        if adv is not None:
            for side in ("pos", "neg"):
                out[f"tokens/adv_{side}"] = total[f"n_{side}"]
                if total[f"n_{side}"] > 0:
                    out[f"entropy/mean_adv_{side}"] = total[f"h_{side}"] / total[f"n_{side}"]
        for name in ("s_star", "s_centered"):
            if f"{name}_1" in total and n > 0:
                mean = total[f"{name}_1"] / n
                out[f"{name}/mean"] = mean
                out[f"{name}/std"] = math.sqrt(max(total[f"{name}_2"] / n - mean * mean, 0.0))
        if mask is not None:
            out.update(self._mask_metrics(mask, total))
        if adv is not None and s_centered is not None:
            y = s_centered.to(torch.float64)
            if ratio is not None:
                y = y * self._masked("ratio", ratio, shape, valid)
            c_n, s_a, s_y, s_ay = covariance_sums(adv, y, valid, group).tolist()
            if c_n > 0:
                cov = s_ay / c_n - (s_a / c_n) * (s_y / c_n)
                out["cov/adv_s_centered"] = cov
                if lr is not None:
                    out["delta_entropy/predicted"] = -lr * cov
        return {self.prefix + k: float(v) for k, v in out.items()}

    def from_stats(
        self,
        stats: TokenStats,
        advantages: torch.Tensor | None = None,
        mask: MaskResult | None = None,
        ratio: torch.Tensor | None = None,
        lr: float | None = None,
    ) -> dict[str, float]:
        """:meth:`__call__` on the fields of a :class:`~entropy_discriminator.TokenStats`."""
        return self(
            entropy=stats.entropy,
            valid=stats.valid,
            advantages=advantages,
            s_star=stats.s_star,
            s_centered=stats.s_centered,
            mask=mask,
            ratio=ratio,
            lr=lr,
        )

    def realised(self, entropy_before: torch.Tensor, entropy_after: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
        """``delta_entropy/realised`` = mean(H after) - mean(H before) over the valid tokens of all ranks.

        Both entropies are of the same tokens (same shape), before and after the update.
        """
        require_float("entropy_before", entropy_before)
        require_float("entropy_after", entropy_after)
        if entropy_after.shape != entropy_before.shape:
            raise ValueError(
                f"entropy_after must have entropy_before's shape {tuple(entropy_before.shape)}, "
                f"got {tuple(entropy_after.shape)}"
            )
        valid = as_valid_mask(valid, entropy_before.shape)
        require_finite("entropy_before", entropy_before, valid)
        require_finite("entropy_after", entropy_after, valid)
        diff = torch.where(valid, entropy_after.to(torch.float64) - entropy_before.to(torch.float64), 0.0)
        n, s = all_reduce(torch.stack([valid.sum().to(torch.float64), diff.sum()]), self.process_group).tolist()
        return {self.prefix + "delta_entropy/realised": s / n} if n > 0 else {}

    @staticmethod
    def _masked(name: str, t: torch.Tensor, shape: torch.Size, valid: torch.Tensor) -> torch.Tensor:
        require_float(name, t)
        if t.shape != shape:
            raise ValueError(f"{name} must have entropy's shape {tuple(shape)}, got {tuple(t.shape)}")
        require_finite(name, t, valid)
        return torch.where(valid, t.to(torch.float64), torch.zeros((), dtype=torch.float64, device=t.device))

    @staticmethod
    def _mask_metrics(mask: MaskResult, total: dict[str, float]) -> dict[str, float]:
        out = {
            "clip/frac": mask.clip_frac,
            "clip/n_clipped": mask.n_clipped,
            "clip/capped": float(mask.capped),
            "clip/frac_adv_pos": mask.n_clipped_pos / mask.n_valid_pos if mask.n_valid_pos else 0.0,
            "clip/frac_adv_neg": mask.n_clipped_neg / mask.n_valid_neg if mask.n_valid_neg else 0.0,
        }
        for key, value in (("clip/threshold_low", mask.lower), ("clip/threshold_high", mask.upper)):
            if math.isfinite(value):
                out[key] = value
        n_clipped = total["n"] - total["n_kept"]
        if total["n_kept"] > 0:
            out["entropy/kept_mean"] = total["h_kept"] / total["n_kept"]
        if n_clipped > 0:
            out["entropy/clipped_mean"] = (total["h"] - total["h_kept"]) / n_clipped
        return out
