"""One settings object for every adapter: which mask, its bounds, and how it acts on the loss."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._checks import exact_fraction, integer, one_of, real_number
from .distributed import Group
from .masks import CAP_RULES, DEFAULT_MU, MASK_MODES, SIDES, MaskResult, clip_b_mask, clip_v_mask
from .stats import IMPLS

METHODS = ("none", "clip_b", "clip_v")
#: The defaults of every entry point (API, CLI, adapters): mu = 2.5 and no cap for both masks (README "Defaults":
#: the reference's Clip_V setting for 7B models, mu 8.5 with a 1e-4 cap, clips nothing in a batch under 10,000 tokens).
DEFAULT_MU_LOW = {"clip_b": DEFAULT_MU, "clip_v": DEFAULT_MU}
DEFAULT_MAX_FRAC: dict[str, float | None] = {"clip_b": None, "clip_v": None}


@dataclass
class EntropyDiscConfig:
    """Entropy-discriminator settings, as adapters read them from a framework's config.

    Every field is checked when it is set, at construction and on any later assignment
    (``cfg.method = "clip_x"`` raises ``ValueError`` naming ``entropy_disc.method`` at once;
    every bad setting raises ``ValueError``, whatever its type);
    real-valued fields take any real number or 0-d tensor and are stored as Python floats.

    Attributes:
        method: ``"none"`` (metrics only), ``"clip_b"`` (mask on S*) or ``"clip_v"`` (mask on S_c).
        mu_low: lower bound in batch stds (>= 0, ``inf`` disables it); None takes the default
            (2.5 for both methods).
        mu_high: upper bound in batch stds; ``inf`` (default) clips one side only.
        sides: advantage sign whose tokens may be clipped: negative, positive or both.
        max_frac: cap on the clipped share, in [0, 1]: a batch of ``n`` valid tokens clips at most
            ``floor(max_frac * n)`` (so 0 clips nothing; see
            :func:`~entropy_discriminator.masks.cap_limit`); ``"auto"`` takes the default (no cap
            for either method), None disables the cap.  Stored as the decimal it was written as
            (``np.float32(1e-4)`` becomes ``0.0001``).
        cap_rule: ``"share"`` (``floor(max_frac * n)``) or ``"reference"`` (at least one token
            when over the cap, Trinity-RFT's rule).
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
    cap_rule: str = "share"
    mask_mode: str = "zero_pg"
    chunk_size: int | None = None
    impl: str = "auto"
    log_metrics: bool = True

    def __setattr__(self, name: str, value: Any) -> None:
        check = _FIELD_CHECKS.get(name)
        if check is not None:
            try:
                value = check(f"entropy_disc.{name}", value)
            except TypeError as exc:  # one exception type for every bad setting, as adapters expect
                raise ValueError(str(exc)) from None
        object.__setattr__(self, name, value)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> EntropyDiscConfig:
        """Build from a dict (e.g. a Hydra/OmegaConf node); unknown keys raise ``ValueError``.

        Strings are accepted for the real-valued fields (``"inf"``, ``"1e-4"`` from a command
        line); one that is not a number raises ``ValueError`` naming the field.
        """
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown entropy_disc option(s) {unknown}; valid: {sorted(known)}")
        for key in ("mu_low", "mu_high", "max_frac"):
            text = values.get(key)
            if isinstance(text, str) and text != "auto":
                try:
                    values[key] = float(text)
                except ValueError:
                    raise ValueError(f"entropy_disc.{key} must be a number, got {text!r}") from None
        return cls(**values)

    def validate(self) -> None:
        """Check every field again (each is also checked whenever it is set); errors name the field."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name))

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
        kwargs = dict(mu_low=mu_low, mu_high=self.mu_high, sides=self.sides, max_frac=max_frac, cap_rule=self.cap_rule,
                      process_group=process_group)
        if self.method == "clip_b":
            if s_star is None:
                raise ValueError("entropy_disc.method='clip_b' needs s_star")
            return clip_b_mask(s_star, advantages, valid, **kwargs)
        if s_centered is None:
            raise ValueError("entropy_disc.method='clip_v' needs s_centered (token_stats over the full vocabulary)")
        return clip_v_mask(s_centered, advantages, valid, **kwargs)


def _choice(options: tuple[str, ...]):
    return lambda name, value: one_of(name, value, options)


def _mu_low(name: str, value: object) -> float | None:
    return None if value is None else real_number(name, value, finite=False, minimum=0)


def _max_frac(name: str, value: object) -> float | str | None:
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, str):
        raise ValueError(f"{name} must be 'auto', None or a number in [0, 1], got {value!r}")
    real_number(name, value, minimum=0, maximum=1)
    return float(exact_fraction(value))


def _chunk_size(name: str, value: object) -> int | None:
    return None if value is None else integer(name, value, minimum=1)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


_FIELD_CHECKS = {
    "method": _choice(METHODS),
    "mu_low": _mu_low,
    "mu_high": lambda name, value: real_number(name, value, finite=False, minimum=0),
    "sides": _choice(SIDES),
    "max_frac": _max_frac,
    "cap_rule": _choice(CAP_RULES),
    "mask_mode": _choice(MASK_MODES),
    "chunk_size": _chunk_size,
    "impl": _choice(IMPLS),
    "log_metrics": _flag,
}
