"""On OpenRLHF, the adapter's statistics are those of the distribution OpenRLHF's log-probs come from.

OpenRLHF with DeepSpeed bf16 (``--ds.param_dtype bf16``, the default): ``Actor`` loads the model with
``torch_dtype=bfloat16`` and DeepSpeed's bf16 engine keeps the module's weights in bf16 (fp32 master
weights live in the optimizer only; no autocast), so the forward runs in bf16 and the LM head
returns bf16 logits. ``Actor.forward`` then upcasts them (``.to(torch.float32)``) and divides the
fp32 logits by the temperature in place (0.11: in ``Actor.forward``; 0.10: in
``log_probs_from_logits``); its log-probs are fp32 arithmetic on those. DeepSpeed's engine builds
on a CPU-only machine only with every CUDA call redirected process-wide
(``tests/gpu/openrlhf_step_on_cpu.py``, ``benchmarks/openrlhf_step.py --smoke``), which a pytest
process shared with other tests cannot take, so this test reproduces exactly the dtype flow the
bf16 engine gives the forward, bf16 module weights, with the real OpenRLHF ``Actor`` (the engine
only wraps that module and casts it to bf16); likewise fp16 weights for ``--ds.param_dtype fp16``;
fp32 weights are the control.

The reference is OpenRLHF's own distribution, captured inside its call: the model's logits (a
forward hook), then ``.float() / T`` in fp32 as OpenRLHF does, then float64 arithmetic. That the
captured values are OpenRLHF's is checked by OpenRLHF's own per-token log-probs of the same
micro-batches (``actor(sequences, action_mask, attention_mask)``, the ``make_experience`` call):
equal to the float64 reference to fp32 rounding (1e-5: fp32 log-softmax over V = 97 of logits of a
few units). Asserted: the adapter's ``log p_k`` equals OpenRLHF's to the same 1e-5; ``H``, ``S*``,
``E_p[S]``, ``S_c`` equal the float64 reference to fp32 accumulation error; and the Clip_B / Clip_V
keep-masks of the real ``begin_round`` equal the masks of the float64 reference: 0 differences (both
sides, mu = 0.5 and 1.0, each clipping between 3% and 60% of the tokens).

On the previous adapter (temperature applied by the core, ``(z - max) / T`` instead of OpenRLHF's
``z / T``: one fp32 rounding apart) this test passes too: OpenRLHF's flow was already followed up to
that rounding; the change makes the temperature step OpenRLHF's own operation.

Both ways the adapter gets its statistics are checked (``path``): ``forward``, the normal one, where
the patched ``Actor.forward`` scores the micro-batches inside the ``make_experience`` call itself and
``begin_round`` runs no forward at all; and ``pass``, the fallback no-grad pass of ``begin_round``
(buffer filled without a scored forward), which must see the very same logits.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_openrlhf import (  # noqa: E402  (skips or fails like it without OpenRLHF)
    VOCAB,
    filled_buffer,
    real_trainer,
    rollout_batch,
)

from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import make_experience_batch  # noqa: E402

from entropy_discriminator import EntropyDiscConfig, clip_b_mask, clip_v_mask  # noqa: E402
from entropy_discriminator.adapters import openrlhf as adapter  # noqa: E402
from entropy_discriminator.adapters.openrlhf._experience import STORE, register_policy  # noqa: E402
from entropy_discriminator.adapters.openrlhf._round import begin_round  # noqa: E402

TEMPERATURE = 0.7
MICRO = 4
CONFIGS = {
    "clip_b": dict(method="clip_b", mu_low=0.5, mu_high=0.5, sides="both", max_frac=None),
    "clip_v": dict(method="clip_v", mu_low=1.0, mu_high=1.0, sides="both", max_frac=None),
}


def _actor(dtype: torch.dtype, packing: bool) -> Actor:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager", use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits of a few units: peaked rows, where bf16 rounding moves the statistics
        model.lm_head.weight.mul_(12.0)
    actor = Actor(model.to(dtype), temperature=TEMPERATURE)
    actor.packing_samples = packing
    return actor.eval()


class LogitsCapture:
    """Every forward's model logits, as OpenRLHF's ``Actor.forward`` receives them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.logits: list[torch.Tensor] = []
        self.handle = model.register_forward_hook(lambda m, a, out: self.logits.append(out["logits"].detach().clone()))


def _openrlhf_rows(logits: torch.Tensor, attention_mask: torch.Tensor, packing: bool) -> list[torch.Tensor]:
    """Per sample of a micro-batch: OpenRLHF's fp32 temperature-scaled logits ``[len, V]`` (float64 copy)."""
    z = logits.to(torch.float32)  # Actor.forward's upcast, then its in-place fp32 division
    z = z / TEMPERATURE
    lengths = attention_mask.sum(-1).tolist()
    if packing:  # [1, sum(len), V] in row-major order of the unpadded positions
        return [r.double() for r in z[0].split(lengths)]
    return [z[b, :n].double() for b, n in enumerate(lengths)]


