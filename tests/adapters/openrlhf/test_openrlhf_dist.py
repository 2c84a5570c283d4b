"""The OpenRLHF adapter across processes: a real local Ray cluster and a 2-rank gloo group.

Stand-ins as in ``test_openrlhf.py`` (``flash_attn``, ``vllm``: not installable on a CPU), also
inside the Ray worker, where the probe installs them before importing OpenRLHF's trainer.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from test_openrlhf import (  # noqa: E402  (skips or fails like it without OpenRLHF)
    STUBBED_MODULES,
    FakeStrategy,
    install_stubs,
    rollout_batch,
    tiny_actor,
    training_args,
)

from ray_local import LOCAL  # noqa: E402  (conftest.py puts tests/adapters on sys.path)

from entropy_discriminator import EntropyDiscConfig  # noqa: E402
from entropy_discriminator.adapters import openrlhf as adapter  # noqa: E402
from entropy_discriminator.adapters.openrlhf._round import begin_round  # noqa: E402

pytestmark = pytest.mark.distributed


def test_ray_workers_patch_through_setup_hook():
    """``runtime_env(config)`` in ``ray.init``: each worker patches the trainer when it imports it."""
    import ray

    cfg = EntropyDiscConfig(method="clip_v", mu_low=4.0, mask_mode="drop_token")
    stubbed = list(STUBBED_MODULES)

    def probe(import_trainer: bool):
        import importlib.machinery
        import importlib.util
        from unittest.mock import MagicMock

        from entropy_discriminator.adapters.openrlhf import _patch as p

        pending = any(isinstance(f, p._PatchOnImport) for f in sys.meta_path)
        loaded = p.TRAINER_MODULE in sys.modules
        if import_trainer:
            import transformers.modeling_utils  # noqa: F401  (before the stand-ins, as install_stubs does)

            missing = {n.split(".")[0] for n in stubbed if importlib.util.find_spec(n.split(".")[0]) is None}
            for name in stubbed:  # the same stand-ins as the test process, only where missing
                if name.split(".")[0] in missing:
                    sys.modules[name] = MagicMock(__spec__=importlib.machinery.ModuleSpec(name, None))
            import openrlhf.trainer.ray.ppo_actor  # noqa: F401
        state = p._STATE.config
        return pending, loaded, p.is_patched(), None if state is None else (state.method, state.mu_low, state.mask_mode)

    ray.init(num_cpus=1, runtime_env=adapter.runtime_env(cfg), **LOCAL)
    try:
        remote = ray.remote(probe)
        pending, loaded, patched, _ = ray.get(remote.remote(False))
        assert pending and not loaded and not patched  # hook ran; trainer not imported, so not patched yet
        _, _, patched, state = ray.get(remote.remote(True))
        assert patched and state == ("clip_v", 4.0, "drop_token")
    finally:
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CFG = dict(method="clip_b", mu_low=0.5, sides="both", max_frac=0.2)
SPLIT = 2  # rank 0 holds samples [0, 2), rank 1 [2, 5): 1 and 2 micro-batches of 2, as batched in one process


def _items():
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    return remove_padding_in_sequences(split_experience_batch(rollout_batch(21, n=5)))


def _trainer(items, mesh=None):
    return SimpleNamespace(
        actor=tiny_actor(seed=4), replay_buffer=SimpleNamespace(items=items), strategy=FakeStrategy(training_args(), mesh),
        micro_train_batch_size=2, actor_scheduler=None,
    )


def _rank(rank: int, world: int, port: int, out: str) -> None:
    install_stubs()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        items = _items()
        mine = items[:SPLIT] if rank == 0 else items[SPLIT:]
        mesh = {"dp": SimpleNamespace(get_group=lambda: dist.group.WORLD)}
        state = begin_round(_trainer(mine, mesh), EntropyDiscConfig(**CFG))
        torch.save({"keep": state.mask.keep, "mask": state.mask, "metrics": state.metrics,
                    "adv": [it.advantages for it in mine]}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process(tmp_path):
    """Thresholds, keep-mask, edited advantages and metrics of 2 gloo ranks == one process on all samples
    (rank 0 has fewer micro-batches, so it also runs a step-keeping forward)."""
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    items = _items()
    whole = begin_round(_trainer(items), EntropyDiscConfig(**CFG))
    for r in got:
        for attr in ("center", "std", "lower", "upper"):
            assert getattr(r["mask"], attr) == pytest.approx(getattr(whole.mask, attr), rel=1e-9, abs=1e-12)
        for attr in ("n_valid", "n_clipped", "n_clipped_pos", "n_clipped_neg", "capped"):
            assert getattr(r["mask"], attr) == getattr(whole.mask, attr)
        for key, value in whole.metrics.items():
            if "timing" not in key:
                assert r["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert whole.mask.n_clipped > 0
    assert torch.equal(torch.cat([got[0]["keep"], got[1]["keep"]]), whole.mask.keep)
    for a, b in zip(got[0]["adv"] + got[1]["adv"], [it.advantages for it in items]):
        assert torch.equal(a, b)


def _ring_rank(rank: int, world: int, port: int, out: str) -> None:
    """Both ranks form one ring-attention group holding the same samples (as OpenRLHF's ring replicas do)."""
    install_stubs()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from openrlhf.models import actor as actor_module
        from openrlhf.models.ring_attn_utils import set_ring_attn_group

        from entropy_discriminator.adapters.openrlhf._round import replay_buffer_stats

        # Actor.forward's compute_entropy is torch.compile'd: the same function, run eagerly (compiling
        # costs tens of seconds on 2 CPU cores).
        eager = getattr(actor_module.compute_entropy, "_torchdynamo_orig_callable", actor_module.compute_entropy)
        actor_module.compute_entropy = eager
        ring = dist.group.WORLD
        set_ring_attn_group(ring)
        actor = tiny_actor(seed=4, packing=True)
        actor.temperature = 1.0  # 0.10.x computes the entropy from unscaled logits; 0.11.x scales first
        items = _items()
        valids = [it.action_mask.bool() for it in items]
        gathered: list[tuple[int, ...]] = []
        original_all_gather = dist.all_gather

        def recording_all_gather(tensors, tensor, group=None, async_op=False):
            gathered.append(tuple(tensor.shape))
            return original_all_gather(tensors, tensor, group=group, async_op=async_op)

        dist.all_gather = recording_all_gather
        try:
            stats = replay_buffer_stats(actor, items, valids, micro_batch_size=3, impl="torch",
                                        ring_attn_group=ring, sync_group=ring)
        finally:
            dist.all_gather = original_all_gather
        from openrlhf.trainer.ppo_utils.experience import make_experience_batch

        own_logp, own_entropy = [], []
        with torch.no_grad():
            for start in (0, 3):
                batch = make_experience_batch(items[start : start + 3])
                logp, output = actor(batch.sequences, batch.action_mask, batch.attention_mask, return_output=True,
                                     return_entropy=True, ring_attn_group=ring)
                a = batch.action_mask.shape[1]
                for row, item in enumerate(items[start : start + 3]):
                    n = item.action_mask.numel()
                    own_logp.append(logp[row, :n])
                    own_entropy.append(output.entropy[row, -a:][:n])
        torch.save({"stats": stats, "logp": torch.cat(own_logp), "entropy": torch.cat(own_entropy),
                    "gathered": gathered, "valid": torch.cat(valids)}, os.path.join(out, f"ring{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ring_attention_statistics_from_local_slices(tmp_path):
    """With ring attention each rank scores only its slice of the packed micro-batch and the ranks
    exchange 6 numbers per token, never logits; the result equals OpenRLHF's own ring-attention
    ``action_log_probs`` and entropy (gathered by its ``gather_and_pad_tensor``), on every rank."""
    mp.spawn(_ring_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"ring{r}.pt", weights_only=False) for r in range(2)]
    valid = got[0]["valid"]
    for r in got:
        st = r["stats"]
        assert torch.equal(st.valid, valid)
        torch.testing.assert_close(st.logp[valid], r["logp"][valid], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.entropy[valid], r["entropy"][valid], rtol=1e-5, atol=1e-6)
        assert r["gathered"] and all(len(shape) == 2 and shape[1] == 6 for shape in r["gathered"])
        assert max(math.prod(s) for s in r["gathered"]) < 6 * 64  # per-token numbers only, never [L, V]
    for name in ("logp", "entropy", "s_star", "s_expected", "s_centered"):
        assert torch.equal(getattr(got[0]["stats"], name), getattr(got[1]["stats"], name)), name
