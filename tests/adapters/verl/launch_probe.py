"""Probe of the verl launch tests (test_verl_launch.py), loaded in every process of the launch.

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` on ``import verl`` (before its
plugins), in the driver, the TaskRunner and every worker; the test names this module there.  It
writes one JSON file per event into ``$ED_LAUNCH_PROBE_DIR``:

* ``plan-<pid>-<n>.json``: each call of the adapter's start-up decision (``_support.check_config``):
  the process, the class of the object whose method called it (the driver's ``validate_config``, or
  the adapter's trainer in the TaskRunner), the settings it decided, and the ``sync`` trainer
  registered in verl's V1 registry there;
* ``worker-<pid>-<n>.json``: when a process reaches ``torch.distributed.init_process_group``
  (verl's ``TrainingWorker.__init__`` in ``init_model``, through
  ``verl.utils.distributed.initialize_global_process_group_ray``): the verl worker classes on the
  stack (the colocated ``WorkerDict`` and the workers it holds), whether the adapter's engine hook is
  installed, and which file ``FSDPEngineWithLMHead.prepare_model_outputs`` comes from.  Then the
  real call runs: on a CPU it fails, because verl builds the process group as
  ``cpu:gloo,cuda:nccl`` from its platform (no setting selects another backend) and this torch has
  no NCCL; its error is written too.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
from typing import Any

import torch.distributed

from entropy_discriminator.adapters.verl import _support

_OUT = os.environ["ED_LAUNCH_PROBE_DIR"]
_count = itertools.count()


def _write(kind: str, record: dict) -> None:
    record["pid"] = os.getpid()
    with open(os.path.join(_OUT, f"{kind}-{os.getpid()}-{next(_count)}.json"), "w") as f:
        json.dump(record, f)


def _name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _stack_selves() -> list[Any]:
    frame, selves = sys._getframe(2), []
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and all(obj is not s for s in selves):
            selves.append(obj)
        frame = frame.f_back
    return selves


def _sync_trainer() -> str | None:
    registry = sys.modules.get("verl.trainer.ppo.v1.trainer_base")
    cls = getattr(registry, "TRAINER_REGISTRY", {}).get("sync") if registry else None
    return None if cls is None else _name(cls)


def _check_config(original):
    @functools.wraps(original)
    def check_config(config):
        plan = original(config)
        caller = sys._getframe(1).f_locals.get("self")
        options = None if plan is None else {k: getattr(plan.options, k) for k in
                                             ("method", "mu_low", "mu_high", "sides", "mask_mode")}
        _write("plan", {"caller": None if caller is None else [_name(c) for c in type(caller).__mro__],
                        "function": sys._getframe(1).f_code.co_name, "options": options,
                        "base_mode": None if plan is None else plan.base_mode, "sync": _sync_trainer()})
        return plan

    return check_config


def _init_process_group(original):
    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        from entropy_discriminator.adapters.verl import is_patched

        workers = {}
        for obj in _stack_selves():
            for key, inner in getattr(obj, "worker_dict", {}).items():
                workers[key] = [_name(c) for c in type(inner).__mro__]
            workers.setdefault("_self", []).append(_name(obj))
        record = {"workers": workers, "hook": is_patched(), "backend": str(kwargs.get("backend")),
                  "prepare_model_outputs": FSDPEngineWithLMHead.prepare_model_outputs.__code__.co_filename}
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            _write("worker", record)

    return init_process_group


_support.check_config = _check_config(_support.check_config)
torch.distributed.init_process_group = _init_process_group(torch.distributed.init_process_group)
