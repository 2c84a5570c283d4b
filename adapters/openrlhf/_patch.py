"""The patch of OpenRLHF's ``ActorPPOTrainer.ppo_train`` and how it reaches Ray workers.

``patch(config)`` wraps ``ActorPPOTrainer.ppo_train`` (module ``openrlhf.trainer.ray.ppo_actor``)
so that each call runs :func:`~._round.begin_round` before the original epochs and adds
the round's ``entropy_disc/*`` metrics to the status dict it returns (the dict OpenRLHF's driver
logs to the console, wandb and TensorBoard). ``unpatch()`` restores the original attribute;
``is_patched()`` tells. The config is read at call time, so patching again only swaps it.

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
    "the adapter wraps the private ActorPPOTrainer.ppo_train and reads NaiveReplayBuffer.items, the "
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


def encode_settings(config: EntropyDiscConfig, *, realised: bool = False) -> str:
    """JSON for :data:`CONFIG_ENV`: the config's fields plus ``realised`` (``inf`` as ``Infinity``)."""
    config.validate()
    return json.dumps({"config": dataclasses.asdict(config), "realised": bool(realised)})


def decode_settings(payload: str) -> tuple[EntropyDiscConfig, bool]:
    """Inverse of :func:`encode_settings`; a malformed payload raises ``ValueError`` naming :data:`CONFIG_ENV`."""
    try:
        data = json.loads(payload)
        return EntropyDiscConfig.from_mapping(data["config"]), bool(data.get("realised", False))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{CONFIG_ENV} does not hold valid entropy_disc settings: {exc}") from exc


def _check_seams(module: Any) -> Any:
    """The ``ActorPPOTrainer`` class, after checking the attributes the adapter relies on."""
    trainer = getattr(module, "ActorPPOTrainer", None)
    actor = getattr(module, "Actor", None)
    problems = []
    if trainer is None or not callable(getattr(trainer, "ppo_train", None)):
        problems.append("ActorPPOTrainer.ppo_train is missing")
    if actor is None or not {"return_output", "ring_attn_group"} <= set(inspect.signature(actor.forward).parameters):
        problems.append("Actor.forward lacks return_output/ring_attn_group")
    if problems:
        raise UnsupportedVersionError(f"{TRAINER_MODULE} does not look like OpenRLHF 0.10.2-0.11.2: {'; '.join(problems)}")
    return trainer


def _wrap(original: Any) -> Any:
    from ._round import begin_round, end_round

    @functools.wraps(original)
    def ppo_train(self: Any, kl_ctl: float, *args: Any, **kwargs: Any) -> dict:
        config, realised = _STATE.config, _STATE.realised
        if config is None or not (config.enabled or config.log_metrics):
            return original(self, kl_ctl, *args, **kwargs)
        state = begin_round(self, config)
        status = original(self, kl_ctl, *args, **kwargs)
        if config.log_metrics:
            status.update(state.metrics)
            if realised:
                status.update(end_round(self, config, state))
        return status

    setattr(ppo_train, _WRAPPER_FLAG, True)
    return ppo_train


def _patch_module(module: Any, config: EntropyDiscConfig, realised: bool) -> None:
    trainer = _check_seams(module)
    _STATE.config, _STATE.realised = config, realised
    if not getattr(trainer.ppo_train, _WRAPPER_FLAG, False):
        _PATCHES.replace(trainer, "ppo_train", _wrap(trainer.ppo_train))


def patch(config: EntropyDiscConfig | None = None, *, realised: bool = False) -> None:
    """Wrap ``ActorPPOTrainer.ppo_train`` in this process (imports OpenRLHF's trainer module).

    ``config`` defaults to ``EntropyDiscConfig()`` (metrics only); ``realised=True`` adds a second
    no-grad pass after the update for ``entropy_disc/delta_entropy/realised``. Idempotent: a second
    call replaces the settings, never wraps twice. Raises :class:`UnsupportedVersionError` outside
    :data:`SUPPORTED_OPENRLHF`.
    """
    config = EntropyDiscConfig() if config is None else config
    if not isinstance(config, EntropyDiscConfig):
        raise TypeError(f"config must be an EntropyDiscConfig, got {type(config).__name__}")
    config.validate()
    check_openrlhf_version()
    module = sys.modules.get(TRAINER_MODULE) or importlib.import_module(TRAINER_MODULE)
    _patch_module(module, config, realised)


def unpatch() -> None:
    """Restore ``ActorPPOTrainer.ppo_train`` and remove a pending import hook. Safe to call twice."""
    _PATCHES.restore()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    _STATE.config, _STATE.realised = None, False


def is_patched() -> bool:
    """True while ``ActorPPOTrainer.ppo_train`` is the adapter's wrapper."""
    module = sys.modules.get(TRAINER_MODULE)
    trainer = getattr(module, "ActorPPOTrainer", None)
    return bool(trainer is not None and getattr(trainer.ppo_train, _WRAPPER_FLAG, False) and _PATCHES.active)


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
    config.validate()
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
