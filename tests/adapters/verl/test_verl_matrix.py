"""Configuration matrix: every verl policy-loss mode x loss_agg_mode x GRPO/GAE advantages x mask request.

Each case goes through the adapter's start-up decision (:func:`check_config` on verl's composed
``ppo_trainer`` config) and then either

* is refused, and the message names the setting, or
* runs verl's own actor loss (``verl.workers.utils.losses.ppo_loss`` with verl's ``ActorConfig``,
  float64) on the fields the adapter hands the update (:func:`apply_mask`), and the gradient with
  respect to the current log-probs is checked against an independent recomputation:
  clipped tokens exactly 0; kept tokens equal to verl's gradient on the *unmasked* batch
  (``zero_pg``) or on a batch in which the clipped tokens do not exist (``drop_token``: the
  sequences are truncated before their clipped tokens, which the test places at the end of each
  response, so the truncated batch is a real, shorter verl batch).

Normalisers are passed as verl's engine passes them (``batch_num_tokens`` = the sum of the
``loss_mask`` the update receives, ``global_batch_size`` = the mini-batch's sequence count,
``dp_size`` = 1).  Dynamic batching and padding removal act in the engine, before this loss, on
the same fields: ``test_verl_engine.py`` checks the update's parameter gradient with them on.
Nothing is stubbed here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from entropy_discriminator.adapters.verl import LOSS_AGG_MODES, LOSS_MODES, check_config  # noqa: E402
from entropy_discriminator.adapters.verl._trainer import apply_mask  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
PROMPT_LENS = [3, 2, 4, 2, 3, 2]
RESPONSE_LENS = [9, 6, 5, 7, 4, 8]  # sequence 0 is the longest and keeps all its tokens
CLIPPED_TAIL = [0, 2, 1, 3, 1, 2]  # clipped tokens at the end of each response
MASK_REQUESTS = ("zero_pg", "drop_token", "default")
#: Loss-mode options that make every mode's own selection act on this small batch.
LOSS_OPTIONS = [
    "actor_rollout_ref.actor.policy_loss.dro_beta=0.3",
    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.3",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.3",
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb=-100.0",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub=100.0",
    "actor_rollout_ref.actor.clip_ratio=0.1",
]


@pytest.fixture(scope="module")
def base_config():
    """What the start-up check and verl's ActorConfig read of verl's composed ``ppo_trainer`` config, resolved."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "trainer.v1.trainer_mode=entropy_disc",
                "+entropy_disc.method=clip_b",
                *LOSS_OPTIONS,
            ],
        )
    keys = ("trainer", "algorithm", "actor_rollout_ref.actor", "actor_rollout_ref.model.use_fused_kernels", "entropy_disc")
    small = OmegaConf.create()
    for key in keys:
        OmegaConf.update(small, key, OmegaConf.select(cfg, key), force_add=True)
    return OmegaConf.to_container(small, resolve=True)


def configured(base, *, loss_mode: str, agg: str, request: str, kl: bool = False, entropy_coeff: float = 0.0):
    cfg = OmegaConf.create(copy.deepcopy(base))
    actor = cfg.actor_rollout_ref.actor
    actor.policy_loss.loss_mode = loss_mode
    actor.loss_agg_mode = agg
    actor.use_kl_loss = kl
    actor.entropy_coeff = entropy_coeff
    if request != "default":
        cfg.entropy_disc.mask_mode = request
    return cfg


_ACTOR_CONFIGS: dict = {}


def actor_config(cfg):
    """verl's ActorConfig dataclass of the case (cached: building it is the slow part of a case)."""
    a = cfg.actor_rollout_ref.actor
    key = (a.policy_loss.loss_mode, a.loss_agg_mode, a.use_kl_loss, a.entropy_coeff)
    if key not in _ACTOR_CONFIGS:
        _ACTOR_CONFIGS[key] = omega_conf_to_dataclass(a)
    return _ACTOR_CONFIGS[key]


def nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def make_batch(estimator: str, seed: int):
    """Per-sequence float64 rows: current / old / reference log-probs, entropies, advantages."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        old = -torch.rand(r, generator=g, dtype=torch.float64) * 3 - 0.05
        cur = old + torch.randn(r, generator=g, dtype=torch.float64) * 0.15
        ref = old + torch.randn(r, generator=g, dtype=torch.float64) * 0.1
        if estimator == "grpo":  # one advantage per sequence, broadcast over its tokens
            adv = torch.full((r,), float(torch.randn((), generator=g, dtype=torch.float64)) + (0.5 if i % 2 else -0.5))
        else:  # GAE: one per token
            adv = torch.randn(r, generator=g, dtype=torch.float64)
        ent = torch.rand(r, generator=g, dtype=torch.float64) * 2
        rows.append(dict(prompt=p, cur=cur, old=old, ref=ref, adv=adv, ent=ent))
    return rows


def loss_grads(actor_cfg, rows, fields=None, *, response_lens=None, seed=0):
    """verl's ppo_loss on ``rows`` (each truncated to ``response_lens``); d loss / d current log-prob and entropy, padded."""
    lens = response_lens or [len(r["cur"]) for r in rows]
    leaves, ent_leaves, seqs = [], [], []
    for r, n in zip(rows, lens):
        lp = r["cur"][:n].clone().requires_grad_(True)
        en = r["ent"][:n].clone().requires_grad_(True)
        leaves.append(lp)
        ent_leaves.append(en)
        # model outputs cover prompt+response positions; position p-1+j predicts response token j
        pad = torch.zeros(r["prompt"] - 1, dtype=torch.float64)
        seqs.append((torch.cat([pad, lp, torch.zeros(1, dtype=torch.float64)]), torch.cat([pad, en, torch.zeros(1, dtype=torch.float64)])))
    if fields is None:
        fields = {
            "response_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
            "loss_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
            "advantages": nested([r["adv"][:n] for r, n in zip(rows, lens)]),
        }
    data = tu.get_tensordict(
        {
            "prompts": nested([torch.zeros(r["prompt"], dtype=torch.int64) for r in rows]),
            "responses": nested([torch.zeros(n, dtype=torch.int64) for n in lens]),
            "old_log_probs": nested([r["old"][:n] for r, n in zip(rows, lens)]),
            "ref_log_prob": nested([r["ref"][:n] for r, n in zip(rows, lens)]),
            **fields,
        },
        non_tensor_dict={
            "dp_size": 1,
            "batch_num_tokens": int(fields["loss_mask"].values().sum()),
            "global_batch_size": len(RESPONSE_LENS),
        },
    )
    model_output = {"log_probs": torch.cat([s[0] for s in seqs]), "entropy": torch.cat([s[1] for s in seqs])}
    torch.manual_seed(seed)  # clip_cov draws its random selection
    loss, _ = ppo_loss(actor_cfg, model_output, data)
    loss.backward()
    width = max(RESPONSE_LENS)
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    out_ent = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, (lp, en) in enumerate(zip(leaves, ent_leaves)):
        out[i, : len(lp)] = lp.grad
        out_ent[i, : len(en)] = en.grad if en.grad is not None else 0.0
    return out, out_ent


def keep_mask():
    keep = torch.zeros(len(RESPONSE_LENS), max(RESPONSE_LENS), dtype=torch.bool)
    for i, (n, c) in enumerate(zip(RESPONSE_LENS, CLIPPED_TAIL)):
        keep[i, : n - c] = True
    return keep


