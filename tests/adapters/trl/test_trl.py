"""The TRL 1.16 adapter against a real CPU install of TRL (nox session ``trl``).

A tiny randomly initialised Llama and a word-level tokenizer built in memory
(``examples/trl/tiny.py``, no hub access) train through the real ``GRPOTrainer``.  Nothing of
TRL is stubbed.  Outside the ``trl`` session (where TRL is not installed) the module is skipped at
collection; with ``ED_REQUIRE_TRL=1`` (set by the session) a missing TRL is an error.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import sys

import pytest
import torch

if os.environ.get("ED_REQUIRE_TRL"):
    import trl
else:
    trl = pytest.importorskip("trl", reason="TRL is installed only in the nox 'trl' session")

from trl import GRPOConfig, GRPOTrainer, RLOOTrainer, TrlParser  # noqa: E402

import entropy_discriminator.adapters.trl._hooks as hooks  # noqa: E402
import entropy_discriminator.adapters.trl as ed_trl  # noqa: E402
from entropy_discriminator import (  # noqa: E402
    EntropyDiscConfig,
    clip_b_mask,
    clip_v_mask,
    discriminator_score,
    token_stats,
)
from entropy_discriminator.adapters.trl import (  # noqa: E402
    KEEP_KEY,
    EntropyDiscGRPOConfig,
    EntropyDiscGRPOTrainer,
    UnsupportedVersionError,
    is_patched,
    patch,
    unpatch,
)

ROOT = pathlib.Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("ed_trl_tiny", ROOT / "examples" / "trl" / "tiny.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

BASE = dict(
    max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
    report_to="none", use_cpu=True, save_strategy="no", learning_rate=1e-2, disable_dropout=True, seed=0,
)


@pytest.fixture(autouse=True)
def _no_leftover_patch():
    yield
    unpatch()  # a failed test must not leave GRPOTrainer patched for the next one


def _trainer(tmp_path, cls=EntropyDiscGRPOTrainer, config_cls=EntropyDiscGRPOConfig, trainer_kwargs=None, **kw):
    tok = tiny.tiny_tokenizer()
    args = config_cls(output_dir=str(tmp_path), **{**BASE, **kw})
    return cls(model=tiny.tiny_model(tok), reward_funcs=tiny.digit_reward, args=args,
               train_dataset=tiny.tiny_dataset(), processing_class=tok, **(trainer_kwargs or {}))


def _ed_logs(trainer) -> list[dict[str, float]]:
    return [{k: v for k, v in h.items() if k.startswith("entropy_disc/")} for h in trainer.state.log_history
            if any(k.startswith("entropy_disc/") for k in h)]


def _reference_stats(trainer, batch):
    """token_stats on the full (not logits_to_keep) forward, shifted by hand."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    p = batch["prompt_ids"].size(1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=att).logits
    labels = batch["completion_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return token_stats(logits[:, p - 1 : -1], labels, temperature=trainer.args.temperature, impl="torch")


# ---------------------------------------------------------------------------------------------- version


def test_version_guard_names_range_and_reason(monkeypatch, tmp_path):
    assert ed_trl.check_trl_version() == trl.__version__ == "1.16.0"
    for bad in ("1.15.2", "1.17.0", "2.0.0"):
        with pytest.raises(UnsupportedVersionError, match=r"trl>=1\.16\.0,<1\.17\.0.*private methods"):
            ed_trl.check_trl_version(bad)
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(UnsupportedVersionError, match="1.17.0 is not supported"):
        patch(config=EntropyDiscConfig(method="clip_b"))
    assert not is_patched()
    with pytest.raises(UnsupportedVersionError):
        _trainer(tmp_path)


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
    assert EntropyDiscGRPOConfig(output_dir="/tmp/x", report_to="none", use_cpu=True,
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


def test_current_source_refuses_what_its_seam_cannot_serve():
    with pytest.raises(ValueError, match="'clip_b' only"):
        hooks.AdapterState(EntropyDiscConfig(method="clip_v"), "current")
    with pytest.raises(ValueError, match="drop_token"):
        hooks.AdapterState(EntropyDiscConfig(method="clip_b", mask_mode="drop_token"), "current")


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("method", ["clip_b", "clip_v"])
def test_train_mask_fixed_over_iterations_and_accumulation(method, monkeypatch, tmp_path):
    """num_iterations=2, gradient_accumulation_steps=2: one generation batch, four loss calls,
    each sees A * keep with keep = the core mask of the generating policy, never recomputed."""
    generations, losses = [], []
    real_gen, real_loss = ed_trl.after_generation, ed_trl.loss_inputs

    def spy_gen(trainer, state, batch):
        ref = _reference_stats(trainer, batch)
        mine = hooks.policy_token_stats(trainer, batch, chunk_size=None, impl="torch")
        out = real_gen(trainer, state, batch)
        generations.append((batch, out, ref, mine))
        return out

    def spy_loss(state, trainer, inputs):
        out = real_loss(state, trainer, inputs)
        losses.append((inputs, out))
        return out

    monkeypatch.setattr(ed_trl, "after_generation", spy_gen)
    monkeypatch.setattr(ed_trl, "loss_inputs", spy_loss)
    trainer = _trainer(tmp_path, gradient_accumulation_steps=2, num_iterations=2, temperature=0.7,
                       entropy_disc_method=method, entropy_disc_mu_low=0.5, entropy_disc_sides="both",
                       entropy_disc_max_frac="none")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))

    assert len(generations) == 1 and len(losses) == 4
    batch, out, ref, mine = generations[0]
    # The mask is the core function's on the same tensors (full forward, temperature 0.7).
    scores = ref.s_star if method == "clip_b" else ref.s_centered
    fn = clip_b_mask if method == "clip_b" else clip_v_mask
    expected = fn(scores, batch["advantages"], ref.valid, mu_low=0.5, sides="both", max_frac=None)
    assert torch.equal(out[KEEP_KEY], expected.keep)
    assert 0 < expected.n_clipped < expected.n_valid
    # The adapter's statistics agree with TRL's own fused-head log-probs of the same policy.
    valid = batch["completion_mask"].bool()
    assert "old_per_token_logps" in batch  # num_iterations > 1 makes TRL score the batch itself
    torch.testing.assert_close(mine.logp[valid], batch["old_per_token_logps"][valid], atol=2e-5, rtol=0)

    # Four loss calls = two buffered slices, each used on both iterations, never modified.
    slices = [inputs for inputs, _ in losses]
    assert slices[0] is slices[2] and slices[1] is slices[3] and slices[0] is not slices[1]
    rows = {}
    for i in range(batch["completion_ids"].size(0)):
        key = (tuple(batch["prompt_ids"][i].tolist()), tuple(batch["completion_ids"][i].tolist()))
        rows[key] = out[KEEP_KEY][i]
    for inputs, passed in losses:
        assert KEEP_KEY not in passed and KEEP_KEY in inputs and inputs["advantages"].dim() == 1
        for i in range(inputs["completion_ids"].size(0)):
            key = (tuple(inputs["prompt_ids"][i].tolist()), tuple(inputs["completion_ids"][i].tolist()))
            assert torch.equal(inputs[KEEP_KEY][i], rows[key])
        torch.testing.assert_close(passed["advantages"], inputs["advantages"][:, None] * inputs[KEEP_KEY])

    logs = _ed_logs(trainer)
    assert len(logs) == 1  # one generation batch -> one set of metrics
    assert logs[0]["entropy_disc/clip/n_clipped"] == expected.n_clipped
    assert logs[0]["entropy_disc/entropy/mean"] == pytest.approx(ref.entropy[ref.valid].double().mean().item(),
                                                                 rel=1e-5)


