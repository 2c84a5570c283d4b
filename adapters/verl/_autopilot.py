"""The entropy autopilot (``method="autopilot"``) in verl's V1 trainers: one controller in the driver,
stepped once per training batch, its state in every verl checkpoint.

Who holds it: verl's V1 trainer is a single controller.  The adapter's advantage step
(``_trainer.EntropyDiscTrainerMixin._compute_advantage``) reads the whole batch from TransferQueue
in the driver process and computes the mask there, so the controller lives in the driver, once,
without a process group (its sums already cover every sequence of the batch); the workers only
compute the statistics and apply the keep-mask the driver wrote.

Stepping (``EntropyDiscTrainerMixin.entropy_disc_step``), all tensors response-aligned ``[B, T_resp]``::

    result = pilot.step(A, s_centered=S_c, entropy=H, valid=response_mask != 0, lr=eta, ratio=r)

``A`` verl's token advantages (GRPO: the sequence's, broadcast), ``H`` and ``S_c = S* - E_p[S]`` the
old-policy pass's (the engine hook's ``log p_k``, ``H``, ``E_p[S]``), ``eta = RunPlan.eta =
config.step_size(actor_rollout_ref.actor.optim.lr)``, ``r = exp(log pi_old - log pi_rollout)`` when
the rollout's log-probs are in the batch (``rollout.calculate_log_probs=True``), else None (r = 1).
``result.mask`` acts on the actor update as Clip_B / Clip_V's mask does; ``result.metrics()``
(``entropy_disc/autopilot/*``) joins the step's metrics.

State with the checkpoint: ``_save_checkpoint`` writes :func:`save`'s JSON file :data:`STATE_FILE`,
``{"global_step": N, "autopilot": pilot.state_dict()}``, into verl's ``<trainer.default_local_dir>/
global_step_N/`` (next to ``actor/`` and ``data.pt``) *before* verl's own files, so verl's tracker
``latest_checkpointed_iteration.txt``, which verl writes last, never names a folder without it.
On resume verl picks its folder in ``_load_checkpoint`` (``trainer.resume_mode=auto``: the tracker's;
``resume_path``: ``trainer.resume_from_path``); :func:`resume_folder` applies the same rule, the
trainer's ``__init__`` refuses (``ValueError``, before any worker starts) a resume at global step
``N > 0`` whose folder lacks the file, and ``_load_checkpoint`` loads it after verl's own load.  A
run from step 0 starts a fresh controller.  Like ``data.pt``, the file is local only (verl copies
the actor and critic to ``trainer.default_hdfs_dir``, not the driver's files).
"""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from entropy_discriminator import EntropyAutopilot

from entropy_discriminator.law_scale import LawScale

#: The controller's file in verl's ``global_step_N`` checkpoint folder.
STATE_FILE = "entropy_disc_autopilot.json"
#: The law scale's file (:mod:`entropy_discriminator.law_scale`; every method) in the same folder.
LAW_FILE = "entropy_disc_law.json"


def step_folder(config: DictConfig, global_step: int) -> str:
    """The folder verl's ``_save_checkpoint`` writes for ``global_step``: ``<default_local_dir>/global_step_<N>``."""
    return os.path.join(config.trainer.default_local_dir, f"global_step_{global_step}")


def save(pilot: EntropyAutopilot, folder: str, global_step: int) -> str:
    """Write ``{"global_step", "autopilot": pilot.state_dict()}`` to ``folder/STATE_FILE`` atomically; its path.

    JSON keeps the state exactly (``h_start`` is written with ``repr``, which round-trips a float).
    """
    return _write(folder, STATE_FILE, {"global_step": int(global_step), "autopilot": pilot.state_dict()})


def save_law(scale: LawScale, folder: str, global_step: int) -> str:
    """Write ``{"global_step", "law": scale.state_dict()}`` to ``folder/LAW_FILE`` atomically; its path."""
    return _write(folder, LAW_FILE, {"global_step": int(global_step), "law": scale.state_dict()})


def _write(folder: str, name: str, payload: dict[str, Any]) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)
    return path


