"""One settings object for every adapter: which mask, its bounds, and how it acts on the loss."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from ._checks import did_you_mean, exact_fraction, integer, one_of, real_number
from . import autopilot as _autopilot
from .autopilot import EntropyAutopilot
from .distributed import Group
from .dynamics import FORMS
from .masks import CAP_RULES, DEFAULT_MU, MASK_MODES, SIDES, MaskResult, clip_b_mask, clip_v_mask
from .stats import IMPLS, TokenStats

METHODS = ("none", "clip_b", "clip_v", "autopilot")
#: The threshold masks (``compute_mask``); ``"autopilot"`` is a controller with state (``build_autopilot``).
MASK_METHODS = ("clip_b", "clip_v")
#: The defaults of every entry point (API, CLI, adapters): mu = 2.5 and no cap for both masks (README "Defaults").
DEFAULT_MU_LOW = {"clip_b": DEFAULT_MU, "clip_v": DEFAULT_MU}
DEFAULT_MAX_FRAC: dict[str, float | None] = {"clip_b": None, "clip_v": None}
#: Fields of the threshold masks and their defaults: a non-default value is refused with method ``"autopilot"``.
MASK_ONLY = {"mu_low": None, "mu_high": math.inf, "cap_rule": "share"}
#: Fields of the autopilot and their defaults: a non-default value is refused with ``"clip_b"``/``"clip_v"``.
AUTOPILOT_ONLY: dict[str, Any] = {
    "target_entropy": "hold", "decay_steps": None, "gain": _autopilot.DEFAULT_GAIN,
    "max_step": _autopilot.DEFAULT_MAX_STEP, "eta": None, "form": "cov", "smoothing": _autopilot.DEFAULT_SMOOTHING,
}
#: Fields that only act through a mask or the autopilot, and their defaults: refused away from them (and a number
#: ``max_frac``) with method ``"none"``, since the run would silently only monitor.
CONTROL_ONLY: dict[str, Any] = {**MASK_ONLY, "sides": "negative", "mask_mode": "zero_pg", **AUTOPILOT_ONLY}
#: Defaults of ``calibrate_every`` and ``calibrate_share``: one calibration batch in ten, of whose sequences the
#: after-update pass reads one in four (docs/adapters/law-and-autopilot.md, "What a calibration batch costs").
DEFAULT_CALIBRATE_EVERY = 10
DEFAULT_CALIBRATE_SHARE = 0.25


@dataclass
class EntropyDiscConfig:
    """Entropy-discriminator settings, as adapters read them from a framework's config.

    Every field is checked whenever it is set: a bad value raises ``ValueError`` naming ``entropy_disc.<field>``
    (real fields take any real or 0-d tensor and store a float), an unknown name ``AttributeError``.  Fields set away
    from their defaults are refused (the config unchanged) under a method they do not act in: :data:`MASK_ONLY` under
    ``"autopilot"``, :data:`AUTOPILOT_ONLY` under the masks, :data:`CONTROL_ONLY` and a number ``max_frac`` under
    ``"none"``: set the method first.

    Attributes:
        method: ``"none"`` (metrics only), ``"clip_b"`` (mask on S*), ``"clip_v"`` (mask on S_c) or ``"autopilot"``.
        mu_low, mu_high, sides, cap_rule: as in :func:`~entropy_discriminator.clip_b_mask` (mu_low None: 2.5).
        max_frac: cap on the clipped share in [0, 1], stored as the decimal it was written as; ``"auto"``: no cap
            for the masks, 0.05 for the autopilot; None: no cap.
        mask_mode: as in :func:`~entropy_discriminator.apply_keep_mask`.
        chunk_size, impl: passed to :func:`~entropy_discriminator.token_stats`; log_metrics: log the monitor's.
        target_entropy, decay_steps, gain, max_step, form, smoothing: the autopilot's (docs/autopilot.md).
        eta: the autopilot's step size in ``dH ~ -eta Cov_B(A, r S_c)``; None: the optimizer's learning rate.
        calibrate_every, calibrate_share: every this many batches (0: off) the adapter measures the realised entropy
            change on this share of the batch's sequences (docs/adapters/law-and-autopilot.md).
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
    target_entropy: float | str = "hold"
    decay_steps: int | None = None
    gain: float = _autopilot.DEFAULT_GAIN
    max_step: float = _autopilot.DEFAULT_MAX_STEP
    eta: float | None = None
    form: str = "cov"
    smoothing: float = _autopilot.DEFAULT_SMOOTHING
    calibrate_every: int = DEFAULT_CALIBRATE_EVERY
    calibrate_share: float = DEFAULT_CALIBRATE_SHARE

    def __setattr__(self, name: str, value: Any) -> None:
        check = _FIELD_CHECKS.get(name)
        if check is None:
            raise AttributeError(f"EntropyDiscConfig has no setting {name!r}{did_you_mean(name, _FIELD_CHECKS)}")
        try:
            value = check(f"entropy_disc.{name}", value)
        except TypeError as exc:  # one exception type for every bad setting, as adapters expect
            raise ValueError(str(exc)) from None
        if all(f in self.__dict__ for f in _FIELD_CHECKS):  # built: check the combination it would make
            _check_combination({**{f: self.__dict__[f] for f in _FIELD_CHECKS}, name: value})
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        _check_combination(self.__dict__)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> EntropyDiscConfig:
        """Build from a dict (e.g. a Hydra/OmegaConf node); unknown keys raise ``ValueError`` naming the closest
        field.  Command-line strings are parsed by the field's type (:func:`_from_text`), else ``ValueError``."""
        values = dict(values or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            hints = "".join(did_you_mean(name, known) for name in unknown)
            raise ValueError(f"unknown entropy_disc option(s) {unknown}{hints}; valid: {sorted(known)}")
        for key, text in values.items():
            if isinstance(text, str) and key in _TEXT_KINDS:
                values[key] = _from_text(key, text)
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
        """True when the method reads ``S_c = S* - E_p[S]`` (a full pass over the vocabulary): Clip_V, autopilot."""
        return self.method in ("clip_v", "autopilot")

    def resolved(self) -> tuple[float, float | None]:
        """``(mu_low, max_frac)`` of a threshold mask (clip_b / clip_v) with the method's defaults filled in."""
        if not self.enabled:
            raise ValueError("entropy_disc.method is 'none': there is no mask to resolve")
        if self.method not in MASK_METHODS:
            raise ValueError("entropy_disc.method is 'autopilot': it has no threshold mu_low (see build_autopilot)")
        mu_low = DEFAULT_MU_LOW[self.method] if self.mu_low is None else float(self.mu_low)
        max_frac = DEFAULT_MAX_FRAC[self.method] if self.max_frac == "auto" else self.max_frac
        return mu_low, max_frac

    def compute_mask(self, *, advantages: torch.Tensor, valid: torch.Tensor, s_star: torch.Tensor | None = None,
                     s_centered: torch.Tensor | None = None, stats: TokenStats | None = None,
                     process_group: Group = None) -> MaskResult:
        """The configured mask: :func:`clip_b_mask` on ``s_star`` or :func:`clip_v_mask` on ``s_centered``, or on
        ``stats`` (a :class:`~entropy_discriminator.TokenStats`, instead of the score tensors).  Method
        ``"autopilot"`` raises ``ValueError``: its mask depends on the controller's state (:meth:`build_autopilot`)."""
        if self.method == "autopilot":
            raise ValueError("entropy_disc.method='autopilot' is a controller with state: build it once with "
                             "build_autopilot() and call its from_stats() once per training batch (compute_mask serves "
                             "clip_b and clip_v)")
        mu_low, max_frac = self.resolved()
        if stats is not None:
            if not isinstance(stats, TokenStats):
                raise TypeError(f"stats must be a TokenStats, got {type(stats).__name__}")
            if s_star is not None or s_centered is not None:
                raise ValueError("give compute_mask either stats or s_star / s_centered, not both")
            s_star = s_centered = stats  # the masks read the field and intersect valid with stats.valid
        kwargs = dict(mu_low=mu_low, mu_high=self.mu_high, sides=self.sides, max_frac=max_frac, cap_rule=self.cap_rule,
                      process_group=process_group)
        if self.method == "clip_b":
            if s_star is None:
                raise ValueError("entropy_disc.method='clip_b' needs s_star")
            return clip_b_mask(s_star, advantages, valid, **kwargs)
        if s_centered is None:
            raise ValueError("entropy_disc.method='clip_v' needs s_centered (token_stats over the full vocabulary)")
        return clip_v_mask(s_centered, advantages, valid, **kwargs)

    def build_autopilot(self, process_group: Group = None, *, vocab_size: int | None = None) -> EntropyAutopilot:
        """A fresh :class:`~entropy_discriminator.EntropyAutopilot` with these settings (method ``"autopilot"``;
        ``max_frac="auto"``: 0.05; ``vocab_size``, when known, refuses a target above its log).  Call it per batch as
        ``from_stats(stats, advantages, lr=self.step_size(lr), ratio=r)``."""
        if self.method != "autopilot":
            raise ValueError(f"entropy_disc.method is {self.method!r}: build_autopilot needs method 'autopilot'")
        max_frac = _autopilot.DEFAULT_MAX_FRAC if self.max_frac == "auto" else self.max_frac
        return EntropyAutopilot(self.target_entropy, decay_steps=self.decay_steps, gain=self.gain,
                                max_step=self.max_step, max_frac=max_frac, sides=self.sides, form=self.form,
                                smoothing=self.smoothing, vocab_size=vocab_size, process_group=process_group)

    def step_size(self, learning_rate: float) -> float:
        """``eta`` of the autopilot's law: the ``eta`` field, else ``learning_rate`` (the optimizer's configured peak;
        docs/autopilot.md); ``ValueError`` naming ``entropy_disc.eta`` unless that is a finite real > 0."""
        if self.eta is not None:
            return self.eta
        try:
            return real_number("learning rate", learning_rate, above=0)
        except (TypeError, ValueError):
            raise ValueError("entropy_disc.eta is None, so the autopilot's step size is the optimizer's learning rate, "
                             f"which must be a finite real number > 0, got {learning_rate!r}; set entropy_disc.eta to "
                             "a finite real > 0 (or give the optimizer such a learning rate)") from None


def _check_combination(values: Mapping[str, Any]) -> None:
    """``ValueError`` for settings the method ignores (class docstring) and ``decay_steps`` without a target."""
    method = values["method"]
    if values["decay_steps"] is not None and values["target_entropy"] == "hold":
        raise ValueError(f"entropy_disc.decay_steps={values['decay_steps']} ramps the target from the starting "
                         "entropy to a number entropy_disc.target_entropy; with target_entropy='hold' leave it None")
    if method == "autopilot":
        foreign, why = MASK_ONLY, ("the autopilot drops tokens by their predicted entropy change, not by a "
                                   "threshold in batch stds, and caps with floor(max_frac * n)")
    elif method in MASK_METHODS:
        foreign, why = AUTOPILOT_ONLY, "it sets the entropy autopilot (method 'autopilot')"
    else:
        if values["max_frac"] not in ("auto", None):
            raise ValueError(f"entropy_disc.max_frac={values['max_frac']!r} does not apply to method 'none' (metrics "
                             "only: nothing is clipped); set entropy_disc.method first; leave it at 'auto'")
        foreign, why = CONTROL_ONLY, ("method 'none' only logs metrics and clips nothing, so the run would ignore it; "
                                      "set entropy_disc.method (clip_b, clip_v or autopilot) first")
    for name, default in foreign.items():
        value = values[name]
        if not (value is default or value == default):
            raise ValueError(f"entropy_disc.{name}={value!r} does not apply to method {method!r}: {why}; "
                             f"leave it at its default {default!r}")


def _optional(check):
    """``check(name, value)`` that lets None through."""
    return lambda name, value: None if value is None else check(name, value)


def _max_frac(name: str, value: object) -> float | str | None:
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, str):
        raise ValueError(f"{name} must be 'auto', None or a number in [0, 1], got {value!r}")
    real_number(name, value, minimum=0, maximum=1)
    return float(exact_fraction(value))


