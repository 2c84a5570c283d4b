"""The entropy autopilot (``method="autopilot"``) in verl's V1 ``sync`` trainer: stepping, metrics, checkpoint, resume
(the async modes: ``test_verl_autopilot_async.py``, with these stubs).

Real: verl's trainer class built from verl's composed ``ppo_trainer`` config, its ``fit`` loop
(step counting, ``save_freq``, metrics to ``Tracking.log``), ``step`` / ``_step_once`` (balance,
old-log-prob pass, GRPO advantages, actor update), ``_save_checkpoint`` / ``_load_checkpoint``
(folders, tracker file, ``data.pt``, ``trainer.resume_mode``), TransferQueue on a local Ray.
Stubbed, as in ``test_verl_advantage.py``: the worker group (``FakeActor``: writes the old-policy
pass's fields where verl's workers and the adapter's hook write them, reads the update's fields,
and keeps a one-number "model" ``theta`` that the masked update moves and that the statistics of
later batches depend on, saved and loaded through verl's actor checkpoint calls), the replay buffer
(``Batches``: batch ``s`` is a fixed function of the global step, as a resumed dataloader gives),
the dataloader's state, the rollout replicas, ``Tracking`` (records what ``fit`` logs) and verl's
data metrics (``_compute_metrics``, which reads rollout fields the stub does not make).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import transfer_queue as tq  # noqa: E402
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from verl.trainer.ppo.v1 import trainer_base  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

import entropy_discriminator.adapters.verl as ed_verl  # noqa: E402
from entropy_discriminator import EntropyDiscConfig, discriminator_score  # noqa: E402
from entropy_discriminator.adapters.verl._autopilot import LAW_FILE, STATE_FILE  # noqa: E402
from entropy_discriminator.adapters.verl._engine import SEQ_FIELDS, STATS_FLAG  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
N_PROMPTS, N_ROLLOUTS, PROMPT_LEN = 4, 4, 2
STEPS = 4
PILOT = ["+entropy_disc.method=autopilot", "+entropy_disc.sides=both", "+entropy_disc.max_frac=0.2",
         "+entropy_disc.eta=0.5", "+entropy_disc.target_entropy=0.3", "+entropy_disc.decay_steps=3",
         "+entropy_disc.calibrate_every=1"]
LAW = "entropy_disc/delta_entropy/"
PREFIX = "entropy_disc/autopilot/"


def compose_config(ckpt_dir: Path, *extra: str, mode: str = "entropy_disc"):
    """verl's composed ``ppo_trainer`` config for trainer ``mode``; an ``extra`` ``key=value`` replaces the base's."""
    base = [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
        f"actor_rollout_ref.rollout.n={N_ROLLOUTS}",
        f"data.train_batch_size={N_PROMPTS}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={N_PROMPTS}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.adv_estimator=grpo",
        f"trainer.v1.trainer_mode={mode}",
        f"trainer.default_local_dir={ckpt_dir}",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.total_epochs=1",
        "trainer.logger=[console]",
        *PILOT,
    ]
    replaced = {e.split("=", 1)[0] for e in extra}
    overrides = [o for o in base if o.split("=", 1)[0] not in replaced] + list(extra)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = "unused"
    return cfg


def nested(ts):
    return torch.nested.as_nested_tensor(ts, layout=torch.jagged)


def padded(meta, names):
    return tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=names).to_padded_tensor()


class Batches:
    """Stands in for verl's replay buffer: the batch of global step ``s`` (``batch_size`` prompts x 4 rollouts;
    the sync trainer asks for 4 prompts) depends on ``s`` and the part ``part()`` only.

    ``part`` reads the trainer's ``local_trigger_step`` (the part of a ``separate_async`` step; 0 in the
    other modes).  Besides verl's rollout fields it stores the stub model's per-position raw statistics
    (``raw_*``, prompt+response positions), which ``FakeActor`` turns into the old-policy pass's fields.
    """

    def __init__(self, tag: str, part=lambda: 0):
        self.tag = tag
        self.part = part

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        part = self.part()
        g = torch.Generator().manual_seed(100 + global_steps + 7919 * part)
        b = batch_size * N_ROLLOUTS
        lens = torch.randint(3, 13, (b,), generator=g).tolist()
        uid = f"{self.tag}s{global_steps}" + (f"q{part}" if part else "")
        uids = [f"{uid}p{i // N_ROLLOUTS}" for i in range(b)]
        keys = [f"{uids[i]}_{i % N_ROLLOUTS}_0" for i in range(b)]
        rewards = []
        for n in lens:
            r = torch.zeros(n)
            r[-1] = float(torch.randint(0, 2, (1,), generator=g))
            rewards.append(r)
        seq = [PROMPT_LEN + n for n in lens]
        raw_logp = [-(torch.rand(m, generator=g) ** 4) * 6 for m in seq]
        fields = {
            "uid": uids,
            "responses": nested([torch.zeros(n, dtype=torch.int64) for n in lens]),
            "response_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
            "loss_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
            "rm_scores": nested(rewards),
            "rollout_log_probs": nested([-(torch.rand(n, generator=g) ** 4) * 6 for n in lens]),
            "raw_logp": nested(raw_logp),
            "raw_entropy": nested([torch.rand(m, generator=g) ** 3 * 0.5 for m in seq]),
            "raw_s_expected": nested([torch.randn(m, generator=g) * 0.05 for m in seq]),
        }
        # the rollout's log-probs near the old policy's, so that r = pi_old / pi_rollout stays near 1
        fields["rollout_log_probs"] = nested(
            [lp[PROMPT_LEN - 1 : -1] + 0.1 * torch.randn(n, generator=g) for lp, n in zip(raw_logp, lens)]
        )
        tags = [{"seq_len": m} for m in seq]
        meta = tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=tu.get_tensordict(fields), tags=tags)
        return meta, {}


class Crash(RuntimeError):
    pass


class FakeActor:
    """The actor worker group: old-policy pass fields, the update's view of the batch, a checkpointed ``theta``."""

    _dispatch_info = {"actor": [0]}

    def __init__(self, crash_at_update: int | None = None):
        self.theta = 0.0
        self.thetas: list[float] = []  # theta after each update
        self.old_thetas: list[float] = []  # theta of each old-policy pass
        self.after_thetas: list[float] = []  # theta of each after-update pass (the law scale's calibration)
        self.old_entropy: list[dict[str, torch.Tensor]] = []  # per old-policy pass: key -> entropy it wrote
        self.after_entropy: list[dict[str, torch.Tensor]] = []  # per after-update pass: key -> entropy, in its order
        self.after_pass = False  # the kind of the pass under way
        self.cpu: dict[int, float] = {}  # separate_async's CPU copies of the weights (decoupled pi_old)
        self.updates: list[dict] = []
        self.loads: list[str] = []
        self.crash_at_update = crash_at_update

    def compute_log_prob(self, batch):
        raw = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                              select_fields=["raw_logp", "raw_entropy", "raw_s_expected"])
        self.begin_pass(batch.extra_info.get)
        fields = self.log_prob_fields(list(batch.keys), raw)
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)

    def begin_pass(self, info):
        """Record the start of a pass, the old-policy one or the adapter's after-update one (``info(name)``: the
        pass's extra info)."""
        self.after_pass = info(STATS_FLAG) is None
        if self.after_pass:  # the adapter's after-update pass: verl's own fields only
            assert info("calculate_entropy") is True
            self.after_thetas.append(self.theta)
            self.after_entropy.append({})
        else:
            assert info(STATS_FLAG) is True  # the adapter asks for the hook's fields
            self.old_thetas.append(self.theta)
            self.old_entropy.append({})

    def log_prob_fields(self, keys, raw):
        """What the current pass writes for the rows ``keys`` (``raw``: their ``raw_*`` fields): verl's ``log_probs``
        and ``entropy``, and the hook's fields in the old-policy pass."""
        scale = math.exp(self.theta)  # the "model": its entropies scale with exp(theta)
        ent = nested([e * scale for e in raw["raw_entropy"].unbind()])
        logp = nested(list(raw["raw_logp"].unbind()))
        (self.after_entropy if self.after_pass else self.old_entropy)[-1].update(zip(keys, ent.unbind()))
        if self.after_pass:
            return tu.get_tensordict({"log_probs": logp, "entropy": ent})
        return tu.get_tensordict({
            "log_probs": logp,
            "entropy": ent,
            SEQ_FIELDS["logp"]: logp,
            SEQ_FIELDS["entropy"]: ent,
            SEQ_FIELDS["s_expected"]: nested(list(raw["raw_s_expected"].unbind())),
        })

    def update_actor(self, batch):
        seen = padded(batch, ["advantages", "response_mask", "loss_mask"])
        self.updates.append({k: seen[k].clone() for k in ("advantages", "response_mask", "loss_mask")})
        if self.crash_at_update == len(self.updates):
            raise Crash("interrupted")
        adv = seen["advantages"] * seen["response_mask"]
        self.theta -= 0.2 * float(adv.sum()) / float(seen["response_mask"].sum())
        self.thetas.append(self.theta)
        return {"metrics": {"mfu": 0.0, "pg_loss": 0.0}}

    def save_model_to_cpu(self, n):
        self.cpu[n] = self.theta

    def restore_model_from_cpu(self, n):
        self.theta = self.cpu[n]

    def clear_cpu_model(self, n):
        del self.cpu[n]

    def save_checkpoint(self, local_path, hdfs_path, global_step, max_ckpt_to_keep=None):
        Path(local_path).mkdir(parents=True, exist_ok=True)
        (Path(local_path) / "theta.json").write_text(json.dumps({"theta": self.theta, "step": global_step}))

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loads.append(local_path)
        self.theta = json.loads((Path(local_path) / "theta.json").read_text())["theta"]


