"""The adapter's driver steps inside verl 0.9.1's V1 trainer, on a synthetic batch in a real TransferQueue.

Real: verl's trainer class (constructed from verl's composed ``ppo_trainer`` config), its
``_compute_old_log_prob`` / ``_compute_advantage`` / ``_update_actor`` bodies, verl's GRPO and GAE
estimators, TransferQueue 0.1.11 on a local Ray instance.  Stubbed: the actor worker group
(``actor_rollout_wg``), since the workers need a model checkpoint and a rollout engine; the stub
writes / reads TransferQueue exactly where verl's workers do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import transfer_queue as tq  # noqa: E402
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

import entropy_discriminator.adapters.verl as ed_verl  # noqa: E402
from entropy_discriminator import clip_b_mask, clip_v_mask, discriminator_score  # noqa: E402
from entropy_discriminator.adapters.verl._engine import SEQ_FIELDS, STATS_FLAG  # noqa: E402
from entropy_discriminator.adapters.verl._trainer import ENTROPY_FIELD, EXPECTED_FIELD, LOGP_FIELD, STATS_FIELDS  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
N_PROMPTS, N_ROLLOUTS, PROMPT_LEN = 4, 4, 2


def make_trainer(overrides: list[str]):
    ed_verl.register_trainers()
    from verl.trainer.ppo.v1 import get_trainer_cls

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                "critic.ppo_micro_batch_size_per_gpu=4",
                f"actor_rollout_ref.rollout.n={N_ROLLOUTS}",
                "trainer.v1.trainer_mode=entropy_disc",
                *overrides,
            ],
        )
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = "unused"
    return get_trainer_cls("entropy_disc")(cfg)


def nested(ts):
    return torch.nested.as_nested_tensor(ts, layout=torch.jagged)


def put_batch(tag: str, *, seed: int) -> tuple[object, dict]:
    """A GRPO/GAE-ready batch as verl's agent loop + old-log-prob pass leave it in TransferQueue."""
    g = torch.Generator().manual_seed(seed)
    b = N_PROMPTS * N_ROLLOUTS
    lens = torch.randint(3, 13, (b,), generator=g).tolist()
    uids = [f"{tag}{i // N_ROLLOUTS}" for i in range(b)]
    keys = [f"{uids[i]}_{i % N_ROLLOUTS}_0" for i in range(b)]
    rewards = []
    for n in lens:
        r = torch.zeros(n)
        r[-1] = float(torch.randint(0, 2, (1,), generator=g))
        rewards.append(r)
    # heavy-tailed statistics so that the masks clip something at modest mu
    logp = [-(torch.rand(n, generator=g) ** 4) * 6 for n in lens]
    ent = [torch.rand(n, generator=g) ** 3 * 0.5 for n in lens]
    s_exp = [torch.randn(n, generator=g) * 0.05 for n in lens]
    fields = {
        "uid": uids,
        "response_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
        "loss_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
        "rm_scores": nested(rewards),
        # verl's own fields rounded to bf16 (as its fused kernel rounds its entropy): the driver must read the hook's
        "old_log_probs": nested([v.bfloat16().float() for v in logp]),
        "entropy": nested([v.bfloat16().float() for v in ent]),
        LOGP_FIELD: nested(logp),
        ENTROPY_FIELD: nested(ent),
        EXPECTED_FIELD: nested(s_exp),
        "values": nested([torch.randn(n, generator=g) * 0.1 for n in lens]),
    }
    meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=tu.get_tensordict(fields), tags=[{}] * b)
    return meta, {"logp": logp, "ent": ent, "s_exp": s_exp, "lens": lens}


def padded(meta, names):
    return tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=names).to_padded_tensor()


class RecordingActor:
    """Stands in for ``actor_rollout_wg``: records what the update would read from TransferQueue."""

    def __init__(self):
        self.seen = None

    def update_actor(self, batch):
        self.seen = padded(batch, ["advantages", "response_mask", "loss_mask"])
        return {"metrics": {"mfu": 0.0, "pg_loss": 0.0}}


CASES = [
    ("grpo", "clip_v", "zero_pg", ["+entropy_disc.mu_low=1.0", "+entropy_disc.max_frac=0.05"]),
    ("grpo", "clip_b", "drop_token", ["+entropy_disc.mu_low=1.0"]),
    ("gae", "clip_v", "drop_token", ["+entropy_disc.mu_low=1.0", "+entropy_disc.max_frac=null", "+entropy_disc.sides=both"]),
    ("gae", "clip_b", "zero_pg", ["+entropy_disc.mu_low=1.0", "+entropy_disc.sides=both"]),
]


