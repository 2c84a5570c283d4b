"""Configuration matrix against the real TRL ``GRPOTrainer`` (the installed release, 1.14 or 1.16).

Every loss type x (steps_per_generation, num_iterations, gradient_accumulation_steps) schedule
trains the tiny model for one generation batch (all its micro-steps and iterations).  Each case
asserts, against an independent float64 recomputation (``_trl_harness.reference_keep``: full
logits of the generating policy's weights in float64, ``tests/reference.py``):

* the mask TRL's loss receives: ``advantages == A * keep`` (zero_pg) or ``tool_mask == keep`` and
  ``num_items_in_batch ==`` the global kept-token count (drop_token), exactly, in every micro-batch
  and iteration;
* the gradient: d loss / d log p_t of TRL's own current-policy log-probs is exactly 0.0 at every
  clipped token (the only way a token reaches the parameters in these runs: no KL term, no entropy
  bonus, so a clipped token contributes exactly zero parameter gradient), and nonzero at kept ones;
* the route the adapter took (TRL's old-policy pass, the training forward, or one extra pass);
* (loss level, off-policy ratios) the zero_pg parameter update equals TRL's stock update with the
  clipped tokens' contributions removed.

Settings the adapter cannot serve exactly are refused before any generation, with their message.
"""

from __future__ import annotations

import pytest
import torch
from _trl_harness import Probe, make_trainer, reference_keep, row_key, tiny
from trl import GRPOConfig, GRPOTrainer

from entropy_discriminator import EntropyDiscConfig
from entropy_discriminator.adapters.trl import KEEP_KEY, LOSS_TYPES, EntropyDiscGRPOTrainer, patch, unpatch

#: name: (steps_per_generation, num_iterations, gradient_accumulation_steps, optimiser steps, route)
SCHEDULES = {
    "spg1-it1-ga1": (1, 1, 1, 1, "training_forward"),
    "spg1-it2-ga1": (1, 2, 1, 2, "old_pass"),
    "spg2-it1-ga2": (2, 1, 2, 1, "extra_pass"),
    "spg2-it2-ga2": (2, 2, 2, 2, "old_pass"),
}
#: Extra gradient-accumulation schedules (one loss type each).
GA_SCHEDULES = {
    "spg1-it2-ga2": (1, 2, 2, 1, "training_forward"),  # no old pass; the cached mask serves iteration 2
    "spg2-it1-ga1": (2, 1, 1, 2, "old_pass"),
}
MU, SIDES = 0.5, "both"


@pytest.fixture(autouse=True)
def _no_leftover_patch():
    yield
    unpatch(Probe)
    unpatch()


def _loss_settings(loss_type: str) -> tuple[dict, str]:
    """TRL settings each loss type needs, and the mask mode it is served with (luspo requires the
    sequence-level ratio, under which zero_pg is refused: see test_zero_pg_refusals)."""
    if loss_type == "luspo":
        return {"importance_sampling_level": "sequence"}, "drop_token"
    return {}, "zero_pg"


def _run_case(tmp_path, loss_type, schedule, method, mask_mode, extra=None):
    spg, iters, ga, steps, route = schedule
    cfg = EntropyDiscConfig(method=method, mu_low=MU, sides=SIDES, max_frac=None, mask_mode=mask_mode)
    patch(Probe, cfg)
    trainer = make_trainer(tmp_path, cls=Probe, config_cls=GRPOConfig, loss_type=loss_type, steps_per_generation=spg,
                           num_iterations=iters, gradient_accumulation_steps=ga, max_steps=steps, temperature=0.7,
                           **(extra or {}))
    trainer.train()
    state = trainer.__dict__["_entropy_disc_class_state"][1]
    # drop_token needs the mask before the loss mask is built: never the training-forward route
    assert state.plan.route == ("extra_pass" if route == "training_forward" and mask_mode == "drop_token" else route)
    (weights, batch), = trainer.probe_generations  # one generation batch, used by every micro-step
    keep = reference_keep(trainer, weights, batch, method=method, mu_low=MU, mu_high=float("inf"), sides=SIDES,
                          max_frac=None)
    rows = {row_key(batch, i): i for i in range(batch["completion_ids"].size(0))}
    valid = batch["completion_mask"].bool()
    n_clipped = int((valid & ~keep & (batch["advantages"][:, None] != 0)).sum())
    assert n_clipped > 0 and bool((valid & keep).any())  # the case can fail

    assert len(trainer.probe_losses) == spg * iters
    kept_grads = 0
    for inputs, logps in trainer.probe_losses:
        idx = torch.tensor([rows[row_key(inputs, i)] for i in range(inputs["completion_ids"].size(0))])
        k, a, v = keep[idx], batch["advantages"][idx], valid[idx]
        if mask_mode == "zero_pg":
            assert torch.equal(inputs["advantages"], a[:, None] * k)
        else:
            assert torch.equal(inputs["tool_mask"].bool(), k) and torch.equal(inputs["advantages"], a)
            assert int(inputs["num_items_in_batch"]) == int((valid & keep).sum())
        grad = logps.grad
        assert grad is not None
        assert torch.all(grad[v & ~k] == 0.0)
        kept_grads += int((grad[v & k & (a[:, None] != 0)] != 0).sum())
    assert kept_grads > 0


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_and_schedule_is_exact(loss_type, schedule, tmp_path):
    extra, mask_mode = _loss_settings(loss_type)
    method = "clip_b" if (LOSS_TYPES.index(loss_type) + list(SCHEDULES).index(schedule)) % 2 == 0 else "clip_v"
    _run_case(tmp_path, loss_type, SCHEDULES[schedule], method, mask_mode, extra)


