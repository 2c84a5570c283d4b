"""Loaded by every Python process of ``tests/gpu/launch_openrlhf.py``'s launches (this directory is on ``PYTHONPATH``
of the launcher and, through Ray's inherited environment, of every Ray worker); never by the library. It first runs
the ``sitecustomize`` it shadows, if the machine has one.

This directory also holds the launch's stand-ins: ``vllm/`` (OpenRLHF's rollout engine generating with HF) and
``flash_attn/`` (an import OpenRLHF makes but this launch never calls); see their docstrings.

With ``ED_LAUNCH_PROBE_DIR`` set, the probe: once ``entropy_discriminator.adapters.openrlhf._round`` has executed
(in the process that imports it: the policy actor, where the adapter patches ``ActorPPOTrainer``), its
``begin_round`` is wrapped, before the adapter's ``ppo_train`` wrapper binds it, so that every round of the adapter
writes ``$ED_LAUNCH_PROBE_DIR/round-<pid>-<n>.pt`` (``torch.save``): the Ray actor classes on the stack, the adapter's
settings (``_patch.encode_settings``), the round's flat ``[N]`` statistics (``TokenStats`` fields, as computed),
OpenRLHF's per-token advantages before the mask (``_round._flat_advantages``, float32, ``[N]``), the keep-mask
(bool ``[N]``), the controller's ``state_dict()`` before and after the round (autopilot), its step size and the
policy's vocabulary size, the round's ``entropy_disc/*`` metrics, and which ``vllm`` module this process imported.

With ``ED_TORCH_ADAM=1`` (a fallback, for a machine where DeepSpeed cannot compile its FusedAdam op just in time):
``DeepspeedStrategy.get_ds_train_config`` is wrapped to add ``"torch_adam": true`` to the optimizer's parameters
(torch's AdamW instead of FusedAdam, the same update rule); the probe records it.
"""

from __future__ import annotations

import copy
import functools
import os
import sys

_ROUND = "entropy_discriminator.adapters.openrlhf._round"
_STRATEGY = "openrlhf.utils.deepspeed.deepspeed"
_COUNT = [0]


def _helpers() -> dict:
    """``tests/adapters/import_hook.py``'s names (run by path: that folder is not on ``sys.path`` here)."""
    import runpy

    return runpy.run_path(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "adapters", "import_hook.py"))


def _probe(original):
    @functools.wraps(original)
    def begin_round(trainer, config):
        import torch

        from entropy_discriminator.adapters.openrlhf import _autopilot, _patch, _round

        pilot = config.method == "autopilot"
        advantages = _round._flat_advantages(trainer.replay_buffer.items, torch.device("cpu"))
        bound = _autopilot._BOUND.get(_autopilot._engine(trainer))
        before = copy.deepcopy(bound.pilot.state_dict()) if pilot and bound is not None else None
        state = original(trainer, config)
        bound = _autopilot._BOUND.get(_autopilot._engine(trainer))
        _COUNT[0] += 1
        record = {
            "pid": os.getpid(), "round": _COUNT[0], "selves": _helpers()["stack_classes"](sys._getframe(1)),
            "settings": _patch.encode_settings(config),
            "stats": {f: getattr(state.stats, f).detach().cpu() for f in _round._FIELDS},
            "advantages": advantages,
            "keep": None if state.mask is None else state.mask.keep.detach().cpu(),
            "before": before,
            "after": copy.deepcopy(bound.pilot.state_dict()) if pilot and bound is not None else None,
            "step_size": _autopilot.step_size(trainer.strategy.args, config) if pilot else None,
            "vocab_size": _autopilot._vocab_size(trainer),
            "metrics": dict(state.metrics),
            "source": state.source,
            "vllm": getattr(sys.modules.get("vllm"), "__file__", None),
            "vllm_stand_in": bool(getattr(sys.modules.get("vllm"), "STAND_IN", False)),
            "torch_adam": os.environ.get("ED_TORCH_ADAM") == "1",
        }
        torch.save(record, os.path.join(os.environ["ED_LAUNCH_PROBE_DIR"], f"round-{os.getpid()}-{_COUNT[0]:03d}.pt"))
        return state

    return begin_round


def _torch_adam(original):
    @functools.wraps(original)
    def get_ds_train_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if "optimizer" in config:  # the training engine's config (the one for Actor's ZeRO-3 init has none)
            config["optimizer"].setdefault("params", {})["torch_adam"] = True
        return config

    return get_ds_train_config


def _wrap_round(module) -> None:
    module.begin_round = _probe(module.begin_round)


def _wrap_strategy(module) -> None:
    module.DeepspeedStrategy.get_ds_train_config = _torch_adam(module.DeepspeedStrategy.get_ds_train_config)


def _chain() -> None:
    """Run the machine's own ``sitecustomize`` (if any, later on ``sys.path``), which this file shadows."""
    import importlib.machinery
    import runpy

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != here])
    if spec is not None and spec.origin:
        runpy.run_path(spec.origin, run_name="sitecustomize")


_chain()
_HOOKS = {**({_ROUND: _wrap_round} if os.environ.get("ED_LAUNCH_PROBE_DIR") else {}),
          **({_STRATEGY: _wrap_strategy} if os.environ.get("ED_TORCH_ADAM") == "1" else {})}
if _HOOKS:
    sys.meta_path.insert(0, _helpers()["AfterImport"](_HOOKS))
