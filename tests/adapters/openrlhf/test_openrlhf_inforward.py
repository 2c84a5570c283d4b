"""The statistics taken in ``make_experience``'s old-policy forward, carried to the replay buffer.

OpenRLHF's real ``PolicyModelActor.forward`` (the method ``make_experience`` dispatches per
micro-batch; called here unbound on its Ray class's underlying class, no Ray) runs the patched real
``Actor``; the real ``ActorPPOTrainer.__init__`` registers the policy; the real
``NaiveReplayBuffer.append`` splits and unpads the Experience; the real ``ppo_train`` runs the round.
Checked: a round runs no policy forward besides the update's own; the statistics taken in the
forward equal those of the previous no-grad pass over the buffer; re-grouped (dynamic batching) and
identical samples are matched; the reference model is never scored; the fallback pass runs where
the forward was not scored; across two gloo ranks, a sample scored on one rank and buffered on the
other is fetched from it.
"""

from __future__ import annotations

import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from test_openrlhf import (  # noqa: E402  (skips or fails like it without OpenRLHF)
    FakeStrategy,
    filled_buffer,
    install_stubs,
    real_trainer,
    rollout_batch,
    tiny_actor,
    training_args,
)

from openrlhf.trainer.ppo_utils.experience import (  # noqa: E402
    Experience,
    make_experience_batch,
    remove_padding_in_sequences,
    split_experience_batch,
)
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer  # noqa: E402
from openrlhf.trainer.ray import ppo_actor  # noqa: E402

from entropy_discriminator import EntropyDiscConfig  # noqa: E402
from entropy_discriminator.adapters import openrlhf as adapter  # noqa: E402
from entropy_discriminator.adapters.openrlhf._experience import STORE, is_policy  # noqa: E402
from entropy_discriminator.adapters.openrlhf._round import begin_round, replay_buffer_stats  # noqa: E402

FIELDS = ("logp", "entropy", "s_star", "s_expected", "s_centered")
#: OpenRLHF's PolicyModelActor.forward (the class under its @ray.remote wrapper)
POLICY_FORWARD = ppo_actor.PolicyModelActor.__ray_actor_class__.forward


@pytest.fixture(autouse=True)
def _clean_patch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # PolicyModelActor.forward / buffer / ppo_train
    adapter.unpatch()
    yield
    adapter.unpatch()


def init_args(packing: bool = False, epochs: int = 1):
    """``training_args`` plus what the real ``ActorPPOTrainer.__init__`` reads (0.10.2 and 0.11.2 names)."""
    args = training_args(epochs=epochs, packing=packing)
    args.actor.eps_clip_low_high = (0.2, 0.2)
    args.actor.dual_clip = None
    args.actor.loss_agg_mode = "token-mean"
    args.algo.advantage = SimpleNamespace(
        is_correction_enable=False, is_correction_type="tis", is_correction_level="off",
        is_correction_mode="mask", is_correction_gating="ratio", is_correction_threshold=(0.5, 5.0),
    )
    args.train.colocate_all = args.train.async_enable = False
    args.vllm = SimpleNamespace(sync_backend="nccl")
    return args