@pytest.mark.parametrize("schedule", list(GA_SCHEDULES))
def test_gradient_accumulation_schedules_are_exact(schedule, tmp_path):
    _run_case(tmp_path, "bnpo", GA_SCHEDULES[schedule], "clip_v", "zero_pg")


@pytest.mark.parametrize("schedule", ["spg1-it1-ga1", "spg2-it1-ga2"])
def test_drop_token_is_exact(schedule, tmp_path):
    """drop_token with the dapo normaliser: never the training-forward route (the loss mask is
    built before the forward), so one extra pass when TRL runs none."""
    spg, iters, ga, steps, _ = SCHEDULES[schedule]
    _run_case(tmp_path, "dapo", (spg, iters, ga, steps, "extra_pass"), "clip_b", "drop_token")


@pytest.mark.parametrize(("settings", "message"), [
    ({"beta": 0.04}, r"beta=0\.04"),
    ({"entropy_coef": 0.01}, "entropy bonus"),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, "importance_sampling_level='sequence'"),
    ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, "importance_sampling_level='sequence'"),
])
def test_zero_pg_refusals(settings, message, tmp_path):
    """zero_pg cannot silence a clipped token where another loss term reaches it: refused when the
    trainer is built, naming the setting; drop_token serves the same settings."""
    tok = tiny.tiny_tokenizer()
    tiny.tiny_model(tok).save_pretrained(tmp_path / "model")  # beta > 0: TRL loads a reference copy by path
    model = str(tmp_path / "model")
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, model=model, entropy_disc_method="clip_b", **settings)
    for ok in ({"entropy_disc_method": "clip_b", "entropy_disc_mask_mode": "drop_token"},
               {"entropy_disc_method": "none"}):  # monitor only
        trainer = make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, model=model, **ok, **settings)
        assert trainer.__dict__["_entropy_disc_state"].plan.route == "training_forward" or ok["entropy_disc_method"] != "none"


def test_logit_transform_models_are_refused(tmp_path):
    model = make_trainer(tmp_path, max_steps=1).model
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        make_trainer(tmp_path, cls=EntropyDiscGRPOTrainer, model=model, entropy_disc_method="clip_v")


def test_current_policy_source_per_micro_batch(tmp_path):
    """mask_source='current': each micro-batch's own mask from the current policy (Clip_V too)."""
    cfg = EntropyDiscConfig(method="clip_v", mu_low=MU, sides=SIDES, max_frac=None)
    patch(Probe, cfg, mask_source="current")
    trainer = make_trainer(tmp_path, cls=Probe, config_cls=GRPOConfig, steps_per_generation=2,
                           gradient_accumulation_steps=1, max_steps=2, loss_type="dapo")
    trainer.train()
    (_, batch), = trainer.probe_generations
    rows = {row_key(batch, i): i for i in range(batch["completion_ids"].size(0))}
    clipped = 0
    for step, (inputs, logps) in enumerate(trainer.probe_losses):
        sub = {k: inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        idx = torch.tensor([rows[row_key(inputs, i)] for i in range(inputs["completion_ids"].size(0))])
        sub["advantages"] = batch["advantages"][idx]
        weights = trainer.probe_weights_before_loss[step]
        keep = reference_keep(trainer, weights, sub, method="clip_v", mu_low=MU, mu_high=float("inf"), sides=SIDES,
                              max_frac=None)
        assert torch.equal(inputs["advantages"], sub["advantages"][:, None] * keep)
        assert torch.all(logps.grad[sub["completion_mask"].bool() & ~keep] == 0.0)
        clipped += int((~keep).sum())
    assert clipped > 0


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "luspo"])
def test_zero_pg_update_is_the_stock_update_without_the_clipped_tokens(loss_type, tmp_path):
    """Parameter gradient, off-policy (old log-probs perturbed, so ratios and their clipping act):
    the adapter's zero_pg update equals TRL's stock update with the clipped tokens' contributions
    removed, i.e. backpropagating the stock per-token gradient d loss / d log p_t times keep_t."""
    patch(Probe, EntropyDiscConfig(method="clip_b", mask_mode="zero_pg"))
    trainer = make_trainer(tmp_path, cls=Probe, config_cls=GRPOConfig, loss_type=loss_type)
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(3)
    vocab, b, p, t = model.config.vocab_size, 4, 3, 5
    cmask = torch.ones(b, t, dtype=torch.long)
    cmask[0, 3:] = 0
    inputs = {"prompt_ids": torch.randint(4, vocab, (b, p), generator=g),
              "prompt_mask": torch.ones(b, p, dtype=torch.long),
              "completion_ids": torch.randint(4, vocab, (b, t), generator=g), "completion_mask": cmask,
              "advantages": torch.tensor([1.0, -0.5, 2.0, -1.5]), "num_items_in_batch": cmask.sum()}
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        current, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, ids, torch.cat([inputs["prompt_mask"], cmask], 1), t)
    inputs["old_per_token_logps"] = current + 0.3 * torch.randn(b, t, generator=g)
    keep = torch.rand(b, t, generator=g) > 0.4

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [q.grad.clone() for q in model.parameters() if q.grad is not None]

    patched = grads(trainer._compute_loss(model, {**inputs, KEEP_KEY: keep}))
    unpatch(Probe)
    stock_loss = trainer._compute_loss(model, dict(inputs))
    logps = trainer.probe_logps
    per_token = torch.autograd.grad(stock_loss, logps, retain_graph=True)[0]
    assert bool((per_token[cmask.bool() & ~keep] != 0).any())  # the clipped tokens would have contributed
    model.zero_grad()
    logps.backward(per_token * keep)
    expected = [q.grad.clone() for q in model.parameters() if q.grad is not None]
    assert len(patched) == len(expected)
    for got, want in zip(patched, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
