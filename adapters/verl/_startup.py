"""The start-up check inside verl's own config validation, in the driver, before Ray starts.

verl's ``main_ppo.main`` (both trainers) and the legacy ``main_ppo_v0.TaskRunner`` call
``verl.utils.config.validate_config(config=..., ...)`` before any worker exists.  Loading the
plugin wraps that function so it first runs :func:`~._support.check_config`: a config that asks for
the adapter where it cannot act exactly (``trainer.use_v1=false``, adapter options without an
adapter trainer, a policy loss where the mask is not exact, ...) fails there with the message
naming the setting.  A config that does not mention the adapter passes through unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .._patching import PatchSet
from ._support import check_config

_PATCHES = PatchSet("entropy_disc verl start-up check")


def _checked(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_config(config: Any, *args: Any, **kwargs: Any) -> Any:
        check_config(config)
        return original(config, *args, **kwargs)

    return validate_config


def install_startup_check() -> None:
    """Wrap ``verl.utils.config.validate_config`` (and its ``verl.utils`` re-export); idempotent."""
    if _PATCHES.active:
        return
    import verl.utils
    import verl.utils.config

    checked = _checked(verl.utils.config.validate_config)
    _PATCHES.replace(verl.utils.config, "validate_config", checked)
    if getattr(verl.utils, "validate_config", None) is checked.__wrapped__:
        _PATCHES.replace(verl.utils, "validate_config", checked)


def remove_startup_check() -> None:
    """Restore verl's ``validate_config`` (idempotent)."""
    _PATCHES.restore()


def startup_check_installed() -> bool:
    """True while ``validate_config`` is wrapped in this process."""
    return _PATCHES.active