def built_trainer(actor, monkeypatch, *, packing=False, epochs=1, micro=2):
    """The real ``ActorPPOTrainer.__init__`` (no DeepSpeed engine, no vLLM, one process)."""
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    args = init_args(packing, epochs)
    optim = torch.optim.SGD(actor.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # NaiveReplayBuffer.__init__ builds cuda:<it>
    trainer = ppo_actor.ActorPPOTrainer(FakeStrategy(args), actor, None, optim, scheduler,
                                        micro_train_batch_size=micro, buffer_cpu_offload=True,
                                        dataloader_pin_memory=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # PolicyModelActor.forward, ppo_train
    return trainer


def make_experience(actor, experience: Experience, micro: int) -> list[Experience]:
    """``make_experience``'s actor part: its micro-batches through OpenRLHF's ``PolicyModelActor.forward``;
    the log-probs land in each micro-batch Experience, as the driver puts them."""
    worker = SimpleNamespace(actor=actor, strategy=SimpleNamespace(ring_attn_group=None))
    items = remove_padding_in_sequences(split_experience_batch(experience))
    batches = [make_experience_batch(items[i : i + micro]) for i in range(0, len(items), micro)]
    for batch in batches:
        batch.action_log_probs = POLICY_FORWARD(worker, batch.sequences, batch.action_mask, batch.attention_mask)
    return batches


class ForwardCounter:
    """Every forward of the policy's model, and whether it tracked gradients."""

    def __init__(self, model):
        self.calls: list[bool] = []
        self.handle = model.register_forward_hook(lambda m, a, out: self.calls.append(torch.is_grad_enabled()))


def stats_equal_previous_pass(state, actor, items, valids, micro):
    previous = replay_buffer_stats(actor, items, valids, micro_batch_size=micro, impl="torch")
    assert torch.equal(state.stats.valid, previous.valid)
    valid = previous.valid
    for name in FIELDS:
        got, want = getattr(state.stats, name), getattr(previous, name)
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-6, msg=name)
        assert (got[~valid] == 0).all() and (want[~valid] == 0).all()


# ------------------------------------------------------------------------------------------- tests


def test_patch_wraps_forward_init_and_ppo_train_reversibly():
    originals = (ppo_actor.Actor.forward, ppo_actor.ActorPPOTrainer.__init__, ppo_actor.ActorPPOTrainer.ppo_train)
    adapter.patch(EntropyDiscConfig(method="clip_b"))
    wrapped = (ppo_actor.Actor.forward, ppo_actor.ActorPPOTrainer.__init__, ppo_actor.ActorPPOTrainer.ppo_train)
    assert all(w is not o and w.__wrapped__ is o for w, o in zip(wrapped, originals))
    adapter.patch(EntropyDiscConfig(method="clip_v"))
    assert (ppo_actor.Actor.forward, ppo_actor.ActorPPOTrainer.__init__, ppo_actor.ActorPPOTrainer.ppo_train) == wrapped
    STORE.put(torch.arange(3), torch.zeros(1, 6))
    adapter.unpatch()
    assert (ppo_actor.Actor.forward, ppo_actor.ActorPPOTrainer.__init__, ppo_actor.ActorPPOTrainer.ppo_train) == originals
    assert "forward" in vars(ppo_actor.Actor) and len(STORE) == 0 and not adapter.is_patched()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("layout", ["v0.11", "left_padded"])
def test_stats_from_make_experience_equal_previous_pass(layout, packing, monkeypatch):
    actor = tiny_actor(packing=packing)
    adapter.patch(EntropyDiscConfig(method="clip_b", mu_low=0.5, max_frac=None, sides="both"))
    trainer = built_trainer(actor, monkeypatch, packing=packing, micro=4)
    assert is_policy(actor)  # registered by the patched ActorPPOTrainer.__init__
    batches = make_experience(actor, rollout_batch(11, n=10, layout=layout), micro=4)
    assert len(STORE) == 10 and STORE.n_forwards == 3
    for batch in batches:
        trainer.replay_buffer.append(batch)
    items = trainer.replay_buffer.items
    valids = [it.action_mask.reshape(-1).bool().clone() for it in items]
    counter = ForwardCounter(actor.model)
    state = begin_round(trainer, EntropyDiscConfig(method="clip_b", mu_low=0.5, max_frac=None, sides="both"))
    assert counter.calls == []  # no forward in the round's statistics
    assert state.source == "forward" and len(STORE) == 0
    assert state.metrics["entropy_disc/stats/from_forward"] == 1.0
    assert state.metrics["entropy_disc/timing/stats_in_forward"] > 0
    assert torch.equal(state.stats.valid, torch.cat(valids))
    # the adapter's logp is OpenRLHF's own old log-prob of the buffered sample
    own = torch.cat([it.action_log_probs.reshape(-1) for it in items])
    torch.testing.assert_close(state.stats.logp[state.stats.valid], own[state.stats.valid], rtol=1e-5, atol=1e-6)
    counter.handle.remove()
    stats_equal_previous_pass(state, actor, items, valids, micro=4)


@pytest.mark.parametrize("method,mode,realised,calibrate,share", [
    ("clip_b", "zero_pg", False, 0, 0.25), ("clip_v", "drop_token", False, 0, 0.25),
    ("none", "zero_pg", False, 0, 0.25), ("clip_b", "zero_pg", True, 0, 0.25), ("none", "zero_pg", False, 1, 0.25),
    ("none", "zero_pg", True, 1, 0.25), ("none", "zero_pg", False, 1, 1.0)])
def test_round_runs_no_extra_policy_forward(method, mode, realised, calibrate, share, monkeypatch):
    """Real ``ppo_train``, patched: the policy's model runs only the update's grad-enabled forwards
    (one per micro-batch and epoch), plus, only with ``realised`` or on a calibration round of the law
    scale (``calibrate_every``; the first round is one), the after-update pass: over ``calibrate_share`` of
    the samples on a calibration round, over all of them otherwise."""
    actor = tiny_actor()
    mask = {} if method == "none" else {"mu_low": 0.5, "sides": "both", "mask_mode": mode}  # none: no mask settings
    cfg = EntropyDiscConfig(method=method, max_frac=None, calibrate_every=calibrate, calibrate_share=share, **mask)
    adapter.patch(cfg, realised=realised)
    trainer = built_trainer(actor, monkeypatch, epochs=2, micro=2)
    for batch in make_experience(actor, rollout_batch(5, n=8), micro=4):
        trainer.replay_buffer.append(batch)
    counter = ForwardCounter(actor.model)
    status = trainer.ppo_train(0.0)
    n_update = 2 * (8 // 2)  # epochs x micro-batches
    assert counter.calls[:n_update] == [True] * n_update
    if realised or calibrate:  # the optional after-update pass, no grad: its samples in micro-batches of 2
        n_read = math.ceil(share * 8) if calibrate else 8
        assert counter.calls[n_update:] == [False] * math.ceil(n_read / 2)
        assert "entropy_disc/delta_entropy/realised" in status
    else:
        assert len(counter.calls) == n_update
    assert status["entropy_disc/stats/from_forward"] == 1.0 and "policy_loss" in status
    if method != "none":
        assert status["entropy_disc/clip/n_clipped"] > 0
    # the stock forward count, for comparison: the same round unpatched
    adapter.unpatch()
    trainer.replay_buffer.clear()  # as PolicyModelActor.fit does after ppo_train
    for batch in make_experience(actor, rollout_batch(5, n=8), micro=4):
        trainer.replay_buffer.append(batch)
    counter.calls.clear()
    trainer.ppo_train(0.0)
    assert counter.calls == [True] * n_update


def test_regrouped_and_identical_samples_are_matched(monkeypatch):
    """Dynamic batching re-groups the samples between the forward and ``append``
    (``balance_experiences``); identical samples share a key and are both served."""
    actor = tiny_actor(packing=True)
    cfg = EntropyDiscConfig(method="clip_v", mu_low=0.5, max_frac=None, sides="both")
    adapter.patch(cfg)
    trainer = built_trainer(actor, monkeypatch, packing=True, micro=3)
    exp = rollout_batch(13, n=9)
    for name in ("sequences", "attention_mask", "action_mask", "advantages"):  # sample 4 == sample 0
        getattr(exp, name)[4] = getattr(exp, name)[0]
    batches = make_experience(actor, exp, micro=3)
    items = [it for b in batches for it in split_experience_batch(b)]
    order = [5, 0, 8, 2, 4, 7, 1, 6, 3]
    regrouped = [make_experience_batch([items[i] for i in order[k : k + 4]]) for k in range(0, 9, 4)]
    for batch in regrouped:
        trainer.replay_buffer.append(batch)
    buffered = trainer.replay_buffer.items
    valids = [it.action_mask.reshape(-1).bool().clone() for it in buffered]
    state = begin_round(trainer, cfg)
    assert state.source == "forward" and len(STORE) == 0
    stats_equal_previous_pass(state, actor, buffered, valids, micro=3)


def test_reference_model_and_training_forwards_are_not_scored(monkeypatch):
    policy, reference = tiny_actor(seed=0), tiny_actor(seed=1)
    adapter.patch(EntropyDiscConfig(method="clip_b"))
    built_trainer(policy, monkeypatch)
    make_experience(reference, rollout_batch(3, n=4), micro=2)  # ReferenceModelActor's forward: another Actor
    assert len(STORE) == 0 and not is_policy(reference)
    batch = make_experience_batch(remove_padding_in_sequences(split_experience_batch(rollout_batch(3, n=4))))
    policy.train()
    policy(batch.sequences, batch.action_mask, batch.attention_mask)  # a training forward (grad, train mode)
    with torch.no_grad():
        policy.eval()
        policy(batch.sequences, None, batch.attention_mask, return_output=True)  # the fallback pass' call
    assert len(STORE) == 0
    adapter.patch(EntropyDiscConfig(method="none", log_metrics=False))  # nothing asked for: nothing scored
    make_experience(policy, rollout_batch(3, n=4), micro=2)
    assert len(STORE) == 0


def test_unscored_buffer_falls_back_to_the_pass(monkeypatch):
    """A trainer built before the patch: its first buffer was not scored, the round runs the previous
    no-grad pass (one forward per micro-batch); from then on the trainer's actor is scored."""
    actor = tiny_actor()
    trainer = real_trainer(actor, filled_buffer(rollout_batch(5, n=6), 2, monkeypatch), epochs=1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # ppo_train moves batches there
    # calibrate_every=0: no after-update calibration pass, so the forwards counted are the pass and the update
    cfg = EntropyDiscConfig(method="clip_b", mu_low=0.5, max_frac=None, sides="both", calibrate_every=0)
    adapter.patch(cfg)
    counter = ForwardCounter(actor.model)
    status = trainer.ppo_train(0.0)
    assert status["entropy_disc/stats/from_forward"] == 0.0
    assert counter.calls[:3] == [False] * 3 and counter.calls[3:] == [True] * 3  # the pass, then the update
    trainer.replay_buffer.clear()
    for batch in make_experience(actor, rollout_batch(6, n=6), micro=2):
        trainer.replay_buffer.append(batch)
    counter.calls.clear()
    status = trainer.ppo_train(0.0)
    assert status["entropy_disc/stats/from_forward"] == 1.0 and counter.calls == [True] * 3


def test_leftover_entries_age_out():
    STORE.clear()
    STORE.put(torch.arange(4), torch.zeros(2, 6))
    STORE.end_round()
    assert len(STORE) == 1  # scored for the next round (asynchronous training): kept one round
    STORE.end_round()
    assert len(STORE) == 0


# ------------------------------------------------------------------------- two ranks, dynamic batching


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moved_rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank r scores micro-batch r of the forward; dynamic batching then swaps one sample between the
    ranks' buffers, so each rank fetches one sample's statistics from the other."""
    install_stubs()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.cuda.current_device = lambda: "cpu"
        from entropy_discriminator.adapters.openrlhf._experience import register_policy

        actor = tiny_actor(seed=4)
        cfg = EntropyDiscConfig(method="clip_b", mu_low=0.5, sides="both", max_frac=None)
        adapter.patch(cfg)
        register_policy(actor)
        batches = make_experience_unpatched(actor, rollout_batch(21, n=8))
        worker = SimpleNamespace(actor=actor, strategy=SimpleNamespace(ring_attn_group=None))
        chunk = batches[rank]  # this rank's forward chunk, as async_run_method_batch hands it out
        POLICY_FORWARD(worker, chunk.sequences, chunk.action_mask, chunk.attention_mask)
        assert len(STORE) == 4
        all_items = [it for b in batches for it in split_experience_batch(b)]
        buffer_idx = [0, 1, 2, 7] if rank == 0 else [4, 5, 6, 3]  # samples 3 and 7 moved
        torch.cuda.current_device = lambda: 0
        buffer = NaiveReplayBuffer(2, cpu_offload=True)
        torch.cuda.current_device = lambda: "cpu"
        buffer.append(make_experience_batch([all_items[i] for i in buffer_idx]))
        mesh = {"dp": SimpleNamespace(get_group=lambda: dist.group.WORLD)}
        trainer = SimpleNamespace(actor=actor, replay_buffer=buffer, strategy=FakeStrategy(training_args(), mesh),
                                  micro_train_batch_size=2, actor_scheduler=None)
        state = begin_round(trainer, cfg)
        valids = [it.action_mask.reshape(-1).bool() for it in buffer.items]
        previous = replay_buffer_stats(actor, buffer.items, valids, micro_batch_size=2, impl="torch")
        torch.save({"source": state.source, "stats": state.stats, "previous": previous,
                    "n_store": len(STORE)}, os.path.join(out, f"moved{rank}.pt"))
    finally:
        dist.destroy_process_group()


def make_experience_unpatched(actor, exp):
    """The same micro-batches with the old log-probs, scored or not (the store is not touched here:
    these calls pass ``return_output``)."""
    items = remove_padding_in_sequences(split_experience_batch(exp))
    batches = [make_experience_batch(items[i : i + 4]) for i in range(0, len(items), 4)]
    with torch.no_grad():
        for b in batches:
            b.action_log_probs = actor(b.sequences, b.action_mask, b.attention_mask, return_output=True)[0]
    return batches


@pytest.mark.distributed
def test_sample_moved_to_another_rank_is_fetched(tmp_path):
    mp.spawn(_moved_rank, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"moved{rank}.pt", weights_only=False)
        assert got["source"] == "forward"
        st, prev = got["stats"], got["previous"]
        assert torch.equal(st.valid, prev.valid)
        for name in FIELDS:
            torch.testing.assert_close(getattr(st, name)[st.valid], getattr(prev, name)[prev.valid],
                                       rtol=1e-5, atol=1e-6, msg=name)
        assert got["n_store"] == 1  # the sample served to the other rank, until it ages out


def _ring_rank(rank: int, world: int, port: int, out: str) -> None:
    """Both ranks form one ring-attention group running the same old-policy micro-batches."""
    install_stubs()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.cuda.current_device = lambda: "cpu"
        from openrlhf.models import actor as actor_module
        from openrlhf.models.ring_attn_utils import set_ring_attn_group

        from entropy_discriminator.adapters.openrlhf._experience import register_policy

        eager = getattr(actor_module.compute_entropy, "_torchdynamo_orig_callable", actor_module.compute_entropy)
        actor_module.compute_entropy = eager
        ring = dist.group.WORLD
        set_ring_attn_group(ring)
        actor = tiny_actor(seed=4, packing=True)
        cfg = EntropyDiscConfig(method="clip_b", mu_low=0.5, sides="both", max_frac=None)
        adapter.patch(cfg)
        register_policy(actor)
        items = remove_padding_in_sequences(split_experience_batch(rollout_batch(21, n=6)))
        worker = SimpleNamespace(actor=actor, strategy=SimpleNamespace(ring_attn_group=ring))
        batches = [make_experience_batch(items[i : i + 3]) for i in (0, 3)]
        for b in batches:
            b.action_log_probs = POLICY_FORWARD(worker, b.sequences, b.action_mask, b.attention_mask)
        torch.cuda.current_device = lambda: 0
        buffer = NaiveReplayBuffer(3, cpu_offload=True, packing_samples=True)
        torch.cuda.current_device = lambda: "cpu"
        for b in batches:
            buffer.append(b)
        strategy = FakeStrategy(training_args(packing=True), {"dp": SimpleNamespace(get_group=lambda: None)})
        strategy.ring_attn_group = ring
        trainer = SimpleNamespace(actor=actor, replay_buffer=buffer, strategy=strategy, micro_train_batch_size=3,
                                  actor_scheduler=None)
        state = begin_round(trainer, cfg)
        valids = [it.action_mask.reshape(-1).bool() for it in buffer.items]
        previous = replay_buffer_stats(actor, buffer.items, valids, micro_batch_size=3, impl="torch",
                                       ring_attn_group=ring, sync_group=ring)
        own = torch.cat([it.action_log_probs.reshape(-1) for it in buffer.items])
        torch.save({"source": state.source, "stats": state.stats, "previous": previous, "own": own},
                   os.path.join(out, f"ring{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ring_attention_old_policy_forward_is_scored(tmp_path):
    """Ring attention: each rank scores its slice inside the forward; the ranks' results equal each
    other, the previous pass and OpenRLHF's own gathered ring-attention log-probs."""
    mp.spawn(_ring_rank, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"ring{r}.pt", weights_only=False) for r in range(2)]
    for r in got:
        assert r["source"] == "forward"
        st, prev = r["stats"], r["previous"]
        assert torch.equal(st.valid, prev.valid)
        for name in FIELDS:
            torch.testing.assert_close(getattr(st, name), getattr(prev, name), rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(st.logp[st.valid], r["own"][st.valid], rtol=1e-5, atol=1e-6)
    for name in FIELDS:
        assert torch.equal(getattr(got[0]["stats"], name), getattr(got[1]["stats"], name)), name
