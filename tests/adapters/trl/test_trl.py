"""The TRL adapter against a real CPU install of TRL (nox sessions ``trl-1.14`` and ``trl-1.16``).

A tiny randomly initialised Llama and a word-level tokenizer built in memory
(``examples/trl/tiny.py``, no hub access) train through the real ``GRPOTrainer``.  Nothing of
TRL is stubbed.  The configuration matrix is in ``test_trl_matrix.py``; here: version guard,
config and CLI flags, the entry points (subclass, stock trainer with the config, patch/unpatch),
the loss seam, the monitor and the examples.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
import trl
from _trl_harness import ROOT, make_trainer, tiny
from trl import GRPOConfig, GRPOTrainer, RLOOTrainer, TrlParser

import entropy_discriminator.adapters.trl as ed_trl
import entropy_discriminator.adapters.trl._patch as ed_patch
from entropy_discriminator import EntropyDiscConfig
from entropy_discriminator.adapters.trl import (
    KEEP_KEY,
    EntropyDiscGRPOConfig,
    EntropyDiscGRPOTrainer,
    UnsupportedVersionError,
    is_patched,
    patch,
    unpatch,
)


@pytest.fixture(autouse=True)
def _no_leftover_patch():
    unpatch()
    yield
    unpatch()  # a failed test must not leave GRPOTrainer patched for the next one


def _trainer(tmp_path, cls=EntropyDiscGRPOTrainer, config_cls=EntropyDiscGRPOConfig, trainer_kwargs=None, **kw):
    return make_trainer(tmp_path, cls=cls, config_cls=config_cls, trainer_kwargs=trainer_kwargs,
                        **{"max_steps": 2, "max_completion_length": 8, **kw})


def _ed_logs(trainer) -> list[dict[str, float]]:
    return [{k: v for k, v in h.items() if k.startswith("entropy_disc/")} for h in trainer.state.log_history
            if any(k.startswith("entropy_disc/") for k in h)]


# ---------------------------------------------------------------------------------------------- version


def test_version_guard_names_range_and_reason(monkeypatch, tmp_path):
    assert ed_trl.check_trl_version() == trl.__version__
    for good in ("1.14.0", "1.14.2", "1.15.0", "1.16.0", "1.16.1"):
        assert ed_trl.check_trl_version(good) == good
    for bad in ("1.13.0", "1.14.0rc1", "1.14.0.dev0", "1.17.0", "1.17.0rc1", "2.0.0"):
        with pytest.raises(UnsupportedVersionError, match=r"trl>=1\.14\.0,<1\.17\.0.*private methods"):
            ed_trl.check_trl_version(bad)
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(UnsupportedVersionError, match="1.17.0 is not supported"):
        patch(config=EntropyDiscConfig(method="clip_b"))
    assert not is_patched()
    with pytest.raises(UnsupportedVersionError):
        _trainer(tmp_path)  # the config itself checks
    assert not is_patched()


# ---------------------------------------------------------------------------------------------- config


def test_config_fields_are_cli_flags():
    (args,) = TrlParser((EntropyDiscGRPOConfig,)).parse_args_and_config(args=[
        "--output_dir", "/tmp/x", "--report_to", "none", "--use_cpu", "--entropy_disc_method", "clip_v",
        "--entropy_disc_mu_low", "3.5", "--entropy_disc_mu_high", "inf", "--entropy_disc_sides", "both",
        "--entropy_disc_max_frac", "none", "--entropy_disc_mask_mode", "drop_token",
        "--entropy_disc_chunk_size", "64",
    ])
    cfg = args.entropy_disc_config()
    assert (cfg.method, cfg.mu_low, cfg.mu_high, cfg.sides, cfg.max_frac, cfg.mask_mode, cfg.chunk_size) == (
        "clip_v", 3.5, math.inf, "both", None, "drop_token", 64)
    assert args.entropy_disc_mask_source == "generation"
    assert EntropyDiscGRPOConfig(output_dir="/tmp/x", report_to="none", use_cpu=True, entropy_disc_method="clip_b",
                                 entropy_disc_max_frac="1e-3").entropy_disc_config().max_frac == 1e-3


@pytest.mark.parametrize(("field", "value", "match"), [
    ("entropy_disc_method", "clip_x", "entropy_disc.method"),
    ("entropy_disc_sides", "left", "entropy_disc.sides"),
    ("entropy_disc_max_frac", "lots", "entropy_disc_max_frac"),
    ("entropy_disc_mask_source", "later", "mask_source"),
])
def test_config_rejects_bad_values_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        EntropyDiscGRPOConfig(output_dir="/tmp/x", report_to="none", use_cpu=True, **{field: value})


def test_current_source_refuses_drop_token():
    ed_patch.AdapterState(EntropyDiscConfig(method="clip_v"), "current")  # served: statistics from hidden states
    with pytest.raises(ValueError, match="drop_token"):
        ed_patch.AdapterState(EntropyDiscConfig(method="clip_b", mask_mode="drop_token"), "current")


# ---------------------------------------------------------------------------------------------- training


def test_monitor_entropy_matches_trl_entropy(tmp_path):
    """Same temperature and one-token shift as TRL: on the first step (no update yet, one micro-batch =
    the whole generation batch) our entropy mean equals TRL's own ``entropy`` metric."""
    trainer = _trainer(tmp_path, max_steps=1, temperature=0.6)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "entropy" in h]
    assert log["entropy_disc/entropy/mean"] == pytest.approx(log["entropy"], rel=1e-5)
    assert "entropy_disc/clip/frac" not in log  # method none: monitor only


