"""Patch and unpatch: the three wrapped ``GRPOTrainer`` methods and what each does per route.

Wrappers (one set per target; :func:`make_wrappers`), each finding its :class:`AdapterState`
with a resolver and passing straight through when there is none:

1. ``_generate_and_score_completions(inputs)``: on the first call decides the route
   (:func:`._support.plan`, refusals raised before any generation); for the old-pass route arms the
   capture of TRL's own old-policy pass; afterwards (old-pass and extra-pass routes) computes the
   mask over the whole generation batch (method ``"autopilot"``: one controller step,
   :mod:`._autopilot`, whose state it first binds to this ``train()`` call), adds it as
   ``KEEP_KEY`` (B, T) (TRL's shuffle/split carry it with its rows) and logs the metrics.
2. ``_compute_loss(model, inputs)``: applies a carried mask (:func:`._mask.apply_keep`), or, on the
   training-forward and current routes, parks a copy of the inputs for the forward below.
3. ``_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)``:
   when a capture is armed (old or extra pass) or inputs are parked (training forward), runs TRL's
   own pass with the backbone's hidden states captured (:mod:`._stats`); for parked inputs it
   writes ``A * keep`` into them before ``_compute_loss`` reads the advantages.

Targets: :class:`EntropyDiscGRPOTrainer` (wraps the stock methods; settings from its arguments),
one instance (:func:`patch` on an object) or a class (:func:`patch` on ``GRPOTrainer`` or a
subclass; settings per instance from ``patch``'s config or the trainer's
``EntropyDiscGRPOConfig``).  Exactly one layer acts on a trainer: class wrappers pass through for
an instance with its own state, and only the class patch nearest in the MRO acts.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from trl import GRPOTrainer

from entropy_discriminator import EntropyAutopilot, EntropyDiscConfig, MaskResult, TokenStats

from entropy_discriminator.law_scale import LawScale
from .._patching import PatchSet
from . import _autopilot
from ._mask import KEEP_KEY, apply_keep, compute_mask, keep_advantages, kept_token_count, loss_mask, process_group
from ._metrics import log_metrics
from ._stats import HiddenCapture, backbone, restrict, stats_from_hidden
from ._tap import HeadTap
from ._support import (
    CURRENT,
    EXTRA_PASS,
    HOOKED_METHODS,
    OLD_PASS,
    TRAINING_FORWARD,
    Plan,
    check_trl_version,
    plan,
    validate_options,
)

_STATE_ATTR = "_entropy_disc_state"
_INSTANCE_PATCHES_ATTR = "_entropy_disc_patches"
_CLASS_STATE_ATTR = "_entropy_disc_class_state"
#: Keys whose presence means a multimodal batch: the statistics read text-only passes.
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                    "mm_token_type_ids", "image_position_ids", "num_images")
#: GRPOTrainer's own methods, taken before anything is patched.
STOCK_METHODS = {name: GRPOTrainer.__dict__[name] for name in HOOKED_METHODS}


@dataclass
class AdapterState:
    """Per-trainer settings and the hand-over between the wrapped methods.

    ``plan``: the route, decided on the first training generation (or at construction).
    ``capture_next``: the next log-prob pass of ``trainer.model`` is captured into ``captured``.
    ``pending``: the parked inputs copy of the ``_compute_loss`` call whose mask is still to be
    computed, ``pending_source`` the buffered dict it copies; ``cached`` keeps
    ``(buffered dict, keep)`` so later ``num_iterations`` passes over that dict reuse the mask.
    ``autopilot``: method ``"autopilot"``'s controller, bound by :func:`._autopilot.sync` to the
    ``trainer.state`` of the running ``train()`` call, ``autopilot_run``; ``law`` the scale of the
    cheap prediction (:func:`._autopilot.sync_law`, ``law_run``), ``law_pending`` a calibration batch
    waiting for its after-update pass.
    """

    config: EntropyDiscConfig
    mask_source: str = "generation"
    plan: Plan | None = field(default=None, init=False)
    capture_next: bool = field(default=False, init=False)
    captured: TokenStats | None = field(default=None, init=False)
    pending: dict[str, Any] | None = field(default=None, init=False)
    pending_source: dict[str, Any] | None = field(default=None, init=False)
    cached: tuple[dict[str, Any], torch.Tensor | None] | None = field(default=None, init=False)
    autopilot: EntropyAutopilot | None = field(default=None, init=False)
    autopilot_run: Any = field(default=None, init=False)
    law: LawScale | None = field(default=None, init=False)
    law_run: Any = field(default=None, init=False)
    law_pending: _autopilot.PendingCalibration | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        validate_options(self.config, self.mask_source)

    @property
    def masking(self) -> bool:
        return self.config.method != "none"


def start(trainer: Any, state: AdapterState) -> Plan:
    """The trainer's route (decided once; raises ``ValueError`` for a refused configuration)."""
    if state.plan is None:
        state.plan = plan(trainer, state.config, state.mask_source)
    return state.plan


