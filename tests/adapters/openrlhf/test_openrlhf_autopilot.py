"""The entropy autopilot (``method="autopilot"``) in the OpenRLHF adapter, against the real OpenRLHF code.

In this process (the harness of ``test_openrlhf.py`` / ``test_openrlhf_inforward.py``: the real
``ActorPPOTrainer.__init__`` and ``ppo_train``, old log-probs through the real
``PolicyModelActor.forward``, the real ``NaiveReplayBuffer``; no DeepSpeed engine): the controller
steps once per round, its keep-mask and metrics equal a core ``EntropyAutopilot`` stepped on the
round's statistics and OpenRLHF's advantages with ``lr = --actor.adam.lr``, the metrics
``entropy_disc/autopilot/*`` are in the status dict ``ppo_train`` returns (what OpenRLHF logs), the
mask reaches the loss (the advantages / action mask ``PolicyLoss`` receives); the state restored
from a loaded client state, and a loaded checkpoint without it refused in ``ActorPPOTrainer.__init__``
(``DeepspeedStrategy.load_ckpt``'s DeepSpeed call replaced there, the strategy method real).

In a subprocess (``openrlhf_autopilot_resume.py``: CUDA calls redirected to the CPU, a real DeepSpeed
engine): OpenRLHF's own ``init_model_from_pretrained`` / ``save_checkpoint`` / ``fit``; a run resumed
from the checkpoint of step 2 continues the uninterrupted 4-step run bit for bit (masks, every
``entropy_disc/*`` metric, policy loss, weights, controller state); a Clip_B run's checkpoint is
refused by an autopilot run with a ``ValueError`` before any step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_openrlhf import rollout_batch, tiny_actor  # noqa: E402  (skips or fails like it without OpenRLHF)
from test_openrlhf_inforward import built_trainer, make_experience  # noqa: E402

from openrlhf.trainer.ray import ppo_actor  # noqa: E402

from entropy_discriminator import EntropyDiscConfig  # noqa: E402
from entropy_discriminator.adapters import openrlhf as adapter  # noqa: E402
from entropy_discriminator.adapters.openrlhf import _autopilot, _round  # noqa: E402

HERE = Path(__file__).resolve().parent
LR = 0.2  # the SGD learning rate of the harness; --actor.adam.lr carries it to the law
KEYS = ("entropy", "target_entropy", "target_dh", "predicted_dh_before", "predicted_dh_after", "dropped_frac",
        "n_dropped", "capped")
CONFIG = dict(method="autopilot", sides="both", max_frac=0.3)


@pytest.fixture(autouse=True)
def _clean_patch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    adapter.unpatch()
    yield
    adapter.unpatch()


def with_lr(args: SimpleNamespace, lr: float = LR, optim: str = "adam") -> SimpleNamespace:
    args.actor.optim, args.actor.adam = optim, SimpleNamespace(lr=lr)
    return args


def autopilot_trainer(monkeypatch, *, epochs: int = 1, optim: str = "adam", lr: float = LR):
    """The real ``ActorPPOTrainer.__init__`` on a tiny actor, ``--actor.adam.lr`` set."""
    import test_openrlhf_inforward as inforward

    original = inforward.init_args
    monkeypatch.setattr(inforward, "init_args", lambda *a, **k: with_lr(original(*a, **k), lr, optim))
    actor = tiny_actor()
    return actor, built_trainer(actor, monkeypatch, epochs=epochs, micro=2)


class Recorder:
    """The round states ``begin_round`` returns and what ``PolicyLoss`` receives (advantages, action mask)."""

    def __init__(self, monkeypatch):
        self.rounds, self.loss_inputs = [], []
        original = _round.begin_round

        def begin_round(*a, **k):
            state = original(*a, **k)
            self.rounds.append(state)
            return state

        monkeypatch.setattr(_round, "begin_round", begin_round)  # before patch(): ppo_train's wrapper imports it

    def watch_loss(self, trainer) -> None:
        loss_fn = trainer.actor_loss_fn

        def recording(*a, **k):
            self.loss_inputs.append((a[2].detach().clone(), k["action_mask"].detach().clone()))  # training_step's call
            return loss_fn(*a, **k)

        trainer.actor_loss_fn = recording


def fill(trainer, actor, seed: int) -> list[torch.Tensor]:
    """A rollout batch through ``make_experience``'s forward into the buffer; returns the advantages per item."""
    trainer.replay_buffer.clear()
    for batch in make_experience(actor, rollout_batch(seed, n=8), micro=4):
        trainer.replay_buffer.append(batch)
    return [it.advantages.reshape(-1).clone() for it in trainer.replay_buffer.items]


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mode", ["zero_pg", "drop_token"])
def test_controller_steps_each_round_its_mask_reaches_the_loss_and_its_metrics_the_status(mode, monkeypatch):
    """Calibration every 2nd round: the after-update pass feeds (cheap, realised) to the controller's own
    calibration; a core controller fed the same pairs selects the same tokens, and the logged prediction is
    kappa times the cheap score."""
    rec = Recorder(monkeypatch)
    cfg = EntropyDiscConfig(**CONFIG, mask_mode=mode, calibrate_every=2)
    adapter.patch(cfg)
    actor, trainer = autopilot_trainer(monkeypatch)
    rec.watch_loss(trainer)
    reference = cfg.build_autopilot()
    dropped = 0
    for rnd in range(4):
        adv_items = fill(trainer, actor, seed=20 + rnd)
        masks = [it.action_mask.reshape(-1).clone() for it in trainer.replay_buffer.items]
        rec.loss_inputs.clear()
        status = trainer.ppo_train(0.0)
        state = rec.rounds[-1]
        assert state.source == "forward"  # statistics of make_experience's old-policy forward
        want = reference.from_stats(state.stats, torch.cat(adv_items), lr=LR)
        assert torch.equal(state.mask.keep, want.mask.keep)
        for key, value in want.metrics().items():  # OpenRLHF's status dict carries the step's metrics
            assert status[key] == value, key
        assert {f"entropy_disc/autopilot/{k}" for k in KEYS} <= set(status) and "policy_loss" in status
        assert status["entropy_disc/clip/n_clipped"] == want.metrics()["entropy_disc/autopilot/n_dropped"]
        kappa = reference.calibration.scale  # before this round's pair
        assert status["entropy_disc/delta_entropy/scale"] == kappa
        assert status["entropy_disc/delta_entropy/predicted"] == kappa * status["entropy_disc/delta_entropy/cheap"]
        assert status["entropy_disc/delta_entropy/cheap"] == state.cheap
        assert state.calibrate == (rnd % 2 == 0) and ("entropy_disc/delta_entropy/realised" in status) == state.calibrate
        if state.calibrate and not status["entropy_disc/delta_entropy/scale_skipped"]:  # the pair the adapter fed
            reference.calibrate(state.cheap, status["entropy_disc/delta_entropy/realised"])
        assert reference.calibration.scale > 0
        assert _autopilot.state_of(actor.model) == reference.state_dict()
        assert (reference.state_dict()["version"], reference.state_dict()["step"]) == (2, rnd + 1)
        # the mask in the buffer and in what PolicyLoss received: dropped tokens have A = 0 (zero_pg)
        # or leave the action mask (drop_token); kept tokens are untouched
        drop = (~state.mask.keep).split([m.numel() for m in masks])
        for item, adv, mask, d in zip(trainer.replay_buffer.items, adv_items, masks, drop):
            if mode == "zero_pg":
                assert torch.equal(item.advantages.reshape(-1), torch.where(d, 0.0, adv))
                assert torch.equal(item.action_mask.reshape(-1), mask)
            else:
                assert torch.equal(item.advantages.reshape(-1), adv)
                assert torch.equal(item.action_mask.reshape(-1), mask & ~d)
        # PolicyLoss saw every sample once (one epoch); valid advantages are never 0 before the mask
        n_zero = sum(int(((adv == 0) & am.bool()).sum()) for adv, am in rec.loss_inputs)
        n_tokens = sum(int(am.sum()) for _, am in rec.loss_inputs)
        n_valid, n_drop = int(state.stats.valid.sum()), drop_count(state)
        assert (n_zero, n_tokens) == ((n_drop, n_valid) if mode == "zero_pg" else (0, n_valid - n_drop))
        assert sum(float((adv.double() * am).abs().sum()) for adv, am in rec.loss_inputs) == pytest.approx(
            float(sum((it.advantages.double() * it.action_mask).abs().sum() for it in trainer.replay_buffer.items)))
        dropped += n_drop
    assert dropped > 0  # the controller acted in some round


