"""The entropy autopilot in verl's two async V1 trainers (``entropy_disc_colocate_async``,
``entropy_disc_separate_async``): stepping, metrics, checkpoint and resume through verl's own code.

Real, as in ``test_verl_autopilot.py`` (whose stubs this reuses): verl's async trainer classes built
from the composed ``ppo_trainer`` config, their ``fit`` loop with the mode's hooks (warm-up requests,
weight syncs, ``separate_async``'s ``parameter_sync_step`` parts and its decoupled ``pi_old``: the
old-policy pass of every part after the first restores the part-0 weights through the worker's
``save_model_to_cpu`` / ``restore_model_from_cpu``), ``_save_checkpoint`` (which in the async modes
also writes TransferQueue's state, ``transfer_queue/``) and ``_load_checkpoint`` (which restores it).
Stubbed: the worker group, the replay buffer (a part's batch is a fixed function of the global step
and the part, as verl's async buffer does *not* guarantee: its rollouts race the trainer, so an async
run is not reproducible even uninterrupted; what the adapter owes is that, given the same batches,
the resumed controller continues the uninterrupted one exactly), the rollout replicas, ``Tracking``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
from test_verl_autopilot import (  # noqa: E402
    N_PROMPTS,
    N_ROLLOUTS,
    PREFIX,
    STATE_FILE,
    STEPS,
    Crash,
    Run,
    entropy_disc_metrics,
    reference_steps,
)
from verl.trainer.ppo.v1.utils import MetricsAggregator  # noqa: E402

PARTS = 2  # separate_async: parameter_sync_step, each part ppo_mini_batch_size = 2 prompts
SEPARATE = [
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    f"trainer.v1.separate_async.parameter_sync_step={PARTS}",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
]
MODES = {
    "entropy_disc_colocate_async": ([], 1),
    "entropy_disc_separate_async": (SEPARATE, PARTS),
}


def keys_of(parts: int, steps) -> list:
    """The recorded advantage steps of global ``steps``, in order: the step, or (step, part)."""
    return [s for s in steps] if parts == 1 else [(s, p) for s in steps for p in range(parts)]


@pytest.mark.parametrize("mode", list(MODES))
def test_async_mode_steps_per_batch_or_part_and_resumes_bit_for_bit(queue, tmp_path, monkeypatch, mode):
    extra, parts = MODES[mode]
    extra = [*extra, "+entropy_disc.calibrate_every=0"]  # the controller alone (the law scale: test_verl_autopilot.py)
    tag = "c" if parts == 1 else "s"
    full = Run(tmp_path / "full", monkeypatch, *extra, mode=mode, tag=f"{tag}full")
    full.fit()
    t = full.trainer
    assert t.trainer_mode == mode.removeprefix("entropy_disc_") and t.parameter_sync_step == parts
    assert t.entropy_disc_autopilot is not None

    # one controller step per advantage step: per global step (colocate_async), per part (separate_async)
    keys = keys_of(parts, range(1, STEPS + 1))
    assert list(full.batches) == keys
    assert t.entropy_disc_autopilot.state_dict()["step"] == STEPS * parts
    assert [full.batches[k]["state"]["step"] for k in keys] == list(range(1, STEPS * parts + 1))
    assert len(full.actor.updates) == STEPS * parts
    rows = N_PROMPTS * N_ROLLOUTS // parts  # each part is its own batch: 2 prompts x 4 rollouts in separate_async
    for i, k in enumerate(keys):
        assert full.batches[k]["inputs"]["advantages"].shape[0] == rows == len(full.actor.updates[i]["advantages"])
    # the core controller stepped on the same inputs in the same order gives the same masks and metrics
    refs = reference_steps(full.batches, keys)
    dropped = 0
    for i, (k, ref) in enumerate(zip(keys, refs)):
        got = full.batches[k]
        assert torch.equal(got["keep"], ref.keep)
        assert {m: v for m, v in got["metrics"].items() if m.startswith(PREFIX)} == ref.metrics()
        seen = full.actor.updates[i]  # the update of this batch / part saw its own mask (zero_pg)
        assert torch.equal(seen["advantages"], got["inputs"]["advantages"] * ref.keep[:, : seen["advantages"].shape[1]])
        dropped += ref.mask.n_clipped
    assert dropped > 0
    # what fit logs per global step: the step's metrics (colocate_async), verl's MetricsAggregator over the
    # parts (separate_async: sample-weighted means, keyword rules; here equal-size parts, so plain means)
    assert sorted(full.logged) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        step_keys = [k for k in keys if (k if parts == 1 else k[0]) == s]
        agg = MetricsAggregator()
        for k in step_keys:
            agg.add_step_metrics(full.batches[k]["metrics"], sample_count=rows)
        want = {m: v for m, v in agg.get_aggregated_metrics().items() if m.startswith(PREFIX)}
        assert set(want) == {m for m in full.logged[s] if m.startswith(PREFIX)}
        for m, v in want.items():
            assert full.logged[s][m] == pytest.approx(v, rel=1e-12, abs=1e-15), m
        if parts > 1:
            mean = sum(full.batches[k]["metrics"][PREFIX + "n_dropped"] for k in step_keys) / parts
            assert full.logged[s][PREFIX + "n_dropped"] == pytest.approx(mean)
    if parts > 1:  # verl's decoupled pi_old: the old-policy pass of part 1 ran on the part-0 weights
        assert full.actor.old_thetas[0::2] == full.actor.old_thetas[1::2]
        assert full.actor.thetas[0::2] != full.actor.old_thetas[1::2]
    assert full.warmup_prompts in ([], [N_PROMPTS])  # 0.9.1 asks for one warm-up batch; 0.9.0 through another stub
    # checkpoints at global steps 2 and 4, next to verl's files, TransferQueue's state among them
    for s in (2, 4):
        folder = tmp_path / "full" / f"global_step_{s}"
        assert {"actor", "data.pt", "transfer_queue", STATE_FILE} <= {p.name for p in folder.iterdir()}
        last = keys[s * parts - 1]
        saved = json.loads((folder / STATE_FILE).read_text())
        assert saved == {"global_step": s, "autopilot": full.batches[last]["state"]}
        assert full.batches[last]["state"]["step"] == s * parts

    # interrupted in the actor update of global step 3's last part, after its controller stepped
    crash = 3 * parts
    cut = Run(tmp_path / "cut", monkeypatch, *extra, mode=mode, crash_at_update=crash, tag=f"{tag}cut")
    with pytest.raises(Crash):
        cut.fit()
    assert cut.trainer.entropy_disc_autopilot.state_dict()["step"] == crash
    assert (tmp_path / "cut" / "latest_checkpointed_iteration.txt").read_text() == "2"
    resumed = Run(tmp_path / "cut", monkeypatch, *extra, "trainer.resume_mode=auto", mode=mode, tag=f"{tag}res")
    assert resumed.trainer.global_steps == 2
    assert resumed.trainer.entropy_disc_autopilot.state_dict() == full.batches[keys[2 * parts - 1]]["state"]
    assert resumed.actor.theta == full.actor.thetas[2 * parts - 1]
    resumed.fit()
    later = keys_of(parts, (3, 4))
    assert list(resumed.batches) == later
    for i, k in enumerate(later):
        a, b = full.batches[k], resumed.batches[k]
        for name, value in a["inputs"].items():
            assert torch.equal(value, b["inputs"][name]), (k, name)
        assert torch.equal(a["keep"], b["keep"])
        assert a["metrics"] == b["metrics"] and a["state"] == b["state"]
        for name in ("advantages", "response_mask", "loss_mask"):
            assert torch.equal(full.actor.updates[2 * parts + i][name], resumed.actor.updates[i][name])
    for s in (3, 4):  # NaN where a batch clipped nothing (the monitor's clipped_mean); in separate_async one such
        # part makes verl's step aggregate NaN
        a, b = entropy_disc_metrics(full.logged[s]), entropy_disc_metrics(resumed.logged[s])
        assert a.keys() == b.keys() and all(a[m] == b[m] or (math.isnan(a[m]) and math.isnan(b[m])) for m in a)
    assert resumed.actor.old_thetas == full.actor.old_thetas[2 * parts:]
    assert resumed.actor.theta == full.actor.theta
    assert resumed.trainer.entropy_disc_autopilot.state_dict() == t.entropy_disc_autopilot.state_dict()
    assert any(full.batches[k]["metrics"][PREFIX + "n_dropped"] > 0 for k in later)
    # the comparison can tell: a fresh controller on the first resumed batch gives other numbers
    (fresh,) = reference_steps(resumed.batches, later[:1])
    assert fresh.metrics()[PREFIX + "target_entropy"] != resumed.batches[later[0]]["metrics"][PREFIX + "target_entropy"]
