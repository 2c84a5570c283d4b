"""The E_p[S] hook on verl 0.9.1's real FSDP engine code path, on CPU.

What runs is verl's own ``FSDPEngineWithLMHead.infer_batch`` -> ``forward_backward_batch`` ->
``prepare_micro_batches`` -> ``forward_step`` -> ``prepare_model_inputs`` -> the model ->
``prepare_model_outputs`` (wrapped by the hook) -> ``postprocess_batch_func``, with a gloo process
group of one rank and a tiny randomly initialised Llama.  Not run: the engine's constructor
(``initialize`` builds the model from a checkpoint path and wraps it in FSDP on a CUDA/NPU device
mesh), so the engine object is created with ``object.__new__`` and given the attributes the
constructor would set; and verl's ``get_device_id``/``get_device_name`` (they call
``torch.cuda.current_device()``, which fails on a CPU-only torch) are pointed at ``"cpu"``.
The reference is float64 arithmetic on the same model's logits.
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from verl.utils import seqlen_balancing  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import response_from_nested  # noqa: E402

import entropy_discriminator.adapters.verl as ed_verl  # noqa: E402
from verl_cpu_engine import cpu_engine  # noqa: E402
from entropy_discriminator import discriminator_score  # noqa: E402
from entropy_discriminator.adapters.verl._engine import SEQ_FIELD, STATS_FLAG  # noqa: E402

VOCAB = 97
PROMPT_LENS = [3, 5, 2, 4]
RESPONSE_LENS = [4, 1, 6, 3]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # spread the logits so softmax rows are far from uniform
        m.lm_head.weight.mul_(40.0)
    return m


@pytest.fixture
def engine(model, gloo, monkeypatch):
    monkeypatch.setattr(seqlen_balancing, "get_device_name", lambda: "cpu")  # dynamic batching's all-reduce tensor
    eng = cpu_engine(model, monkeypatch, autocast_dtype=torch.float32, entropy_chunk=5)
    ed_verl.patch()
    yield eng
    ed_verl.unpatch()


def _batch(stats: bool, *, remove_padding: bool, temperature: float, fused: bool = False):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (p + r,), generator=g) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    flags = dict(
        use_remove_padding=remove_padding, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
        use_fused_kernels=fused, calculate_entropy=True, temperature=temperature, pad_token_id=0,
    )
    if stats:
        flags[STATS_FLAG] = True
    return tu.get_tensordict(
        tensor_dict={
            "input_ids": nested(seqs),
            "position_ids": nested([torch.arange(len(s)) for s in seqs]),
            "loss_mask": nested([torch.ones(r, dtype=torch.int64) for r in RESPONSE_LENS]),
            "response_mask": nested([torch.ones(r, dtype=torch.int64) for r in RESPONSE_LENS]),
        },
        non_tensor_dict=flags,
    ), seqs


def _reference(model, seqs, temperature, remove_padding):
    """float64 (H, logp, S*, E_p[S]) per response token from the model's own logits."""
    with torch.no_grad():
        if remove_padding:  # verl packs all sequences into one row, position ids restarting per sequence
            ids = torch.cat(seqs)[None]
            pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            rows = torch.split(logits, [len(s) for s in seqs])
        else:
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            att = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)], att[i, : len(s)] = s, 1
            pos = torch.arange(width).expand(len(seqs), -1)
            logits = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits
            rows = [logits[i, : len(s)] for i, s in enumerate(seqs)]
    out = []
    for row, s, r in zip(rows, seqs, RESPONSE_LENS):
        z = row[len(s) - r - 1 : len(s) - 1].double() / temperature  # predicts the r response tokens
        logq = torch.log_softmax(z, -1)
        p = logq.exp()
        h = -(p * logq).sum(-1)
        lpk = logq.gather(-1, s[len(s) - r :, None])[:, 0]
        out.append((h, lpk, lpk.exp() * (h + lpk), (p * p * (h[:, None] + logq)).sum(-1)))
    return out