class Dataloader:
    def __init__(self):
        self.state = {"consumed": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


class Replicas:
    """verl's checkpoint managers of the rollout replicas (the async modes' standalone one too): no replicas."""

    def __init__(self):
        self.synced: list[int] = []

    def sleep_replicas(self):
        pass

    def abort_replicas(self, **kwargs):
        pass

    def resume_generation_replicas(self):
        pass

    def update_weights(self, global_steps=None):
        self.synced.append(global_steps)


class Run:
    """One training process: verl's trainer with the stubs; ``fit()`` runs verl's loop and records per global step
    the adapter's batch inputs and outputs (``entropy_disc_step``) and what ``fit`` logs."""

    def __init__(self, ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, *extra: str, crash_at_update=None, tag="r",
                 mode="entropy_disc", actor: FakeActor | None = None):
        ed_verl.register_trainers()
        from verl.trainer.ppo.v1 import get_trainer_cls

        self.trainer = t = get_trainer_cls(mode)(compose_config(ckpt_dir, *extra, mode=mode))
        t.actor_rollout_wg = self.actor = FakeActor(crash_at_update) if actor is None else actor
        t.replay_buffer = Batches(tag, part=lambda: t.local_trigger_step)
        t.train_dataloader = Dataloader()
        t.checkpoint_manager = Replicas()
        self.warmup_prompts: list[int] = []  # the async modes' warm-up requests (verl 0.9.1; 0.9.0 asks per batch)
        t._add_prompts_to_generate = lambda n: self.warmup_prompts.append(n) or n
        if t.trainer_mode == "separate_async":  # what verl's _setup() builds: the standalone rollout, trainer mode
            from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

            t.standalone_checkpoint_manager = Replicas()
            t.current_mode = HybridEngineMode.TRAINER
        t.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=["reward"])
        t.tokenizer = SimpleNamespace(eos_token_id=0, pad_token_id=0)
        t._add_batch_to_generate = lambda *a, **k: None
        t._compute_metrics = lambda *a, **k: None
        t.total_training_steps = t.steps_per_epoch = STEPS
        t._init_dump_executor()
        self.logged: dict[int, dict] = {}
        self.states: dict[int, dict] = {}
        self.batches: dict[int, dict] = {}
        monkeypatch.setattr(trainer_base, "Tracking", lambda **kw: SimpleNamespace(log=self._log))
        inner = t.entropy_disc_step

        def recorded(**kw):  # keyed by global step; by (global step, part) where a step has several parts
            mask, metrics = inner(**kw)
            key = t.global_steps if t.parameter_sync_step == 1 else (t.global_steps, t.local_trigger_step)
            assert key not in self.batches
            self.batches[key] = {"inputs": {k: v.clone() for k, v in kw.items() if v is not None},
                                            "keep": mask.keep.clone(), "metrics": dict(metrics),
                                            "state": t.entropy_disc_autopilot.state_dict()}
            return mask, metrics

        t.entropy_disc_step = recorded
        t._load_checkpoint()  # where verl's init() calls it, once the workers are up

    def _log(self, data, step):
        self.logged[step] = dict(data)
        self.states[step] = self.trainer.entropy_disc_autopilot.state_dict()  # after the step, as checkpointed

    def fit(self):
        self.trainer.fit(agent_loop_manager=None)


