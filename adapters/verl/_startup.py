"""The start-up check inside verl's own config validation, in the driver, before Ray starts.

verl's ``main_ppo.main`` (both trainers) and the legacy ``main_ppo_v0.TaskRunner`` call
``verl.utils.config.validate_config(config=..., ...)`` before any worker exists.  Loading the
plugin wraps that function so it first runs :func:`~._support.check_config`: a config that asks for
the adapter where it cannot act exactly (``trainer.use_v1=false``, adapter options without an
adapter trainer, a policy loss where the mask is not exact, ...) fails there with the message
naming the setting.  A config that does not mention the adapter passes through unchanged.

All of this needs verl to load the plugin.  :func:`plugin_problem` says, before a launch, why it
would not (``VERL_USE_EXTERNAL_PLUGINS``, a missing entry point, an error while loading it);
``examples/verl/_preflight.py`` refuses a launch that asks for the adapter on that ground.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from collections.abc import Callable
from typing import Any

from .._patching import PatchSet
from ._support import check_config

_PATCHES = PatchSet("entropy_disc verl start-up check")
#: The adapter's entry point in verl's ``verl.plugins`` group (pyproject.toml) and the module it loads.
ENTRY_POINT = "entropy_disc"
PLUGIN_MODULE = f"{__package__}._plugin"


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


def plugin_problem() -> str | None:
    """Why ``import verl`` in a process with this environment would not load the adapter's plugin, or None.

    verl reads ``VERL_USE_EXTERNAL_PLUGINS`` (``auto``, the default: every ``verl.plugins`` entry point;
    ``none``: no plugin; else a comma-separated list of entry-point names) and logs a plugin's
    import error at DEBUG only.  Without the plugin, a config with ``entropy_disc`` options and one of
    verl's own trainer modes trains as stock verl with no error.  Imports verl (and so loads its plugins).
    """
    raw = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto")
    policy = raw.strip().lower()
    if policy == "none" or (policy != "auto" and ENTRY_POINT not in {n.strip() for n in policy.split(",")}):
        return (
            f"VERL_USE_EXTERNAL_PLUGINS={raw!r} keeps verl from loading the {ENTRY_POINT!r} plugin, so verl would "
            f"ignore the entropy_disc settings (with verl's own trainer mode it trains as stock verl, without a "
            f"word): unset it (default 'auto': every plugin) or add {ENTRY_POINT} to its comma-separated list"
        )
    if not any(ep.name == ENTRY_POINT and ep.value == PLUGIN_MODULE
               for ep in importlib.metadata.entry_points(group="verl.plugins")):
        return (
            f"no verl.plugins entry point {ENTRY_POINT} -> {PLUGIN_MODULE} is installed: reinstall the package "
            "(pip install -e '.[verl]' from the clone)"
        )
    import verl  # noqa: F401  (loads the plugins)

    if startup_check_installed():
        return None
    try:
        importlib.import_module(PLUGIN_MODULE)
        error = "it raised nothing when imported again"
    except Exception as exc:  # what verl swallowed
        error = f"{type(exc).__name__}: {exc}"
    return f"verl did not load the {ENTRY_POINT} plugin ({error}), so it would ignore the entropy_disc settings"