def drop_count(state) -> int:
    return int((state.stats.valid & ~state.mask.keep).sum())


def test_state_is_restored_from_a_loaded_client_state_and_refused_without_it(monkeypatch):
    """``DeepspeedStrategy.load_ckpt`` (real, its DeepSpeed call replaced) before ``ActorPPOTrainer.__init__``,
    as in ``PolicyModelActor.init_model_from_pretrained``."""
    strategy_cls = ppo_actor.DeepspeedStrategy
    loaded = {}
    monkeypatch.setattr(strategy_cls, "load_ckpt", lambda self, model, load_dir, **k: loaded["result"])
    cfg = EntropyDiscConfig(**CONFIG)
    adapter.patch(cfg)  # wraps the load_ckpt above
    strategy = strategy_cls.__new__(strategy_cls)
    saved = {**cfg.build_autopilot().state_dict(), "step": 5, "h_start": 2.5, "h_smooth": 2.5}
    for result, outcome in ((("ckpt/global_step5", {"global_step": 5, _autopilot.STATE_KEY: saved}), saved),
                            ((None, {}), None),  # OpenRLHF's "no checkpoint found": a fresh controller
                            (("ckpt/global_step5", {"global_step": 5}), ValueError)):
        actor = tiny_actor()
        loaded["result"] = result
        assert strategy.load_ckpt(actor.model, "ckpt") == result
        if outcome is ValueError:
            with pytest.raises(ValueError, match=r"global step 5.*no 'entropy_disc_autopilot' entry.*ckpt\.load_enable"):
                built_trainer_for(actor, monkeypatch)
            continue
        trainer = built_trainer_for(actor, monkeypatch)
        want = outcome or cfg.build_autopilot().state_dict()
        assert _autopilot.state_of(trainer.actor.model) == want


