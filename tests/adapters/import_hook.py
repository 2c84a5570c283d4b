"""Run a function on a module right after it is first imported, and name the classes on a call stack: test helpers for the launch tests' ``sitecustomize``
files (``tests/adapters/openrlhf/launch_site``, ``tests/gpu/openrlhf_site``), which load it by its path because they
run at interpreter start, before this folder is on ``sys.path``."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, hook: Callable[[ModuleType], None]) -> None:
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.hook(module)


class AfterImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder: ``hooks`` maps a module name to a function called with the module once it has
    executed (found through the other finders, loaded by its own loader)."""

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.hooks = dict(hooks)

    def find_spec(self, fullname, path, target=None):
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, hook)
                return spec
        return None



def stack_classes(frame) -> list[str]:
    """``module.qualname`` of the class of each ``self`` on the call stack from ``frame`` outwards (innermost first):
    which objects (e.g. which Ray actor) a probed call runs inside."""
    out = []
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None:
            out.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
        frame = frame.f_back
    return out
