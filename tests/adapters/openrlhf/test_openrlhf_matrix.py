"""Configuration matrix: OpenRLHF's real training round with the adapter, against a float64 recomputation.

Each exact case builds a rollout batch of 3 prompts x 2 samples, computes advantages with OpenRLHF's
own ``RemoteExperienceMaker.compute_advantages_and_returns`` (the estimator under test), fills
OpenRLHF's ``NaiveReplayBuffer`` and runs the patched, real ``ActorPPOTrainer.ppo_train`` (real
``Actor.forward`` with or without packing, real ``PolicyLoss``, one micro-batch holding the whole
buffer, one epoch). The stand-in strategy records the parameter gradient instead of stepping.
Independently, a float64 copy of the model scores every sample unpacked; from it the test derives

* the keep-mask, with ``tests/reference.py``'s plain-Python Clip_B / Clip_V rule on the float64
  S* / S_c and the estimator's advantages; it must equal the adapter's (tokens within 1e-6 std of a
  threshold, where fp32 may fall either side, are left out of the comparison);
* the parameter gradient of the masked PPO loss written out per token (ratio, clip, token mean
  over the valid tokens for ``zero_pg``, over the kept tokens for ``drop_token``); it must equal
  OpenRLHF's within fp32 accuracy;
* and, directly, that no clipped token gets any gradient: the gradient reaching the LM head's input
  at the position that predicts a clipped token is exactly zero (kept tokens' is not).

Variants outside plain PPO (GSPO, dual clip, KL loss, entropy bonus, sequence-mean aggregation) are
checked by the mask and the exact-zero criterion; those that ``zero_pg`` cannot serve are refused at
start-up by the launcher (the real CLI, stopped at ``ray.init``) and, as a backstop, by the worker.
"""

from __future__ import annotations

import copy
import importlib.metadata
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

sys.path.insert(0, os.path.dirname(__file__))
from test_openrlhf import (  # noqa: E402  (skips or fails like it without OpenRLHF)
    VOCAB,
    FakeStrategy,
    filled_buffer,
    real_trainer,
    tiny_actor,
    training_args,
)

from openrlhf.models import PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from reference import reference_outlier_keep, reference_token_stats  # noqa: E402

from entropy_discriminator import EntropyDiscConfig  # noqa: E402
from entropy_discriminator.adapters import openrlhf as adapter  # noqa: E402
from entropy_discriminator.adapters.openrlhf import _round  # noqa: E402
from entropy_discriminator.adapters.openrlhf._checks import UnsupportedConfigurationError  # noqa: E402

RELEASE = Version(importlib.metadata.version("openrlhf"))
ESTIMATORS = ("gae", "group_norm", "rloo", "reinforce_baseline", "dr_grpo")
N_PROMPTS, N_PER_PROMPT = 3, 2
EPS_CLIP = 0.2
CONFIGS = {
    "clip_b": dict(method="clip_b", mu_low=1.0, sides="both", max_frac=None),
    "clip_v": dict(method="clip_v", mu_low=1.0, sides="both", max_frac=0.25),
}


@pytest.fixture(autouse=True)
def _clean_patch():
    adapter.unpatch()
    yield
    adapter.unpatch()


class RecordingStrategy(FakeStrategy):
    """Records the gradient of each optimizer step instead of stepping."""

    def __init__(self, args):
        super().__init__(args)
        self.grads: list[list[torch.Tensor]] = []

    def optimizer_step(self, optimizer, model, scheduler, name=None):
        self.grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.zero_grad()


# ----------------------------------------------------------------------------------------- fixtures