def entropy_disc_metrics(logged: dict) -> dict:
    return {k: v for k, v in logged.items() if k.startswith("entropy_disc/")}


def reference_steps(batches: dict[int, dict], steps, *, with_ratio: bool = True, logged: dict | None = None) -> list:
    """The core controller, fresh, stepped on the batches the driver saw (its own S_c, r and eta), fed after each
    step the law scale's pair the adapter logged (``logged``: what ``fit`` logged per step; None: no pairs)."""
    pilot = EntropyDiscConfig.from_mapping({k[len("+entropy_disc."):]: v for k, v in (p.split("=") for p in PILOT)})
    pilot = pilot.build_autopilot()
    out = []
    for s in steps:
        if logged is not None and s - 1 in logged and not logged[s - 1][LAW + "scale_skipped"]:
            pilot.calibrate(batches[s - 1]["metrics"][LAW + "cheap"], logged[s - 1][LAW + "realised"])
        x = batches[s]["inputs"]
        valid = x["response_mask"].bool()
        s_c = torch.where(valid, discriminator_score(x["old_log_probs"], x["entropy"]) - x["s_expected"], 0.0)
        ratio = torch.where(valid, (x["old_log_probs"] - x["rollout_log_probs"]).exp(), 0.0)
        out.append(pilot.step(x["advantages"], s_centered=s_c, entropy=torch.where(valid, x["entropy"], 0.0),
                              valid=valid, lr=0.5, ratio=ratio if with_ratio else None))
    return out


