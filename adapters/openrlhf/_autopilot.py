"""The entropy autopilot (``method="autopilot"``) in OpenRLHF: one controller per policy, stepped once
per round of updates, its state in every DeepSpeed checkpoint OpenRLHF saves of the actor.

Stepping: where Clip_B / Clip_V compute their mask (:func:`~._round.begin_round`, once per
``ActorPPOTrainer.ppo_train`` call, i.e. per rollout batch, before the first epoch), :func:`step`
calls ``EntropyAutopilot.from_stats(stats, advantages, lr=eta, ratio=None)`` instead, global over the
data-parallel group: ``stats`` the round's flat ``[N]`` statistics of the old policy (the forward
OpenRLHF takes its old log-probs from), ``advantages`` OpenRLHF's per-token ``Experience.advantages``
flattened the same way (``[N]``), ``eta = config.step_size(lr)`` with ``lr`` the configured peak
learning rate ``--actor.adam.lr`` (:func:`learning_rate`), ``r = 1`` (``ratio=None``): the statistics
are those of the policy the PPO ratio is taken against, whose ratio is 1 at the round's first update;
OpenRLHF's optional vLLM importance-sampling weight (``--algo.advantage.is_correction_*``) is not in
the law (a gain of the law, absorbed by the feedback; docs/adapters/openrlhf.md). The keep-mask then
reaches the loss exactly like the masks' (``zero_pg`` / ``drop_token``, :func:`~._round.apply_keep`).

State with the checkpoint. OpenRLHF saves the actor with ``PolicyModelActor.save_checkpoint(tag,
client_states)`` -> ``DeepspeedStrategy.save_ckpt(engine, dir, tag, max_num, max_mem, client_state)``
-> DeepSpeed's ``engine.save_checkpoint(..., client_state=...)`` (the driver's ``client_states``:
``global_step``, ``episode``, the data loader's state, ...), and resumes in
``PolicyModelActor.init_model_from_pretrained`` with ``_, states = strategy.load_ckpt(engine, dir)``
(``--ckpt.load_enable``) *before* it builds the ``ActorPPOTrainer``. The patch wraps the two
strategy methods:

* ``save_ckpt`` of the policy's engine adds ``client_state[STATE_KEY] = controller.state_dict()``
  (version 2, plain Python values) and its law scale's under :data:`LAW_KEY`, on every rank (every rank holds the same
  state; DeepSpeed writes the client state with the model states);
* ``load_ckpt`` remembers what it returned for that engine; the patched ``ActorPPOTrainer.__init__``
  (:func:`bind`) builds the controller and restores it from ``states[STATE_KEY]``. A checkpoint that
  was loaded (DeepSpeed found one) but has no such entry is refused with a ``ValueError`` right there,
  before any generation or update. No checkpoint loaded: a fresh controller.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from entropy_discriminator import EntropyAutopilot, EntropyDiscConfig, MaskResult, TokenStats

from entropy_discriminator.law_scale import LawScale

#: Key of the controller's ``state_dict()`` in the client state of the actor's DeepSpeed checkpoints.
STATE_KEY = "entropy_disc_autopilot"
#: Key of the :class:`~entropy_discriminator.law_scale.LawScale` state (calibration schedule and, without the
#: autopilot, ``kappa``).
LAW_KEY = "entropy_disc_law"


@dataclass
class Bound:
    """The controller of one policy engine and the config it was built from."""

    pilot: EntropyAutopilot
    config: EntropyDiscConfig


#: policy engine (``trainer.actor.model``) -> its controller
_BOUND: "weakref.WeakKeyDictionary[Any, Bound]" = weakref.WeakKeyDictionary()
#: engine -> ``(load_path, client_states)`` returned by the last ``load_ckpt`` of it
_LOADED: "weakref.WeakKeyDictionary[Any, tuple[Any, dict]]" = weakref.WeakKeyDictionary()
#: policy engine -> the scale of its cheap prediction (every method)
_SCALES: "weakref.WeakKeyDictionary[Any, LawScale]" = weakref.WeakKeyDictionary()


def clear() -> None:
    """Forget every controller, scale and loaded client state (``unpatch``)."""
    _BOUND.clear()
    _LOADED.clear()
    _SCALES.clear()


def law_scale(trainer: Any, config: EntropyDiscConfig, group: Any) -> LawScale:
    """The :class:`~entropy_discriminator.law_scale.LawScale` of ``trainer``'s policy engine, built on first use and
    restored from the client state its ``load_ckpt`` returned (key :data:`LAW_KEY`, when present); with method
    ``"autopilot"`` bound to the controller's calibration.  A changed ``calibrate_every`` takes effect, the state kept."""
    engine = _engine(trainer)
    scale = _SCALES.get(engine)
    if scale is None:
        scale = _SCALES[engine] = LawScale(config.calibrate_every)
        loaded = _LOADED.get(engine)
        if loaded is not None and loaded[0] is not None and (loaded[1] or {}).get(LAW_KEY) is not None:
            scale.load_state_dict(loaded[1][LAW_KEY])
    scale.every = config.calibrate_every
    scale.bind(bind(trainer, config, group).pilot if config.method == "autopilot" else None)
    return scale


def learning_rate(args: Any) -> float | None:
    """The actor's configured peak learning rate, ``--actor.adam.lr`` (None when absent); with
    ``--actor.optim muon`` None (the Muon step is no gradient step of that size: set ``entropy_disc.eta``)."""
    actor = getattr(args, "actor", None)
    if getattr(actor, "optim", "adam") != "adam":
        return None
    return getattr(getattr(actor, "adam", None), "lr", None)