def built_trainer_for(actor, monkeypatch):
    import test_openrlhf_inforward as inforward

    original = inforward.init_args
    monkeypatch.setattr(inforward, "init_args", lambda *a, **k: with_lr(original(*a, **k)))
    return built_trainer(actor, monkeypatch, micro=2)


def test_save_ckpt_adds_the_state_to_the_client_state(monkeypatch):
    """``DeepspeedStrategy.save_ckpt`` (real, its DeepSpeed body replaced) of the policy's engine carries the
    controller's state; the caller's dict is unchanged; another model's checkpoint carries nothing."""
    strategy_cls = ppo_actor.DeepspeedStrategy
    seen = []
    monkeypatch.setattr(strategy_cls, "save_ckpt", lambda self, model, save_dir, tag=None, max_num=3, max_mem=1000,
                        client_state=None, **k: seen.append(client_state))
    adapter.patch(EntropyDiscConfig(**CONFIG))
    actor, trainer = autopilot_trainer(monkeypatch)
    fill(trainer, actor, seed=3)
    trainer.ppo_train(0.0)
    strategy = strategy_cls.__new__(strategy_cls)
    client = {"global_step": 1}
    strategy.save_ckpt(actor.model, "dir", "global_step1", 3, 1000, client)  # PolicyModelActor.save_checkpoint's call
    strategy.save_ckpt(tiny_actor(seed=1).model, "dir", "global_step1", client_state=client)  # e.g. a critic
    law = {"version": 1, "batches": 1, "calibration": None}  # kappa in the controller's own state
    assert seen[0] == {"global_step": 1, _autopilot.STATE_KEY: _autopilot.state_of(actor.model), _autopilot.LAW_KEY: law}
    assert seen[0][_autopilot.STATE_KEY]["step"] == 1 and seen[1] == client == {"global_step": 1}


def test_missing_step_size_is_refused_before_work(monkeypatch):
    """The law needs eta: --actor.adam.lr (adam), or entropy_disc.eta; refused in __init__ and by the argument check."""
    adapter.patch(EntropyDiscConfig(**CONFIG))
    with pytest.raises(ValueError, match=r"--actor\.optim muon.*entropy_disc\.eta"):
        autopilot_trainer(monkeypatch, optim="muon")
    args = with_lr(SimpleNamespace(ds=SimpleNamespace(tensor_parallel_size=1),
                                   actor=SimpleNamespace(policy_loss_type="ppo", entropy_coef=None),
                                   algo=SimpleNamespace(kl=SimpleNamespace(use_loss=False, init_coef=0.0))), lr=0.0)
    with pytest.raises(adapter.UnsupportedConfigurationError, match=r"entropy_disc\.eta"):
        adapter.check_training_args(args, EntropyDiscConfig(**CONFIG))
    adapter.check_training_args(args, EntropyDiscConfig(**CONFIG, eta=1e-6))  # eta set: served
    with_lr(args, lr=1e-6, optim="muon")
    adapter.check_training_args(args, EntropyDiscConfig(**CONFIG, eta=1e-6))
    with_lr(args, lr=1e-6)
    adapter.check_training_args(args, EntropyDiscConfig(**CONFIG))


