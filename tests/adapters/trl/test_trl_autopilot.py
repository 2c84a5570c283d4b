"""``method="autopilot"`` in the real TRL ``GRPOTrainer``: flags, refusals, one controller step per
training batch with the adapter's statistics, the scale ``kappa`` of the cheap prediction fed from the
realised change of the same batch, and the controller's and the scale's state through TRL's
checkpoint/resume (bit for bit against the run that was not interrupted)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _trl_harness import make_trainer, reference
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer, TrlParser

import entropy_discriminator.adapters.trl._autopilot as ed_autopilot
from entropy_discriminator import EntropyAutopilot, EntropyDiscConfig, batch_entropy_change
from entropy_discriminator.law_scale import LawScale
from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, EntropyDiscGRPOTrainer, patch, unpatch

#: Settings under which the tiny model's batches drop tokens every step: a target near log V = log 24 (the
#: law asks for a rise) and eta large enough that a few tokens' terms can meet it.
PILOT = dict(entropy_disc_method="autopilot", entropy_disc_target_entropy="3.1", entropy_disc_eta=2.0,
             entropy_disc_sides="both", entropy_disc_max_frac="0.25", entropy_disc_calibrate_every=1)
#: The same without calibration: kappa stays 1, so a core controller replays the steps from the statistics alone.
RAW = {**PILOT, "entropy_disc_calibrate_every": 0}
#: Routes: the first training forward (zero_pg, one micro-batch per generation batch) and one extra
#: no-grad pass over the generation batch (drop_token); TRL's own old pass (steps_per_generation 2).
ROUTES = {
    "training_forward": {},
    "extra_pass": {"entropy_disc_mask_mode": "drop_token"},
    "old_pass": {"steps_per_generation": 2, "gradient_accumulation_steps": 1},
}


@pytest.fixture(autouse=True)
def _no_leftover_patch():
    unpatch()
    yield
    unpatch()


@pytest.fixture
def steps(monkeypatch):
    """Every controller step the adapter takes: ``(stats, advantages, ratio, keep)``."""
    seen = []
    real = ed_autopilot.step

    def record(trainer, state, stats, advantages, ratio):
        mask = real(trainer, state, stats, advantages, ratio)
        seen.append((stats, advantages.clone(), ratio, mask.keep.clone()))
        return mask

    monkeypatch.setattr(ed_autopilot, "step", record)
    return seen


def _ed_logs(trainer) -> list[dict[str, float]]:
    return [{k: v for k, v in h.items() if k.startswith("entropy_disc/") or k == "loss"}
            for h in trainer.state.log_history if "loss" in h]


# ---------------------------------------------------------------------------------------------- config


def test_flags_reach_the_core_config():
    (args,) = TrlParser((EntropyDiscGRPOConfig,)).parse_args_and_config(args=[
        "--output_dir", "/tmp/x", "--report_to", "none", "--use_cpu", "--entropy_disc_method", "autopilot",
        "--entropy_disc_target_entropy", "1.5", "--entropy_disc_decay_steps", "10", "--entropy_disc_gain", "0.3",
        "--entropy_disc_max_step", "inf", "--entropy_disc_eta", "1e-3", "--entropy_disc_form", "mean",
        "--entropy_disc_max_frac", "auto", "--entropy_disc_sides", "both",
    ])
    assert args.entropy_disc_config() == EntropyDiscConfig(
        method="autopilot", target_entropy=1.5, decay_steps=10, gain=0.3, max_step=math.inf, eta=1e-3, form="mean",
        sides="both")
    (default,) = TrlParser((EntropyDiscGRPOConfig,)).parse_args_and_config(args=[
        "--output_dir", "/tmp/x", "--report_to", "none", "--use_cpu", "--entropy_disc_method", "autopilot"])
    assert default.entropy_disc_config() == EntropyDiscConfig(method="autopilot")  # hold, eta = learning_rate
    assert default.entropy_disc_config().build_autopilot().max_frac == 0.05


@pytest.mark.parametrize(("fields", "match"), [
    ({"entropy_disc_target_entropy": "lots"}, "entropy_disc_target_entropy must be 'hold' or a number"),
    ({"entropy_disc_target_entropy": "-1"}, r"entropy_disc\.target_entropy"),
    ({"entropy_disc_gain": 2.0}, r"entropy_disc\.gain"),
    ({"entropy_disc_eta": 0.0}, r"entropy_disc\.eta"),
    ({"entropy_disc_decay_steps": 5}, r"entropy_disc\.decay_steps=5 .*target_entropy='hold'"),
    ({"entropy_disc_mu_low": 2.0}, r"entropy_disc\.mu_low=2\.0 does not apply to method 'autopilot'"),
    ({"entropy_disc_cap_rule": "reference"}, r"entropy_disc\.cap_rule"),
    ({"entropy_disc_mask_source": "current"}, "method='autopilot' needs mask_source='generation'"),
])
def test_config_refusals_name_the_setting(fields, match):
    with pytest.raises(ValueError, match=match):
        EntropyDiscGRPOConfig(output_dir="/tmp/x", report_to="none", use_cpu=True, entropy_disc_method="autopilot",
                              **fields)


def test_autopilot_fields_refused_with_the_masks():
    with pytest.raises(ValueError, match=r"entropy_disc\.gain=0\.3 does not apply to method 'clip_b'"):
        EntropyDiscGRPOConfig(output_dir="/tmp/x", report_to="none", use_cpu=True, entropy_disc_method="clip_b",
                              entropy_disc_gain=0.3)


def test_no_step_size_is_refused_before_generation(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=r"entropy_disc\.eta is None and TRL's learning rate is 0\.0, so the autopilot "
                                         r"has no step size for its law: set learning_rate > 0, or entropy_disc\.eta"):
        make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, learning_rate=0.0, entropy_disc_method="autopilot")
    trainer = make_trainer(tmp_path, cls=GRPOTrainer, learning_rate=0.0, entropy_disc_method="autopilot")
    with pytest.raises(ValueError, match=r"entropy_disc\.eta is None"):  # stock trainer: on its first step
        trainer.train()
    assert not calls
    with pytest.raises(ValueError, match="needs mask_source='generation'"):
        patch(config=EntropyDiscConfig(method="autopilot"), mask_source="current")


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("route", list(ROUTES))
def test_one_step_per_batch_with_the_adapters_statistics(route, steps, tmp_path):
    """The controller steps once per generation batch; replaying the recorded statistics through a
    fresh core controller (eta = entropy_disc_eta, r = 1) gives the same keep-masks and metrics, and
    the masks reach TRL's logs (clip fraction = dropped share)."""
    trainer = make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, max_steps=4, max_completion_length=8,
                           **RAW, **ROUTES[route])
    trainer.train()
    state = trainer._entropy_disc_state
    assert state.plan.route == route
    generations = 4 // trainer.args.steps_per_generation
    assert len(steps) == generations and state.autopilot.state_dict()["step"] == generations
    replay = EntropyAutopilot(3.1, sides="both", max_frac=0.25)
    logs = [h for h in trainer.state.log_history if "entropy_disc/autopilot/target_dh" in h]
    assert len(logs) == generations
    dropped = 0
    for (stats, adv, ratio, keep), log in zip(steps, logs):
        assert ratio is None
        res = replay.from_stats(stats, adv, lr=2.0)
        assert torch.equal(res.keep, keep)
        assert {k: log[k] for k in res.metrics()} == res.metrics()
        assert log["entropy_disc/clip/frac"] == res.dropped_frac
        dropped += res.mask.n_clipped
    assert dropped > 0
    assert replay.state_dict() == state.autopilot.state_dict()
    assert trainer.state.stateful_callbacks[ed_autopilot.STATE_KEY] == replay.state_dict()