def step_size(args: Any, config: EntropyDiscConfig) -> float:
    """``eta`` of the law: ``entropy_disc.eta`` or :func:`learning_rate`; ``ValueError`` naming
    ``entropy_disc.eta`` when neither gives a finite real > 0."""
    lr = learning_rate(args)
    if config.eta is None and lr is None:
        optim = getattr(getattr(args, "actor", None), "optim", "adam")
        raise ValueError(
            f"entropy_disc.eta is None and the actor's learning rate cannot serve as the autopilot's step size "
            f"(--actor.optim {optim}: only --actor.optim adam's --actor.adam.lr does); set entropy_disc.eta"
        )
    return config.step_size(lr if lr is not None else 0.0)


def _engine(trainer: Any) -> Any:
    return trainer.actor.model


def _vocab_size(trainer: Any) -> int | None:
    """The policy's vocabulary size from its Hugging Face config (None when not found)."""
    model = getattr(_engine(trainer), "module", _engine(trainer))
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and size >= 2 else None


def bind(trainer: Any, config: EntropyDiscConfig, group: Any) -> Bound:
    """The controller of ``trainer``'s policy engine, built on first use (see the module doc):
    restored from the client state its ``load_ckpt`` returned, if any; ``ValueError`` when a loaded
    checkpoint has no :data:`STATE_KEY`. A controller built from another config is rebuilt with the
    new settings and the same state."""
    engine = _engine(trainer)
    bound = _BOUND.get(engine)
    if bound is not None:
        if bound.config != config:
            pilot = config.build_autopilot(group, vocab_size=_vocab_size(trainer))
            state = bound.pilot.state_dict()
            state["settings"] = pilot.settings()  # the new settings, deliberately: the same memory continues
            pilot.load_state_dict(state)
            bound = _BOUND[engine] = Bound(pilot, config)
        return bound
    step_size(trainer.strategy.args, config)  # a missing step size is refused before any work
    pilot = config.build_autopilot(group, vocab_size=_vocab_size(trainer))
    _restore(pilot, _LOADED.get(engine))
    bound = _BOUND[engine] = Bound(pilot, config)
    return bound


def _restore(pilot: EntropyAutopilot, loaded: tuple[Any, dict] | None) -> None:
    if loaded is None or loaded[0] is None:
        return  # no checkpoint loaded: a fresh start
    load_path, states = loaded
    saved = (states or {}).get(STATE_KEY)
    if saved is None:
        step = (states or {}).get("global_step")
        raise ValueError(
            f"entropy_disc.method='autopilot' resumes from the DeepSpeed checkpoint {load_path!r}"
            + (f" (global step {step})" if step is not None else "")
            + f", whose client state has no {STATE_KEY!r} entry (saved by a run without the autopilot, or by an "
            "older adapter): the controller's state (its step and starting entropy) cannot be restored. Resume "
            "from a checkpoint of an autopilot run, or start without --ckpt.load_enable."
        )
    pilot.load_state_dict(saved)


def step(trainer: Any, config: EntropyDiscConfig, group: Any, stats: TokenStats,
         advantages: torch.Tensor) -> tuple[MaskResult, dict[str, float]]:
    """One controller step on the round's flat ``[N]`` statistics and advantages; returns its keep-mask
    and the metrics ``entropy_disc/autopilot/*``. Every rank calls it once per round, in step."""
    bound = bind(trainer, config, group)
    result = bound.pilot.from_stats(stats, advantages, lr=step_size(trainer.strategy.args, config), ratio=None)
    return result.mask, result.metrics()


def state_of(engine: Any) -> dict[str, Any] | None:
    """The ``state_dict()`` of ``engine``'s controller, or None when it has none."""
    bound = _BOUND.get(engine)
    return None if bound is None else bound.pilot.state_dict()


def wrap_save_ckpt(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DeepspeedStrategy.save_ckpt`` that adds the controller's state of the saved engine (if it has a
    controller) to ``client_state`` under :data:`STATE_KEY` and its law scale's under :data:`LAW_KEY`
    (a copy; the caller's dict is unchanged)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_ckpt(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound_args = signature.bind(self, *args, **kwargs)
        engine = bound_args.arguments.get("model")
        state, scale = state_of(engine), _SCALES.get(engine)
        if state is not None or scale is not None:
            client_state = dict(bound_args.arguments.get("client_state") or {})
            if state is not None:
                client_state[STATE_KEY] = state
            if scale is not None:
                client_state[LAW_KEY] = scale.state_dict()
            bound_args.arguments["client_state"] = client_state
        return original(*bound_args.args, **bound_args.kwargs)

    return save_ckpt


def wrap_load_ckpt(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DeepspeedStrategy.load_ckpt`` that remembers ``(load_path, states)`` per engine; an engine that
    already has a controller is restored from them at once (or refused, as in :func:`bind`)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_ckpt(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        engine = signature.bind(self, *args, **kwargs).arguments.get("model")
        try:
            _LOADED[engine] = (result[0], dict(result[1] or {}))
        except TypeError:  # not weak-referenceable: not an engine this adapter binds
            return result
        bound = _BOUND.get(engine)
        if bound is not None:
            _restore(bound.pilot, _LOADED[engine])
        scale = _SCALES.get(engine)
        if scale is not None and result[0] is not None and (result[1] or {}).get(LAW_KEY) is not None:
            scale.load_state_dict(result[1][LAW_KEY])
        return result

    return load_ckpt
