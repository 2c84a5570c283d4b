"""``calibrate_share``: the after-update pass of a calibration round reads only that share of the round's samples.

In this process, as in ``test_openrlhf_inforward.py``: old log-probs (and with them the adapter's statistics) from
OpenRLHF's real ``PolicyModelActor.forward``, the real ``NaiveReplayBuffer`` (split into samples, right padding
removed), the real ``ActorPPOTrainer.__init__`` and the patched real ``ppo_train`` (update and after-update pass).
Checked: with share 0.25 the pass reads exactly the samples ``calibration_rows`` picks (recorded where the adapter
selects them, and as the token ids the policy's model receives, padded or packed), the fed realised change equals a
float64 reference over those samples' valid tokens, share 1 reproduces the adapter's earlier whole-round value bit
for bit, and ``--entropy_disc.realised`` reads the whole round except on a calibration round.  Across two gloo ranks
holding 3 and 6 samples: each rank reads its own picks, both run the same number of forwards, and the realised
change is the global token mean over the samples read.  The launcher refuses a bad ``--entropy_disc.calibrate_share``
naming it, before OpenRLHF is asked anything.
"""

from __future__ import annotations

import math
import os
import runpy
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from test_openrlhf import (  # noqa: E402  (skips or fails like it without OpenRLHF)
    FakeStrategy,
    install_stubs,
    reference_stats,
    rollout_batch,
    tiny_actor,
    training_args,
)
from test_openrlhf_inforward import built_trainer, make_experience  # noqa: E402

from entropy_discriminator import EntropyDiscConfig, EntropyMonitor  # noqa: E402
from entropy_discriminator.adapters import openrlhf as adapter  # noqa: E402
from entropy_discriminator.adapters.openrlhf import _launch, _round  # noqa: E402
from entropy_discriminator.law_scale import calibration_rows  # noqa: E402

N = 10  # samples of a round: calibration_rows(10, 0.25) == [0, 3, 6]
MICRO = 2
REALISED = "entropy_disc/delta_entropy/realised"
SKIPPED = "entropy_disc/delta_entropy/scale_skipped"


@pytest.fixture(autouse=True)
def _clean_patch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # PolicyModelActor.forward / buffer / ppo_train
    adapter.unpatch()
    yield
    adapter.unpatch()


class PassRecorder:
    """What the after-update pass reads: the buffered samples ``end_round`` hands to ``replay_buffer_stats`` (as
    indices into the buffer) and the token ids of every no-grad forward of the policy's model (the attended
    positions of a padded micro-batch, or the whole packed row), in order."""

    def __init__(self, monkeypatch, actor):
        self.reads: list[list[int]] = []
        self.fed: list[torch.Tensor] = []
        self.buffer: list = []
        original = _round.replay_buffer_stats

        def recording(actor_, items, valids, **kwargs):
            self.reads.append([next(k for k, it in enumerate(self.buffer) if it is item) for item in items])
            return original(actor_, items, valids, **kwargs)

        monkeypatch.setattr(_round, "replay_buffer_stats", recording)  # end_round looks it up when it runs
        actor.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if torch.is_grad_enabled():
            return  # the update's own forwards
        ids = args[0] if args else kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        self.fed.append(ids.reshape(-1) if mask is None else ids[mask.bool()])


class StateRecorder:
    """The round states ``begin_round`` returns."""

    def __init__(self, monkeypatch):
        self.states = []
        original = _round.begin_round

        def begin_round(*a, **k):
            self.states.append(original(*a, **k))
            return self.states[-1]

        monkeypatch.setattr(_round, "begin_round", begin_round)  # before patch(): ppo_train's wrapper imports it


def start(monkeypatch, cfg: EntropyDiscConfig, *, packing: bool, realised: bool = False):
    """The patched real trainer on a tiny actor, with the recorders attached."""
    states = StateRecorder(monkeypatch)
    adapter.patch(cfg, realised=realised)
    actor = tiny_actor(packing=packing)
    trainer = built_trainer(actor, monkeypatch, packing=packing, epochs=2, micro=MICRO)
    return actor, trainer, states, PassRecorder(monkeypatch, actor)


def run_round(trainer, actor, recorder: PassRecorder, seed: int) -> dict:
    """One rollout batch of ``N`` samples through ``make_experience``'s forward into the buffer, then ``ppo_train``."""
    trainer.replay_buffer.clear()  # as PolicyModelActor.fit does after ppo_train
    for batch in make_experience(actor, rollout_batch(seed, n=N), micro=4):
        trainer.replay_buffer.append(batch)
    recorder.buffer = list(trainer.replay_buffer.items)
    recorder.fed.clear()
    return trainer.ppo_train(0.0)


def weights_of(actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.model.state_dict().items()}