def settings_from_args(args: Any) -> tuple[EntropyDiscConfig, str] | None:
    """``(config, mask_source)`` carried by an ``EntropyDiscGRPOConfig``, else None."""
    build = getattr(args, "entropy_disc_config", None)
    return None if build is None else (build(), args.entropy_disc_mask_source)


# ------------------------------------------------------------------------------------------------- routes


def _generate(trainer: Any, state: AdapterState, original: Callable, inputs: Any) -> dict[str, Any]:
    if not trainer.model.training:
        return original(trainer, inputs)
    route = start(trainer, state).route
    if state.config.method == "autopilot":
        _autopilot.sync(trainer, state)
    _autopilot.sync_law(trainer, state)
    _autopilot.calibrate_pending(trainer, state, _extra_pass)
    state.capture_next = route == OLD_PASS
    try:
        batch = original(trainer, inputs)
    finally:
        state.capture_next = False
    if route not in (OLD_PASS, EXTRA_PASS):
        return batch
    multimodal = [k for k in _MULTIMODAL_KEYS if batch.get(k) is not None]
    if multimodal:
        raise ValueError(
            f"the entropy-discriminator TRL adapter scores text-only batches; this batch carries {multimodal}")
    if route == EXTRA_PASS:
        _extra_pass(trainer, state, batch)
    stats, state.captured = state.captured, None
    if stats is None:
        raise RuntimeError("TRL ran no old-policy pass over this generation batch although its settings say it does "
                           "(gradient_accumulation_steps, steps_per_generation, num_iterations, vLLM importance "
                           "sampling); this TRL build differs from the supported releases")
    return _mask_generation_batch(trainer, state, batch, restrict(stats, loss_mask(batch)))