@pytest.mark.parametrize(("estimator", "method", "mode", "extra"), CASES)
def test_advantage_step_gives_the_core_mask_and_update_sees_it(queue, estimator, method, mode, extra):
    trainer = make_trainer(  # calibrate_every=0: no after-update pass (the law scale: test_verl_autopilot.py)
        [f"algorithm.adv_estimator={estimator}", f"+entropy_disc.method={method}", f"+entropy_disc.mask_mode={mode}",
         "+entropy_disc.calibrate_every=0", *extra]
    )
    meta, raw = put_batch(f"{estimator}{method}{mode}", seed=len(estimator) + len(method) + len(mode))
    metrics: dict = {}
    meta = trainer._compute_advantage(meta, metrics)

    got = padded(meta, ["advantages", "response_mask", LOGP_FIELD, ENTROPY_FIELD, EXPECTED_FIELD])
    valid = got["response_mask"].bool()
    adv = got["advantages"]
    if estimator == "grpo":  # sequence advantages, broadcast over the response by verl
        a_seq = adv[:, 0]
        assert torch.equal(adv, a_seq[:, None] * valid)
        assert (a_seq > 0).any() and (a_seq < 0).any()
        a_core = a_seq
    else:  # token advantages
        assert not torch.equal(adv, adv[:, :1] * valid)
        a_core = adv
    s_star = discriminator_score(got[LOGP_FIELD], got[ENTROPY_FIELD])
    mu_low, max_frac = trainer.entropy_disc.resolved()
    kw = dict(mu_low=mu_low, sides=trainer.entropy_disc.sides, max_frac=max_frac)
    if method == "clip_v":
        ref = clip_v_mask(s_star - got[EXPECTED_FIELD], a_core, valid, **kw)
    else:
        ref = clip_b_mask(s_star, a_core, valid, **kw)
    pending = trainer._entropy_disc_pending
    assert ref.n_clipped > 0
    assert torch.equal(pending.keep, ref.keep)
    assert metrics["entropy_disc/clip/frac"] == pytest.approx(ref.clip_frac)
    assert metrics["entropy_disc/clip/n_clipped"] == ref.n_clipped
    assert metrics["entropy_disc/tokens/valid"] == sum(raw["lens"])
    assert "entropy_disc/cov/adv_s_centered" in metrics and "entropy_disc/delta_entropy/cheap" in metrics
    assert "entropy_disc/delta_entropy/predicted" not in metrics  # calibration off: the raw score, named so
    assert metrics["entropy_disc/entropy/mean"] == pytest.approx(
        float(torch.cat(raw["ent"]).double().mean()), rel=1e-6
    )

    actor = RecordingActor()
    trainer.actor_rollout_wg = actor
    trainer.global_steps = 1
    before = padded(meta, ["advantages", "response_mask", "loss_mask"])
    trainer._update_actor(meta, metrics)
    keep = ref.keep.to(torch.int64)
    if mode == "zero_pg":
        torch.testing.assert_close(actor.seen["advantages"], before["advantages"] * keep, rtol=0, atol=0)
        assert torch.equal(actor.seen["loss_mask"], before["loss_mask"])
        assert torch.equal(actor.seen["response_mask"], before["response_mask"])
    else:
        assert torch.equal(actor.seen["response_mask"], before["response_mask"] * keep)
        assert torch.equal(actor.seen["loss_mask"], before["loss_mask"] * keep)
        assert torch.equal(actor.seen["advantages"], before["advantages"])
    after = padded(meta, ["advantages", "response_mask", "loss_mask"])
    for name in ("advantages", "response_mask", "loss_mask"):  # the critic and verl's metrics see verl's values
        assert torch.equal(after[name], before[name])
    assert trainer._entropy_disc_pending is None


