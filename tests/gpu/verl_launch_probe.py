"""Probe of ``launch_verl.py``: loaded by verl in every process of a launch (``VERL_USE_EXTERNAL_MODULES``).

It writes what the adapter computed into ``$ED_VERL_PROBE_DIR`` (``torch.save`` files), without changing
any value verl or the adapter computes:

* TaskRunner (the driver), per advantage step: ``driver-<step>-<pid>-<n>.pt`` with the global step, the
  batch's inputs to :meth:`EntropyDiscTrainerMixin.entropy_disc_step` (padded ``[B, T]``: advantages,
  response mask, the hook's ``log p`` / ``H`` / ``E_p[S]``, the rollout's log-probs), its keep-mask and
  metrics, the autopilot's state before and after, the adapter's settings (``options``, ``eta``), the
  vocabulary size, the batch's prompt and response token ids and TransferQueue tags (the rollout's
  weight version), and the wall-clock window of the step's old-log-prob pass;
* TaskRunner, at start-up and at each checkpoint: ``ckpt-<step>-<pid>-<n>.pt`` with the event
  (``load``: after verl's and the adapter's resume, ``save``), the global step and the autopilot's state;
* every worker process, per call of the engine hook (``_engine.hook_stats``, i.e. per micro-batch of an
  old-log-prob pass with the adapter's flag): ``hook-<pid>-<n>.pt`` with the rank, the time and the three
  float32 fields it returned.

``ED_VERL_CPU_GLOO=1`` (CPU smoke runs only, with ``verl_cpu_platform.py``): verl builds its process group as
``cpu:gloo,<device>:<backend>`` from its platform; the probe makes that ``gloo`` when this torch has no CUDA.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from typing import Any

import torch
import torch.distributed

from entropy_discriminator.adapters.verl import _autopilot, _engine, _trainer

_OUT = os.environ["ED_VERL_PROBE_DIR"]
_count = itertools.count()


def _save(kind: str, step: int | None, record: dict[str, Any]) -> None:
    record["pid"] = os.getpid()
    name = f"{kind}-{-1 if step is None else step:04d}-{os.getpid()}-{next(_count)}.pt"
    torch.save(record, os.path.join(_OUT, name))


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", -1))


def _state(trainer: Any) -> dict | None:
    pilot = trainer.entropy_disc_autopilot
    return None if pilot is None else pilot.state_dict()


def _cpu(t: Any) -> Any:
    return None if t is None else t.detach().cpu().clone()


def _hook_stats(original):
    @functools.wraps(original)
    def hook_stats(*args, **kwargs):
        out = original(*args, **kwargs)
        _save("hook", None, {"rank": _rank(), "time": time.time(), "fields": {k: _cpu(v) for k, v in out.items()}})
        return out

    return hook_stats


def _entropy_disc_step(original):
    @functools.wraps(original)
    def entropy_disc_step(self, **kwargs):
        before = _state(self)
        mask, metrics = original(self, **kwargs)
        self._probe_record = {
            "inputs": {k: _cpu(v) for k, v in kwargs.items()}, "keep": None if mask is None else _cpu(mask.keep),
            "metrics": dict(metrics), "before": before, "after": _state(self),
        }
        return mask, metrics

    return entropy_disc_step


def _compute_old_log_prob(original):
    @functools.wraps(original)
    def compute_old_log_prob(self, batch, metrics):
        start = time.time()
        out = original(self, batch, metrics)
        self._probe_window = (start, time.time())
        return out

    return compute_old_log_prob


def _compute_advantage(original):
    @functools.wraps(original)
    def compute_advantage(self, batch, metrics):
        import transfer_queue as tq

        out = original(self, batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
        record = self.__dict__.pop("_probe_record")
        record.update({
            "step": self.global_steps, "keys": list(batch.keys), "tags": [dict(t) for t in batch.tags],
            "prompts": [t.tolist() for t in data["prompts"].unbind()],
            "responses": [t.tolist() for t in data["responses"].unbind()],
            "window": self.__dict__.pop("_probe_window", None),
            "options": self.entropy_disc, "eta": self.entropy_disc_plan.eta,
            "vocab_size": _autopilot.vocab_size(self.config),
            "temperature": float(self.config.actor_rollout_ref.rollout.temperature),
            "lr": float(self.config.actor_rollout_ref.actor.optim.lr),
        })
        _save("driver", self.global_steps, record)
        return out

    return compute_advantage


def _checkpoint(original, event: str):
    @functools.wraps(original)
    def checkpoint(self):
        if event == "save":
            _save("ckpt", self.global_steps, {"event": event, "step": self.global_steps, "state": _state(self)})
            return original(self)
        out = original(self)
        _save("ckpt", self.global_steps, {"event": event, "step": self.global_steps, "state": _state(self)})
        return out

    return checkpoint


def _gloo_on_cpu(original):
    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if not torch.cuda.is_available() and str(kwargs.get("backend")).startswith("cpu:gloo,"):
            kwargs["backend"] = "gloo"
        return original(*args, **kwargs)

    return init_process_group


_engine.hook_stats = _hook_stats(_engine.hook_stats)
_mixin = _trainer.EntropyDiscTrainerMixin
_mixin.entropy_disc_step = _entropy_disc_step(_mixin.entropy_disc_step)
_mixin._compute_old_log_prob = _compute_old_log_prob(_mixin._compute_old_log_prob)
_mixin._compute_advantage = _compute_advantage(_mixin._compute_advantage)
_mixin._save_checkpoint = _checkpoint(_mixin._save_checkpoint, "save")
_mixin._load_checkpoint = _checkpoint(_mixin._load_checkpoint, "load")
if os.environ.get("ED_VERL_CPU_GLOO") == "1":
    torch.distributed.init_process_group = _gloo_on_cpu(torch.distributed.init_process_group)
