"""verl adapter: Clip_B / Clip_V, the entropy autopilot and the entropy-dynamics metrics in verl's V1 PPO trainer.

Selected from config alone once the package is installed (verl loads the ``verl.plugins`` entry
point ``_plugin`` on ``import verl``, in every process)::

    python -m verl.trainer.main_ppo ... \\
        trainer.v1.trainer_mode=entropy_disc \\
        +entropy_disc.method=clip_v +entropy_disc.mu_low=2.5

Trainer modes: ``entropy_disc`` (verl's ``sync``), ``entropy_disc_colocate_async``,
``entropy_disc_separate_async``.  Options (``+entropy_disc.<name>=...``) are the fields of
:class:`~entropy_discriminator.EntropyDiscConfig`: ``method`` (none|clip_b|clip_v|autopilot),
``mu_low``, ``mu_high``, ``sides``, ``max_frac``, ``mask_mode`` (zero_pg|drop_token), ``chunk_size``,
``impl``, ``log_metrics``; for ``autopilot`` also ``target_entropy``, ``decay_steps``, ``gain``,
``max_step``, ``eta`` (None: ``actor_rollout_ref.actor.optim.lr``), ``form``.  Metrics appear in
verl's tracking as ``entropy_disc/*`` every step (``entropy_disc/autopilot/*`` for the autopilot,
whose state is saved in every verl checkpoint and restored on resume).

The modules, in reading order:

* ``_support``: version guard (:data:`SUPPORTED_VERL`), trainer names, the policy-loss table and
  :func:`check_config`, the start-up decision (a :class:`RunPlan`, or an error naming the setting).
* ``_startup``: that check inside verl's ``validate_config``, in the driver before Ray starts.
* ``_plugin``: the entry point: installs the start-up check, registers the trainers once verl
  imports its V1 trainer package.
* ``_engine`` (statistics, workers): the hook that computes ``E_p[S]`` in the old-policy pass;
  ``_workers``: verl's actor workers with the hook installed.
* ``_trainer`` (mask, metrics, driver): the V1 trainers; the mask acts on the actor update and is
  undone after it.
* ``_autopilot`` (driver): method ``autopilot``'s controller, stepped in the advantage step, its
  state in verl's ``global_step_N`` checkpoint folder, restored on resume.
* :func:`patch` / :func:`unpatch` / :func:`is_patched` (here): the same by hand in the current
  process (registration plus the engine hook) for custom launches, custom workers and tests.

Tensor conventions: verl's log-probs, entropies and ``E_p[S]`` at model position ``i`` belong to
the token at ``i + 1``; the adapter slices them to the response with verl's own
``response_from_nested`` (the one-token shift is verl's), so all per-token tensors it hands to
the core are response-aligned ``[B, T_resp]``.
"""

from __future__ import annotations

import importlib.util

# Looked up, not imported: ``import verl`` loads this package's own plugin entry point.
if importlib.util.find_spec("verl") is None:
    raise ImportError("entropy_discriminator.adapters.verl needs verl 0.9.0-0.9.1: from the clone: pip install -e '.[verl]'")

from ._support import (
    LOSS_AGG_MODES,
    LOSS_MODES,
    SUPPORTED_VERL,
    TRAINER_MODES,
    RunPlan,
    check_config,
    check_version,
    unsupported_reason,
)

__all__ = [
    "LOSS_AGG_MODES",
    "LOSS_MODES",
    "SUPPORTED_VERL",
    "TRAINER_MODES",
    "RunPlan",
    "check_config",
    "check_version",
    "is_patched",
    "patch",
    "register_trainers",
    "unpatch",
    "unsupported_reason",
]

_patch_registered: set[str] = set()


def register_trainers() -> list[str]:
    """Add the adapter's trainers to verl's V1 registry (idempotent); returns the names added now.

    Raises :class:`UnsupportedVersionError` (a ``RuntimeError``) for an unsupported verl.
    """
    check_version()
    from . import _trainer

    return _trainer.register_trainers()


def patch() -> None:
    """Register the trainers and install the ``E_p[S]`` engine hook in this process (idempotent).

    Raises :class:`UnsupportedVersionError` (a ``RuntimeError``) for an unsupported verl.  The hook
    stays inert until a micro-batch carries the ``entropy_disc_stats`` flag, which only the
    adapter's trainers set.
    """
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