def _rollout(seed: int, actor) -> Experience:
    """3 prompts x 2 samples, OpenRLHF 0.10/0.11 layout (unpadded prompt + response, action_mask over
    positions 1..T-1), rewards, critic values, and old log-probs = the actor's own plus noise (so the
    PPO ratio differs from 1 and its clip is exercised)."""
    g = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for _ in range(N_PROMPTS):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)
        for _ in range(N_PER_PROMPT):
            resp = torch.randint(1, VOCAB, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
            seqs.append(torch.cat([prompt, resp]))
            masks.append(torch.cat([torch.zeros(len(prompt) - 1), torch.ones(len(resp))]).bool())
    n, width = len(seqs), max(len(x) for x in seqs)
    sequences = torch.zeros(n, width, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    action_mask = torch.zeros(n, width - 1, dtype=torch.bool)
    for i, (x, m) in enumerate(zip(seqs, masks)):
        sequences[i, : len(x)], attention_mask[i, : len(x)], action_mask[i, : len(m)] = x, 1, m
    with torch.no_grad():
        logp = actor(sequences, action_mask, attention_mask)
    old = (logp + 0.15 * torch.randn(logp.shape, generator=g)) * action_mask
    rewards = torch.randn(n, generator=g)
    return Experience(
        sequences=sequences, attention_mask=attention_mask, action_mask=action_mask, action_log_probs=old,
        values=torch.randn(action_mask.shape, generator=g) * action_mask, kl=torch.zeros(action_mask.shape),
        rewards=rewards, response_length=action_mask.sum(-1).float(), total_length=attention_mask.sum(-1).float(),
        index=list(range(n)), info={"reward": rewards.clone()},
    )


def _advantages(experience: Experience, estimator: str) -> None:
    """OpenRLHF's own advantage computation for ``estimator`` (driver side, one rollout batch)."""
    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=N_PER_PROMPT, max_new_tokens=16),
        reward=SimpleNamespace(clip_range=(-10.0, 10.0), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0, lambd=0.95, no_std_norm=False)),
        data=SimpleNamespace(max_len=64),
    )
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.advantage_estimator = SimpleNamespace(args=args), args, estimator
    maker.kl_ctl = SimpleNamespace(value=0.0)
    (out,) = maker.compute_advantages_and_returns([experience])
    assert out.advantages.shape == experience.action_mask.shape


def _float64_reference(actor, items, masks):
    """``(model64, refs)``: a float64 copy of the model and, per item, the float64 stats of its
    action columns (``masks``: the action masks before the round) from an unpacked forward, plus
    ``logp_grad``, the log-probs with their graph (for the reference gradient)."""
    model = _SHARED["model64"]
    model.zero_grad(set_to_none=True)
    out = []
    for item, mask in zip(items, masks):
        tokens = item.sequences[item.attention_mask.bool()]
        z = model(tokens[None]).logits[0]
        n = mask.numel()
        labels = torch.where(mask.bool(), tokens[1 : n + 1], torch.full((n,), -100))
        with torch.no_grad():
            ref = reference_token_stats(z[:n].detach(), labels, temperature=actor.temperature)
        ref["logp_grad"] = torch.log_softmax(z[:n] / actor.temperature, -1).gather(-1, tokens[1 : n + 1, None])[:, 0]
        out.append(ref)
    return model, out


def _reference_keep(cfg: dict, refs, masks, adv_flat: torch.Tensor, got_keep: torch.Tensor) -> torch.Tensor:
    """Plain-Python Clip_B / Clip_V on the float64 scores; tokens within 1e-6 std of a threshold take
    the adapter's value (fp32 may round them to either side)."""
    key = "s_star" if cfg["method"] == "clip_b" else "s_centered"
    scores = torch.cat([r[key] for r in refs])
    valid = torch.cat([m.bool() for m in masks])
    keep = reference_outlier_keep(
        scores.tolist(), adv_flat.tolist(), valid.tolist(), recentre=cfg["method"] == "clip_b",
        mu_low=cfg["mu_low"], mu_high=math.inf, sides=cfg["sides"], max_frac=cfg["max_frac"],
    )
    keep = torch.tensor(keep)
    xs = scores[valid]
    mean, std = xs.mean(), xs.std(unbiased=False)
    centre = mean if cfg["method"] == "clip_b" else 0.0
    near = (scores - (centre - cfg["mu_low"] * std)).abs() < 1e-6 * std
    assert int(near.sum()) <= 1
    return torch.where(near, got_keep, keep)