def test_default_step_size_is_the_learning_rate(steps, tmp_path):
    trainer = make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, max_steps=2, learning_rate=3e-3,
                           **{**RAW, "entropy_disc_eta": None})
    trainer.train()
    replay = EntropyAutopilot(3.1, sides="both", max_frac=0.25)
    for stats, adv, _, keep in steps:
        assert torch.equal(replay.from_stats(stats, adv, lr=3e-3).keep, keep)


def test_sampling_ratio_is_trls_importance_ratio_broadcast():
    shape = torch.Size([2, 3])
    assert ed_autopilot.sampling_ratio({}, shape) is None
    per_seq = ed_autopilot.sampling_ratio({"importance_sampling_ratio": torch.tensor([[0.5], [2.0]])}, shape)
    assert torch.equal(per_seq, torch.tensor([[0.5] * 3, [2.0] * 3]))
    per_token = torch.rand(2, 3, dtype=torch.float64)
    assert torch.equal(ed_autopilot.sampling_ratio({"importance_sampling_ratio": per_token}, shape),
                       per_token.float())


# ---------------------------------------------------------------------------------------------- checkpoint


class _Interrupt(Exception):
    pass


class _StopAt(TrainerCallback):
    """Interrupts training when step ``done + 1`` begins: ``done`` steps finished and logged, none of the next."""

    def __init__(self, done: int) -> None:
        self.done = done

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.done:
            raise _Interrupt