def _extra_pass(trainer: Any, state: AdapterState, batch: dict[str, Any]) -> None:
    """TRL's own log-prob method over the generation batch (no grad), its hidden states captured."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    state.capture_next = True
    try:
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention, batch["completion_ids"].size(1),
                batch_size=trainer.args.per_device_train_batch_size,
            )
    finally:
        state.capture_next = False


def _mask_generation_batch(trainer: Any, state: AdapterState, batch: dict[str, Any], stats: TokenStats) -> dict[str, Any]:
    """Add ``KEEP_KEY`` (and the kept-token ``num_items_in_batch`` for drop_token); log metrics."""
    group = process_group(trainer)
    result = None
    if state.masking:
        result = _select(trainer, state, stats, batch["advantages"], batch, group)
        batch = dict(batch)
        batch[KEEP_KEY] = result.keep.bool()
        if state.config.mask_mode == "drop_token":
            batch["num_items_in_batch"] = kept_token_count(trainer, batch, batch[KEEP_KEY])
    law = _autopilot.law_batch(trainer, state, stats, batch["advantages"], batch)
    if state.config.log_metrics:
        log_metrics(trainer, stats, batch["advantages"], result, group, law)
    return batch


def _select(trainer: Any, state: AdapterState, stats: TokenStats, advantages: torch.Tensor, batch: dict[str, Any],
            group: Any) -> MaskResult:
    """The keep-mask of one batch: the configured Clip_B / Clip_V mask, or one autopilot step."""
    if state.config.method == "autopilot":
        return _autopilot.step(trainer, state, stats, advantages, _autopilot.sampling_ratio(batch, stats.valid.shape))
    return compute_mask(state.config, stats, advantages, group)


def _compute_loss(trainer: Any, state: AdapterState, original: Callable, model: Any, inputs: dict[str, Any]) -> Any:
    keep = inputs.get(KEEP_KEY)
    if keep is not None:
        return original(trainer, model, apply_keep(state.config, inputs, keep))
    if not trainer.model.training or state.plan is None or state.plan.route not in (TRAINING_FORWARD, CURRENT):
        return original(trainer, model, inputs)
    if state.plan.route == TRAINING_FORWARD and state.cached is not None and state.cached[0] is inputs:
        cached_keep = state.cached[1]
        return original(trainer, model, inputs if cached_keep is None else apply_keep(state.config, inputs, cached_keep))
    state.pending, state.pending_source = dict(inputs), inputs
    try:
        return original(trainer, model, state.pending)
    finally:
        state.pending = state.pending_source = None


def _logps(trainer: Any, state: AdapterState, original: Callable, model: Any, input_ids: torch.Tensor,
           attention_mask: torch.Tensor, logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
    parked = state.pending if kwargs.get("compute_entropy") else None
    if not (state.capture_next and model is trainer.model) and parked is None:
        return original(trainer, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
    state.capture_next = False
    state.pending = None
    with HiddenCapture(backbone(trainer), logits_to_keep) as capture, HeadTap(state.config.impl) as tap:
        out = original(trainer, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
    valid = attention_mask[:, -logits_to_keep:].bool()
    stats = tap.stats(valid)
    if stats is None:  # TRL's head could not be read (1.14's full logits, softcapped logits): a head pass of ours
        stats = stats_from_hidden(trainer, capture.hidden(), input_ids[:, -logits_to_keep:], valid,
                                  chunk_size=state.config.chunk_size, impl=state.config.impl,
                                  autocast_dtype=capture.autocast_dtype)
    if parked is None:
        state.captured = stats
    else:
        _mask_micro_batch(trainer, state, parked, restrict(stats, loss_mask(parked)))
    return out


def _mask_micro_batch(trainer: Any, state: AdapterState, parked: dict[str, Any], stats: TokenStats) -> None:
    """Training-forward / current routes: the mask of this micro-batch written into the parked inputs
    as ``A * keep`` before ``_compute_loss`` reads them (zero_pg; the plan refuses drop_token here)."""
    group = process_group(trainer)
    advantages = parked["advantages"]
    result = _select(trainer, state, stats, advantages, parked, group) if state.masking else None
    if result is not None:
        parked["advantages"] = keep_advantages(advantages, result.keep.bool())
    if state.plan.route == TRAINING_FORWARD:
        state.cached = (state.pending_source, None if result is None else result.keep.bool())
    law = _autopilot.law_batch(trainer, state, stats, advantages, parked)
    if state.config.log_metrics:
        log_metrics(trainer, stats, advantages, result, group, law)


# ------------------------------------------------------------------------------------------------- wrappers

Resolver = Callable[[Any], "AdapterState | None"]


def make_wrappers(originals: dict[str, Callable], resolve: Resolver) -> dict[str, Callable]:
    """The three wrapped methods around ``originals`` (plain functions taking ``self``); each
    passes through when ``resolve(self)`` gives no state."""
    gen, loss, logps = (originals[name] for name in HOOKED_METHODS)

    def _generate_and_score_completions(self: Any, inputs: Any) -> dict[str, Any]:
        state = resolve(self)
        return gen(self, inputs) if state is None else _generate(self, state, gen, inputs)

    def _compute_loss_(self: Any, model: Any, inputs: dict[str, Any]) -> Any:
        state = resolve(self)
        return loss(self, model, inputs) if state is None else _compute_loss(self, state, loss, model, inputs)

    def _get_per_token_logps_and_entropies(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        state = resolve(self)
        if state is None:
            return logps(self, model, *args, **kwargs)
        return _logps(self, state, logps, model, *args, **kwargs)

    wrapped = dict(zip(HOOKED_METHODS, (_generate_and_score_completions, _compute_loss_,
                                        _get_per_token_logps_and_entropies)))
    for name, fn in wrapped.items():
        fn.__name__ = fn.__qualname__ = name
        fn.__wrapped__ = originals[name]  # type: ignore[attr-defined]
        fn.__doc__ = f"entropy-discriminator wrapper of GRPOTrainer.{name} (adapters/trl/_patch.py)."
    return wrapped


def own_state(trainer: Any) -> AdapterState | None:
    """The state of an ``EntropyDiscGRPOTrainer`` or a patched instance."""
    return trainer.__dict__.get(_STATE_ATTR)


# ------------------------------------------------------------------------------------------------- patch


@dataclass
class _ClassPatch:
    """One patched class: ``config``/``mask_source`` from :func:`patch` (None: from the trainer's
    args); ``explicit``: set by :func:`patch` (else installed by an ``EntropyDiscGRPOConfig``, which
    serves only trainers built with one)."""

    patches: PatchSet
    config: EntropyDiscConfig | None
    mask_source: str | None
    explicit: bool


_CLASS_PATCHES: dict[type, _ClassPatch] = {}


def _class_resolver(owner: type) -> Resolver:
    def resolve(trainer: Any) -> AdapterState | None:
        if _STATE_ATTR in trainer.__dict__:
            return None  # its own (instance or subclass) wrappers act
        nearest = next((cls for cls in type(trainer).__mro__ if cls in _CLASS_PATCHES), None)
        return None if nearest is not owner else _class_state(trainer, _CLASS_PATCHES[owner])

    return resolve


def _class_state(trainer: Any, entry: _ClassPatch) -> AdapterState | None:
    """The instance's state under a class patch, built once per patch setting (cached on it)."""
    key = (entry, entry.config, entry.mask_source, entry.explicit)
    cached = trainer.__dict__.get(_CLASS_STATE_ATTR)
    if cached is not None and cached[0] == key:
        return cached[1]
    from_args = settings_from_args(trainer.args)
    if entry.config is None:
        settings = from_args if from_args is not None else (
            (EntropyDiscConfig(), entry.mask_source or "generation") if entry.explicit else None)
    else:
        settings = (entry.config, entry.mask_source or "generation")
        if from_args is not None and from_args != settings:
            raise ValueError(
                f"patch() was given {settings[0]} (mask_source={settings[1]!r}) but the trainer's "
                f"EntropyDiscGRPOConfig args say {from_args[0]} (mask_source={from_args[1]!r}); give the settings "
                "in one place: patch() with no config takes the args' settings"
            )
    state = None if settings is None else AdapterState(*settings)
    trainer.__dict__[_CLASS_STATE_ATTR] = (key, state)
    return state


