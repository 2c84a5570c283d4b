"""Clip_B / Clip_V and the entropy monitor in TRL's ``GRPOTrainer`` (TRL 1.16.x).

Two ways in, same behaviour:

* ``EntropyDiscGRPOTrainer(model, reward_funcs, args=EntropyDiscGRPOConfig(...), ...)`` — a
  drop-in subclass; ``EntropyDiscGRPOConfig`` is ``GRPOConfig`` plus ``entropy_disc_*`` fields,
  which ``TrlParser`` turns into ``--entropy_disc_method clip_b`` style flags.
* ``patch(config=EntropyDiscConfig(method="clip_b"))`` — gives every stock ``GRPOTrainer``
  (or ``patch(trainer, config)`` one instance) the same behaviour, for launch scripts that build
  the trainer elsewhere (e.g. the ``trl grpo`` CLI).  ``unpatch()`` restores the original
  methods exactly; ``is_patched()`` tells.

Per generation batch (``mask_source="generation"``, default) the policy that generated the batch
scores every completion token once (no grad, TRL's sampling temperature, the core's
:func:`~entropy_discriminator.token_stats`), the keep-mask is computed over the whole global batch
(the torch.distributed world group when accelerate runs several processes) and carried as an
extra (B, T) key through TRL's shuffle/split, so it is the same mask for every
``gradient_accumulation_steps`` slice and every ``num_iterations`` pass.  ``mask_source="current"``
instead recomputes Clip_B per optimisation micro-batch from the loss's own current-policy
log-probs and entropies (``S* = exp(logp) (H + logp)``).  Metrics go to ``trainer._metrics``
under ``entropy_disc/``.  How the seams work: ``_hooks.py``.

``RLOOTrainer`` is not served: its 1.16.0 loss clips a sequence-level ratio of summed log-probs
against an ``old_logps`` stored already summed, so dropping a token would change both sums and the
clipping itself; the same seam (per-token advantages or loss mask) does not exist there.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Any

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without TRL
    raise ImportError(
        "entropy_discriminator.adapters.trl needs TRL 1.16: pip install 'entropy-discriminator[trl]'"
    ) from exc

from entropy_discriminator import EntropyDiscConfig

from .._patching import PatchSet, UnsupportedVersionError, require_version
from ._hooks import (
    KEEP_KEY,
    AdapterState,
    after_generation,
    current_policy_mask,
    loss_inputs,
    validate_options,
)

__all__ = [
    "KEEP_KEY",
    "SUPPORTED_TRL",
    "UnsupportedVersionError",
    "EntropyDiscGRPOConfig",
    "EntropyDiscGRPOTrainer",
    "check_trl_version",
    "is_patched",
    "patch",
    "unpatch",
]

#: TRL versions this adapter is checked against (the private seams below are read from 1.16.0).
SUPPORTED_TRL = ">=1.16.0,<1.17.0"
#: The GRPOTrainer methods the adapter wraps.
HOOKED_METHODS = ("_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies")
_STATE_ATTR = "_entropy_disc_state"


def check_trl_version(version: str | None = None) -> str:
    """Return the installed (or given) TRL version; raise :class:`UnsupportedVersionError`
    (a ``RuntimeError``) outside ``SUPPORTED_TRL``, saying why."""
    return require_version(
        "trl", SUPPORTED_TRL, installed=trl.__version__ if version is None else version,
        why=(f"the adapter enters GRPOTrainer through private methods ({', '.join(HOOKED_METHODS)}) and relies "
             "on their call order and batch keys as read in the TRL 1.16.0 source; another release may change "
             "them without raising an error"),
    )


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EntropyDiscGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the entropy-discriminator settings (CLI flags through ``TrlParser``).

    The ``entropy_disc_*`` fields map one-to-one onto :class:`EntropyDiscConfig` (``mask_source``
    is the adapter's own option); ``__post_init__`` validates them.
    """

    entropy_disc_method: str = field(
        default="none", metadata=_help("Token mask: 'none' (monitor only), 'clip_b' (on S*) or 'clip_v' (on S_c).")
    )
    entropy_disc_mu_low: float | None = field(
        default=None, metadata=_help("Lower threshold in batch std units (None: clip_b 2.5, clip_v 8.5).")
    )
    entropy_disc_mu_high: float = field(
        default=math.inf, metadata=_help("Upper threshold in batch std units (inf: no upper clipping).")
    )
    entropy_disc_sides: str = field(
        default="negative", metadata=_help("Which advantage sign may be clipped: negative, positive or both.")
    )
    entropy_disc_max_frac: str | None = field(
        default="auto",
        metadata=_help("Cap on the clipped share of valid tokens: a number in [0, 1], 'none' (no cap) or 'auto' "
                       "(clip_b: no cap, clip_v: 1e-4)."),
    )
    entropy_disc_mask_mode: str = field(
        default="zero_pg",
        metadata=_help("'zero_pg': clipped tokens lose their policy-gradient term; 'drop_token': they leave the "
                       "loss mask (normaliser shrinks)."),
    )
    entropy_disc_mask_source: str = field(
        default="generation",
        metadata=_help("'generation': one mask per generation batch from the generating policy; 'current': "
                       "Clip_B per micro-batch from the loss's current-policy log-probs and entropies."),
    )
    entropy_disc_chunk_size: int | None = field(
        default=None, metadata=_help("Rows per chunk of the statistics pass (None: sized to ~128 MiB buffers).")
    )
    entropy_disc_impl: str = field(
        default="auto", metadata=_help("Statistics implementation: auto, torch or triton.")
    )
    entropy_disc_log_metrics: bool = field(
        default=True, metadata=_help("Log the entropy_disc/ metrics (entropy percentiles, S*, clip fractions, ...).")
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_options(self.entropy_disc_config(), self.entropy_disc_mask_source)

    def entropy_disc_config(self) -> EntropyDiscConfig:
        """The core :class:`EntropyDiscConfig` these fields describe."""
        return EntropyDiscConfig(
            method=self.entropy_disc_method,
            mu_low=self.entropy_disc_mu_low,
            mu_high=self.entropy_disc_mu_high,
            sides=self.entropy_disc_sides,
            max_frac=_max_frac(self.entropy_disc_max_frac),
            mask_mode=self.entropy_disc_mask_mode,
            chunk_size=self.entropy_disc_chunk_size,
            impl=self.entropy_disc_impl,
            log_metrics=self.entropy_disc_log_metrics,
        )


def _max_frac(value: Any) -> float | str | None:
    """CLI text of ``--entropy_disc_max_frac`` -> the core's value ('auto', None or a float)."""
    if value is None or value == "auto" or isinstance(value, (int, float)):
        return value
    if str(value).lower() in ("none", "null"):
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"entropy_disc_max_frac must be 'auto', 'none' or a number in [0, 1], got {value!r}") from None


class EntropyDiscGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the entropy-discriminator mask and metrics.

    Settings come from ``entropy_disc=`` / ``mask_source=`` when given, else from an
    :class:`EntropyDiscGRPOConfig` ``args``, else monitoring only (``method="none"``).
    """

    def __init__(
        self,
        *args: Any,
        entropy_disc: EntropyDiscConfig | None = None,
        mask_source: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_trl_version()
        train_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if entropy_disc is None:
            entropy_disc = (
                train_args.entropy_disc_config()
                if isinstance(train_args, EntropyDiscGRPOConfig)
                else EntropyDiscConfig()
            )
        if mask_source is None:
            mask_source = (
                train_args.entropy_disc_mask_source if isinstance(train_args, EntropyDiscGRPOConfig) else "generation"
            )
        state = AdapterState(entropy_disc, mask_source)
        super().__init__(*args, **kwargs)
        setattr(self, _STATE_ATTR, state)

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        return after_generation(self, getattr(self, _STATE_ATTR), super()._generate_and_score_completions(inputs))

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        state = getattr(self, _STATE_ATTR)
        try:
            return super()._compute_loss(model, loss_inputs(state, self, inputs))
        finally:
            state.pending = None

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        state = getattr(self, _STATE_ATTR)
        if state.pending is not None and kwargs.get("compute_entropy"):
            current_policy_mask(self, state, out[0], out[1])
        return out


# ---------------------------------------------------------------------------------------------
# patch / unpatch


@dataclass
class _ClassPatch:
    patches: PatchSet
    config: EntropyDiscConfig
    mask_source: str


_CLASS_PATCHES: dict[type, _ClassPatch] = {}
_INSTANCE_PATCHES_ATTR = "_entropy_disc_patches"
_INSTANCE_CACHE_ATTR = "_entropy_disc_class_state"


def _state_for(trainer: Any) -> AdapterState | None:
    """The instance's own state (subclass or instance patch), else one built from the nearest
    class-wide patch in its MRO (cached per instance and per patch), else None (pass through)."""
    own = trainer.__dict__.get(_STATE_ATTR)
    if own is not None:
        return own
    for cls in type(trainer).__mro__:
        entry = _CLASS_PATCHES.get(cls)
        if entry is not None:
            cached = trainer.__dict__.get(_INSTANCE_CACHE_ATTR)
            if cached is None or cached[0] is not entry:
                cached = (entry, AdapterState(entry.config, entry.mask_source))
                trainer.__dict__[_INSTANCE_CACHE_ATTR] = cached
            return cached[1]
    return None


def _wrappers(originals: dict[str, Any]) -> dict[str, Any]:
    """The three wrapped methods around ``originals`` (plain functions taking ``self``).

    Each wrapper finds its settings with :func:`_state_for` and passes through when there are
    none.  Nested wrappers (a patched instance of a patched class, an ``EntropyDiscGRPOTrainer``
    under a class patch) act once: the batch key is added once, stripped by the outermost loss
    wrapper, and the parked current-policy inputs are consumed by the first forward.
    """
    gen, loss, logps = (originals[name] for name in HOOKED_METHODS)

    def _generate_and_score_completions(self: Any, inputs: Any) -> dict[str, Any]:
        out = gen(self, inputs)
        state = _state_for(self)
        return out if state is None else after_generation(self, state, out)

    def _compute_loss(self: Any, model: Any, inputs: dict[str, Any]) -> Any:
        state = _state_for(self)
        if state is None:
            return loss(self, model, inputs)
        try:
            return loss(self, model, loss_inputs(state, self, inputs))
        finally:
            state.pending = None

    def _get_per_token_logps_and_entropies(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = logps(self, *args, **kwargs)
        state = _state_for(self)
        if state is not None and state.pending is not None and kwargs.get("compute_entropy"):
            current_policy_mask(self, state, out[0], out[1])
        return out

    wrapped = {
        "_generate_and_score_completions": _generate_and_score_completions,
        "_compute_loss": _compute_loss,
        "_get_per_token_logps_and_entropies": _get_per_token_logps_and_entropies,
    }
    for name, fn in wrapped.items():
        fn.__wrapped__ = originals[name]  # type: ignore[attr-defined]
        fn.__doc__ = f"entropy-discriminator wrapper of GRPOTrainer.{name} (see adapters/trl/_hooks.py)."
    return wrapped


def _check_target(target: Any) -> None:
    cls = target if isinstance(target, type) else type(target)
    if not issubclass(cls, GRPOTrainer):
        rloo = (" RLOOTrainer's 1.16 loss is sequence-level (a ratio of summed log-probs), so a token mask has no "
                "seam there.") if cls.__name__ == "RLOOTrainer" else ""
        raise TypeError(f"patch() target must be GRPOTrainer, a subclass or an instance of one; got {cls.__name__}."
                        + rloo)


def patch(
    target: Any = None,
    config: EntropyDiscConfig | None = None,
    *,
    mask_source: str = "generation",
) -> Any:
    """Give ``target`` (default: the ``GRPOTrainer`` class) the entropy-discriminator behaviour.

    ``target`` is a ``GRPOTrainer`` subclass (class-wide: every instance, existing or future) or
    one trainer instance.  ``config`` defaults to ``EntropyDiscConfig()`` (monitor only).
    Idempotent: patching again only replaces the settings.  Raises
    :class:`UnsupportedVersionError` for a TRL outside ``SUPPORTED_TRL``, ``TypeError`` /
    ``ValueError`` for a bad target / config.  Returns ``target``.
    """
    check_trl_version()
    target = GRPOTrainer if target is None else target
    _check_target(target)
    config = EntropyDiscConfig() if config is None else config
    validate_options(config, mask_source)
    if isinstance(target, type):
        entry = _CLASS_PATCHES.get(target)
        if entry is not None:
            entry.config, entry.mask_source = config, mask_source
            return target
        patches = PatchSet(f"entropy_disc:{target.__qualname__}")
        for name, fn in _wrappers({name: getattr(target, name) for name in HOOKED_METHODS}).items():
            patches.replace(target, name, fn)
        _CLASS_PATCHES[target] = _ClassPatch(patches, config, mask_source)
        return target
    state = AdapterState(config, mask_source)
    if is_patched(target):
        target.__dict__[_STATE_ATTR] = state
        return target
    if target.__dict__.get(_STATE_ATTR) is not None:
        raise TypeError(f"{type(target).__name__} already applies the entropy discriminator (it is an "
                        "EntropyDiscGRPOTrainer); give it settings with entropy_disc= instead of patch()")
    patches = PatchSet(f"entropy_disc:{type(target).__qualname__} instance")
    unbound = {name: getattr(type(target), name) for name in HOOKED_METHODS}
    for name, fn in _wrappers(unbound).items():
        patches.replace(target, name, types.MethodType(fn, target))
    target.__dict__[_INSTANCE_PATCHES_ATTR] = patches
    target.__dict__[_STATE_ATTR] = state
    return target


def unpatch(target: Any = None) -> bool:
    """Undo :func:`patch` on ``target`` (default: ``GRPOTrainer``); restores the exact original
    class attributes (or removes the instance's wrappers).  Returns whether anything was patched."""
    target = GRPOTrainer if target is None else target
    if isinstance(target, type):
        entry = _CLASS_PATCHES.pop(target, None)
        if entry is None:
            return False
        entry.patches.restore()
        return True
    patches = target.__dict__.pop(_INSTANCE_PATCHES_ATTR, None)
    if patches is None:
        return False
    patches.restore()
    target.__dict__.pop(_STATE_ATTR, None)
    return True


def is_patched(target: Any = None) -> bool:
    """Whether :func:`patch` is in effect on ``target`` itself (a class, default ``GRPOTrainer``,
    or one instance; a class-wide patch is reported for the class, not for its instances)."""
    target = GRPOTrainer if target is None else target
    if isinstance(target, type):
        return target in _CLASS_PATCHES
    return _INSTANCE_PATCHES_ATTR in target.__dict__
