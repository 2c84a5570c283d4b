"""Loaded by every Python process of the OpenRLHF launch test (its directory is put on ``PYTHONPATH``:
the launcher, and through Ray's inherited environment every Ray worker); never by the library.

1. Stand-ins, only where the module is not installed and only for an import made by OpenRLHF's own
   code, for the modules a CPU machine cannot install (as in test_openrlhf.py): ``flash_attn``
   (imported by ``openrlhf/models/ring_attn_utils.py``), ``ring_flash_attn`` and ``vllm`` (imported by
   ``openrlhf/trainer/ray/__init__.py``).  They are empty modules: the launch stops before any of
   them is called.  transformers is imported first, so that its own availability checks see the
   real environment.  The ``vllm`` stand-in has ``__version__`` "0.29.0" (OpenRLHF 0.11.2's pin), which
   ``PolicyModelActor.init_model_from_pretrained`` reads before its process group.
2. The probe: once ``openrlhf.utils.deepspeed.deepspeed`` has executed, ``DeepspeedStrategy.
   setup_distributed`` (the first thing ``PolicyModelActor.init_model_from_pretrained`` does) writes
   what the process holds into ``$ED_LAUNCH_PROBE_DIR/worker-<pid>.json``: the Ray actor classes on
   the stack, whether the adapter's patch is live (``is_patched()``, the wrapped ``ppo_train`` and
   ``Actor.forward``) and the settings it carries; then the real call runs, which on a CPU stops at
   ``torch.cuda.set_device(local_rank)``; its error is written too.  An actor whose call fails holds its
   failure until the policy and the reference actor have both written theirs, so that the launch, which
   ends at the first failure, cannot end before the test's two actors are probed.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_STAND_INS = ("flash_attn", "ring_flash_attn", "vllm")
_PROBED = "openrlhf.utils.deepspeed.deepspeed"
_VLLM_VERSION = "0.29.0"


def _importer_is_openrlhf() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("importlib") or name == __name__ or frame.f_code.co_filename.startswith("<frozen")):
            return name.startswith("openrlhf")
        frame = frame.f_back
    return False


class _StandIn(importlib.abc.Loader):
    def create_module(self, spec):
        from unittest.mock import MagicMock

        module = MagicMock(name=spec.name)
        module.__spec__, module.__name__, module.__path__ = spec, spec.name, []
        if spec.name == "vllm":  # PolicyModelActor reads it before its process group (the release OpenRLHF pins)
            module.__version__ = _VLLM_VERSION
        return module

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        root = fullname.split(".")[0]
        if root in _STAND_INS:
            if fullname == root and (_installed(root) or not _importer_is_openrlhf()):
                return None
            if fullname != root and not isinstance(getattr(sys.modules.get(root), "__loader__", None), _StandIn):
                return None
            import transformers.modeling_utils  # noqa: F401  (its checks see the real environment first)

            return importlib.machinery.ModuleSpec(fullname, _StandIn(), is_package=True)
        return None


def _installed(root: str) -> bool:
    return importlib.machinery.PathFinder.find_spec(root) is not None


def _probe(original):
    @functools.wraps(original)
    def setup_distributed(self, *args, **kwargs):
        from entropy_discriminator.adapters.openrlhf import _patch

        selves = _helpers()["stack_classes"](sys._getframe(1))
        module = sys.modules.get(_patch.TRAINER_MODULE)
        config = _patch._STATE.config
        record = {
            "pid": os.getpid(), "selves": selves, "patched": _patch.is_patched(),
            "ppo_train": module.ActorPPOTrainer.ppo_train.__code__.co_filename if module else None,
            "forward": module.Actor.forward.__code__.co_filename if module else None,
            "settings": None if config is None else {k: getattr(config, k) for k in
                                                     ("method", "mu_low", "mu_high", "sides", "mask_mode")},
            "realised": _patch._STATE.realised,
        }
        probes = os.environ["ED_LAUNCH_PROBE_DIR"]
        try:
            result = original(self, *args, **kwargs)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            _write_record(probes, record)
            _wait_for_records(probes)
            raise
        _write_record(probes, record)
        return result

    return setup_distributed


def _write_record(probes: str, record: dict) -> None:
    partial = os.path.join(probes, f".worker-{os.getpid()}.partial")
    with open(partial, "w") as f:
        json.dump(record, f)
    os.replace(partial, os.path.join(probes, f"worker-{os.getpid()}.json"))  # a record appears whole


#: The actors whose records the test reads: each actor holds its failure until both have written theirs.
_AWAITED = ("ppo_actor.PolicyModelActor", "ReferenceModelActor")


def _wait_for_records(probes: str, timeout_s: float = 240.0) -> None:
    """Hold this actor's failure until the policy and the reference actor have written their records (or
    ``timeout_s`` passed): the first actor to fail ends the launch, and on a slow machine one of them would
    otherwise be stopped before it reached ``setup_distributed``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = set()
        for name in os.listdir(probes):
            if name.startswith("worker-"):
                with open(os.path.join(probes, name)) as f:
                    selves = json.load(f)["selves"]
                seen.update(a for a in _AWAITED if any(s.endswith(a) for s in selves))
        if len(seen) == len(_AWAITED):
            return
        time.sleep(0.2)


def _probe_strategy(module) -> None:
    module.DeepspeedStrategy.setup_distributed = _probe(module.DeepspeedStrategy.setup_distributed)


def _helpers() -> dict:
    """``tests/adapters/import_hook.py``'s names (run by path: that folder is not on ``sys.path`` here)."""
    import runpy

    return runpy.run_path(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "import_hook.py"))


if os.environ.get("ED_LAUNCH_PROBE_DIR"):
    sys.meta_path.insert(0, _helpers()["AfterImport"]({_PROBED: _probe_strategy}))
    sys.meta_path.insert(0, _Finder())