@pytest.mark.parametrize("route", ["training_forward", "extra_pass"])
def test_resume_continues_the_uninterrupted_run_bit_for_bit(route, steps, tmp_path):
    """4 steps with a checkpoint every 2 (A) against a run interrupted after step 3 (its last checkpoint:
    step 2) and resumed from that checkpoint, by a fresh trainer (B) and by the interrupted trainer
    itself, whose controller had already taken step 3 (C): steps 3-4 log the same autopilot metrics,
    monitor metrics and losses, drop the same tokens, and end in the same controller state, exactly."""
    kw = dict(cls=EntropyDiscGRPOTrainer, max_steps=4, max_completion_length=8, save_strategy="steps", save_steps=2,
              **PILOT, **ROUTES[route])
    full = make_trainer(tmp_path / "a", **kw)
    full.train()
    masks_a = [s[3] for s in steps]
    assert len(masks_a) == 4 and sum(int((~m).sum()) for m in masks_a[2:]) > 0
    steps.clear()

    cut = make_trainer(tmp_path / "b", **kw)
    cut.add_callback(_StopAt(3))
    with pytest.raises(_Interrupt):
        cut.train()
    assert len(steps) == 3 and all(torch.equal(a, s[3]) for a, s in zip(masks_a, steps))
    assert cut._entropy_disc_state.autopilot.state_dict()["step"] == 3
    checkpoint = tmp_path / "b" / "checkpoint-2"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved[ed_autopilot.STATE_KEY]["step"] == 2
    steps.clear()

    cut.callback_handler.remove_callback(_StopAt)
    for resumed in (make_trainer(tmp_path / "b", **kw), cut):
        resumed.train(resume_from_checkpoint=str(checkpoint))
        assert len(steps) == 2 and all(torch.equal(a, s[3]) for a, s in zip(masks_a[2:], steps))
        assert _ed_logs(resumed)[-2:] == _ed_logs(full)[-2:]
        assert resumed._entropy_disc_state.autopilot.state_dict() == full._entropy_disc_state.autopilot.state_dict()
        steps.clear()


def test_resume_without_controller_state_is_refused_before_generation(tmp_path, monkeypatch):
    """A checkpoint of a Clip_B run carries no controller state: resuming it with the autopilot fails
    before any generation (and a train() from step 0 starts a fresh controller)."""
    clip = make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, max_steps=2, save_strategy="steps", save_steps=2,
                        entropy_disc_method="clip_b")
    clip.train()
    pilot = make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, max_steps=4, **PILOT)
    calls = []
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=r"resumes at global step 2 .*no 'EntropyDiscAutopilot' entry"):
        pilot.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert not calls


def test_stock_trainer_and_patch_carry_the_state_too(steps, tmp_path):
    """A stock GRPOTrainer given the config (class patch) and an instance patch step and save the
    controller like the subclass."""
    stock = make_trainer(tmp_path / "s", cls=GRPOTrainer, max_steps=2, **RAW)
    stock.train()
    unpatch()
    core = EntropyDiscGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **RAW)
    unpatch()
    inst = patch(make_trainer(tmp_path / "i", cls=GRPOTrainer, config_cls=GRPOConfig, max_steps=2),
                 core.entropy_disc_config())
    inst.train()
    assert len(steps) == 4
    for trainer in (stock, inst):
        assert trainer.state.stateful_callbacks[ed_autopilot.STATE_KEY]["step"] == 2
    assert all(torch.equal(a[3], b[3]) for a, b in zip(steps[:2], steps[2:]))