def load_law(folder: str | None) -> dict[str, Any] | None:
    """The law scale's state saved in ``folder`` (None from step 0, or for a checkpoint without :data:`LAW_FILE`:
    the scale then starts afresh at ``kappa = 1``, which changes only the logged prediction's size until the next
    calibration batch); ``ValueError`` when the file's ``global_step`` is not the folder's."""
    step = folder_step(folder)
    path = None if step == 0 else os.path.join(folder, LAW_FILE)
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    if not isinstance(saved, dict) or saved.get("global_step") != step or "law" not in saved:
        raise ValueError(f"{path} must hold {{'global_step': {step}, 'law': ...}} for the checkpoint of global step "
                         f"{step}, got {saved!r}")
    return saved["law"]


def vocab_size(config: DictConfig) -> int | None:
    """The policy's vocabulary size from the Hugging Face config in the local folder ``actor_rollout_ref.model.path``
    (the driver loads no weights); None for a path that is no local folder (a hub name: nothing is downloaded for
    this) or a config without one: a target above ``log V`` is then not checked."""
    from transformers import AutoConfig

    path = OmegaConf.select(config, "actor_rollout_ref.model.path", default=None)
    if not isinstance(path, str) or not os.path.isdir(path):
        return None
    remote = bool(OmegaConf.select(config, "actor_rollout_ref.model.trust_remote_code", default=False))
    try:
        size = getattr(AutoConfig.from_pretrained(path, trust_remote_code=remote), "vocab_size", None)
    except (OSError, ValueError):  # not a local folder or hub name readable here: the check is skipped
        return None
    return size if isinstance(size, int) and size >= 2 else None


def resume_folder(config: DictConfig) -> str | None:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumes from, or None (training from scratch).

    verl 0.9's rule: ``trainer.resume_mode=disable``: none; ``auto``: the folder named by
    ``latest_checkpointed_iteration.txt`` in ``trainer.default_local_dir`` (None without one);
    ``resume_path``: ``trainer.resume_from_path``.  Relative paths are taken from the working
    directory, as verl takes them.  A setting verl itself rejects (another mode, a path without
    ``global_step_``) gives None here and fails in verl.
    """
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    mode = config.trainer.resume_mode
    if mode == "auto":
        return find_latest_ckpt_path(os.path.abspath(config.trainer.default_local_dir))
    if mode == "resume_path":
        path = config.trainer.resume_from_path
        if isinstance(path, str) and "global_step_" in path:
            return os.path.abspath(path)
    return None


def folder_step(folder: str | None) -> int:
    """The global step verl reads from a checkpoint folder's name (``global_step_<N>``); 0 for None."""
    return 0 if folder is None else int(folder.split("global_step_")[-1])


def require_state(folder: str | None) -> None:
    """``ValueError`` when a resume at global step > 0 from ``folder`` would find no :data:`STATE_FILE`."""
    step = folder_step(folder)
    if step > 0 and not os.path.isfile(os.path.join(folder, STATE_FILE)):
        raise ValueError(
            f"entropy_disc.method=autopilot resumes at global step {step} from {folder}, which has no {STATE_FILE} "
            "(saved by a run without the autopilot, or by an older adapter); the controller's state (its step and "
            "starting entropy) cannot be restored. Resume from a checkpoint of an autopilot run, or start from step 0 "
            "(trainer.resume_mode=disable)."
        )


def load(folder: str | None) -> dict[str, Any] | None:
    """The controller state saved in ``folder`` (None for a run from step 0); see :func:`require_state`.

    ``ValueError`` when the file's ``global_step`` is not the folder's (a file copied between folders).
    """
    require_state(folder)
    step = folder_step(folder)
    if step == 0:
        return None
    with open(os.path.join(folder, STATE_FILE)) as f:
        saved = json.load(f)
    if not isinstance(saved, dict) or saved.get("global_step") != step or "autopilot" not in saved:
        raise ValueError(
            f"{os.path.join(folder, STATE_FILE)} must hold {{'global_step': {step}, 'autopilot': ...}} for the "
            f"checkpoint of global step {step}, got {saved!r}"
        )
    return saved["autopilot"]
