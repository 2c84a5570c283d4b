"""Target of the ``verl.plugins`` entry point: verl imports it on ``import verl`` in every process.

Loading it (1) wraps verl's config validation with the adapter's start-up check (``_startup``),
which passes every config that does not mention the adapter unchanged, and (2) arranges for the
adapter's trainer names to be registered once verl itself imports ``verl.trainer.ppo.v1``: a
one-shot import hook, so ``import verl`` does not pull in verl's trainer stack.

verl catches an exception raised while it loads a plugin and logs it at DEBUG only, after which
``entropy_disc`` options are ignored without a word.  So a failure here is logged at ERROR (with
its traceback and what it means for the run) before it propagates to verl.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any

_V1_PACKAGE = "verl.trainer.ppo.v1"
_TRAINER_MODULE = f"{__package__}._trainer"
_logger = logging.getLogger(__name__)
#: Logged at ERROR when loading the plugin fails.
LOAD_FAILED = (
    "entropy_disc: the verl plugin failed to load, so this process runs verl without the adapter: an "
    "adapter trainer mode fails in verl's trainer lookup, and entropy_disc options with verl's own trainer "
    "modes are ignored without any check. Fix the error below (python examples/verl/_preflight.py reports it "
    "too)."
)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: once ``verl.trainer.ppo.v1`` has executed, import the adapter's trainers.

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
            _import_trainers()

        spec.loader.exec_module = exec_then_register
        return spec


def _import_trainers() -> None:
    """Import ``_trainer``, which registers its trainers at its end (if it is importing v1 itself, it will)."""
    from ._support import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        _logger.warning("entropy_disc trainers not registered: %s", reason)
        return
    importlib.import_module(_TRAINER_MODULE)


def on_plugin_load() -> None:
    """What loading the entry point does: the start-up check, and the trainers' registration (now or on import)."""
    from ._startup import install_startup_check

    install_startup_check()
    if _V1_PACKAGE in sys.modules:
        _import_trainers()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


try:
    on_plugin_load()
except Exception:
    _logger.error(LOAD_FAILED, exc_info=True)
    raise