def test_monitor_entropy_matches_trl_entropy(tmp_path):
    """Same temperature and one-token shift as TRL: on the first step (no update yet, one micro-batch =
    the whole generation batch) our entropy mean equals TRL's own ``entropy`` metric."""
    trainer = _trainer(tmp_path, max_steps=1, temperature=0.6)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "entropy" in h]
    assert log["entropy_disc/entropy/mean"] == pytest.approx(log["entropy"], rel=1e-5)
    assert "entropy_disc/clip/frac" not in log  # method none: monitor only


def test_current_policy_clip_b_per_micro_batch(monkeypatch, tmp_path):
    seen = []
    real = ed_trl.current_policy_mask

    def spy(trainer, state, logps, entropies):
        inputs = state.pending
        adv = inputs["advantages"]
        real(trainer, state, logps, entropies)
        seen.append((adv, logps.detach().clone(), entropies.detach().clone(), hooks.loss_mask(inputs),
                     inputs["advantages"]))

    monkeypatch.setattr(ed_trl, "current_policy_mask", spy)
    trainer = _trainer(tmp_path, gradient_accumulation_steps=2, entropy_disc_method="clip_b",
                       entropy_disc_mask_source="current", entropy_disc_mu_low=0.5, entropy_disc_sides="both")
    trainer.train()
    assert len(seen) == 4  # 2 optimiser steps x 2 micro-batches
    n_clipped = 0
    for adv, logps, ent, valid, written in seen:
        ref = clip_b_mask(discriminator_score(logps, ent), adv, valid, mu_low=0.5, sides="both")
        torch.testing.assert_close(written, adv[:, None] * ref.keep)
        n_clipped += ref.n_clipped
    assert n_clipped > 0
    assert all("entropy_disc/clip/frac" in log for log in _ed_logs(trainer))