def reference_realised(before: dict[str, torch.Tensor], actor, items: list, packing: bool) -> float:
    """float64: mean over the valid tokens of ``items`` of ``H`` under the current weights minus ``H`` under
    ``before`` (:func:`test_openrlhf.reference_stats`: a float64 forward of each sample alone)."""
    old = tiny_actor(packing=packing)
    old.model.load_state_dict(before)
    diff = [reference_stats(actor, it)["entropy"] - reference_stats(old, it)["entropy"] for it in items]
    return float(torch.cat([d[it.action_mask.bool()] for d, it in zip(diff, items)]).mean())


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_share_reads_exactly_the_rows_calibration_rows_picks(packing, monkeypatch):
    """Share 0.25 of 10 samples: the pass reads samples 0, 3 and 6, in 2 micro-batches of 2 (packed: 2 packed
    rows), and the policy's model receives exactly their token ids; the pair is fed."""
    cfg = EntropyDiscConfig(calibrate_every=1, calibrate_share=0.25)
    actor, trainer, states, recorder = start(monkeypatch, cfg, packing=packing)
    status = run_round(trainer, actor, recorder, seed=31)
    rows = calibration_rows(N, 0.25).tolist()
    assert rows == [0, 3, 6] and states.states[-1].calibrate
    assert recorder.reads == [rows]
    assert len(recorder.fed) == math.ceil(len(rows) / MICRO)  # the pass's forwards, no grad
    assert torch.equal(torch.cat(recorder.fed), torch.cat([recorder.buffer[i].sequences for i in rows]))
    assert math.isfinite(status[REALISED]) and status[SKIPPED] == 0.0


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_realised_equals_a_float64_reference_over_the_rows_read(packing, monkeypatch):
    """The fed (and logged) realised change is the mean entropy change of the picked samples' valid tokens,
    float64 reference; it differs from the whole round's by far more than the tolerance."""
    cfg = EntropyDiscConfig(calibrate_every=1, calibrate_share=0.25)
    actor, trainer, states, recorder = start(monkeypatch, cfg, packing=packing)
    trainer.replay_buffer.clear()
    for batch in make_experience(actor, rollout_batch(32, n=N), micro=4):
        trainer.replay_buffer.append(batch)
    items = list(trainer.replay_buffer.items)
    recorder.buffer = items
    before = weights_of(actor)
    status = trainer.ppo_train(0.0)
    rows = calibration_rows(N, 0.25).tolist()
    assert recorder.reads == [rows]
    want = reference_realised(before, actor, [items[i] for i in rows], packing)
    whole = reference_realised(before, actor, items, packing)
    assert status[REALISED] == pytest.approx(want, rel=1e-4, abs=2e-6)
    assert abs(want - whole) > 100 * (1e-4 * abs(want) + 2e-6)  # the comparison above tells the subset apart
    assert status[SKIPPED] == 0.0
    assert states.states[-1].calibrate


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_share_one_reproduces_the_whole_round_pass(packing, monkeypatch):
    """Share 1: the pass reads every sample in buffer order, in the same micro-batches, and the realised value is
    bit for bit the earlier adapter's: the monitor over the round's statistics and a pass over the whole buffer."""
    cfg = EntropyDiscConfig(calibrate_every=1, calibrate_share=1.0)
    actor, trainer, states, recorder = start(monkeypatch, cfg, packing=packing)
    status = run_round(trainer, actor, recorder, seed=33)
    state = states.states[-1]
    items = trainer.replay_buffer.items
    assert recorder.reads == [list(range(N))] and len(recorder.fed) == N // MICRO
    after = _round.replay_buffer_stats(actor, items, state.valids, micro_batch_size=MICRO, chunk_size=cfg.chunk_size,
                                       impl=cfg.impl)
    today = EntropyMonitor().realised(state.stats.entropy, after.entropy, state.stats.valid)
    assert status[REALISED] == today[REALISED]


def test_realised_flag_reads_the_whole_round_except_on_calibration_rounds(monkeypatch):
    """``--entropy_disc.realised`` with calibration every 2nd round: round 1 (calibration) reads the share, its
    realised is the calibration pass's; round 2 reads all samples and logs the whole round's change, not fed."""
    cfg = EntropyDiscConfig(calibrate_every=2, calibrate_share=0.25)
    actor, trainer, states, recorder = start(monkeypatch, cfg, packing=False, realised=True)
    first = run_round(trainer, actor, recorder, seed=34)
    second = run_round(trainer, actor, recorder, seed=35)
    assert [s.calibrate for s in states.states] == [True, False]
    assert recorder.reads == [calibration_rows(N, 0.25).tolist(), list(range(N))]
    assert math.isfinite(first[REALISED]) and math.isfinite(second[REALISED])
    assert SKIPPED in first and SKIPPED not in second
    state = states.states[-1]
    after = _round.replay_buffer_stats(actor, trainer.replay_buffer.items, state.valids, micro_batch_size=MICRO,
                                       impl=cfg.impl)
    whole = EntropyMonitor().realised(state.stats.entropy, after.entropy, state.stats.valid)
    assert second[REALISED] == whole[REALISED]