# ---------------------------------------------------------------------------------------------- loss


def _manual_inputs(vocab: int, *, b=4, p=3, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    cmask = torch.ones(b, t, dtype=torch.long)
    cmask[0, 3:] = 0
    cmask[2, 1:] = 0
    return {
        "prompt_ids": torch.randint(4, vocab, (b, p), generator=g),
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": torch.randint(4, vocab, (b, t), generator=g),
        "completion_mask": cmask,
        "advantages": torch.tensor([1.0, -0.5, 2.0, -1.5]),
        "num_items_in_batch": cmask.sum(),
        KEEP_KEY: torch.rand(b, t, generator=g) > 0.4,
    }


@pytest.mark.parametrize("mode", ["zero_pg", "drop_token"])
def test_keep_mask_acts_on_the_loss_as_documented(mode, tmp_path):
    """bnpo, on-policy (ratio 1), beta 0: per-token loss is -A_t, so
    zero_pg: sum_{valid & keep} -A / n_valid;  drop_token: sum_{valid & keep} -A / n_{valid & keep}."""
    trainer = _trainer(tmp_path, loss_type="bnpo",
                       trainer_kwargs={"entropy_disc": EntropyDiscConfig(method="clip_b", mask_mode=mode)})
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = _manual_inputs(trainer.model.config.vocab_size)
    frozen = {k: v.clone() for k, v in inputs.items()}
    loss = trainer._compute_loss(trainer.model, inputs)
    valid = inputs["completion_mask"].bool()
    kept = valid & inputs[KEEP_KEY]
    pg = -(inputs["advantages"][:, None].expand_as(valid))[kept].sum()
    expected = pg / (valid.sum() if mode == "zero_pg" else kept.sum())
    torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-6)
    assert all(torch.equal(inputs[k], frozen[k]) for k in frozen)  # the buffered batch is never modified
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())


# ---------------------------------------------------------------------------------------------- patching


def test_patch_unpatch_restore_exact_originals(tmp_path):
    names = ed_trl.HOOKED_METHODS
    before = {n: GRPOTrainer.__dict__[n] for n in names}
    assert not is_patched()
    patch(config=EntropyDiscConfig(method="clip_b"))
    patched = {n: GRPOTrainer.__dict__[n] for n in names}
    assert is_patched() and all(patched[n] is not before[n] and patched[n].__wrapped__ is before[n] for n in names)
    patch(config=EntropyDiscConfig(method="clip_v"))  # idempotent: settings replaced, wrappers kept
    assert all(GRPOTrainer.__dict__[n] is patched[n] for n in names)
    assert ed_patch._CLASS_PATCHES[GRPOTrainer].config.method == "clip_v"
    assert unpatch() is True and unpatch() is False
    assert not is_patched() and all(GRPOTrainer.__dict__[n] is before[n] for n in names)

    # Building an EntropyDiscGRPOConfig installs the same wrappers (serving only trainers built with one).
    EntropyDiscGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert is_patched() and not ed_patch._CLASS_PATCHES[GRPOTrainer].explicit
    assert unpatch() and all(GRPOTrainer.__dict__[n] is before[n] for n in names)

    class Sub(GRPOTrainer):
        pass

    patch(Sub)
    assert all(n in Sub.__dict__ for n in names) and not is_patched(GRPOTrainer)
    unpatch(Sub)
    assert all(n not in Sub.__dict__ for n in names)

    trainer = _trainer(tmp_path, cls=GRPOTrainer, config_cls=GRPOConfig)
    patch(trainer, EntropyDiscConfig(method="clip_b"))
    assert is_patched(trainer) and not is_patched(GRPOTrainer)
    assert all(getattr(trainer, n).__func__.__wrapped__ is before[n] for n in names)
    assert unpatch(trainer) and not is_patched(trainer)
    assert all(n not in trainer.__dict__ for n in names) and ed_patch._STATE_ATTR not in trainer.__dict__
    assert all(getattr(type(trainer), n) is before[n] for n in names)


