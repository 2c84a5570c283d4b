"""verl adapter: Clip_B / Clip_V and the entropy-dynamics metrics in verl's V1 PPO trainer.

Selected from config alone once the package is installed (verl loads this module through the
``verl.plugins`` entry point on ``import verl``, in every process)::

    python -m verl.trainer.main_ppo ... \\
        trainer.v1.trainer_mode=entropy_disc \\
        +entropy_disc.method=clip_v +entropy_disc.mu_low=8.5

Trainer modes: ``entropy_disc`` (verl's ``sync``), ``entropy_disc_colocate_async``,
``entropy_disc_separate_async``.  Options (``+entropy_disc.<name>=...``) are the fields of
:class:`~entropy_discriminator.EntropyDiscConfig`: ``method`` (none|clip_b|clip_v), ``mu_low``,
``mu_high``, ``sides``, ``max_frac``, ``mask_mode`` (zero_pg|drop_token), ``chunk_size``,
``impl``, ``log_metrics``.  Metrics appear in verl's tracking as ``entropy_disc/*`` every step.

Loading the plugin changes no verl behaviour: it only adds the three trainer names to verl's
trainer registry, and only once verl itself imports ``verl.trainer.ppo.v1`` (a one-shot import
hook, so ``import verl`` stays as cheap as before).  The engine hook that computes ``E_p[S]`` is
installed only inside the actor workers of a run that selects one of these trainers.

:func:`patch` / :func:`unpatch` / :func:`is_patched` do the same by hand in the current process
(registration plus the engine hook) for custom launches, custom workers and tests.

Tensor conventions: verl's log-probs, entropies and ``E_p[S]`` at model position ``i`` belong to
the token at ``i + 1``; the adapter slices them to the response with verl's own
``response_from_nested`` (the one-token shift is verl's), so all per-token tensors it hands to
the core are response-aligned ``[B, T_resp]``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any

from .._patching import UnsupportedVersionError, require_version

#: verl versions this adapter is written and tested against (PEP 440).
SUPPORTED_VERL = ">=0.9.1,<0.9.2"
#: Trainer names added to verl's registry (``trainer.v1.trainer_mode=<name>``).
TRAINER_MODES = ("entropy_disc", "entropy_disc_colocate_async", "entropy_disc_separate_async")

_V1_PACKAGE = "verl.trainer.ppo.v1"
_logger = logging.getLogger(__name__)
_patch_registered: set[str] = set()
_deferred = False


_WHY = (
    "the adapter overrides private methods of verl's V1 PPOTrainer (_compute_old_log_prob, _compute_advantage, "
    "_update_actor, _init_resource_pool_mgr) and of its FSDP/Megatron engines (prepare_model_outputs, "
    "_lm_head_logits_processor), whose signatures and data layout change between releases"
)


def check_version(installed: str | None = None) -> str:
    """Return the installed verl version; raise ``UnsupportedVersionError`` (a ``RuntimeError``) saying why if unsupported."""
    return require_version("verl", SUPPORTED_VERL, why=_WHY, installed=installed)


def unsupported_reason(installed: str | None = None) -> str | None:
    """The :func:`check_version` message, or None when the verl release is supported."""
    try:
        check_version(installed)
    except UnsupportedVersionError as exc:
        return str(exc)
    return None


def register_trainers() -> list[str]:
    """Add the adapter's trainers to verl's V1 registry (idempotent); returns the names added now."""
    check_version()
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    from ._trainer import TRAINERS

    added = [name for name in TRAINER_MODES if name not in TRAINER_REGISTRY]
    for name in TRAINER_MODES:
        register_trainer(name)(TRAINERS[name])
    return added


def patch() -> None:
    """Register the trainers and install the ``E_p[S]`` engine hook in this process (idempotent).

    Raises :class:`UnsupportedVersionError` (a ``RuntimeError``) for an unsupported verl.  The hook stays inert until a micro-batch
    carries the ``entropy_disc_stats`` flag, which only the adapter's trainers set.
    """
    check_version()
    from ._engine import install_engine_hook

    _patch_registered.update(register_trainers())
    install_engine_hook()


def unpatch() -> None:
    """Undo :func:`patch`: restore the engine methods and drop the registry entries it added (idempotent)."""
    from ._engine import remove_engine_hook

    remove_engine_hook()
    if _patch_registered:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

        for name in _patch_registered:
            TRAINER_REGISTRY.pop(name, None)
        _patch_registered.clear()


def is_patched() -> bool:
    """True while the engine hook is installed in this process."""
    from ._engine import engine_hook_installed

    return engine_hook_installed()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: once ``verl.trainer.ppo.v1`` has executed, register the trainers.

    It finds the package's normal spec and wraps that spec's own loader's ``exec_module``; the
    module, its spec and loader are otherwise verl's.
    """

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _V1_PACKAGE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register_quietly()

        spec.loader.exec_module = exec_then_register
        return spec


def _register_quietly() -> None:
    global _deferred
    reason = unsupported_reason()
    if reason is not None:
        _logger.warning("entropy_disc trainers not registered: %s", reason)
        return
    trainer_module = sys.modules.get(f"{__package__}._trainer")
    if trainer_module is not None and not hasattr(trainer_module, "TRAINERS"):
        _deferred = True  # our own trainer module is importing verl's v1 package: finish after it
        return
    register_trainers()


def register_deferred() -> None:
    """Called at the end of ``_trainer``: the registration the import hook had to postpone."""
    global _deferred
    if _deferred:
        _deferred = False
        register_trainers()


def on_plugin_load() -> None:
    """What loading the ``verl.plugins`` entry point does: schedule (or do) the registration."""
    if _V1_PACKAGE in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