def run_case(base, *, loss_mode, agg, estimator, request, kl=False, entropy_coeff=0.0):
    """'exact' after the checks below, or the start-up refusal message."""
    cfg = configured(base, loss_mode=loss_mode, agg=agg, request=request, kl=kl, entropy_coeff=entropy_coeff)
    try:
        plan = check_config(cfg)
    except ValueError as exc:
        return str(exc)
    mode = plan.options.mask_mode
    actor_cfg = actor_config(cfg)
    rows = make_batch(estimator, seed=len(loss_mode) * 7 + len(agg))
    keep = keep_mask()
    full = {
        "response_mask": nested([torch.ones(n, dtype=torch.int64) for n in RESPONSE_LENS]),
        "loss_mask": nested([torch.ones(n, dtype=torch.int64) for n in RESPONSE_LENS]),
        "advantages": nested([r["adv"] for r in rows]),
    }
    masked = {**full, **apply_mask(full, keep, mode)}
    got, got_ent = loss_grads(actor_cfg, rows, masked)
    assert torch.equal(got[~keep], torch.zeros_like(got[~keep])), "clipped tokens got log-prob gradient"
    assert torch.equal(got_ent[~keep], torch.zeros_like(got_ent[~keep])), "clipped tokens got entropy gradient"
    if mode == "zero_pg":
        ref, ref_ent = loss_grads(actor_cfg, rows)
    else:
        kept_lens = [n - c for n, c in zip(RESPONSE_LENS, CLIPPED_TAIL)]
        ref, ref_ent = loss_grads(actor_cfg, rows, response_lens=kept_lens)
    assert got[keep].abs().max() > 0, "the kept tokens must get gradient for the comparison to mean something"
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got_ent[keep], ref_ent[keep], rtol=1e-12, atol=1e-15)
    return f"exact:{mode}"


def test_every_registered_loss_mode_has_a_decision():
    assert set(LOSS_MODES) == set(POLICY_LOSS_REGISTRY)


@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSS_REGISTRY))
def test_matrix(base_config, loss_mode):
    """All loss_agg_modes x GRPO/GAE x mask requests of one loss mode (one test per mode keeps the output short)."""
    kind, _ = LOSS_MODES[loss_mode]
    outcomes = {}
    for agg in LOSS_AGG_MODES:
        for estimator in ("grpo", "gae"):
            for request in MASK_REQUESTS:
                outcomes[agg, estimator, request] = run_case(
                    base_config, loss_mode=loss_mode, agg=agg, estimator=estimator, request=request
                )
    for (agg, estimator, request), outcome in outcomes.items():
        if kind == "refused":
            assert f"policy_loss.loss_mode={loss_mode}" in outcome
        elif kind == "drop_token" and request == "zero_pg":
            assert outcome.startswith("entropy_disc.mask_mode=zero_pg would leave clipped tokens with gradient")
            assert f"policy_loss.loss_mode={loss_mode}" in outcome
        elif kind == "drop_token":
            assert outcome == "exact:drop_token"
        else:
            assert outcome == ("exact:drop_token" if request == "drop_token" else "exact:zero_pg")


@pytest.mark.parametrize("regulariser", ["kl", "entropy"])
def test_regularisers_route_zero_pg_to_drop_token(base_config, regulariser):
    """KL loss and entropy bonus act on every token in response_mask: zero_pg cannot silence them."""
    kw = {"kl": True} if regulariser == "kl" else {"entropy_coeff": 0.01}
    for agg in ("token-mean", "seq-mean-token-mean"):
        assert run_case(base_config, loss_mode="vanilla", agg=agg, estimator="grpo", request="default", **kw) == "exact:drop_token"
        assert run_case(base_config, loss_mode="vanilla", agg=agg, estimator="gae", request="drop_token", **kw) == "exact:drop_token"
        refused = run_case(base_config, loss_mode="vanilla", agg=agg, estimator="grpo", request="zero_pg", **kw)
        setting = "use_kl_loss=True" if regulariser == "kl" else "entropy_coeff != 0"
        assert refused.startswith("entropy_disc.mask_mode=zero_pg would leave") and setting in refused


def test_unknown_loss_mode_and_agg_mode_are_refused(base_config):
    cfg = configured(base_config, loss_mode="my_custom_loss", agg="token-mean", request="default")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.policy_loss\.loss_mode='my_custom_loss'"):
        check_config(cfg)
    cfg = configured(base_config, loss_mode="vanilla", agg="token-median", request="default")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.loss_agg_mode='token-median'"):
        check_config(cfg)