def test_start_up_accepts_autopilot_with_its_step_size_and_refuses_a_missing_one(tmp_path):
    plan = ed_verl.check_config(compose_config(tmp_path))
    assert plan.options.method == "autopilot" and plan.eta == 0.5 and plan.expected
    base = [p for p in PILOT if "eta" not in p]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=["trainer.v1.trainer_mode=entropy_disc", *base,
                                                            "actor_rollout_ref.actor.optim.lr=3e-6"])
        assert ed_verl.check_config(cfg).eta == 3e-6  # the actor's configured learning rate
        cfg = compose(config_name="ppo_trainer", overrides=["trainer.v1.trainer_mode=entropy_disc", *base,
                                                            "actor_rollout_ref.actor.optim.lr=0"])
        with pytest.raises(ValueError, match=r"entropy_disc\.eta"):
            ed_verl.check_config(cfg)
        cfg = compose(config_name="ppo_trainer", overrides=["trainer.v1.trainer_mode=entropy_disc", *PILOT,
                                                            "actor_rollout_ref.actor.strategy=veomni"])
        with pytest.raises(ValueError, match=r"entropy_disc\.method=autopilot needs E_p\[S\]"):
            ed_verl.check_config(cfg)


def test_controller_steps_in_verls_loop_its_metrics_are_logged_and_its_mask_reaches_the_update(
        queue, tmp_path, monkeypatch):
    run = Run(tmp_path / "ckpt", monkeypatch, tag="one")
    run.fit()
    t = run.trainer
    assert sorted(run.batches) == sorted(run.logged) == list(range(1, STEPS + 1))
    assert t.entropy_disc_autopilot.state_dict()["step"] == STEPS
    refs = reference_steps(run.batches, range(1, STEPS + 1), logged=run.logged)
    dropped = 0
    # the law scale: each batch's realised change measured after its update (theta after it), fed with its cheap
    # score; the logged prediction is kappa times the cheap score
    assert run.actor.after_thetas == run.actor.thetas and len(run.actor.after_thetas) == STEPS
    for s, ref in zip(range(1, STEPS + 1), refs):
        got = run.batches[s]
        assert got["metrics"][LAW + "scale"] == ref.scale
        assert got["metrics"][LAW + "predicted"] == ref.scale * got["metrics"][LAW + "cheap"]
        # the after pass read every 2nd row: calibrate_share 0.25 of 16 rows is 4, rounded up to one whole
        # micro-batch of log_prob_micro_batch_size_per_gpu=8 rows (test_verl_calibration.py: the rows in detail)
        x = {k: v[::2] for k, v in got["inputs"].items()}
        valid = x["response_mask"].bool()
        h_after = x["entropy"] * math.exp(run.actor.thetas[s - 1] - run.actor.old_thetas[s - 1])
        want = float(((h_after - x["entropy"]).double() * valid).sum() / valid.sum())
        assert run.logged[s][LAW + "realised"] == pytest.approx(want, rel=1e-3, abs=1e-7)  # float32 entropies
        assert torch.equal(got["keep"], ref.keep)
        assert {k: v for k, v in got["metrics"].items() if k.startswith(PREFIX)} == ref.metrics()
        for key, value in ref.metrics().items():  # through verl's step() aggregation into Tracking.log
            assert run.logged[s][key] == pytest.approx(value, rel=1e-12, abs=0)
        assert run.logged[s]["entropy_disc/clip/n_clipped"] == ref.mask.n_clipped  # the monitor reports its mask
        # the actor update saw verl's advantages with the dropped tokens zeroed (mask_mode zero_pg)
        seen = run.actor.updates[s - 1]
        keep = ref.keep[:, : seen["advantages"].shape[1]]
        assert torch.equal(seen["advantages"], got["inputs"]["advantages"] * keep)
        assert torch.equal(seen["loss_mask"], got["inputs"]["response_mask"])
        dropped += ref.mask.n_clipped
    assert dropped > 0
    assert sum(not run.logged[s][LAW + "scale_skipped"] for s in run.logged) >= 1 and refs[-1].scale != 1.0
    # the law saw r = pi_old / pi_rollout: without it the prediction differs
    (on_policy,) = reference_steps(run.batches, [1], with_ratio=False)
    assert on_policy.predicted_dh_before != refs[0].predicted_dh_before
    # and the controller followed a non-trivial target (the ramp), with the entropy the hook measured
    assert refs[0].metrics()[PREFIX + "target_entropy"] == pytest.approx(refs[0].entropy)
    assert len({r.metrics()[PREFIX + "target_entropy"] for r in refs}) == STEPS
    # checkpoints at global steps 2 and 4 (save_freq=2, last step), next to verl's own files
    for s in (2, 4):
        folder = tmp_path / "ckpt" / f"global_step_{s}"
        assert {"actor", "data.pt", STATE_FILE} <= {p.name for p in folder.iterdir()}
        saved = json.loads((folder / STATE_FILE).read_text())
        assert saved == {"global_step": s, "autopilot": run.states[s]}
        assert json.loads((folder / LAW_FILE).read_text()) == {
            "global_step": s, "law": {"version": 1, "batches": s, "calibration": None}}
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)