def test_calibrate_share_flag_reaches_the_config_and_the_workers(monkeypatch, capsys):
    cfg, _, rest = adapter.parse(["--actor.model_name_or_path", "m", "--entropy_disc.calibrate_share", "0.5",
                                  "--entropy_disc.calibrate_every", "3"])
    assert rest == ["--actor.model_name_or_path", "m"]
    assert cfg == EntropyDiscConfig(calibrate_share=0.5, calibrate_every=3)
    assert adapter.parse([])[0].calibrate_share == 0.25
    assert adapter.parse(["--entropy_disc.calibrate_share=1"])[0].calibrate_share == 1.0
    monkeypatch.setenv(adapter.CONFIG_ENV, adapter.runtime_env(cfg)["env_vars"][adapter.CONFIG_ENV])
    adapter.worker_setup_hook()  # what each Ray worker runs
    from entropy_discriminator.adapters.openrlhf import _patch

    assert _patch._STATE.config == cfg and _patch._STATE.config.calibrate_share == 0.5
    with pytest.raises(SystemExit):
        adapter.parse(["--entropy_disc.help"])
    assert "--entropy_disc.calibrate_share" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "1.5", "x"])
def test_a_bad_calibrate_share_is_refused_naming_it_before_any_work(value, monkeypatch, capsys):
    """The launcher exits with argparse's usage error naming the option; neither the OpenRLHF version check nor
    OpenRLHF's CLI (and so no Ray) is reached."""
    reached = []
    monkeypatch.setattr(_launch, "check_openrlhf_version", lambda *a: reached.append("version"))
    monkeypatch.setattr(runpy, "run_module", lambda *a, **k: reached.append("cli"))
    with pytest.raises(SystemExit) as exc:
        adapter.main(["--actor.model_name_or_path", "m", "--entropy_disc.calibrate_share", value])
    assert exc.value.code == 2 and reached == []
    assert "error: entropy_disc.calibrate_share must be" in capsys.readouterr().err


# ------------------------------------------------------------------------- two ranks, different counts

COUNTS = (3, 6)  # samples of rank 0 and rank 1: calibration_rows picks [0] and [0, 3]


def _items():
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    return remove_padding_in_sequences(split_experience_batch(rollout_batch(41, n=sum(COUNTS))))


def _updated(actor) -> None:
    """A deterministic stand-in for the round's update (the same on every rank)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _share_rank(rank: int, world: int, port: int, out: str) -> None:
    install_stubs()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        items = _items()
        mine = items[: COUNTS[0]] if rank == 0 else items[COUNTS[0] :]
        args = training_args()
        args.actor.adam = SimpleNamespace(lr=0.1)  # the step size of the cheap score: rounds can calibrate
        mesh = {"dp": SimpleNamespace(get_group=lambda: dist.group.WORLD)}
        trainer = SimpleNamespace(actor=tiny_actor(seed=4), replay_buffer=SimpleNamespace(items=mine),
                                  strategy=FakeStrategy(args, mesh), micro_train_batch_size=1, actor_scheduler=None)
        cfg = EntropyDiscConfig(calibrate_every=1, calibrate_share=0.25)
        state = _round.begin_round(trainer, cfg)
        _updated(trainer.actor)
        reads, forwards = [], []
        original = _round.replay_buffer_stats

        def recording(actor, items_, valids, **kwargs):
            reads.append([next(k for k, it in enumerate(mine) if it is item) for item in items_])
            return original(actor, items_, valids, **kwargs)

        _round.replay_buffer_stats = recording
        trainer.actor.model.register_forward_hook(lambda m, a, o: forwards.append(torch.is_grad_enabled()))
        metrics = _round.end_round(trainer, cfg, state)
        torch.save({"calibrate": state.calibrate, "reads": reads, "forwards": forwards, "metrics": metrics},
                   os.path.join(out, f"share{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ranks_with_different_counts_read_their_own_share(tmp_path):
    """Rank 0 (3 samples) reads its sample 0, rank 1 (6 samples) its samples 0 and 3; both run 2 no-grad forwards
    (micro-batches of 1: rank 0 adds a step-keeping forward), and both log the global token mean over the 3
    samples read, which equals a float64 reference of one process over the same samples."""
    mp.spawn(_share_rank, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"share{r}.pt", weights_only=False) for r in range(2)]
    for count, r in zip(COUNTS, got):
        assert r["calibrate"] and r["reads"] == [calibration_rows(count, 0.25).tolist()]
        assert r["forwards"] == [False, False]
    assert got[0]["reads"] == [[0]] and got[1]["reads"] == [[0, 3]]
    assert got[0]["metrics"] == got[1]["metrics"]
    items = _items()
    read = [items[0], items[COUNTS[0]], items[COUNTS[0] + 3]]
    before = weights_of(tiny_actor(seed=4))
    actor = tiny_actor(seed=4)
    _updated(actor)
    want = reference_realised(before, actor, read, packing=False)
    assert got[0]["metrics"][REALISED] == pytest.approx(want, rel=1e-4, abs=2e-6)
    assert got[0]["metrics"][SKIPPED] == 0.0
