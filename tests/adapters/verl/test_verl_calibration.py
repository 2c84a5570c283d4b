"""The law scale's after-update pass in verl's V1 ``sync`` trainer reads ``entropy_disc.calibrate_share`` of the batch.

Real, as in ``test_verl_autopilot.py`` (whose stubs this reuses): verl's trainer built from the composed
``ppo_trainer`` config, its ``fit`` loop (``_balance_batch``'s reordering, the old-policy pass, GRPO advantages, the
actor update), TransferQueue on a local Ray.  With ``DispatchedActor`` the worker group is verl's own
``WorkerGroup`` and ``compute_log_prob`` goes through verl's dispatch of the actor's engine worker
(``make_nd_compute_dataproto_dispatch_fn("actor")``: the metadata chunked over the data-parallel ranks, each rank's
chunk read through ``tqbridge`` and cut into micro-batches by verl's ``prepare_micro_batches``, the outputs
collected back into one ``KVBatchMeta``); only the per-rank forward is the stub model's.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import ray  # noqa: E402
import transfer_queue as tq  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from test_verl_autopilot import (  # noqa: E402
    CONFIG_DIR,
    LAW,
    N_PROMPTS,
    N_ROLLOUTS,
    PILOT,
    PROMPT_LEN,
    STEPS,
    FakeActor,
    Run,
)
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn  # noqa: E402
from verl.single_controller.base.worker_group import WorkerGroup  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.transferqueue_utils import batch_meta2kv_batch_meta, tqbridge  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402

import entropy_discriminator.adapters.verl as ed_verl  # noqa: E402
from entropy_discriminator.adapters.verl._trainer import EntropyDiscTrainerMixin  # noqa: E402
from entropy_discriminator.law_scale import calibration_rows  # noqa: E402

ROWS = N_PROMPTS * N_ROLLOUTS  # one training batch: 4 prompts x 4 rollouts, a multiple of every dp size below


class DispatchedActor(WorkerGroup, FakeActor):
    """The stub actor behind verl's own dispatch of ``compute_log_prob`` over ``dp`` data-parallel ranks, each
    cutting its rows into micro-batches of ``micro`` as verl's engine does without dynamic batch sizes."""

    def __init__(self, dp: int, micro: int):
        WorkerGroup.__init__(self, resource_pool=None)
        FakeActor.__init__(self)
        self._workers = list(range(dp))  # world_size: one worker per data-parallel rank
        self._dispatch_info = {"actor": list(range(dp))}
        self._collect_info = {"actor": [True] * dp}
        self.micro = micro
        self.rank_keys: list[list[list[str]]] = []  # per pass: the keys each rank got, rank by rank

    def compute_log_prob(self, batch):
        dispatch = make_nd_compute_dataproto_dispatch_fn(mesh_name="actor")
        (chunks,), _ = dispatch["dispatch_fn"](self, batch)
        metas = ray.get(list(chunks))
        keys = [batch_meta2kv_batch_meta(meta).keys for meta in metas]
        self.rank_keys.append(keys)
        self.begin_pass(batch.extra_info.get)
        rank_pass = tqbridge()(self._rank_pass)  # verl's worker-side bridge: the chunk's data in, its output put
        outputs = [rank_pass(meta, rank_keys, batch.extra_info) for meta, rank_keys in zip(metas, keys)]
        return dispatch["collect_fn"](self, outputs)

    def _rank_pass(self, data, keys, extra_info):
        """One rank's share of the pass over its chunk (a TensorDict, as verl's worker gets it, the pass's extra info
        among its entries): verl's micro-batching, then the stub model over the chunk."""
        assert {name: tu.get_non_tensor_data(data, name, None) for name in extra_info} == extra_info
        tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=self.micro)
        micro_batches, _ = prepare_micro_batches(data)  # asserts whole micro-batches of `micro` rows
        assert [len(m) for m in micro_batches] == [self.micro] * (len(data) // self.micro)
        return self.log_prob_fields(keys, data.select("raw_logp", "raw_entropy", "raw_s_expected"))


def run_fit(tmp_path, monkeypatch, tag: str, *extra: str, actor: FakeActor | None = None) -> Run:
    """verl's fit loop with the stubs, a calibration batch every step; each after-update pass is checked to leave
    the batch (its metadata and the ``entropy`` / ``log_probs`` of every row in TransferQueue) as it found it."""
    run = Run(tmp_path / tag, monkeypatch, *extra, tag=tag, actor=actor)
    t = run.trainer
    inner = t._entropy_disc_calibrate

    def snapshot(batch):
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["entropy", "log_probs"])
        return (list(batch.keys), copy.deepcopy(batch.tags), copy.deepcopy(batch.extra_info),
                {name: [v.clone() for v in data[name].unbind()] for name in ("entropy", "log_probs")})

    def checked(batch, metrics):
        before = snapshot(batch)
        inner(batch, metrics)
        after = snapshot(batch)
        assert after[:3] == before[:3]
        for name in ("entropy", "log_probs"):
            assert all(torch.equal(a, b) for a, b in zip(after[3][name], before[3][name], strict=True)), name

    t._entropy_disc_calibrate = checked
    run.fit()
    assert len(run.actor.after_entropy) == len(run.actor.old_entropy) == STEPS
    return run