@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_expected_score_matches_float64(engine, model, remove_padding, temperature):
    data, seqs = _batch(True, remove_padding=remove_padding, temperature=temperature)
    out = engine.infer_batch(data)["model_output"]
    response_mask = data["response_mask"]
    s_exp = response_from_nested(out[SEQ_FIELD], response_mask)
    logp = response_from_nested(out["log_probs"], response_mask)
    ent = response_from_nested(out["entropy"], response_mask)
    for i, (h, lpk, s_star, e_s) in enumerate(_reference(model, seqs, temperature, remove_padding)):
        assert s_exp[i].dtype == torch.float32
        assert e_s.abs().max() > 1e-2  # the statistic is far from 0 here, so the comparison means something
        torch.testing.assert_close(s_exp[i].double(), e_s, rtol=1e-5, atol=1e-6)
        # S* from verl's own log-probs and entropy, as the driver forms it
        torch.testing.assert_close(discriminator_score(logp[i], ent[i]).double(), s_star, rtol=1e-4, atol=1e-5)


def test_hook_leaves_verl_outputs_alone(engine):
    with_stats, _ = _batch(True, remove_padding=True, temperature=0.7)
    without, _ = _batch(False, remove_padding=True, temperature=0.7)
    a = engine.infer_batch(with_stats)["model_output"]
    b = engine.infer_batch(without)["model_output"]
    assert SEQ_FIELD in a and SEQ_FIELD not in b
    for key in ("log_probs", "entropy"):
        assert torch.equal(a[key].values(), b[key].values())
    ed_verl.unpatch()
    c = engine.infer_batch(without)["model_output"]
    assert set(c) == set(b)
    for key in ("log_probs", "entropy"):
        assert torch.equal(c[key].values(), b[key].values())


def test_bad_logits_give_nan_not_a_worker_exception(engine, model):
    """The hook runs unchecked (no host sync per micro-batch): a NaN logit or a row of -inf only gives NaN
    E_p[S] at exactly that position, for the driver to refuse; every other position is unchanged."""
    data, _ = _batch(True, remove_padding=True, temperature=1.0)
    clean = engine.infer_batch(data)["model_output"][SEQ_FIELD].values()
    nan_at, masked_at = 2, 7  # packed positions of the first micro-batch (the first two sequences)
    calls = []

    def corrupt(module, args, output):
        calls.append(output.logits.shape)
        if len(calls) > 1:
            return output
        assert output.logits.shape[1] > masked_at
        logits = output.logits.clone()
        logits[0, nan_at, 5] = float("nan")
        logits[0, masked_at, :] = float("-inf")
        output.logits = logits
        return output

    handle = model.register_forward_hook(corrupt)
    try:
        data, _ = _batch(True, remove_padding=True, temperature=1.0)
        got = engine.infer_batch(data)["model_output"][SEQ_FIELD].values()
    finally:
        handle.remove()
    bad = torch.zeros_like(got, dtype=torch.bool)
    bad[[nan_at, masked_at]] = True
    assert torch.isnan(got[bad]).all()
    assert torch.equal(got[~bad], clean[~bad])


class FusedLlama(LlamaForCausalLM):
    """A subclass, so that verl's fused-kernel forward (patched onto the class) leaves the plain model alone."""


@pytest.fixture(scope="module")
def fused_model(model):
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    fused = FusedLlama(model.config).eval()
    fused.load_state_dict(model.state_dict())
    patch_forward_with_backends(fused, use_fused_kernels=True, fused_kernels_backend="torch")
    return fused


@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_kernels_expected_score_from_hidden_matches_float64(engine, model, fused_model, remove_padding, temperature):
    """use_fused_kernels=True: no logits exist; E_p[S] comes from the hidden states and the LM-head weight."""
    engine.module = fused_model
    data, seqs = _batch(True, remove_padding=remove_padding, temperature=temperature, fused=True)
    out = engine.infer_batch(data)["model_output"]
    response_mask = data["response_mask"]
    s_exp = response_from_nested(out[SEQ_FIELD], response_mask)
    logp = response_from_nested(out["log_probs"], response_mask)
    for i, (h, lpk, s_star, e_s) in enumerate(_reference(model, seqs, temperature, remove_padding)):
        assert e_s.abs().max() > 1e-2
        torch.testing.assert_close(s_exp[i].double(), e_s, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logp[i].double(), lpk, rtol=1e-4, atol=1e-5)  # verl's fused log-probs, same rows
    plain, _ = _batch(False, remove_padding=remove_padding, temperature=temperature, fused=True)
    assert SEQ_FIELD not in engine.infer_batch(plain)["model_output"]
    assert "_entropy_disc_from_hidden" not in vars(engine)


# --- the actor update: dynamic batch x padding removal x mask mode x GRPO/GAE --------------------


