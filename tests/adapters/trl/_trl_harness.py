"""Shared pieces of the TRL adapter tests: the tiny local model, a probing trainer class and an
independent float64 recomputation of the mask.

Imported by the test modules of this folder (pytest puts the folder on ``sys.path``).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import pathlib

import pytest
import torch

if os.environ.get("ED_REQUIRE_TRL"):
    import trl  # noqa: F401
else:
    pytest.importorskip("trl", reason="TRL is installed only in the nox 'trl' sessions")

from trl import GRPOTrainer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny = _load("ed_trl_tiny", ROOT / "examples" / "trl" / "tiny.py")
reference = _load("ed_reference", ROOT / "tests" / "reference.py")

BASE = dict(
    max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=6, logging_steps=1,
    report_to="none", use_cpu=True, bf16=False, save_strategy="no", learning_rate=1e-2, disable_dropout=True, seed=0,
)


class Probe(GRPOTrainer):
    """Records what the adapter hands to TRL: each generation batch as TRL produced it with the
    policy's weights at that moment, and each ``_compute_loss`` call's inputs (as TRL's loss
    reads them, after the adapter) with its current-policy log-probs (grad retained).

    Used under ``patch(Probe, ...)``, so the adapter's wrappers sit outside these methods."""

    def _generate_and_score_completions(self, inputs):
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        out = super()._generate_and_score_completions(inputs)
        self.__dict__.setdefault("probe_generations", []).append((weights, out))
        return out

    def _compute_loss(self, model, inputs):
        self.__dict__["probe_logps"] = None
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.__dict__.setdefault("probe_weights_before_loss", []).append(weights)
        loss = super()._compute_loss(model, inputs)
        self.__dict__.setdefault("probe_losses", []).append((inputs, self.__dict__["probe_logps"]))
        return loss

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if torch.is_grad_enabled() and out[0].requires_grad:
            out[0].retain_grad()
            self.__dict__["probe_logps"] = out[0]
        return out


def make_trainer(tmp_path, cls=GRPOTrainer, config_cls=None, model=None, trainer_kwargs=None, **kw):
    """A trainer over the tiny model, prompts and reward; ``kw`` overrides :data:`BASE`."""
    from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig

    tok = tiny.tiny_tokenizer()
    args = (config_cls or EntropyDiscGRPOConfig)(output_dir=str(tmp_path), **{**BASE, **kw})
    return cls(model=model if model is not None else tiny.tiny_model(tok), reward_funcs=tiny.digit_reward,
               args=args, train_dataset=tiny.tiny_dataset(), processing_class=tok, **(trainer_kwargs or {}))


def reference_keep(trainer, weights, batch, *, method, mu_low, mu_high, sides, max_frac) -> torch.Tensor:
    """The (B, T) keep-mask recomputed independently: the policy with ``weights`` in float64, a full
    forward (all logits), the one-token shift by hand, ``tests/reference.py``'s statistics
    (TRL's temperature) and its plain-Python Clip_B / Clip_V over the batch's valid tokens."""
    live = trainer.accelerator.unwrap_model(trainer.model)
    model = type(live)(copy.deepcopy(live.config)).double()  # a fresh model: TRL patched the live one's forward
    model.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in weights.items()})
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    p = batch["prompt_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits
    valid = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        valid &= batch["tool_mask"].bool()
    labels = batch["completion_ids"].masked_fill(~valid, -100)
    stats = reference.reference_token_stats(logits[:, p - 1 : -1], labels, temperature=trainer.temperature)
    score = stats["s_star"] if method == "clip_b" else stats["s_centered"]
    adv = batch["advantages"][:, None].expand_as(valid)
    keep = reference.reference_outlier_keep(
        score.flatten().tolist(), adv.flatten().tolist(), valid.flatten().tolist(), recentre=method == "clip_b",
        mu_low=mu_low, mu_high=mu_high, sides=sides, max_frac=max_frac)
    return torch.tensor(keep).reshape(valid.shape)


def row_key(batch, i: int) -> tuple:
    return tuple(batch["prompt_ids"][i].tolist()), tuple(batch["completion_ids"][i].tolist())