def test_old_log_prob_pass_asks_for_and_slices_the_statistic(queue):
    trainer = make_trainer(["+entropy_disc.method=clip_v", "actor_rollout_ref.rollout.calculate_log_probs=false"])
    b, prompt = 3, PROMPT_LEN
    lens = [4, 2, 5]
    keys = [f"olp{i}_0_0" for i in range(b)]
    meta = tq.kv_batch_put(
        keys=keys,
        partition_id="train",
        fields=tu.get_tensordict({"response_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens])}),
        tags=[{}] * b,
    )
    seq_values = [torch.arange(prompt + n, dtype=torch.float32) + 100 * i for i, n in enumerate(lens)]
    seen = {}

    class Worker:
        def compute_log_prob(self, batch):  # what verl's worker writes: full prompt+response rows
            seen.update(batch.extra_info)
            fields = {"log_probs": nested([-v for v in seq_values]), "entropy": nested(seq_values)}
            fields.update({name: nested([v + k for v in seq_values]) for k, name in enumerate(SEQ_FIELDS.values())})
            return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=tu.get_tensordict(fields))

    trainer.actor_rollout_wg = Worker()
    metrics: dict = {}
    out = trainer._compute_old_log_prob(meta, metrics)
    assert seen[STATS_FLAG] is True and seen["calculate_entropy"] is True
    assert STATS_FLAG not in meta.extra_info and STATS_FLAG not in out.extra_info
    got = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=[*STATS_FIELDS.values(), "entropy"])
    for i, n in enumerate(lens):  # response positions, shifted by one like verl's old_log_probs
        for k, name in enumerate(SEQ_FIELDS):  # each hook field lands in its own response field
            assert torch.equal(got[STATS_FIELDS[name]][i], seq_values[i][prompt - 1 : prompt + n - 1] + k)
        assert torch.equal(got[EXPECTED_FIELD][i] - 2, got["entropy"][i])


def test_off_policy_ratio_weights_the_monitor():
    trainer = make_trainer(["+entropy_disc.method=none"])
    g = torch.Generator().manual_seed(3)
    shape = (6, 5)
    old = -torch.rand(shape, generator=g) * 3
    rollout = old + torch.randn(shape, generator=g) * 0.3
    ent = torch.rand(shape, generator=g) * 2
    s_exp = torch.randn(shape, generator=g) * 0.1
    adv = torch.randn(shape, generator=g)
    valid = torch.ones(shape, dtype=torch.int64)
    mask, on = trainer.entropy_disc_step(
        advantages=adv, response_mask=valid, old_log_probs=old, entropy=ent, s_expected=s_exp
    )
    _, off = trainer.entropy_disc_step(
        advantages=adv, response_mask=valid, old_log_probs=old, entropy=ent, s_expected=s_exp, rollout_log_probs=rollout
    )
    assert mask is None and "entropy_disc/clip/frac" not in on
    s_c = (discriminator_score(old, ent) - s_exp).double()
    r = (old - rollout).exp().double()
    a = adv.double()
    for metrics, y in ((on, s_c), (off, r * s_c)):
        cov = (a * y).mean() - a.mean() * y.mean()
        assert metrics["entropy_disc/cov/adv_s_centered"] == pytest.approx(float(cov), rel=1e-5)
        lr = trainer.config.actor_rollout_ref.actor.optim.lr
        assert metrics["entropy_disc/delta_entropy/predicted"] == pytest.approx(-lr * float(cov), rel=1e-5)


def test_update_without_its_mask_is_refused():
    """An actor update whose batch got no mask in the advantage step before it raises instead of training unmasked."""
    from types import SimpleNamespace

    trainer = make_trainer(["+entropy_disc.method=clip_b"])
    with pytest.raises(RuntimeError, match="refusing to update without the mask"):
        trainer._update_actor(SimpleNamespace(keys=["x0_0_0"], partition_id="train"), {})


def test_driver_refuses_nan_expected_score_at_response_tokens():
    """The workers report bad policy logits as NaN E_p[S] (no host check there); the driver names it."""
    trainer = make_trainer(["+entropy_disc.method=clip_v"])
    g = torch.Generator().manual_seed(5)
    shape = (4, 6)
    old = -torch.rand(shape, generator=g) * 3
    ent = torch.rand(shape, generator=g) * 2
    adv = torch.randn(shape, generator=g)
    valid = torch.ones(shape, dtype=torch.int64)
    valid[1, 4:] = 0
    s_exp = torch.randn(shape, generator=g) * 0.1
    s_exp[1, 5] = float("nan")  # padding: ignored
    trainer.entropy_disc_step(advantages=adv, response_mask=valid, old_log_probs=old, entropy=ent, s_expected=s_exp)
    s_exp[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"E_p\[S\].*NaN or inf at 1 response token\(s\) of sequence\(s\) \[2\]"):
        trainer.entropy_disc_step(advantages=adv, response_mask=valid, old_log_probs=old, entropy=ent, s_expected=s_exp)