def test_patch_rejects_bad_targets_and_settings(tmp_path):
    with pytest.raises(TypeError, match="sequence-level"):
        patch(RLOOTrainer)
    with pytest.raises(TypeError, match="GRPOTrainer"):
        patch(object)
    with pytest.raises(ValueError, match="mask_source"):
        patch(config=EntropyDiscConfig(method="clip_b"), mask_source="sometimes")
    with pytest.raises(ValueError, match="drop_token"):
        patch(config=EntropyDiscConfig(method="clip_b", mask_mode="drop_token"), mask_source="current")
    with pytest.raises(TypeError, match="already applies"):
        patch(EntropyDiscGRPOTrainer)
    assert not is_patched()
    trainer = _trainer(tmp_path)
    with pytest.raises(TypeError, match="already applies"):
        patch(trainer)


CLIP_ARGS = dict(entropy_disc_method="clip_b", entropy_disc_mu_low=0.5, entropy_disc_sides="both")


@pytest.fixture(scope="module")
def subclass_run(tmp_path_factory):
    """One EntropyDiscGRPOTrainer run with CLIP_ARGS: what every entry point must reproduce."""
    unpatch()
    ref = _trainer(tmp_path_factory.mktemp("ref"), **CLIP_ARGS)
    ref.train()
    unpatch()
    return ref


@pytest.mark.parametrize("how", ["stock_trainer_given_the_config", "patch_without_config_takes_args",
                                 "class_patch", "instance_patch", "subclass_under_class_patch"])
def test_every_entry_point_behaves_like_the_subclass(how, subclass_run, tmp_path):
    """A stock GRPOTrainer given EntropyDiscGRPOConfig(clip_b) without patch() clips;
    patch() with no config takes the args' clip_b.  Every entry point logs the same metrics and losses
    as EntropyDiscGRPOTrainer (whose masks test_trl_matrix.py checks)."""
    ref = subclass_run
    core = EntropyDiscConfig(method="clip_b", mu_low=0.5, sides="both")
    if how == "stock_trainer_given_the_config":
        unpatch()  # the config built below installs the wrappers again
        trainer = _trainer(tmp_path / "t", cls=GRPOTrainer, **CLIP_ARGS)
    elif how == "patch_without_config_takes_args":
        patch()
        trainer = _trainer(tmp_path / "t", cls=GRPOTrainer, **CLIP_ARGS)
    elif how == "class_patch":
        patch(config=core)
        trainer = _trainer(tmp_path / "t", cls=GRPOTrainer, config_cls=GRPOConfig)
    elif how == "instance_patch":
        trainer = patch(_trainer(tmp_path / "t", cls=GRPOTrainer, config_cls=GRPOConfig), core)
    else:  # nested wrappers must act once
        patch(config=core)
        trainer = _trainer(tmp_path / "t", **CLIP_ARGS)
    trainer.train()
    expected, got = _ed_logs(ref), _ed_logs(trainer)
    assert len(expected) == 2 and expected[0]["entropy_disc/clip/n_clipped"] > 0
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), k
    losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(losses, rel=1e-6)


def test_patch_without_config_monitors_a_plain_config(tmp_path):
    patch()
    trainer = _trainer(tmp_path, cls=GRPOTrainer, config_cls=GRPOConfig, max_steps=1)
    trainer.train()
    (log,) = _ed_logs(trainer)
    assert "entropy_disc/entropy/mean" in log and "entropy_disc/clip/frac" not in log