def _target_entropy(name: str, value: object) -> float | str:
    if isinstance(value, str):
        if value != "hold":
            raise ValueError(f"{name} must be 'hold' or a number of nats/token >= 0, got {value!r}")
        return value
    return real_number(name, value, minimum=0)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _from_text(key: str, text: str) -> object:
    """The value a command-line string stands for in field ``key`` (:data:`_TEXT_KINDS`), or ``ValueError``."""
    kind, words, takes_none = _TEXT_KINDS[key]
    word = text.strip().lower()
    if text in words:
        return text
    if takes_none and word in ("none", "null"):
        return None
    if kind is bool and word in _TRUE + _FALSE:
        return word in _TRUE
    if kind is not bool:
        with contextlib.suppress(ValueError):
            return kind(text)
    wanted = {float: "a number", int: "an integer", bool: "true or false"}[kind]
    options = [wanted, *(repr(w) for w in words), *(["none"] if takes_none else [])]
    raise ValueError(f"entropy_disc.{key} must be {' or '.join(options)}, got {text!r}")


#: Each field's check, and how :meth:`EntropyDiscConfig.from_mapping` reads a string for it (:func:`_from_text`):
#: ``(kind, words kept as text, takes None)``, or None where the string is the value.
_FIELDS: dict[str, tuple[Callable[[str, Any], Any], tuple[type, tuple[str, ...], bool] | None]] = {
    "method": (partial(one_of, options=METHODS), None),
    "mu_low": (_optional(partial(real_number, finite=False, minimum=0)), (float, (), True)),
    "mu_high": (partial(real_number, finite=False, minimum=0), (float, (), False)),
    "sides": (partial(one_of, options=SIDES), None),
    "max_frac": (_max_frac, (float, ("auto",), True)),
    "cap_rule": (partial(one_of, options=CAP_RULES), None),
    "mask_mode": (partial(one_of, options=MASK_MODES), None),
    "chunk_size": (_optional(partial(integer, minimum=1)), (int, (), True)),
    "impl": (partial(one_of, options=IMPLS), None),
    "log_metrics": (_flag, (bool, (), False)),
    "target_entropy": (_target_entropy, (float, ("hold",), False)),
    "decay_steps": (_optional(partial(integer, minimum=1)), (int, (), True)),
    "gain": (partial(real_number, above=0, maximum=1), (float, (), False)),
    "max_step": (partial(real_number, finite=False, above=0), (float, (), False)),
    "eta": (_optional(partial(real_number, above=0)), (float, (), True)),
    "form": (partial(one_of, options=FORMS), None),
    "smoothing": (partial(real_number, above=0, maximum=1), (float, (), False)),
    "calibrate_every": (partial(integer, minimum=0), (int, (), False)),
    "calibrate_share": (partial(real_number, above=0, maximum=1), (float, (), False)),
}
_FIELD_CHECKS = {name: check for name, (check, _) in _FIELDS.items()}
_TEXT_KINDS = {name: kind for name, (_, kind) in _FIELDS.items() if kind is not None}
