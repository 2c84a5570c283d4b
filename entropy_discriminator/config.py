"""One settings object for every adapter: which mask, its bounds, and how it acts on the loss."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .distributed import Group
from .masks import MASK_MODES, SIDES, MaskResult, clip_b_mask, clip_v_mask
from .stats import IMPLS

METHODS = ("none", "clip_b", "clip_v")
#: The reference implementation's defaults (Trinity-RFT 0.6.0 configs): mu and the clipped-share cap.
DEFAULT_MU_LOW = {"clip_b": 2.5, "clip_v": 8.5}
DEFAULT_MAX_FRAC = {"clip_b": None, "clip_v": 1e-4}


@dataclass
class EntropyDiscConfig:
    """Entropy-discriminator settings, as adapters read them from a framework's config.

    Attributes:
        method: ``"none"`` (metrics only), ``"clip_b"`` (mask on S*) or ``"clip_v"`` (mask on S_c).
        mu_low: lower bound in batch stds; None takes the method's default (2.5 / 8.5).
        mu_high: upper bound in batch stds; ``inf`` (default) clips one side only.
        sides: advantage sign whose tokens may be clipped: negative, positive or both.
        max_frac: cap on the clipped share; ``"auto"`` takes the method's default (none for
            Clip_B, 1e-4 for Clip_V), None disables the cap.
        mask_mode: ``"zero_pg"`` (clipped tokens lose their policy-gradient term; the loss
            normaliser is unchanged) or ``"drop_token"`` (they leave the loss mask).
        chunk_size, impl: passed to :func:`~entropy_discriminator.token_stats`.
        log_metrics: log the monitor's metrics every step.
    """

    method: str = "none"
    mu_low: float | None = None
    mu_high: float = math.inf
    sides: str = "negative"
    max_frac: float | str | None = "auto"
    mask_mode: str = "zero_pg"
    chunk_size: int | None = None
    impl: str = "auto"
    log_metrics: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> EntropyDiscConfig:
        """Build from a dict (e.g. a Hydra/OmegaConf node); unknown keys raise ``ValueError``."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown entropy_disc option(s) {unknown}; valid: {sorted(known)}")
        for key in ("mu_low", "mu_high", "max_frac"):
            if isinstance(values.get(key), str) and values[key] not in ("auto",):
                values[key] = float(values[key])  # "inf" from a command line
        return cls(**values)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.method not in METHODS:
            raise ValueError(f"entropy_disc.method must be one of {METHODS}, got {self.method!r}")
        for name in ("mu_low", "mu_high"):
            mu = getattr(self, name)
            if mu is None and name == "mu_low":
                continue
            if not isinstance(mu, (int, float)) or math.isnan(mu) or mu < 0:
                raise ValueError(f"entropy_disc.{name} must be a number >= 0, got {mu!r}")
        if self.sides not in SIDES:
            raise ValueError(f"entropy_disc.sides must be one of {SIDES}, got {self.sides!r}")
        mf = self.max_frac
        if mf != "auto" and mf is not None and (not isinstance(mf, (int, float)) or not 0 <= mf <= 1):
            raise ValueError(f"entropy_disc.max_frac must be 'auto', None or a number in [0, 1], got {mf!r}")
        if self.mask_mode not in MASK_MODES:
            raise ValueError(f"entropy_disc.mask_mode must be one of {MASK_MODES}, got {self.mask_mode!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"entropy_disc.impl must be one of {IMPLS}, got {self.impl!r}")
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size < 1):
            raise ValueError(f"entropy_disc.chunk_size must be a positive int or None, got {self.chunk_size!r}")

    @property
    def enabled(self) -> bool:
        """True when a mask is computed (method is not ``"none"``)."""
        return self.method != "none"

    @property
    def needs_expected(self) -> bool:
        """True when the mask needs ``E_p[S]`` (a full pass over the vocabulary), i.e. Clip_V."""
        return self.method == "clip_v"

    def resolved(self) -> tuple[float, float | None]:
        """``(mu_low, max_frac)`` with the method's defaults filled in."""
        if not self.enabled:
            raise ValueError("entropy_disc.method is 'none': there is no mask to resolve")
        mu_low = DEFAULT_MU_LOW[self.method] if self.mu_low is None else float(self.mu_low)
        max_frac = DEFAULT_MAX_FRAC[self.method] if self.max_frac == "auto" else self.max_frac
        return mu_low, max_frac

    def compute_mask(
        self,
        *,
        advantages: torch.Tensor,
        valid: torch.Tensor,
        s_star: torch.Tensor | None = None,
        s_centered: torch.Tensor | None = None,
        process_group: Group = None,
    ) -> MaskResult:
        """The configured mask: :func:`clip_b_mask` on ``s_star`` or :func:`clip_v_mask` on ``s_centered``."""
        mu_low, max_frac = self.resolved()
        kwargs = dict(mu_low=mu_low, mu_high=self.mu_high, sides=self.sides, max_frac=max_frac, process_group=process_group)
        if self.method == "clip_b":
            if s_star is None:
                raise ValueError("entropy_disc.method='clip_b' needs s_star")
            return clip_b_mask(s_star, advantages, valid, **kwargs)
        if s_centered is None:
            raise ValueError("entropy_disc.method='clip_v' needs s_centered (token_stats over the full vocabulary)")
        return clip_v_mask(s_centered, advantages, valid, **kwargs)