def reference_realised(run: Run, step: int, keys: list[str]) -> float:
    """The mean over the response tokens of the rows ``keys`` of (entropy after - entropy before), in float64, from
    the entropies the stub wrote in global step ``step``'s old-policy and after-update passes (verl's entropy at
    model position ``i`` is the token at ``i + 1``'s: the response's are positions ``PROMPT_LEN - 1 .. -2``)."""
    before, after = run.actor.old_entropy[step - 1], run.actor.after_entropy[step - 1]
    total, count = torch.zeros((), dtype=torch.float64), 0
    for key in keys:
        h0, h1 = before[key][PROMPT_LEN - 1 : -1], after[key][PROMPT_LEN - 1 : -1]
        total += (h1.double() - h0.double()).sum()
        count += h0.numel()
    return float(total / count)


def batch_keys(run: Run, step: int) -> list[str]:
    """The keys of global step ``step``'s batch in verl's order (after ``_balance_batch``): its old pass's order."""
    return list(run.actor.old_entropy[step - 1])


@pytest.mark.parametrize(
    ("dp", "micro", "share", "count"),
    [
        (1, 4, 0.25, 4),  # calibration_rows' own 4 of 16: one whole micro-batch on the one rank
        (4, 1, 0.1, 4),  # ceil(1.6) = 2 rows, rounded up to one row per rank of 4
        (4, 2, 0.25, 8),  # 4 rows, rounded up to one micro-batch of 2 per rank of 4
        (2, 8, 0.25, ROWS),  # 4 rows, rounded up to 2 x 8 = the whole batch
    ],
)
def test_after_update_pass_reads_the_evenly_spread_share_verls_dispatch_can_split(
        queue, tmp_path, monkeypatch, dp, micro, share, count):
    actor = DispatchedActor(dp, micro)
    run = run_fit(tmp_path, monkeypatch, f"d{dp}m{micro}s{share}".replace(".", ""),
                  f"+entropy_disc.calibrate_share={share}",
                  f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}", actor=actor)
    want_rows = torch.arange(count) * ROWS // count  # calibration_rows' spacing at the rounded count
    if count == len(calibration_rows(ROWS, share)):
        assert torch.equal(want_rows, calibration_rows(ROWS, share))
    for step in range(1, STEPS + 1):
        keys = batch_keys(run, step)
        read = [keys[i] for i in want_rows.tolist()]
        assert list(run.actor.after_entropy[step - 1]) == read  # exactly these rows, in the batch's order
        old_ranks, after_ranks = run.actor.rank_keys[2 * step - 2], run.actor.rank_keys[2 * step - 1]
        # verl's dispatch gave every rank an equal chunk, and each rank's rows come from its own part of the batch
        assert [len(k) for k in after_ranks] == [count // dp] * dp
        assert [k for rank in after_ranks for k in rank] == read
        for old, after in zip(old_ranks, after_ranks, strict=True):
            assert set(after) <= set(old)
        assert run.logged[step][LAW + "realised"] == pytest.approx(reference_realised(run, step, read), rel=1e-12)


def test_share_quarter_reads_calibration_rows_and_its_realised_change_is_theirs(queue, tmp_path, monkeypatch):
    # no rounding: one rank (FakeActor's dispatch info), micro-batches of 1 row
    run = run_fit(tmp_path, monkeypatch, "quarter", "+entropy_disc.calibrate_share=0.25",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1")
    rows = calibration_rows(ROWS, 0.25)
    assert rows.tolist() == [0, 4, 8, 12]
    full_values = []
    for step in range(1, STEPS + 1):
        keys = batch_keys(run, step)
        read = [keys[i] for i in rows.tolist()]
        assert list(run.actor.after_entropy[step - 1]) == read
        assert run.logged[step][LAW + "realised"] == pytest.approx(reference_realised(run, step, read), rel=1e-12)
        # the stub model scales every entropy by exp(theta after - theta before): the whole batch's change
        h = torch.cat([run.actor.old_entropy[step - 1][k][PROMPT_LEN - 1 : -1] for k in keys]).double()
        growth = math.exp(run.actor.after_thetas[step - 1] - run.actor.old_thetas[step - 1]) - 1
        full_values.append(growth * float(h.mean()))
    # the subset's value is its own, not the whole batch's
    assert [run.logged[s][LAW + "realised"] for s in range(1, STEPS + 1)] != pytest.approx(full_values, rel=1e-6)


def test_share_one_reads_the_whole_batch_and_gives_its_value(queue, tmp_path, monkeypatch):
    run = run_fit(tmp_path, monkeypatch, "whole", "+entropy_disc.calibrate_share=1")
    for step in range(1, STEPS + 1):
        keys = batch_keys(run, step)
        assert list(run.actor.after_entropy[step - 1]) == keys  # every row, in verl's order
        assert run.logged[step][LAW + "realised"] == pytest.approx(reference_realised(run, step, keys), rel=1e-12)
    assert run.actor.after_thetas == run.actor.thetas


@pytest.mark.parametrize(("value", "why"), [("0", r"> 0"), ("1.5", r"<= 1"), ("x", r"must be a number, got 'x'")])
def test_bad_calibrate_share_is_refused_before_any_work(tmp_path, monkeypatch, value, why):
    overrides = ["trainer.v1.trainer_mode=entropy_disc", *PILOT, f"+entropy_disc.calibrate_share={value}",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    match = rf"entropy_disc\.calibrate_share .*{why}"
    with pytest.raises(ValueError, match=match):
        ed_verl.check_config(cfg)
    from verl.trainer.main_ppo import main

    with pytest.raises(ValueError, match=match):  # inside verl's validate_config, before Ray or any worker starts
        main(cfg)
    with pytest.raises(ValueError, match=match):  # the trainer itself, before verl's __init__ and any worker
        Run(tmp_path / "refused", monkeypatch, f"+entropy_disc.calibrate_share={value}", tag=f"bad{value}")


@pytest.mark.parametrize(
    ("config_name", "overrides", "multiple"),
    [
        ("ppo_trainer", [], 4 * 8),  # dp x log_prob_micro_batch_size_per_gpu
        ("ppo_trainer", ["actor_rollout_ref.actor.use_dynamic_bsz=true"], 4),  # verl balances micro-batches itself
        ("ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"], 4 * 8),
        ("ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",  # Megatron's
                                  "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],  # default
         4 * 8 * 2),  # group: the pipeline size
        ("ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                  "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
                                  "+actor_rollout_ref.actor.megatron.override_transformer_config."
                                  "microbatch_group_size_per_vp_stage=3"], 4 * 8 * 3),
        ("ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                  "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
                                  "actor_rollout_ref.actor.use_dynamic_bsz=true"], 4 * 2),
    ],
)
def test_row_multiple_follows_verls_dispatch_and_micro_batching(config_name, overrides, multiple):
    """The subset size is rounded to ``dp`` (the actor mesh's data-parallel ranks, verl's dispatch info), times
    the per-GPU log-prob micro-batch without dynamic batch sizes, times Megatron's virtual-pipeline group."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name=config_name, overrides=[
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", *overrides])
    queried = []

    class Group:  # verl's worker group before _balance_batch asked: dp ranks 0..3, each over 2 workers (tp 2)
        _dispatch_info: dict = {}

        def _query_dispatch_info(self, mesh):
            queried.append(mesh)
            return [0, 0, 1, 1, 2, 2, 3, 3]

    group = Group()
    trainer = SimpleNamespace(actor_rollout_wg=group, config=cfg)
    assert EntropyDiscTrainerMixin._entropy_disc_read_multiple(trainer) == multiple
    assert queried == ["actor"] and group._dispatch_info == {"actor": [0, 0, 1, 1, 2, 2, 3, 3]}