# ---------------------------------------------------------------------------------------------- law scale


@pytest.fixture
def feeds(monkeypatch):
    """Every pair the adapter offers the law scale: ``(cheap, realised, fed)``."""
    seen = []
    real = LawScale.feed

    def record(self, cheap, realised):
        fed = real(self, cheap, realised)
        seen.append((cheap, realised, fed))
        return fed

    monkeypatch.setattr(LawScale, "feed", record)
    return seen


@pytest.mark.parametrize("route", ["training_forward", "old_pass"])
def test_kappa_is_fed_from_the_same_batch_and_scales_the_logged_prediction(route, steps, feeds, tmp_path):
    """calibrate_every=1: after each batch's update the adapter measures the realised change of that batch's
    tokens (logged as delta_entropy/realised) and feeds (cheap, realised); the controller selects with that
    kappa (a core controller fed the same pairs replays every mask); each logged delta_entropy/predicted is
    kappa times delta_entropy/cheap, and cheap is -eta Cov_B(A, S_c) of the batch's statistics."""
    trainer = make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, max_steps=4, max_completion_length=8,
                           **PILOT, **ROUTES[route])
    trainer.train()
    generations = 4 // trainer.args.steps_per_generation
    assert len(steps) == generations and len(feeds) == generations  # every batch, after its last update
    replay = EntropyAutopilot(3.1, sides="both", max_frac=0.25)
    logs = [h for h in trainer.state.log_history if "entropy_disc/autopilot/target_dh" in h]
    for i, ((stats, adv, _, keep), log) in enumerate(zip(steps, logs)):
        kappa = replay.calibration.scale
        assert log["entropy_disc/delta_entropy/scale"] == kappa
        cheap = batch_entropy_change(adv, stats.s_centered, stats.valid, lr=2.0)
        assert log["entropy_disc/delta_entropy/cheap"] == pytest.approx(cheap, rel=1e-12, abs=1e-15)
        assert log["entropy_disc/delta_entropy/predicted"] == pytest.approx(kappa * log["entropy_disc/delta_entropy/cheap"],
                                                                            rel=1e-12, abs=1e-15)
        assert torch.equal(replay.from_stats(stats, adv, lr=2.0).keep, keep)
        assert feeds[i][0] == pytest.approx(cheap, rel=1e-12, abs=1e-15) and math.isfinite(feeds[i][1])
        if feeds[i][2]:  # a pair that keeps kappa > 0 (the controller's selection needs it) was fed
            replay.calibrate(*feeds[i][:2])
        assert replay.calibration.scale > 0
    realised = [(h["entropy_disc/delta_entropy/realised"], h["entropy_disc/delta_entropy/scale_skipped"])
                for h in trainer.state.log_history if "entropy_disc/delta_entropy/realised" in h]
    assert realised == [(r, float(not fed)) for _, r, fed in feeds] and any(r != 0 for r, _ in realised)
    state = trainer._entropy_disc_state
    assert state.autopilot.state_dict() == replay.state_dict()
    assert state.autopilot.calibration.count == sum(fed for *_, fed in feeds)
    assert trainer.state.stateful_callbacks[ed_autopilot.LAW_KEY] == {"version": 1, "batches": generations,
                                                                      "calibration": None}