@pytest.mark.parametrize("resume", ["auto", "resume_path"])
def test_resumed_run_continues_the_uninterrupted_run_bit_for_bit(queue, tmp_path, monkeypatch, resume):
    full = Run(tmp_path / "full", monkeypatch, tag=f"full{resume}")
    full.fit()
    # the interrupted run dies in the actor update of global step 3, after its controller stepped
    cut = Run(tmp_path / "cut", monkeypatch, crash_at_update=3, tag=f"cut{resume}")
    with pytest.raises(Crash):
        cut.fit()
    assert cut.trainer.entropy_disc_autopilot.state_dict()["step"] == 3
    assert (tmp_path / "cut" / "latest_checkpointed_iteration.txt").read_text() == "2"
    extra = ["trainer.resume_mode=auto"] if resume == "auto" else [
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'cut' / 'global_step_2'}"]
    resumed = Run(tmp_path / "cut", monkeypatch, *extra, tag=f"res{resume}")
    assert resumed.trainer.global_steps == 2
    assert resumed.trainer.entropy_disc_autopilot.state_dict() == full.states[2]
    assert resumed.trainer.entropy_disc_law.state_dict() == {"version": 1, "batches": 2, "calibration": None}
    assert resumed.actor.theta == full.actor.thetas[1]  # the stub model's weights came back with verl's actor load
    resumed.fit()
    assert sorted(resumed.batches) == [3, 4]
    for s in (3, 4):
        a, b = full.batches[s], resumed.batches[s]
        for name, value in a["inputs"].items():
            assert torch.equal(value, b["inputs"][name]), name
        assert torch.equal(a["keep"], b["keep"])
        assert a["metrics"] == b["metrics"] and a["state"] == b["state"]
        assert entropy_disc_metrics(full.logged[s]) == entropy_disc_metrics(resumed.logged[s])
        for name in ("advantages", "response_mask", "loss_mask"):
            assert torch.equal(full.actor.updates[s - 1][name], resumed.actor.updates[s - 3][name])
    assert resumed.actor.theta == full.actor.theta
    assert resumed.trainer.entropy_disc_autopilot.state_dict() == full.trainer.entropy_disc_autopilot.state_dict()
    assert any(full.batches[s]["metrics"][PREFIX + "n_dropped"] > 0 for s in (3, 4))
    # the comparison can tell: a fresh controller on the same step-3 batch gives other numbers
    (fresh,) = reference_steps(resumed.batches, [3])
    assert fresh.metrics() != resumed.batches[3]["metrics"] and fresh.metrics()[PREFIX + "target_entropy"] != \
        resumed.batches[3]["metrics"][PREFIX + "target_entropy"]


