"""The patch of OpenRLHF's ``ActorPPOTrainer`` / ``Actor`` and how it reaches Ray workers.

``patch(config)`` replaces five attributes reached through module ``openrlhf.trainer.ray.ppo_actor``:

* ``Actor.forward`` (OpenRLHF's ``openrlhf.models.actor.Actor``): the policy's old-log-prob forward
  of ``make_experience`` (no grad, eval mode, an action mask, no ``return_output``) also scores the
  micro-batch's action tokens from the logits it computes its log-probs from, and keeps the
  per-token results for the replay buffer (``_experience.py``); every other call is unchanged;
* ``ActorPPOTrainer.__init__``: registers the trainer's ``actor`` as the policy whose forwards
  are scored (the reference model, an EMA copy or a critic are never scored);
* ``ActorPPOTrainer.ppo_train``: each call runs :func:`~._round.begin_round` before the original
  epochs (statistics of the buffered samples, mask) and adds the round's ``entropy_disc/*`` metrics
  to the status dict it returns (the dict OpenRLHF's driver logs to the console, wandb and
  TensorBoard);
* ``DeepspeedStrategy.save_ckpt`` / ``load_ckpt`` (the class ``ppo_actor`` imports from
  ``openrlhf.utils.deepspeed``): the autopilot's state rides in the client state of the policy's
  DeepSpeed checkpoints (:mod:`._autopilot`); without a controller both are the originals' calls.

``unpatch()`` restores the five, empties the statistics store and forgets the controllers; ``is_patched()`` tells. The
config is read at call time, so patching again only swaps it. Patch before the trainer is built
(the Ray setup hook does): for a trainer built earlier, the first round falls back to a no-grad
pass of its own (see ``_round.py``), later rounds read the old-policy forward.

Training runs in Ray actors (``PolicyModelActor``), so the patch must be made inside every
worker process: :func:`worker_setup_hook` (Ray's ``worker_process_setup_hook``) reads the config
from the environment variable :data:`CONFIG_ENV` and patches the trainer module when a worker
imports it (an import hook; workers that never import it, e.g. vLLM engines, stay untouched).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
from typing import Any

from entropy_discriminator import EntropyDiscConfig

from .._patching import PatchSet, UnsupportedVersionError, require_version

#: OpenRLHF releases this adapter is written and tested against.
SUPPORTED_OPENRLHF = ">=0.10.2,<0.12"
_WHY = (
    "the adapter wraps the private ActorPPOTrainer.__init__/ppo_train and Actor.forward (the old-log-prob call "
    "of PolicyModelActor.forward) and DeepspeedStrategy.save_ckpt/load_ckpt (the autopilot's state), reads NaiveReplayBuffer.items (split, right padding removed), the "
    "Experience fields advantages/action_mask, Actor.forward's logits layout (padded, packed, ring-attention "
    "slices) and the hierarchical arguments (--actor.*, --algo.*, --ds.*) as they are in OpenRLHF 0.10.2 to "
    "0.11.2 (0.10.0 and 0.10.1 use flat argument names); other releases may change them without raising an error"
)
TRAINER_MODULE = "openrlhf.trainer.ray.ppo_actor"
#: Environment variable carrying the JSON settings to Ray workers.
CONFIG_ENV = "ENTROPY_DISC_OPENRLHF_CONFIG"
#: Ray ``worker_process_setup_hook`` value (``module.function``).
SETUP_HOOK = "entropy_discriminator.adapters.openrlhf.worker_setup_hook"

_PATCHES = PatchSet("entropy_discriminator.adapters.openrlhf")
_WRAPPER_FLAG = "__entropy_disc_wrapped__"


@dataclasses.dataclass
class _State:
    config: EntropyDiscConfig | None = None
    realised: bool = False


_STATE = _State()


def check_openrlhf_version(version: str | None = None) -> str:
    """Return the installed (or given) OpenRLHF version; raise :class:`UnsupportedVersionError`
    (a ``RuntimeError``) outside :data:`SUPPORTED_OPENRLHF`, saying why."""
    return require_version("openrlhf", SUPPORTED_OPENRLHF, why=_WHY, installed=version)


def check_served(config: EntropyDiscConfig) -> None:
    """Validate ``config`` (``ValueError`` naming the field). Every method is served here, ``autopilot``
    included (its state rides in OpenRLHF's checkpoints, :mod:`._autopilot`); the OpenRLHF settings a
    method cannot serve are refused by :func:`~._checks.check_training_args`."""
    config.validate()


def encode_settings(config: EntropyDiscConfig, *, realised: bool = False) -> str:
    """JSON for :data:`CONFIG_ENV`: the config's fields plus ``realised`` (``inf`` as ``Infinity``)."""
    check_served(config)
    return json.dumps({"config": dataclasses.asdict(config), "realised": bool(realised)})


def decode_settings(payload: str) -> tuple[EntropyDiscConfig, bool]:
    """Inverse of :func:`encode_settings`; a malformed payload raises ``ValueError`` naming :data:`CONFIG_ENV`."""
    try:
        data = json.loads(payload)
        return EntropyDiscConfig.from_mapping(data["config"]), bool(data.get("realised", False))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{CONFIG_ENV} does not hold valid entropy_disc settings: {exc}") from exc


_FORWARD_PARAMS = ("sequences", "action_mask", "attention_mask", "return_output", "ring_attn_group")


def _check_seams(module: Any) -> tuple[Any, Any]:
    """The ``ActorPPOTrainer`` and ``Actor`` classes, after checking the attributes the adapter relies on."""
    trainer = getattr(module, "ActorPPOTrainer", None)
    actor = getattr(module, "Actor", None)
    problems = []
    if trainer is None or not callable(getattr(trainer, "ppo_train", None)):
        problems.append("ActorPPOTrainer.ppo_train is missing")
    elif "actor" not in inspect.signature(trainer.__init__).parameters:
        problems.append("ActorPPOTrainer.__init__ takes no actor")
    if actor is None or not set(_FORWARD_PARAMS) <= set(inspect.signature(_unwrapped(actor.forward)).parameters):
        problems.append(f"Actor.forward lacks one of {'/'.join(_FORWARD_PARAMS)}")
    strategy = getattr(module, "DeepspeedStrategy", None)
    for name, params in (("save_ckpt", ("model", "client_state")), ("load_ckpt", ("model",))):
        method = getattr(strategy, name, None)
        if method is None or not set(params) <= set(inspect.signature(_unwrapped(method)).parameters):
            problems.append(f"DeepspeedStrategy.{name} is missing or lacks one of {'/'.join(params)}")
    if problems:
        raise UnsupportedVersionError(f"{TRAINER_MODULE} does not look like OpenRLHF 0.10.2-0.11.2: {'; '.join(problems)}")
    return trainer, actor, strategy


def _unwrapped(fn: Any) -> Any:
    return fn.__wrapped__ if getattr(fn, _WRAPPER_FLAG, False) else fn


def _wrap(original: Any) -> Any:
    from ._round import begin_round, end_round

    @functools.wraps(original)
    def ppo_train(self: Any, kl_ctl: float, *args: Any, **kwargs: Any) -> dict:
        config, realised = _STATE.config, _STATE.realised
        if config is None or not (config.enabled or config.log_metrics):
            return original(self, kl_ctl, *args, **kwargs)
        state = begin_round(self, config)
        status = original(self, kl_ctl, *args, **kwargs)
        after = end_round(self, config, state) if (realised and config.log_metrics) or state.calibrate else {}
        if config.log_metrics:
            status.update(state.metrics)
            status.update(after)
        return status

    setattr(ppo_train, _WRAPPER_FLAG, True)
    return ppo_train


def _wrap_init(original: Any) -> Any:
    from ._experience import register_policy

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        register_policy(getattr(self, "actor", None))
        config = _STATE.config
        if config is not None and config.method == "autopilot":  # restore or refuse before any work
            from ._autopilot import bind
            from ._round import dp_group

            bind(self, config, dp_group(self.strategy))

    setattr(__init__, _WRAPPER_FLAG, True)
    return __init__


def _wrap_forward(original: Any) -> Any:
    from ._experience import wrap_actor_forward

    forward = wrap_actor_forward(original, lambda: _STATE.config)
    setattr(forward, _WRAPPER_FLAG, True)
    return forward


def _flagged(wrap: Any) -> Any:
    def flagged(original: Any) -> Any:
        wrapper = wrap(original)
        setattr(wrapper, _WRAPPER_FLAG, True)
        return wrapper

    return flagged


def _patch_module(module: Any, config: EntropyDiscConfig, realised: bool) -> None:
    from ._autopilot import wrap_load_ckpt, wrap_save_ckpt

    trainer, actor, strategy = _check_seams(module)
    _STATE.config, _STATE.realised = config, realised
    for owner, name, wrap in ((actor, "forward", _wrap_forward), (trainer, "__init__", _wrap_init),
                              (trainer, "ppo_train", _wrap), (strategy, "save_ckpt", _flagged(wrap_save_ckpt)),
                              (strategy, "load_ckpt", _flagged(wrap_load_ckpt))):
        if not getattr(getattr(owner, name), _WRAPPER_FLAG, False):
            _PATCHES.replace(owner, name, wrap(getattr(owner, name)))


def patch(config: EntropyDiscConfig | None = None, *, realised: bool = False) -> None:
    """Patch ``Actor.forward``, ``ActorPPOTrainer.__init__`` / ``ppo_train`` and ``DeepspeedStrategy.save_ckpt``
    / ``load_ckpt`` in this process (imports OpenRLHF's trainer module; see the module doc).

    ``config`` defaults to ``EntropyDiscConfig()`` (metrics only); ``realised=True`` adds a second
    no-grad pass after the update for ``entropy_disc/delta_entropy/realised`` over every buffered sample (on a
    calibration round that pass is the calibration's, over ``config.calibrate_share`` of them:
    :func:`~._round.end_round`). Idempotent: a second
    call replaces the settings, never wraps twice. Raises :class:`UnsupportedVersionError` outside
    :data:`SUPPORTED_OPENRLHF`.
    """
    config = EntropyDiscConfig() if config is None else config
    if not isinstance(config, EntropyDiscConfig):
        raise TypeError(f"config must be an EntropyDiscConfig, got {type(config).__name__}")
    check_served(config)
    check_openrlhf_version()
    module = sys.modules.get(TRAINER_MODULE) or importlib.import_module(TRAINER_MODULE)
    _patch_module(module, config, realised)


def unpatch() -> None:
    """Restore ``Actor.forward``, ``ActorPPOTrainer.__init__`` / ``ppo_train`` and ``DeepspeedStrategy.save_ckpt``
    / ``load_ckpt``, drop the statistics kept from old-policy forwards and the autopilot controllers, and
    remove a pending import hook. Safe to call twice."""
    from ._autopilot import clear
    from ._experience import STORE

    _PATCHES.restore()
    STORE.clear()
    clear()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    _STATE.config, _STATE.realised = None, False


def is_patched() -> bool:
    """True while ``ActorPPOTrainer.ppo_train`` and ``Actor.forward`` are the adapter's wrappers."""
    module = sys.modules.get(TRAINER_MODULE)
    trainer = getattr(module, "ActorPPOTrainer", None)
    actor = getattr(module, "Actor", None)
    return bool(
        trainer is not None
        and actor is not None
        and getattr(trainer.ppo_train, _WRAPPER_FLAG, False)
        and getattr(actor.forward, _WRAPPER_FLAG, False)
        and _PATCHES.active
    )


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds :data:`TRAINER_MODULE` through the other finders and patches it right after it executes."""

    def __init__(self, config: EntropyDiscConfig, realised: bool) -> None:
        self.config, self.realised = config, realised

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TRAINER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is None:
                    return None
                spec.loader = _PatchingLoader(spec.loader, self)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _PatchOnImport) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self.finder]
        _patch_module(module, self.finder.config, self.finder.realised)


def patch_on_import(config: EntropyDiscConfig, *, realised: bool = False) -> None:
    """Patch now if OpenRLHF's trainer module is loaded, else as soon as it is imported."""
    check_served(config)
    check_openrlhf_version()
    if TRAINER_MODULE in sys.modules:
        _patch_module(sys.modules[TRAINER_MODULE], config, realised)
        return
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    sys.meta_path.insert(0, _PatchOnImport(config, realised))


def worker_setup_hook() -> None:
    """Ray ``worker_process_setup_hook``: patch this worker with the settings in :data:`CONFIG_ENV`."""
    payload = os.environ.get(CONFIG_ENV)
    if payload is None:
        raise RuntimeError(
            f"{CONFIG_ENV} is not set in this Ray worker: start the job with "
            "`python -m entropy_discriminator.adapters.openrlhf ...` or add "
            "entropy_discriminator.adapters.openrlhf.runtime_env(config) to ray.init"
        )
    config, realised = decode_settings(payload)
    patch_on_import(config, realised=realised)


def runtime_env(config: EntropyDiscConfig | None = None, *, realised: bool = False, base: dict | None = None) -> dict:
    """A Ray ``runtime_env`` that patches every worker: ``base`` plus :data:`SETUP_HOOK` and
    :data:`CONFIG_ENV` in ``env_vars``. Refuses a ``base`` that already has another setup hook
    (Ray runs one hook per job)."""
    config = EntropyDiscConfig() if config is None else config
    env = dict(base or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK):
        raise ValueError(
            f"runtime_env already has worker_process_setup_hook={hook!r}; Ray runs one hook per job, so "
            f"call {SETUP_HOOK} from that hook instead"
        )
    env["worker_process_setup_hook"] = SETUP_HOOK
    env_vars = dict(env.get("env_vars") or {})
    env_vars[CONFIG_ENV] = encode_settings(config, realised=realised)
    env["env_vars"] = env_vars
    return env