def test_patch_config_conflicting_with_the_args_is_refused_before_generation(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, *a, **k: calls.append(1))
    patch(config=EntropyDiscConfig(method="clip_v"))
    trainer = _trainer(tmp_path, cls=GRPOTrainer, **CLIP_ARGS)
    with pytest.raises(ValueError, match="give the settings in one place"):
        trainer.train()
    assert not calls
    unpatch()
    with pytest.raises(ValueError, match="give the settings in one place"):
        patch(_trainer(tmp_path / "instance", cls=GRPOTrainer, **CLIP_ARGS), EntropyDiscConfig(method="clip_v"))


def test_refused_configuration_stops_a_stock_trainer_before_generation(tmp_path, monkeypatch):
    """A stock GRPOTrainer given EntropyDiscGRPOConfig(clip_b) with a setting zero_pg cannot serve
    fails on its first step, before generating anything."""
    calls = []
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, *a, **k: calls.append(1))
    trainer = _trainer(tmp_path, cls=GRPOTrainer, entropy_coef=0.01, **CLIP_ARGS)
    with pytest.raises(ValueError, match="entropy bonus"):
        trainer.train()
    assert not calls


# ---------------------------------------------------------------------------------------------- example


def _example():
    spec = importlib.util.spec_from_file_location("ed_trl_example", ROOT / "examples" / "trl" / "grpo_entropy_disc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_example_accuracy_reward_reads_the_final_number():
    ex = _example()
    completions = [[{"role": "assistant", "content": "3 + 4 = 7 apples\n#### 7"}],
                   [{"role": "assistant", "content": "She pays 1,250 dollars in total."}],
                   [{"role": "assistant", "content": "#### 12.5"}],
                   [{"role": "assistant", "content": "no idea"}]]
    assert ex.accuracy_reward(completions, answer=["7", "1250", "12", "3"]) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("extra", [
    ["--entropy_disc_method", "clip_b"],
    ["--entropy_disc_method", "clip_v", "--use_patch", "--entropy_disc_max_frac", "none"],
])
def test_example_script_runs_its_tiny_path(extra, tmp_path):
    summary = _example().main([
        "--tiny", "--use_cpu", "--output_dir", str(tmp_path), "--max_steps", "1", "--max_completion_length", "8",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--gradient_accumulation_steps", "1",
        "--tiny_hidden", "32", "--entropy_disc_mu_low", "0.5", "--summary_json", str(tmp_path / "s.json"), *extra,
    ])
    unpatch()
    last = summary["last"]
    assert last["entropy_disc/tokens/valid"] > 0 and 0 < last["entropy_disc/clip/frac"] < 1
    assert last["entropy_disc/entropy/mean"] == pytest.approx(last["entropy"], rel=1e-4)
    assert (tmp_path / "s.json").exists()


def test_trl_grpo_script_wrapper_patches_the_stock_trainer(monkeypatch, tmp_path):
    """examples/trl/trl_grpo_cli.py: TRL's own grpo script (local model dir, local json dataset,
    dotted-path reward) trains a stock GRPOTrainer that logs entropy_disc/ metrics and clips."""
    tok = tiny.tiny_tokenizer()
    tiny.tiny_model(tok).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    tiny.tiny_dataset(16).to_json(str(tmp_path / "data" / "train.jsonl"))
    (tmp_path / "tiny_reward.py").write_text((ROOT / "examples" / "trl" / "tiny.py").read_text())
    monkeypatch.chdir(tmp_path)  # trl's script imports dotted reward paths from the working directory
    logged = []
    real_log = GRPOTrainer.log

    def spy_log(self, logs, *args, **kwargs):
        real_log(self, logs, *args, **kwargs)  # merges self._metrics into logs
        logged.append(dict(logs))

    monkeypatch.setattr(GRPOTrainer, "log", spy_log)
    spec = importlib.util.spec_from_file_location("ed_trl_cli", ROOT / "examples" / "trl" / "trl_grpo_cli.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    cli.main([
        "--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "data"),
        "--reward_funcs", "tiny_reward.digit_reward", "--output_dir", str(tmp_path / "out"), "--use_cpu",
        "--report_to", "none", "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "8", "--save_strategy", "no", "--dtype", "float32", "--bf16", "False",
        "--entropy_disc_method", "clip_b", "--entropy_disc_mu_low", "0.5", "--entropy_disc_sides", "both",
    ])
    assert not is_patched()
    step = next(h for h in logged if "entropy_disc/clip/frac" in h)
    assert 0 < step["entropy_disc/clip/frac"] < 1
    assert step["entropy_disc/entropy/mean"] == pytest.approx(step["entropy"], rel=1e-4)