def _update_batch(estimator: str, mode: str, *, remove_padding: bool, dynamic: bool, seed: int):
    """A training batch as the actor update receives it, the adapter's mask applied; plus what the reference needs."""
    from entropy_discriminator.adapters.verl._trainer import apply_mask

    g = torch.Generator().manual_seed(seed)
    data, seqs = _batch(False, remove_padding=remove_padding, temperature=1.0)
    lens = RESPONSE_LENS
    old = [-(torch.rand(r, generator=g) * 2) for r in lens]
    if estimator == "grpo":
        adv = [torch.full((r,), float(torch.randn((), generator=g))) for r in lens]
    else:
        adv = [torch.randn(r, generator=g) for r in lens]
    keep = torch.rand(len(lens), max(lens), generator=g) > 0.35
    keep[0, 0] = False  # at least one clipped and one kept token
    keep[2, 1] = True
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    fields = {"response_mask": data["response_mask"], "loss_mask": data["loss_mask"], "advantages": nested(adv)}
    masked = {**fields, **apply_mask(fields, keep, mode)}
    for name, value in masked.items():
        data[name] = value
    data["old_log_probs"] = nested(old)
    data["prompts"] = nested([s[: len(s) - r] for s, r in zip(seqs, lens)])
    data["responses"] = nested([s[len(s) - r :] for s, r in zip(seqs, lens)])
    flags = {"use_dynamic_bsz": dynamic, "max_token_len_per_gpu": 12, "global_batch_size": len(lens), "calculate_entropy": False}
    for key, value in flags.items():
        tu.assign_non_tensor(data, **{key: value})
    return data, seqs, old, adv, keep


@pytest.fixture(scope="module")
def model64(model):
    ref = LlamaForCausalLM(model.config).double().eval()
    ref.load_state_dict(model.state_dict())
    return ref


def _reference_grads(ref, seqs, old, adv, keep, mode, clip=0.2, clip_c=3.0):
    """float64 vanilla PPO (dual clip), token-mean, written out: parameter gradients of the kept tokens' loss."""
    ref.zero_grad(set_to_none=True)
    terms, n_all = [], 0
    for i, (s, r) in enumerate(zip(seqs, RESPONSE_LENS)):
        logits = ref(input_ids=s[None], use_cache=False).logits[0].double()
        logq = torch.log_softmax(logits[len(s) - r - 1 : len(s) - 1], -1).gather(-1, s[len(s) - r :, None])[:, 0]
        ratio = (logq - old[i].double()).exp()
        a = adv[i].double()
        pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))
        pg = torch.where(a < 0, torch.minimum(pg, -a * clip_c), pg)
        k = keep[i, :r]
        terms.append(pg[k].sum())
        n_all += r
    n_kept = int(sum(keep[i, :r].sum() for i, r in enumerate(RESPONSE_LENS)))
    loss = torch.stack(terms).sum() / (n_all if mode == "zero_pg" else n_kept)
    loss.backward()
    return {name: p.grad.clone() for name, p in ref.named_parameters()}


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
@pytest.mark.parametrize("mode", ["zero_pg", "drop_token"])
@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.parametrize("dynamic", [True, False])
def test_update_gradient_is_the_kept_tokens_only(engine, model, model64, estimator, mode, remove_padding, dynamic):
    """verl's engine (micro-batching, padding removal) and loss on the masked fields = float64 loss of the kept tokens."""
    import functools

    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    actor_cfg = omega_conf_to_dataclass(
        OmegaConf.create(
            {"_target_": "verl.workers.config.FSDPActorConfig", "strategy": "fsdp", "ppo_micro_batch_size_per_gpu": 2,
             "clip_ratio": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean", "use_dynamic_bsz": dynamic,
             "ppo_max_token_len_per_gpu": 12, "rollout_n": 1}
        )
    )
    data, seqs, old, adv, keep = _update_batch(estimator, mode, remove_padding=remove_padding, dynamic=dynamic, seed=5)
    engine.module = model
    model.zero_grad(set_to_none=True)
    engine.forward_backward_batch(data, functools.partial(ppo_loss, actor_cfg), forward_only=False)
    expected = _reference_grads(model64, seqs, old, adv, keep, mode)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[name], rtol=2e-4, atol=1e-7, msg=name)
    unmasked = _reference_grads(model64, seqs, old, adv, torch.ones_like(keep), mode)  # the mask changes the update
    head = "lm_head.weight"
    assert (unmasked[head] - expected[head]).abs().max() > 100 * (model.get_parameter(head).grad.double() - expected[head]).abs().max()
    model.zero_grad(set_to_none=True)