def _run_round(actor, experience, cfg, mode, args, monkeypatch, loss_fn=None):
    """Patched real ppo_train over the buffer; returns (items, advantages before, mask before,
    adapter keep, recorded gradient, LM-head-input gradient per item [A_i, H])."""
    buffer = filled_buffer(experience, micro_batch_size=len(experience.sequences), monkeypatch=monkeypatch)
    items = buffer.items
    adv0 = [it.advantages.clone() for it in items]
    mask0 = [it.action_mask.clone() for it in items]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    trainer = real_trainer(actor, buffer, args=args, micro_batch_size=len(items), loss_fn=loss_fn)
    trainer.strategy = RecordingStrategy(args)
    seen: dict[str, torch.Tensor] = {}
    original_apply = _round.apply_keep

    def spy(items_, keep, mode_):
        seen["keep"] = keep.detach().cpu().clone()
        return original_apply(items_, keep, mode_)

    monkeypatch.setattr(_round, "apply_keep", spy)
    batches, head_grads = [], []

    def on_actor(module, args_, kwargs):
        if torch.is_grad_enabled():
            batches.append((args_[0].detach().clone(), kwargs["attention_mask"].detach().clone()))

    def on_head(module, args_):
        if args_[0].requires_grad:
            args_[0].register_hook(lambda g: head_grads.append(g.detach().clone()))

    hooks = [actor.register_forward_pre_hook(on_actor, with_kwargs=True),
             actor.model.lm_head.register_forward_pre_hook(on_head)]
    try:
        adapter.patch(EntropyDiscConfig(mask_mode=mode, **cfg))
        status = trainer.ppo_train(float(args.algo.kl.init_coef))  # the KL controller's value
    finally:
        for h in hooks:
            h.remove()
    assert "entropy_disc/clip/frac" in status
    assert len(trainer.strategy.grads) == 1 and len(batches) == 1 and len(head_grads) == 1
    per_item = _head_grad_per_item(items, *batches[0], head_grads[0])
    return items, adv0, mask0, seen["keep"], trainer.strategy.grads[0], per_item


def _head_grad_per_item(items, sequences, attention_mask, grad) -> list[torch.Tensor]:
    """The LM-head-input gradient at each item's action positions (row j predicts token j + 1),
    matched to the item by its tokens (the data loader shuffles). Packed ``[1, L, H]`` gradients
    are put back at their positions of the right-padded batch first."""
    b, t = sequences.shape
    if grad.shape[0] != b:  # packed: the unpadded positions in row-major order
        full = torch.zeros(b * t, grad.shape[-1], dtype=grad.dtype)
        full[attention_mask.reshape(-1).nonzero().squeeze(-1)] = grad[0]
        grad = full.reshape(b, t, -1)
    rows = {tuple(sequences[r][attention_mask[r].bool()].tolist()): r for r in range(b)}
    return [grad[rows[tuple(it.sequences.tolist())], : it.action_mask.numel()] for it in items]


def _assert_clipped_get_no_gradient(items, mask0, keep, head_grads):
    clipped_any = kept_nonzero = False
    for item_keep, m, g in zip(keep.split([m.numel() for m in mask0]), mask0, head_grads):
        clipped = m.bool() & ~item_keep
        clipped_any |= bool(clipped.any())
        assert (g[clipped] == 0).all(), "a clipped token got gradient"
        kept_nonzero |= bool((g[m.bool() & item_keep].abs().sum(-1) > 0).any())
    assert clipped_any and kept_nonzero


_SHARED: dict[str, object] = {}


def _case(estimator, packing, seed=0):
    """The shared tiny actor (built once; the recording strategy never steps it) with ``packing``,
    and a rollout batch with ``estimator``'s advantages."""
    if "actor" not in _SHARED:
        _SHARED["actor"] = tiny_actor(seed=1)
        _SHARED["model64"] = copy.deepcopy(_SHARED["actor"].model).double()
    actor = _SHARED["actor"]
    actor.packing_samples = packing
    exp = _rollout(seed, actor)
    _advantages(exp, estimator)
    return actor, exp


