"""Driver side of the verl adapter: V1 trainers that mask once per training batch.

Per step, on the driver (which sees the batch through TransferQueue):

1. ``_compute_old_log_prob`` (statistics): verl's old-policy pass, with the flag that makes the
   worker hook (``_engine``) add ``log p_k``, ``H`` and ``E_p[S]`` of the logits verl takes its
   log-probs from (its dtype, rounding and temperature division); the flag is removed afterwards so
   the reference and update passes never compute them.  The three are sliced to the response like
   ``old_log_probs`` and stored as :data:`STATS_FIELDS`.
2. ``_compute_advantage`` (mask and metrics): verl's advantages (GRPO: per sequence, broadcast over
   tokens; GAE: per token), then, from the hook's ``log p_k`` and ``H`` (verl's own
   ``old_log_probs`` and ``entropy`` only where no hook runs: strategies other than FSDP and
   Megatron, or Megatron with fused kernels), ``S* = exp(logp) (H + logp)`` (:func:`discriminator_score`),
   ``S_c = S* - E_p[S]``, the configured Clip_B / Clip_V mask over every valid token of the batch,
   and the monitor's ``entropy_disc/*`` metrics (``S_c`` weighted by ``r = pi_old / pi_rollout``
   when the rollout's log-probs exist, i.e. off-policy).  Method ``autopilot``: one step of the
   driver's controller in place of the Clip_B / Clip_V mask, its ``entropy_disc/autopilot/*``
   metrics with the monitor's (:mod:`._autopilot`).
3. ``_update_actor``: the mask acts on the actor update only (:func:`apply_mask`), then the stored
   fields are restored (so the critic, verl's metrics and later readers see verl's own values).

"The batch" is what one ``_step_once`` of verl's trainer samples: the whole training batch in the
``sync`` and ``colocate_async`` modes; in ``separate_async`` one of its ``parameter_sync_step``
parts (``train_batch_size / parameter_sync_step`` prompts, which verl requires to equal
``ppo_mini_batch_size``), each with its own advantage step and actor update (and its own
autopilot step).

Law scale (every method, :mod:`entropy_discriminator.law_scale`): the advantage step logs
``entropy_disc/delta_entropy/cheap`` (``-eta Cov_B(A, r S_c)``), ``/predicted = kappa * cheap`` and ``/scale``; on every
``calibrate_every``-th batch, after ``_update_actor``, the driver runs the actor group's
``compute_log_prob`` once more (as verl's old-policy pass: ``calculate_entropy``, no loss, the rollout
temperature) on a copy of the batch's metadata that holds only the rows
:func:`~entropy_discriminator.law_scale.calibration_rows` picks (the
``calibrate_share`` of its sequences, evenly spread, rounded up to what verl's dispatch needs), takes the
realised change of verl's own ``entropy`` field over those rows' response tokens, feeds ``(cheap,
realised)`` and puts back the ``entropy`` / ``log_probs`` values the pass wrote over those rows in
TransferQueue (the batch's metadata and every other row are never touched).  Why the realised change:
under FSDP (and Megatron) the parameters and the optimizer state are sharded over the workers and the
driver holds neither, so the exact ``grad H . dtheta`` of ``law.step_entropy_change`` has no seam here;
the realised change of the same tokens needs one forward.

Checkpoints: ``_save_checkpoint`` adds the controller's state (method ``autopilot``) and the law scale's
to verl's ``global_step_N`` folder, ``_load_checkpoint`` restores them, ``__init__`` refuses a resume
whose folder lacks the controller's (:mod:`._autopilot`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf, open_dict
from tensordict import TensorDict
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.workers.utils.padding import response_from_nested, response_to_nested

from entropy_discriminator import EntropyAutopilot, EntropyMonitor, MaskResult, discriminator_score
from entropy_discriminator.law_scale import (
    CHEAP_KEY,
    PREDICTED_KEY,
    REALISED_KEY,
    SKIPPED_KEY,
    LawScale,
    calibration_rows,
    cheap_change,
)
from . import _autopilot
from ._engine import SEQ_FIELDS, STATS_CHUNK, STATS_FLAG, STATS_IMPL
from ._support import BASE_MODES, TRAINER_MODES, check_config
from ._workers import stats_worker

#: Response-aligned ``E_p[S]`` in TransferQueue (float32, jagged like ``old_log_probs``).
EXPECTED_FIELD = "entropy_disc_s_expected"
#: Response-aligned ``log p_k`` and ``H`` of the same distribution (float32, jagged like ``old_log_probs``).
LOGP_FIELD = "entropy_disc_logp"
ENTROPY_FIELD = "entropy_disc_entropy"
#: ``TokenStats`` attribute -> response-aligned TransferQueue field written by ``_compute_old_log_prob``.
STATS_FIELDS = {"logp": LOGP_FIELD, "entropy": ENTROPY_FIELD, "s_expected": EXPECTED_FIELD}
#: Fields the mask rewrites for the actor update, per mask mode.
MASKED_FIELDS = {"zero_pg": ("advantages",), "drop_token": ("response_mask", "loss_mask")}

_logger = logging.getLogger(__name__)


def apply_mask(fields: dict[str, torch.Tensor], keep: torch.Tensor, mask_mode: str) -> dict[str, torch.Tensor]:
    """The actor-update fields with the clipped tokens masked: ``{name: field * keep}`` for :data:`MASKED_FIELDS`.

    Args:
        fields: verl's jagged response-aligned ``[B, j]`` tensors, at least the ones
            ``MASKED_FIELDS[mask_mode]`` names (``zero_pg``: ``advantages``; ``drop_token``:
            ``response_mask`` and ``loss_mask``).
        keep: bool ``[B, T]`` (``T >=`` the longest response), True for kept tokens.
        mask_mode: ``"zero_pg"`` or ``"drop_token"``.

    Returns:
        New jagged tensors of the same dtype and layout; clipped positions hold 0.
    """
    out = {}
    for name in MASKED_FIELDS[mask_mode]:
        nested = fields[name]
        padded = torch.nested.to_padded_tensor(nested, 0)
        out[name] = response_to_nested(padded * keep[:, : padded.shape[1]].to(padded.dtype), nested)
    return out


@dataclass
class _PendingMask:
    keys: tuple[str, ...]
    keep: torch.Tensor  # bool [B, T_resp], padded like to_padded_tensor()


@dataclass
class _PendingCalibration:
    """A calibration batch waiting for its after-update pass (:mod:`entropy_discriminator.law_scale`)."""

    keys: tuple[str, ...]  # the whole batch's, in verl's order
    rows: torch.Tensor  # int64 [m]: the rows the after pass reads (calibration_rows)
    entropy: torch.Tensor  # float [m, T_resp]: those rows' old-pass entropy (the after pass reads the same field)
    valid: torch.Tensor  # bool [m, T_resp]
    cheap: float


class EntropyDiscTrainerMixin:
    """Mix in front of a verl V1 ``PPOTrainer`` subclass: ``class T(EntropyDiscTrainerMixin, PPOTrainerSync)``.

    The registered trainer names map onto verl's modes (``BASE_MODES``); inside the trainer
    ``self.trainer_mode`` reads as the base mode, so verl's mode-dependent choices (replay
    buffer, ``trainer.v1.<mode>`` options) are exactly those of the base mode.
    """

    def __init__(self, config: DictConfig) -> None:
        plan = check_config(config)
        if plan is None:
            raise ValueError(
                f"{type(self).__name__} needs trainer.use_v1=true and trainer.v1.trainer_mode in {list(TRAINER_MODES)}"
            )
        if plan.mask_mode_reason is not None:
            _logger.warning("entropy_disc: mask_mode=drop_token, because %s", plan.mask_mode_reason)
        self.entropy_disc_plan = plan
        self.entropy_disc = plan.options
        self._entropy_disc_expected = plan.expected
        self._entropy_disc_monitor = EntropyMonitor()
        self._entropy_disc_pending: _PendingMask | None = None
        #: Method ``autopilot``: the controller (driver only, no process group); else None.
        self.entropy_disc_autopilot: EntropyAutopilot | None = None
        if plan.options.method == "autopilot":
            _autopilot.require_state(_autopilot.resume_folder(config))  # before any worker starts
            self.entropy_disc_autopilot = plan.options.build_autopilot(vocab_size=_autopilot.vocab_size(config))
        #: The scale of the cheap prediction (every method; the autopilot's calibration with method autopilot).
        self.entropy_disc_law = LawScale(plan.options.calibrate_every)
        self.entropy_disc_law.bind(self.entropy_disc_autopilot)
        self._entropy_disc_calibration: _PendingCalibration | None = None
        _alias_mode_options(config)
        super().__init__(config)

    @property
    def trainer_mode(self) -> str:
        return self.__dict__["_entropy_disc_trainer_mode"]

    @trainer_mode.setter
    def trainer_mode(self, name: str) -> None:
        self.__dict__["_entropy_disc_trainer_mode"] = BASE_MODES.get(name, name)

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        if not self._entropy_disc_expected:
            return
        for role in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
            remote_cls = self.role_worker_mapping.get(role)
            if remote_cls is not None:
                self.role_worker_mapping[role] = ray.remote(stats_worker(remote_cls.__ray_actor_class__))

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        if not self._entropy_disc_expected:
            return super()._compute_old_log_prob(batch, metrics)
        batch.extra_info.update(
            {
                STATS_FLAG: True,
                STATS_CHUNK: self.entropy_disc.chunk_size,
                STATS_IMPL: self.entropy_disc.impl,
            }
        )
        try:
            out = super()._compute_old_log_prob(batch, metrics)
        finally:
            for key in (STATS_FLAG, STATS_CHUNK, STATS_IMPL):
                batch.extra_info.pop(key, None)
        for key in (STATS_FLAG, STATS_CHUNK, STATS_IMPL):
            out.extra_info.pop(key, None)
        seq = list(SEQ_FIELDS.values())
        data = tq.kv_batch_get(keys=out.keys, partition_id=out.partition_id, select_fields=[*seq, "response_mask"])
        fields = TensorDict(
            {STATS_FIELDS[name]: response_from_nested(data[SEQ_FIELDS[name]], data["response_mask"]) for name in SEQ_FIELDS},
            batch_size=len(out),
        )
        return tq.kv_batch_put(keys=out.keys, partition_id=out.partition_id, fields=fields)

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        batch = super()._compute_advantage(batch, metrics)
        self._entropy_disc_pending = None
        wanted = ["response_mask", "advantages", "old_log_probs", "entropy", "rollout_log_probs"]
        if self._entropy_disc_expected:
            wanted.extend(STATS_FIELDS.values())
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=wanted)
        padded = data.to_padded_tensor()
        hooked = self._entropy_disc_expected  # the hook's one distribution, else verl's own fields
        mask, batch_metrics = self.entropy_disc_step(
            advantages=padded["advantages"],
            response_mask=padded["response_mask"],
            old_log_probs=padded[LOGP_FIELD] if hooked else padded["old_log_probs"],
            entropy=padded[ENTROPY_FIELD] if hooked else padded["entropy"],
            s_expected=padded[EXPECTED_FIELD] if hooked else None,
            rollout_log_probs=padded.get("rollout_log_probs", None),
        )
        if self.entropy_disc.log_metrics:
            metrics.update(batch_metrics)
        if mask is not None:
            self._entropy_disc_pending = _PendingMask(keys=tuple(batch.keys), keep=mask.keep)
        self._entropy_disc_calibration = None
        cheap = batch_metrics.get(self._entropy_disc_monitor.prefix + CHEAP_KEY)
        if self.entropy_disc_law.tick() and cheap is not None:
            share, multiple = self.entropy_disc.calibrate_share, self._entropy_disc_read_multiple()
            rows = calibration_rows(len(batch), share, multiple)
            self._entropy_disc_calibration = _PendingCalibration(
                keys=tuple(batch.keys), rows=rows, entropy=padded["entropy"][rows].float(),
                valid=padded["response_mask"][rows].bool(), cheap=cheap)
        return batch

    def entropy_disc_step(
        self,
        *,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        old_log_probs: torch.Tensor,
        entropy: torch.Tensor,
        s_expected: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
    ) -> tuple[MaskResult | None, dict[str, float]]:
        """Mask and metrics of one whole training batch (all tensors ``[B, T_resp]``, padded).

        ``old_log_probs``, ``entropy`` and ``s_expected`` are one distribution's (the hook's fields,
        see the module docstring). ``S* = exp(old_log_probs) (entropy + old_log_probs)``; ``S_c = S* - s_expected``; the mask
        is ``self.entropy_disc.compute_mask`` over the tokens with ``response_mask != 0``
        (None for ``method=none``).  Metrics: :class:`EntropyMonitor` with ``r = exp(old -
        rollout)`` when rollout log-probs are given and ``lr = actor.optim.lr``.  A NaN or infinite
        ``s_expected`` at a response token (the workers' hook reports bad policy logits that way)
        raises ``ValueError``.

        Method ``autopilot``: the mask is one step of :attr:`entropy_disc_autopilot` (this call
        advances its state), ``step(advantages, s_centered=S_c, entropy=entropy, valid, lr=plan.eta,
        ratio=r)`` with the same ``r`` (None without rollout log-probs); ``s_expected`` is required;
        the metrics add ``entropy_disc/autopilot/*``.
        """
        valid = response_mask.bool()
        zero = torch.zeros((), dtype=torch.float32)
        old_lp = torch.where(valid, old_log_probs.float(), zero)
        h = torch.where(valid, entropy.float(), zero)
        s_star = discriminator_score(old_lp, h, check=False)  # verl's own entropies: its rounding, not ours
        if s_expected is not None:
            _require_finite_expected(s_expected, valid)
        s_centered = None if s_expected is None else torch.where(valid, s_star - s_expected.float(), zero)
        adv = advantages.float()
        ratio = None
        if rollout_log_probs is not None and s_centered is not None:
            ratio = torch.where(valid, (old_lp - rollout_log_probs.float()).exp(), zero)
        mask, pilot_metrics = None, {}
        pilot = getattr(self, "entropy_disc_autopilot", None)  # duck-typed drivers (benchmarks) have none
        if pilot is not None:
            if s_centered is None:
                raise ValueError("entropy_disc.method=autopilot needs s_expected (E_p[S]) to form S_c")
            result = pilot.step(
                adv, s_centered=s_centered, entropy=h, valid=valid, lr=self.entropy_disc_plan.eta, ratio=ratio
            )
            mask, pilot_metrics = result.mask, result.metrics()
        elif self.entropy_disc.enabled:
            mask = self.entropy_disc.compute_mask(advantages=adv, valid=valid, s_star=s_star, s_centered=s_centered)
        lr = float(self.config.actor_rollout_ref.actor.optim.lr)
        batch_metrics = self._entropy_disc_monitor(
            entropy=h,
            valid=valid,
            advantages=adv,
            s_star=s_star,
            s_centered=s_centered,
            mask=mask,
            ratio=ratio,
            lr=lr if math.isfinite(lr) else None,
        )
        law = getattr(self, "entropy_disc_law", None)  # duck-typed drivers (benchmarks) have none
        if law is not None and s_centered is not None:
            batch_metrics.pop(self._entropy_disc_monitor.prefix + PREDICTED_KEY, None)  # the law scale's below
            cheap = cheap_change(adv, s_centered, valid, eta=self._entropy_disc_eta(), ratio=ratio,
                                 form=self.entropy_disc.form)
            batch_metrics.update(law.metrics(cheap, self._entropy_disc_monitor.prefix))
        batch_metrics.update(pilot_metrics)
        return mask, batch_metrics

    def _entropy_disc_eta(self) -> float | None:
        """``eta`` of the cheap prediction: the autopilot's step size, else ``options.step_size(actor.optim.lr)``;
        None when there is none (no cheap prediction, no calibration)."""
        if self.entropy_disc_plan.eta is not None:
            return self.entropy_disc_plan.eta
        try:
            return self.entropy_disc.step_size(self.config.actor_rollout_ref.actor.optim.lr)
        except ValueError:
            return None

    def _entropy_disc_read_multiple(self) -> int:
        """The row count a subset of the batch must be a multiple of for verl's ``compute_log_prob`` dispatch.

        verl's dispatch (``make_nd_compute_dataproto_dispatch_fn("actor")``) chunks the metadata into ``dp``
        consecutive pieces, one per data-parallel rank of the actor mesh (``dp = max(dp_rank_mapping) + 1``, the
        size verl's ``_balance_batch`` pads the whole batch to a multiple of); TransferQueue's ``chunk`` gives
        unequal or empty pieces for other counts, and the FSDP / Megatron ranks must run the same forwards.
        Without dynamic batch sizes each rank's rows must also fill whole micro-batches of
        ``rollout.log_prob_micro_batch_size_per_gpu`` (verl's ``prepare_micro_batches`` asserts it), and under
        Megatron's virtual pipeline the micro-batches come in groups of ``microbatch_group_size_per_vp_stage``
        (Megatron's default: the pipeline size), so each rank's rows are a multiple of the group too.  Returns
        ``dp x micro x group`` (``micro`` 1 with dynamic batch sizes, ``group`` 1 without a virtual pipeline).

        The rows read stay evenly spread from row 0 (:func:`~entropy_discriminator.law_scale.calibration_rows` with
        this ``multiple``); when both their count and the batch's are multiples of ``dp``, the ``r``-th of the ``dp``
        equal consecutive chunks verl hands to rank ``r`` lies inside rank ``r``'s part of the whole batch (the part
        ``_balance_batch`` balanced for it).  Rounding up reads more real rows where verl's padding helper
        (``upsample_batch_to_divisible_size``) would forward synthetic ones at the same cost and add keys to
        TransferQueue."""
        group = self.actor_rollout_wg
        if "actor" not in group._dispatch_info:
            group._dispatch_info["actor"] = group._query_dispatch_info("actor")
        multiple = max(group._dispatch_info["actor"]) + 1
        ref = self.config.actor_rollout_ref
        if not ref.actor.get("use_dynamic_bsz", False):
            multiple *= int(ref.rollout.log_prob_micro_batch_size_per_gpu)
        megatron = ref.actor.get("megatron", None) if ref.actor.get("strategy", None) == "megatron" else None
        if megatron is not None and (megatron.get("virtual_pipeline_model_parallel_size", None) or 1) > 1:
            override = megatron.get("override_transformer_config", None) or {}
            multiple *= int(override.get("microbatch_group_size_per_vp_stage", None)
                            or megatron.get("pipeline_model_parallel_size", 1))
        return multiple

    def _entropy_disc_calibrate(self, batch: Any, metrics: dict) -> None:
        """The after-update pass of a calibration batch: verl's own log-prob/entropy pass (``calculate_entropy``, no
        loss, the rollout temperature, as its old-policy pass) over the pending rows only (``calibration_rows``, run on
        ``batch.select_keys`` of their keys: a copy, so ``batch`` and its ``extra_info`` stay as verl left them),
        then ``delta_entropy/realised`` = mean over those rows' valid response tokens of (entropy after - entropy
        before), fed with the cheap prediction to the law scale.  The ``entropy`` and ``log_probs`` values the
        pass writes over those rows in TransferQueue are put back afterwards."""
        pending, self._entropy_disc_calibration = self._entropy_disc_calibration, None
        if pending is None or pending.keys != tuple(batch.keys):
            return
        read = batch.select_keys([batch.keys[i] for i in pending.rows.tolist()])
        read.extra_info.update({"calculate_entropy": True, "compute_loss": False,
                                "temperature": self.config.actor_rollout_ref.rollout.temperature})
        names = ["entropy", "log_probs"]
        original = tq.kv_batch_get(keys=read.keys, partition_id=read.partition_id, select_fields=names)
        try:
            self.actor_rollout_wg.compute_log_prob(read)
            data = tq.kv_batch_get(keys=read.keys, partition_id=read.partition_id,
                                   select_fields=["entropy", "response_mask"])
        finally:
            tq.kv_batch_put(keys=read.keys, partition_id=read.partition_id, fields=original.select(*names))
        after = torch.nested.to_padded_tensor(response_from_nested(data["entropy"], data["response_mask"]), 0.0).float()
        width = pending.entropy.shape[1]
        after = torch.nn.functional.pad(after, (0, max(0, width - after.shape[1])))[:, :width]
        realised = self._entropy_disc_monitor.realised(pending.entropy, after, pending.valid)
        fed = self.entropy_disc_law.feed(pending.cheap, realised[self._entropy_disc_monitor.prefix + REALISED_KEY])
        if self.entropy_disc.log_metrics:
            metrics.update(realised)
            metrics[self._entropy_disc_monitor.prefix + SKIPPED_KEY] = float(not fed)

    def _save_checkpoint(self) -> None:
        """verl's checkpoint of this global step, the autopilot's and the law scale's state first (:mod:`._autopilot`)."""
        folder = _autopilot.step_folder(self.config, self.global_steps)
        if self.entropy_disc_autopilot is not None:
            _autopilot.save(self.entropy_disc_autopilot, folder, self.global_steps)
        _autopilot.save_law(self.entropy_disc_law, folder, self.global_steps)
        return super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        """verl's resume, then the autopilot's state from the same folder (a fresh controller from step 0)."""
        folder = _autopilot.resume_folder(self.config)
        law = _autopilot.load_law(folder)
        if self.entropy_disc_autopilot is None:
            super()._load_checkpoint()
        else:
            saved = _autopilot.load(folder)  # refuses a missing state before verl loads anything
            super()._load_checkpoint()
            if self.global_steps != _autopilot.folder_step(folder):
                raise RuntimeError(
                    f"entropy_disc: verl resumed at global step {self.global_steps}, but the adapter read the "
                    f"autopilot's state for {folder!r}; refusing to continue with a state of another step"
                )
            pilot = self.entropy_disc.build_autopilot(vocab_size=_autopilot.vocab_size(self.config))
            if saved is not None:
                pilot.load_state_dict(saved)
            self.entropy_disc_autopilot = pilot
        scale = LawScale(self.entropy_disc.calibrate_every)
        scale.bind(self.entropy_disc_autopilot)
        if law is not None:
            scale.load_state_dict(law)
        self.entropy_disc_law = scale

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        pending, self._entropy_disc_pending = self._entropy_disc_pending, None
        if not self.entropy_disc.enabled:
            out = super()._update_actor(batch, metrics)
            self._entropy_disc_calibrate(batch, metrics)
            return out
        if pending is None or pending.keys != tuple(batch.keys):
            raise RuntimeError(
                "entropy_disc: the actor update got a batch whose mask was not computed in the advantage step "
                "before it; refusing to update without the mask"
            )
        names = list(MASKED_FIELDS[self.entropy_disc.mask_mode])
        original = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=names)
        masked = apply_mask(dict(original.items()), pending.keep, self.entropy_disc.mask_mode)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(masked, batch_size=len(batch)))
        try:
            out = super()._update_actor(batch, metrics)
        finally:
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=original.select(*names))
        self._entropy_disc_calibrate(batch, metrics)
        return out


def _require_finite_expected(s_expected: torch.Tensor, valid: torch.Tensor) -> None:
    """Refuse a batch whose ``E_p[S]`` from the old-log-prob pass is NaN/inf at a response token."""
    bad = valid & ~torch.isfinite(s_expected)
    if bool(bad.any()):
        rows = sorted({int(i) for i in bad.nonzero()[:, 0].tolist()})
        raise ValueError(
            f"entropy_disc: E_p[S] from the old-log-prob pass (field entropy_disc_s_expected_seq) is NaN or inf at "
            f"{int(bad.sum())} response token(s) of sequence(s) {rows[:8]}{' ...' if len(rows) > 8 else ''}: the "
            "policy's logits there contain NaN or +inf, or only -inf (the workers compute E_p[S] without a host "
            "check and report such rows as NaN)"
        )


def _alias_mode_options(config: DictConfig) -> None:
    """Make ``trainer.v1.<adapter mode>`` read as ``trainer.v1.<base mode>`` in the raw config.

    verl code that looks a mode's options up by the configured name (e.g. the rollout-skip cache
    reads ``trainer.v1.<trainer_mode>.parameter_sync_step``) then sees the base mode's values.
    :func:`check_config` has already refused a config that sets the adapter's name itself.
    """
    mode = config.trainer.v1.trainer_mode
    base = config.trainer.v1.get(BASE_MODES[mode], None)
    if base is None:
        return
    with open_dict(config):
        config.trainer.v1[mode] = OmegaConf.create(OmegaConf.to_container(base, resolve=True))


class EntropyDiscTrainerSync(EntropyDiscTrainerMixin, PPOTrainerSync):
    """``trainer.v1.trainer_mode=entropy_disc``: verl's ``sync`` trainer with the masks."""


class EntropyDiscTrainerColocateAsync(EntropyDiscTrainerMixin, PPOTrainerColocateAsync):
    """``trainer.v1.trainer_mode=entropy_disc_colocate_async``: verl's ``colocate_async`` trainer with the masks."""


class EntropyDiscTrainerSeparateAsync(EntropyDiscTrainerMixin, PPOTrainerSeparateAsync):
    """``trainer.v1.trainer_mode=entropy_disc_separate_async``: verl's ``separate_async`` trainer with the masks."""


#: Registered trainer name -> class.
TRAINERS: dict[str, type[PPOTrainer]] = {
    "entropy_disc": EntropyDiscTrainerSync,
    "entropy_disc_colocate_async": EntropyDiscTrainerColocateAsync,
    "entropy_disc_separate_async": EntropyDiscTrainerSeparateAsync,
}


def register_trainers() -> list[str]:
    """Add :data:`TRAINERS` to verl's V1 trainer registry (idempotent); returns the names added now."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    added = [name for name in TRAINERS if name not in TRAINER_REGISTRY]
    for name, cls in TRAINERS.items():
        register_trainer(name)(cls)
    return added


register_trainers()