def _check_target(target: Any) -> None:
    cls = target if isinstance(target, type) else type(target)
    if not issubclass(cls, GRPOTrainer):
        rloo = (" RLOOTrainer's loss is sequence-level (a ratio of summed log-probs), so a token mask has no "
                "seam there.") if cls.__name__ == "RLOOTrainer" else ""
        raise TypeError(f"patch() target must be GRPOTrainer, a subclass or an instance of one; got {cls.__name__}."
                        + rloo)


def _patch_class(target: type, config: EntropyDiscConfig | None, mask_source: str | None, explicit: bool) -> None:
    entry = _CLASS_PATCHES.get(target)
    if entry is not None:
        if explicit:
            entry.config, entry.mask_source, entry.explicit = config, mask_source, True
        return
    patches = PatchSet(f"entropy_disc:{target.__qualname__}")
    originals = {name: getattr(target, name) for name in HOOKED_METHODS}
    for name, fn in make_wrappers(originals, _class_resolver(target)).items():
        patches.replace(target, name, fn)
    _CLASS_PATCHES[target] = _ClassPatch(patches, config, mask_source, explicit)


def ensure_args_patch() -> None:
    """Make every ``GRPOTrainer`` act on an ``EntropyDiscGRPOConfig`` it is given (called by that
    config's ``__post_init__``), so a stock trainer never silently ignores the settings."""
    _patch_class(GRPOTrainer, None, None, explicit=False)