def test_kappa_without_the_autopilot_is_saved_and_restored(feeds, tmp_path):
    """Method clip_b, calibrate_every=2: kappa lives in the law scale's own state, written into every
    checkpoint's trainer_state.json and restored on resume (the resumed run logs what the full run logged)."""
    kw = dict(cls=EntropyDiscGRPOTrainer, max_steps=4, max_completion_length=8, save_strategy="steps", save_steps=2,
              entropy_disc_method="clip_b", entropy_disc_mu_low=1.0, entropy_disc_calibrate_every=2)
    full = make_trainer(tmp_path / "a", **kw)
    full.train()
    assert len(feeds) == 2  # batches 1 and 3
    saved = json.loads((tmp_path / "a" / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    law = saved[ed_autopilot.LAW_KEY]
    assert law["batches"] == 2 and law["calibration"]["count"] == 1
    assert law["calibration"]["s_xy"] == feeds[0][0] * feeds[0][1] and all(fed for *_, fed in feeds)
    resumed = make_trainer(tmp_path / "a", **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert _ed_logs(resumed)[-2:] == _ed_logs(full)[-2:]
    assert resumed.state.stateful_callbacks[ed_autopilot.LAW_KEY] == full.state.stateful_callbacks[ed_autopilot.LAW_KEY]


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_the_after_update_pass_reads_the_chosen_rows_and_their_realised_change(share, feeds, monkeypatch, tmp_path):
    """calibrate_share: the after-update pass of a calibration batch reads exactly the rows that
    ``calibration_rows(B, share)`` picks from the generation batch (8 rows: 2, 4 or all 8), and the fed realised
    change equals a float64 recomputation over those rows: the policy after the update in float64, its entropy of
    each completion token at TRL's temperature, minus the entropy the adapter read before the update."""
    from entropy_discriminator.adapters.trl import _patch as trl_patch
    from entropy_discriminator.law_scale import calibration_rows

    generated, passes, real_batch, real_pass = [], [], ed_autopilot.law_batch, trl_patch._extra_pass

    def record_batch(trainer, state, stats, advantages, batch):
        out = real_batch(trainer, state, stats, advantages, batch)
        if state.law_pending is not None:
            generated.append(({k: batch[k].clone() for k in ed_autopilot._PASS_KEYS}, stats.entropy.clone()))
        return out

    def record_pass(trainer, state, batch):  # on this route (the training forward) only calibration calls it
        passes.append((dict(batch), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}))
        return real_pass(trainer, state, batch)

    monkeypatch.setattr(ed_autopilot, "law_batch", record_batch)
    monkeypatch.setattr(trl_patch, "_extra_pass", record_pass)
    trainer = make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, max_steps=2, per_device_train_batch_size=8,
                           entropy_disc_method="clip_b", entropy_disc_mu_low=1.0, entropy_disc_calibrate_every=1,
                           entropy_disc_calibrate_share=share)
    trainer.train()
    assert len(generated) == len(passes) == len(feeds) == 2
    for (full, before), (read, weights), (_, realised, _) in zip(generated, passes, feeds):
        rows = calibration_rows(8, share)
        assert len(rows) == {0.25: 2, 0.5: 4, 1.0: 8}[share]
        assert all(torch.equal(read[k], full[k][rows]) for k in ed_autopilot._PASS_KEYS)
        live = trainer.accelerator.unwrap_model(trainer.model)
        model = type(live)(live.config).double()
        model.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in weights.items()})
        ids = torch.cat([read["prompt_ids"], read["completion_ids"]], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.cat([read["prompt_mask"], read["completion_mask"]], 1)).logits
        p = read["prompt_ids"].size(1)
        after = reference.reference_entropy(logits[:, p - 1 : -1] / trainer.temperature)
        valid = read["completion_mask"].bool()
        expected = float((after - before[rows].double())[valid].mean())
        assert realised == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("value", [0, 1.5, "x"])
def test_a_bad_calibrate_share_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"entropy_disc\.calibrate_share must be"):
        EntropyDiscGRPOConfig(output_dir="/tmp/x", report_to="none", use_cpu=True, entropy_disc_calibrate_share=value)


@pytest.mark.parametrize("value", [-1, "often"])
def test_a_bad_calibrate_every_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"entropy_disc\.calibrate_every must be an integer"):
        EntropyDiscGRPOConfig(output_dir="/tmp/x", report_to="none", use_cpu=True, entropy_disc_calibrate_every=value)


def test_target_above_log_vocab_is_refused_before_generation(tmp_path, monkeypatch):
    """The adapter passes the policy's vocabulary size (24 here) to the controller: a target above log 24 fails
    before any generation, naming the target."""
    calls = []
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, *a, **k: calls.append(1))
    trainer = make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, max_steps=1,
                           **{**PILOT, "entropy_disc_target_entropy": "5.0"})
    with pytest.raises(ValueError, match=r"target_entropy 5 nats is above log\(vocab_size\) = 3\.178"):
        trainer.train()
    assert not calls