def test_drop_token_shrinks_loss_mask_and_normaliser(monkeypatch, tmp_path):
    outs = []
    real = ed_trl.after_generation
    monkeypatch.setattr(ed_trl, "after_generation", lambda t, s, b: outs.append(real(t, s, b)) or outs[-1])
    trainer = _trainer(tmp_path, loss_type="dapo", entropy_disc_method="clip_b", entropy_disc_mu_low=0.5,
                       entropy_disc_sides="both", entropy_disc_mask_mode="drop_token")
    trainer.train()
    for out in outs:
        kept = (out["completion_mask"].bool() & out[KEEP_KEY]).sum()
        assert out["num_items_in_batch"] == kept < out["completion_mask"].sum()


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
    assert ed_trl._CLASS_PATCHES[GRPOTrainer].config.method == "clip_v"
    assert unpatch() is True and unpatch() is False
    assert not is_patched() and all(GRPOTrainer.__dict__[n] is before[n] for n in names)

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
    assert all(n not in trainer.__dict__ for n in names) and ed_trl._STATE_ATTR not in trainer.__dict__
    assert all(getattr(type(trainer), n) is before[n] for n in names)


def test_patch_rejects_bad_targets_and_settings(tmp_path):
    with pytest.raises(TypeError, match="sequence-level"):
        patch(RLOOTrainer)
    with pytest.raises(TypeError, match="GRPOTrainer"):
        patch(object)
    with pytest.raises(ValueError, match="mask_source"):
        patch(config=EntropyDiscConfig(method="clip_b"), mask_source="sometimes")
    with pytest.raises(ValueError, match="'clip_b' only"):
        patch(config=EntropyDiscConfig(method="clip_v"), mask_source="current")
    assert not is_patched()
    trainer = _trainer(tmp_path)
    with pytest.raises(TypeError, match="already applies"):
        patch(trainer)


@pytest.mark.parametrize("how", ["class_patch", "instance_patch", "subclass_under_class_patch"])
def test_patched_stock_trainer_behaves_like_the_subclass(how, tmp_path):
    cfg = dict(entropy_disc_method="clip_b", entropy_disc_mu_low=0.5, entropy_disc_sides="both")
    ref = _trainer(tmp_path / "ref", **cfg)
    ref.train()
    core = EntropyDiscConfig(method="clip_b", mu_low=0.5, sides="both")
    if how == "class_patch":
        patch(config=core)
        trainer = _trainer(tmp_path / "t", cls=GRPOTrainer, config_cls=GRPOConfig)
    elif how == "instance_patch":
        trainer = patch(_trainer(tmp_path / "t", cls=GRPOTrainer, config_cls=GRPOConfig), core)
    else:  # nested wrappers must act once
        patch(config=core)
        trainer = _trainer(tmp_path / "t", **cfg)
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
        "--max_completion_length", "8", "--save_strategy", "no", "--dtype", "float32",
        "--entropy_disc_method", "clip_b", "--entropy_disc_mu_low", "0.5", "--entropy_disc_sides", "both",
    ])
    assert not is_patched()
    step = next(h for h in logged if "entropy_disc/clip/frac" in h)
    assert 0 < step["entropy_disc/clip/frac"] < 1
    assert step["entropy_disc/entropy/mean"] == pytest.approx(step["entropy"], rel=1e-4)