# ------------------------------------------------------------------------------------------- matrix


@pytest.mark.parametrize("mode", ["zero_pg", "drop_token"])
@pytest.mark.parametrize("method", ["clip_b", "clip_v"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_matrix_exact(packing, estimator, method, mode, monkeypatch):
    cfg = CONFIGS[method]
    actor, exp = _case(estimator, packing, seed=ESTIMATORS.index(estimator))
    args = training_args(epochs=1, packing=packing, **{"actor.eps_clip_low_high": (EPS_CLIP, EPS_CLIP)})
    items, adv0, mask0, keep, grads, head = _run_round(actor, exp, cfg, mode, args, monkeypatch)

    # mask == plain-Python rule on float64 statistics
    model64, refs = _float64_reference(actor, items, mask0)
    adv_flat = torch.cat(adv0).double()
    ref_keep = _reference_keep(cfg, refs, mask0, adv_flat, keep)
    assert torch.equal(keep, ref_keep)
    _assert_clipped_get_no_gradient(items, mask0, keep, head)

    # parameter gradient == float64 masked PPO loss written out per token
    valid = torch.cat(mask0).bool()
    logp = torch.cat([r["logp_grad"] for r in refs])
    old = torch.cat([it.action_log_probs for it in items]).double()
    ratio = (logp - old).clamp(-20, 20).exp()
    per_token = -torch.min(ratio * adv_flat, ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP) * adv_flat)
    counted = valid & ref_keep if mode == "drop_token" else valid
    loss = (per_token * (counted & ref_keep)).sum() / counted.sum()
    loss.backward()
    for got, p in zip(grads, model64.parameters()):
        torch.testing.assert_close(got.double(), p.grad, rtol=2e-4, atol=2e-6)
    # the unmasked loss has another gradient, so the comparison above can fail
    plain = (per_token.detach() * valid).sum() / valid.sum()
    assert not torch.isclose(plain, loss.detach())


# ---------------------------------------------------------------------------- other loss variants

VARIANTS = {
    # name: (OpenRLHF argument overrides, PolicyLoss kwargs, modes served exactly)
    "dual_clip": ({"actor.dual_clip": 3.0}, {"dual_clip": 3.0}, ("zero_pg", "drop_token")),
    # before 0.10.3 GSPO's sequence mean turns NaN on a fully clipped sample: refused in both modes
    "gspo": ({"actor.policy_loss_type": "gspo"}, {"policy_loss_type": "gspo"},
             ("drop_token",) if RELEASE >= Version("0.10.3") else ()),
    "kl_loss": ({"algo.kl.use_loss": True, "algo.kl.init_coef": 0.5}, {}, ("drop_token",)),
    "entropy_bonus": ({"actor.entropy_coef": 0.3}, {}, ("drop_token",)),
    "entropy_logged_only": ({"actor.entropy_coef": 0.0}, {}, ("zero_pg", "drop_token")),
}
if RELEASE >= Version("0.11.0"):  # --actor.loss_agg_mode
    VARIANTS["seq_mean_token_mean"] = (
        {"actor.loss_agg_mode": "seq-mean-token-mean"}, {"token_level_loss": False}, ("zero_pg", "drop_token"))


@pytest.mark.parametrize("mode", ["zero_pg", "drop_token"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_variants_exact_or_refused(variant, mode, monkeypatch):
    overrides, loss_kwargs, exact_modes = VARIANTS[variant]
    cfg = CONFIGS["clip_b"]
    actor, exp = _case("gae", packing=True, seed=7)
    exp.base_action_log_probs = exp.action_log_probs - 0.1  # a reference policy for the KL loss
    exp_copy = copy.deepcopy(exp)
    args = training_args(epochs=1, packing=True, **overrides)
    loss_fn = PolicyLoss(**loss_kwargs)
    if overrides.get("actor.entropy_coef") is not None:
        # Actor.forward's compute_entropy is torch.compile'd; compiling costs tens of seconds on 2 CPU
        # cores. The same function, run eagerly.
        from openrlhf.models import actor as actor_module

        eager = getattr(actor_module.compute_entropy, "_torchdynamo_orig_callable", actor_module.compute_entropy)
        monkeypatch.setattr(actor_module, "compute_entropy", eager)
        if RELEASE < Version("0.11.0"):  # 0.10.x divides the logits in place after taking the entropy from
            monkeypatch.setattr(actor, "temperature", 1.0)  # them, so backward fails unless T == 1
    if mode not in exact_modes:
        with pytest.raises(UnsupportedConfigurationError, match=r"--entropy_disc.mask_mode drop_token|OpenRLHF >="):
            _run_round(actor, exp, cfg, mode, args, monkeypatch, loss_fn=loss_fn)
        if mode == "drop_token":
            return  # GSPO before 0.10.3: refused for the NaN on a fully clipped sample, not for a leak
        # the refusal is needed: without it, a clipped token gets gradient from this term
        monkeypatch.setattr(_round, "check_training_args", lambda *a: None)
        items, _, mask0, keep, _, head = _run_round(actor, exp_copy,
                                                    cfg, mode, args, monkeypatch, loss_fn=loss_fn)
        leaked = [g[m.bool() & ~k] for g, m, k in zip(head, mask0, keep.split([m.numel() for m in mask0]))]
        assert any((g != 0).any() for g in leaked)
        return
    items, adv0, mask0, keep, _, head = _run_round(actor, exp, cfg, mode, args, monkeypatch, loss_fn=loss_fn)
    _, refs = _float64_reference(actor, items, mask0)
    assert torch.equal(keep, _reference_keep(cfg, refs, mask0, torch.cat(adv0).double(), keep))
    _assert_clipped_get_no_gradient(items, mask0, keep, head)


REFUSED_FLAGS = {
    "gspo": ["--actor.policy_loss_type", "gspo"],
    "kl_loss": ["--algo.kl.use_loss", "--algo.kl.init_coef", "0.01"],
    "entropy_bonus": ["--actor.entropy_coef", "0.001"],
    "autotp": ["--ds.tensor_parallel_size", "2"],
}


class _StopAtRayInit(Exception):
    pass


@pytest.mark.parametrize("mode", ["zero_pg", "drop_token"])
@pytest.mark.parametrize("setting", list(REFUSED_FLAGS))
def test_launcher_refuses_before_ray_starts(setting, mode, monkeypatch, capsys):
    """The real train_ppo_ray CLI through the launcher: a refused combination stops with a message
    naming the setting before ``ray.init``; an allowed one reaches ``ray.init``."""
    import ray

    def fake_init(*args, **kwargs):
        raise _StopAtRayInit

    monkeypatch.setattr(ray, "init", fake_init)
    argv = ["--actor.model_name_or_path", "tiny", "--reward.remote_url", "http://127.0.0.1:9/reward",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--rollout.batch_size", "8", "--vllm.num_engines", "1", "--ds.packing_samples",
            "--entropy_disc.method", "clip_b", "--entropy_disc.mask_mode", mode, *REFUSED_FLAGS[setting]]
    if setting == "autotp" or mode == "zero_pg" or (setting == "gspo" and RELEASE < Version("0.10.3")):
        with pytest.raises(SystemExit, match=REFUSED_FLAGS[setting][0].replace(".", r"\.")):
            adapter.main(argv)
    else:
        with pytest.raises(_StopAtRayInit):
            adapter.main(argv)
    metrics_only = [a for a in argv if a not in ("clip_b", "--entropy_disc.method", "--entropy_disc.mask_mode", mode)]
    with pytest.raises(_StopAtRayInit):  # metrics only (no method, so no mask settings): nothing to refuse
        adapter.main(metrics_only)