def test_launcher_parses_the_autopilot_flags_and_hands_them_to_the_workers(monkeypatch, capsys):
    argv = ["--actor.model_name_or_path", "m", "--entropy_disc.method", "autopilot", "--entropy_disc.target_entropy",
            "0.8", "--entropy_disc.decay_steps", "50", "--entropy_disc.gain", "0.25", "--entropy_disc.eta", "1e-6",
            "--entropy_disc.max_step", "inf", "--entropy_disc.form", "mean", "--entropy_disc.sides", "both",
            "--entropy_disc.smoothing", "0.5", "--entropy_disc.calibrate_every", "3"]
    cfg, _, rest = adapter.parse(argv)
    assert rest == ["--actor.model_name_or_path", "m"]
    assert cfg == EntropyDiscConfig(method="autopilot", target_entropy=0.8, decay_steps=50, gain=0.25, eta=1e-6,
                                    max_step=float("inf"), form="mean", sides="both", smoothing=0.5, calibrate_every=3)
    assert adapter.parse(["--entropy_disc.method", "autopilot"])[0] == EntropyDiscConfig(method="autopilot")
    env = adapter.runtime_env(cfg)
    payload = json.loads(env["env_vars"][adapter.CONFIG_ENV])["config"]
    assert EntropyDiscConfig.from_mapping(payload) == cfg
    for bad in (["--entropy_disc.target_entropy", "-1"], ["--entropy_disc.decay_steps", "x"],
                ["--entropy_disc.method", "clip_b", "--entropy_disc.gain", "0.3"],
                ["--entropy_disc.calibrate_every", "-1"], ["--entropy_disc.smoothing", "0"]):
        with pytest.raises(SystemExit):
            adapter.parse(["--entropy_disc.method", "autopilot", *bad])
        assert "entropy_disc." in capsys.readouterr().err


def test_resumed_run_continues_the_uninterrupted_one_bit_for_bit(tmp_path):
    """Real DeepSpeed checkpoints through OpenRLHF's PolicyModelActor (subprocess; see the module doc)."""
    out = tmp_path / "result.json"
    port = str(29600 + os.getpid() % 300)
    proc = subprocess.run([sys.executable, str(HERE / "openrlhf_autopilot_resume.py"), str(out), port],
                          cwd=HERE.parents[2], capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    full, resumed = result["full"], result["resumed"]
    assert [r["state"]["step"] for r in full] == [1, 2, 3, 4]
    assert result["states"]["entry"] == full[1]["state"]  # saved with OpenRLHF's client states, after step 2
    assert {"global_step", "episode", _autopilot.STATE_KEY, _autopilot.LAW_KEY} <= set(result["states"]["keys"])
    assert result["states"]["law"] == {"version": 1, "batches": 2, "calibration": None}  # kappa: in the controller's
    realised = "entropy_disc/delta_entropy/realised"
    assert [realised in r["status"] for r in full] == [True, False, False, True]  # calibration rounds 1 and 4
    fed = not full[0]["status"]["entropy_disc/delta_entropy/scale_skipped"]  # round 1's pair (kappa > 0 kept)
    assert full[0]["state"]["calibration"]["count"] == int(fed)
    assert (full[1]["status"]["entropy_disc/delta_entropy/scale"] != 1.0) == fed
    assert sum(r["status"]["entropy_disc/autopilot/n_dropped"] for r in full) > 0
    for want, got in zip(full[2:], resumed):  # masks, metrics, loss, weights, state: bit for bit
        assert got["keep"] == want["keep"]
        assert got["status"] == want["status"]
        assert {f"entropy_disc/autopilot/{k}" for k in KEYS} <= set(got["status"])
        assert got["policy_loss"] == want["policy_loss"] and got["weights"] == want["weights"]
        assert got["state"] == want["state"]
    assert result["fresh_without_checkpoint"]["state"]["step"] == 1  # load enabled, nothing there: fresh
    assert result["fresh_without_checkpoint"]["keep"] == full[0]["keep"]
    assert result["refusal"] and "no 'entropy_disc_autopilot' entry" in result["refusal"]
    assert "global step 1" in result["refusal"]