def patch(target: Any = None, config: EntropyDiscConfig | None = None, *, mask_source: str | None = None) -> Any:
    """Give ``target`` (default: the ``GRPOTrainer`` class) the entropy-discriminator behaviour.

    ``target`` is a ``GRPOTrainer`` subclass (class-wide: every instance, existing or future) or
    one trainer instance.  Settings: ``config``/``mask_source`` when given; else those of the
    trainer's ``EntropyDiscGRPOConfig`` args; else monitoring only (``method="none"``).  Both given
    and different is refused (``ValueError``) when the trainer starts.  Idempotent: patching again
    only replaces the settings.  Raises :class:`UnsupportedVersionError` for a TRL outside
    ``SUPPORTED_TRL``, ``TypeError``/``ValueError`` for a bad target or settings (for an instance:
    also its refused configurations, :func:`._support.plan`).  Returns ``target``.
    """
    check_trl_version()
    target = GRPOTrainer if target is None else target
    _check_target(target)
    if config is not None:
        validate_options(config, mask_source or "generation")
    elif mask_source is not None:
        validate_options(EntropyDiscConfig(), mask_source)
    if isinstance(target, type):
        if issubclass(target, EntropyDiscGRPOTrainer):
            raise TypeError("EntropyDiscGRPOTrainer already applies the entropy discriminator; give it settings with "
                            "entropy_disc= or its EntropyDiscGRPOConfig")
        _patch_class(target, config, mask_source, explicit=True)
        return target
    if isinstance(target, EntropyDiscGRPOTrainer):
        raise TypeError(f"{type(target).__name__} already applies the entropy discriminator (it is an "
                        "EntropyDiscGRPOTrainer); give it settings with entropy_disc= instead of patch()")
    from_args = settings_from_args(target.args)
    settings = (config, mask_source or "generation") if config is not None else (
        from_args if from_args is not None else (EntropyDiscConfig(), mask_source or "generation"))
    if config is not None and from_args is not None and from_args != settings:
        raise ValueError(f"patch() was given {settings[0]} but the trainer's EntropyDiscGRPOConfig args say "
                         f"{from_args[0]}; give the settings in one place")
    state = AdapterState(*settings)
    start(target, state)
    if is_patched(target):
        target.__dict__[_STATE_ATTR] = state
        return target
    patches = PatchSet(f"entropy_disc:{type(target).__qualname__} instance")
    unbound = {name: getattr(type(target), name) for name in HOOKED_METHODS}
    for name, fn in make_wrappers(unbound, own_state).items():
        patches.replace(target, name, types.MethodType(fn, target))
    target.__dict__[_INSTANCE_PATCHES_ATTR] = patches
    target.__dict__[_STATE_ATTR] = state
    return target


def unpatch(target: Any = None) -> bool:
    """Undo :func:`patch` on ``target`` (default: ``GRPOTrainer``, including the patch an
    ``EntropyDiscGRPOConfig`` installed); restores the exact original class attributes (or removes
    the instance's wrappers).  An ``EntropyDiscGRPOConfig`` built afterwards installs it again.
    Returns whether anything was patched."""
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
    """Whether the wrappers are installed on ``target`` itself (a class, default ``GRPOTrainer``,
    by :func:`patch` or by an ``EntropyDiscGRPOConfig``; or one instance by :func:`patch`)."""
    target = GRPOTrainer if target is None else target
    if isinstance(target, type):
        return target in _CLASS_PATCHES
    return _INSTANCE_PATCHES_ATTR in target.__dict__


# ------------------------------------------------------------------------------------------------- subclass


class EntropyDiscGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the entropy-discriminator mask and metrics.

    Settings come from ``entropy_disc=`` / ``mask_source=`` when given, else from an
    ``EntropyDiscGRPOConfig`` ``args``, else monitoring only (``method="none"``).  Refused
    configurations (:func:`._support.plan`) raise ``ValueError`` here, before any generation.
    """

    def __init__(self, *args: Any, entropy_disc: EntropyDiscConfig | None = None, mask_source: str | None = None,
                 **kwargs: Any) -> None:
        check_trl_version()
        train_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        from_args = settings_from_args(train_args)
        config = entropy_disc if entropy_disc is not None else (from_args[0] if from_args else EntropyDiscConfig())
        source = mask_source if mask_source is not None else (from_args[1] if from_args else "generation")
        state = AdapterState(config, source)
        super().__init__(*args, **kwargs)
        self.__dict__[_STATE_ATTR] = state
        start(self, state)


for _name, _fn in make_wrappers(STOCK_METHODS, own_state).items():
    setattr(EntropyDiscGRPOTrainer, _name, _fn)