def test_resume_without_the_controllers_state_is_refused_before_work(queue, tmp_path, monkeypatch):
    run = Run(tmp_path / "ckpt", monkeypatch, crash_at_update=3, tag="refuse")
    with pytest.raises(Crash):
        run.fit()
    (tmp_path / "ckpt" / "global_step_2" / STATE_FILE).unlink()  # as a checkpoint of a clip_b run, or an older adapter
    with pytest.raises(ValueError, match=rf"resumes at global step 2 from .*global_step_2, which has no {STATE_FILE}"):
        Run(tmp_path / "ckpt", monkeypatch, "trainer.resume_mode=auto", tag="refuse2")  # in __init__: no worker yet
    # verl's own resume call refuses before it loads anything (the actor's checkpoint stays unread)
    with pytest.raises(ValueError, match=rf"which has no {STATE_FILE}"):
        run.trainer._load_checkpoint()
    assert run.actor.loads == []
    # training from step 0 over the same folder is a fresh start
    fresh = Run(tmp_path / "ckpt", monkeypatch, "trainer.resume_mode=disable", tag="refuse3")
    assert fresh.trainer.global_steps == 0
    fresh_state = fresh.trainer.entropy_disc_autopilot.state_dict()
    assert (fresh_state["step"], fresh_state["h_start"]) == (0, None)
    # a state file of another step is refused too
    (tmp_path / "ckpt" / "global_step_2" / STATE_FILE).write_text(
        json.dumps({"global_step": 1, "autopilot": {"version": 1, "step": 1, "h_start": 0.5}}))
    with pytest.raises(ValueError, match=r"must hold \{'global_step': 2"):
        run.trainer._load_checkpoint()
    assert run.actor.loads == []