def _make_experience_forward(actor, items, capture, packing):
    """OpenRLHF's own per-token log-probs of the buffer's micro-batches: ``make_experience``'s call
    (``PolicyModelActor.forward``: ``actor(sequences, action_mask, attention_mask)``, eval, no grad)."""
    chunks = [items[i : i + MICRO] for i in range(0, len(items), MICRO)]
    own_logp, rows = [], []
    with torch.no_grad():
        for chunk in chunks:
            batch = make_experience_batch(chunk)
            lp = actor(batch.sequences, batch.action_mask, batch.attention_mask)
            own_logp += [lp[b, : it.action_mask.numel()] for b, it in enumerate(chunk)]
            rows += _openrlhf_rows(capture.logits[-1], batch.attention_mask, packing)
    return own_logp, rows


@pytest.fixture(autouse=True)
def _clean_patch():
    adapter.unpatch()
    yield
    adapter.unpatch()


@pytest.mark.parametrize("path", ["forward", "pass"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["ds_bf16", "ds_fp16", "fp32"])
def test_statistics_are_those_of_openrlhfs_own_distribution(monkeypatch, dtype, packing, path):
    actor = _actor(dtype, packing)
    experience = rollout_batch(11, n=24, prompt_len=6, max_resp=40)
    buffer = filled_buffer(experience, MICRO, monkeypatch)
    items = buffer.items
    capture = LogitsCapture(actor.model)

    own_logp, rows = _make_experience_forward(actor, items, capture, packing)  # not patched: stock OpenRLHF
    n_own = len(capture.logits)

    # float64 statistics of that distribution, per action column
    ref = {k: [] for k in ("logp", "entropy", "s_star", "s_expected", "s_centered")}
    for z, item in zip(rows, items):
        tokens = item.sequences[item.attention_mask.bool()]
        n_act, n_seq = item.action_mask.numel(), tokens.numel()
        logq = torch.log_softmax(z[n_seq - n_act - 1 : n_seq - 1], -1)
        p = logq.exp()
        h = -(p * logq).sum(-1)
        lpk = logq.gather(-1, tokens[n_seq - n_act :, None])[:, 0]
        s_star = lpk.exp() * (h + lpk)
        e_s = (p * p * (h[:, None] + logq)).sum(-1)
        for k, v in zip(ref, (lpk, h, s_star, e_s, s_star - e_s)):
            ref[k].append(v)
    ref = {k: torch.cat(v) for k, v in ref.items()}
    valid = torch.cat([it.action_mask.reshape(-1).bool() for it in items])
    advantages = torch.cat([it.advantages.reshape(-1).float() for it in items])
    own = torch.cat(own_logp).double()
    # the captured distribution is OpenRLHF's: its own log-probs agree with the float64 reference
    torch.testing.assert_close(own[valid], ref["logp"][valid], rtol=1e-5, atol=1e-5)

    for name, settings in CONFIGS.items():
        config = EntropyDiscConfig(**settings)
        trainer = real_trainer(actor, filled_buffer(experience, MICRO, monkeypatch), micro_batch_size=MICRO)
        if path == "forward":  # the adapter patched in, the make_experience call scored
            adapter.patch(config)
            register_policy(actor)  # what the patched ActorPPOTrainer.__init__ does
            patched_logp, _ = _make_experience_forward(actor, items, capture, packing)
            for a, b in zip(patched_logp, own_logp):  # the patch leaves OpenRLHF's log-probs as they are
                assert torch.equal(a, b)
            assert len(STORE) == len(items)
        n_before = len(capture.logits)
        state = begin_round(trainer, config)
        if path == "forward":
            assert state.source == "forward" and len(STORE) == 0
            assert len(capture.logits) == n_before  # no forward of its own
        else:
            assert state.source == "pass" and len(capture.logits) > n_before
        for a, b in zip(capture.logits[n_own:], capture.logits[:n_own]):  # same micro-batches, same logits
            assert torch.equal(a, b)
        del capture.logits[n_own:]
        adapter.unpatch()
        stats = state.stats
        assert torch.equal(stats.valid, valid)
        # the adapter's logp is OpenRLHF's own per-token log-prob (fp32 both)
        torch.testing.assert_close(stats.logp.double()[valid], own[valid], rtol=1e-5, atol=1e-5)
        for field in ("entropy", "s_star", "s_expected", "s_centered"):
            sigma = float(ref[field][valid].std())
            torch.testing.assert_close(
                getattr(stats, field).double()[valid], ref[field][valid], rtol=0, atol=1e-5 * max(sigma, 1e-3)
            )
        kw = dict(mu_low=settings["mu_low"], mu_high=settings["mu_high"], sides="both", max_frac=None)
        if name == "clip_b":
            want = clip_b_mask(ref["s_star"], advantages, valid, **kw)
        else:
            want = clip_v_mask(ref["s_centered"], advantages, valid, **kw)
        assert 0.03 * want.n_valid < want.n_clipped < 0.6 * want.n_valid, (name, want.n_clipped, want.n_valid)
        assert int((state.mask.keep != want.keep)[valid].sum()) == 0, name
    capture.handle.remove()
