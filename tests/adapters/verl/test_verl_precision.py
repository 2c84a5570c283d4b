"""On verl, the adapter's statistics are those of the logits verl takes its log-probs from.

Driven on CPU through verl's own ``FSDPEngineWithLMHead.infer_batch`` (the engine object is set up
as in ``test_verl_engine.py``: no FSDP wrap, which needs an accelerator) in each precision set-up
the engine offers there:

* ``bf16``: bf16 parameters and ``autocast(bf16)`` (what FSDP's ``MixedPrecision(param_dtype=bf16)``
  hands the forward: parameters cast to bf16, verl's ``forward_step`` under autocast);
* ``fp16``: ``mixed_precision.param_dtype=fp16`` (verl adds its gradient scaler): fp16 parameters and
  ``autocast(fp16)``;
* ``fp32_autocast``: fp32 parameters under ``autocast(bf16)`` (the engine's ``_autocast_dtype`` is
  bf16, the weights stay fp32: the matmuls, LM head included, run in bf16, norms in fp32);
* ``fp32``: ``mixed_precision.param_dtype=fp32`` (verl skips autocast), fp32 parameters;

each with verl's logits path (``use_fused_kernels=False``) and its torch fused kernel
(``use_fused_kernels=True``: ``FusedLinearForPPO``), padding removed and not, temperature 0.7
(verl divides in the logits' dtype: 0.7 becomes bf16 0.69921875 there).

The reference is the distribution verl itself computes, captured inside verl's call: its logits
(a forward hook on the model) or its fused head's chunk of ``(hidden @ W.T) / T`` (a wrapper around
``_fused_linear_for_ppo_fwd`` that forms the same expression from the same arguments), then
float64 arithmetic on those rounded values.  That the captured values *are* verl's is checked by
verl's own fp32 output of the pass (the logits path's chunked entropy, the fused path's
log-probs): equal to the float64 reference to fp32 rounding.

Asserted per set-up: the adapter's ``log p_k`` equals verl's own per-token log-prob to verl's output
rounding (fp32 outputs: 1e-5; bf16 outputs, verl's CPU ``log_softmax`` fallback or its fused
entropy: one bf16 ulp, at most ``2^-7 |x|``: verl's bf16 output is rounded from fp32 arithmetic, and
PyTorch's CPU bf16 ``log_softmax`` was measured up to 1.17 half-ulps off the exact value, so half an ulp
is not a bound); the adapter's ``H``, ``S*``, ``E_p[S]`` and ``S_c`` equal the
float64 reference to fp32 accumulation error; and the Clip_B and Clip_V keep-masks that the driver
(``EntropyDiscTrainerMixin.entropy_disc_step``) computes from the hook's fields equal the masks of
the float64 reference: 0 differences (both sides clipped, ``sides="both"``, Clip_B at mu = 0.5 and
Clip_V at mu = 1.0, so that each clips between 3% and 60% of the ~880 response tokens; uniformly
drawn tokens have S* near 0 with a long upper tail).  On the previous adapter (``S*`` from verl's
bf16 log-probs / entropy, ``E_p[S]`` from unrounded fp32 logits on the fused path) the eight bf16
cases fail: ``S*`` off by up to 0.27 sigma and ``S_c`` by up to 0.12 sigma, and 1-3 mask
differences in six of them; the four fp16 cases fail too (``S*`` 0.02 sigma, ``S_c`` 0.015 sigma,
one mask difference); the fp32 cases pass on both.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.experimental import torch_functional as verl_fused  # noqa: E402
from verl.workers.utils.padding import response_from_nested  # noqa: E402

import entropy_discriminator.adapters.verl as ed_verl  # noqa: E402
from verl_cpu_engine import cpu_engine  # noqa: E402
from entropy_discriminator import EntropyDiscConfig, EntropyMonitor, clip_b_mask, clip_v_mask  # noqa: E402
from entropy_discriminator.adapters.verl._engine import SEQ_FIELDS, STATS_FLAG  # noqa: E402
from entropy_discriminator.adapters.verl._trainer import EntropyDiscTrainerMixin  # noqa: E402

VOCAB = 256
TEMPERATURE = 0.7
N_SEQ = 32
MU = {"clip_b": 0.5, "clip_v": 1.0}
#: set-up -> (parameter dtype, the engine's autocast dtype)
SETUPS = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "fp32_autocast": (torch.float32, torch.bfloat16),
    "fp32": (torch.float32, torch.float32),
}


class PlainLlama(LlamaForCausalLM):
    """Own class per path: verl's fused patch replaces the forward of the class it is given."""


class FusedLlama(LlamaForCausalLM):
    """The model verl's ``patch_forward_with_backends(use_fused_kernels=True, backend="torch")`` patches."""


def _model(fused: bool, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    m = (FusedLlama if fused else PlainLlama)(cfg).eval()
    with torch.no_grad():  # logits of a few units: peaked rows, where bf16 rounding moves the statistics
        m.lm_head.weight.mul_(12.0)
    if fused:
        from verl.models.transformers.monkey_patch import patch_forward_with_backends

        patch_forward_with_backends(m, use_fused_kernels=True, fused_kernels_backend="torch")
    return m.to(dtype)


def _batch(*, remove_padding: bool, fused: bool):
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(2, 7, (N_SEQ,), generator=g).tolist()
    responses = torch.randint(20, 41, (N_SEQ,), generator=g).tolist()
    seqs = [torch.randint(0, VOCAB, (p + r,), generator=g) for p, r in zip(prompts, responses)]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    flags = dict(
        use_remove_padding=remove_padding, use_dynamic_bsz=False, micro_batch_size_per_gpu=4,
        use_fused_kernels=fused, calculate_entropy=True, temperature=TEMPERATURE, pad_token_id=0,
    )
    flags[STATS_FLAG] = True
    data = tu.get_tensordict(
        tensor_dict={
            "input_ids": nested(seqs),
            "position_ids": nested([torch.arange(len(s)) for s in seqs]),
            "loss_mask": nested([torch.ones(r, dtype=torch.int64) for r in responses]),
            "response_mask": nested([torch.ones(r, dtype=torch.int64) for r in responses]),
        },
        non_tensor_dict=flags,
    )
    return data, seqs, responses


class Capture:
    """verl's own temperature-scaled logits of every forward, as rows per sequence (float64)."""

    def __init__(self, model, fused: bool, monkeypatch) -> None:
        self.calls: list[dict] = []
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)
        if fused:
            real = verl_fused._fused_linear_for_ppo_fwd

            def fwd(hidden_states, vocab_weights, input_ids, temperature=1.0):
                # the expression of verl's torch fused head, on its arguments, in its autocast state
                self.calls[-1]["z"].append(((hidden_states @ vocab_weights.t()) / temperature).double())
                return real(hidden_states, vocab_weights, input_ids, temperature)

            monkeypatch.setattr(verl_fused, "_fused_linear_for_ppo_fwd", fwd)
        else:
            model.register_forward_hook(self._logits)

    def _inputs(self, module, args, kwargs):
        self.calls.append(
            {"ids": kwargs["input_ids"], "pos": kwargs["position_ids"], "mask": kwargs.get("attention_mask"), "z": []}
        )

    def _logits(self, module, args, output):
        logits = output.logits  # verl: logits / T.clamp(1e-8).to(logits.dtype), in the logits' dtype
        t = torch.tensor(TEMPERATURE, dtype=torch.float32).to(logits.dtype)
        self.calls[-1]["z"].append((logits / t).double().reshape(-1, logits.shape[-1]))

    def rows(self) -> list[torch.Tensor]:
        """Per sequence, in batch order: ``[len, V]`` float64 rows (row i predicts token i + 1)."""
        out = []
        for call in self.calls:
            z = torch.cat(call["z"])
            ids = call["ids"]
            if call["mask"] is None:  # packed: one row of concatenated sequences, positions restart at 0
                starts = (call["pos"][0] == 0).nonzero()[:, 0].tolist()
                bounds = [*starts, ids.shape[1]]
                out += [z[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            else:  # padded [b, L]
                width = ids.shape[1]
                for b, n in enumerate(call["mask"].sum(-1).tolist()):
                    out.append(z[b * width : b * width + n])
        return out


def _reference(rows, seqs, responses):
    """float64 (logp, H, S*, E_p[S], S_c) per response token of the captured distribution, padded ``[B, T]``."""
    width = max(responses)
    out = torch.zeros(5, len(seqs), width, dtype=torch.float64)
    for i, (z, s, r) in enumerate(zip(rows, seqs, responses)):
        assert z.shape[0] == len(s)
        z = z[len(s) - r - 1 : len(s) - 1]
        logq = torch.log_softmax(z, -1)
        p = logq.exp()
        h = -(p * logq).sum(-1)
        lpk = logq.gather(-1, s[len(s) - r :, None])[:, 0]
        s_star = lpk.exp() * (h + lpk)
        e_s = (p * p * (h[:, None] + logq)).sum(-1)
        out[:, i, :r] = torch.stack([lpk, h, s_star, e_s, s_star - e_s])
    return out


def _padded(nested_values, response_mask):
    return torch.nested.to_padded_tensor(response_from_nested(nested_values, response_mask), 0.0)


def _within_rounding(got: torch.Tensor, framework: torch.Tensor, valid: torch.Tensor) -> None:
    """``got`` (fp32, the adapter's) equals ``framework`` (verl's output) to verl's output rounding."""
    ours, theirs = got.double()[valid], framework.double()[valid]
    if framework.dtype in (torch.bfloat16, torch.float16):  # one ulp: <= eps |x| (bf16 2^-7, fp16 2^-10)
        bound = theirs.abs() * torch.finfo(framework.dtype).eps + 1e-6
        assert bool(((ours - theirs).abs() <= bound).all()), float(((ours - theirs).abs() / bound).max())
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_statistics_are_those_of_verls_own_distribution(gloo, monkeypatch, setup, fused, remove_padding):
    param_dtype, autocast_dtype = SETUPS[setup]
    model = _model(fused, param_dtype)
    capture = Capture(model, fused, monkeypatch)
    engine = cpu_engine(model, monkeypatch, autocast_dtype=autocast_dtype, entropy_chunk=64)
    ed_verl.patch()
    try:
        data, seqs, responses = _batch(remove_padding=remove_padding, fused=fused)
        out = engine.infer_batch(data)["model_output"]
    finally:
        ed_verl.unpatch()
    rows = capture.rows()
    assert [len(r) for r in rows] == [len(s) for s in seqs]
    ref = _reference(rows, seqs, responses)
    response_mask = data["response_mask"]
    valid = torch.nested.to_padded_tensor(response_mask, 0).bool()
    hook = {name: _padded(out[field], response_mask) for name, field in SEQ_FIELDS.items()}
    verl_logp, verl_h = out["log_probs"], out["entropy"]
    verl_logp_pad, verl_h_pad = _padded(verl_logp, response_mask), _padded(verl_h, response_mask)

    # the captured distribution is verl's: verl's own outputs of the pass agree with the float64 reference to their
    # rounding; at least one of them is fp32 (fused: the log-probs; logits path with padding removed: the chunked
    # entropy), where a different rounding of the logits would show
    outputs = {"logp": (verl_logp_pad, verl_logp.values().dtype, ref[0])}
    if not fused:  # the fused kernel rounds its entropy to the logits' dtype, also where it stores it in fp32
        outputs["entropy"] = (verl_h_pad, verl_h.values().dtype, ref[1])
    assert any(dtype == torch.float32 for _, dtype, _ in outputs.values()) or (setup not in ("fp32",) and not remove_padding)
    for name, (value, dtype, want) in outputs.items():
        if dtype == torch.float32:
            torch.testing.assert_close(value.double()[valid], want[valid], rtol=2e-6, atol=2e-6)
        elif name == "logp":  # verl's half-precision entropy is bf16/fp16 arithmetic (softmax, product, sum)
            _within_rounding(want, value.to(dtype), valid)

    # the adapter's logp is verl's own per-token log-prob, to verl's output rounding
    _within_rounding(hook["logp"], verl_logp_pad.to(verl_logp.values().dtype), valid)

    # all five fields from that one distribution: the float64 reference to fp32 accumulation error
    driver = SimpleNamespace(
        entropy_disc=EntropyDiscConfig(method="clip_b"),
        config=SimpleNamespace(actor_rollout_ref=SimpleNamespace(actor=SimpleNamespace(optim=SimpleNamespace(lr=1e-6)))),
        _entropy_disc_monitor=EntropyMonitor(),
    )
    g = torch.Generator().manual_seed(3)
    adv_seq = torch.randn(N_SEQ, generator=g)
    advantages = adv_seq[:, None] * valid
    sigma = {}
    for k, name in enumerate(("logp", "entropy", "s_star", "s_expected", "s_centered")):
        sigma[name] = float(ref[k][valid].std())
    for k, name in enumerate(("logp", "entropy")):
        torch.testing.assert_close(hook[name].double()[valid], ref[k][valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hook["s_expected"].double()[valid], ref[3][valid], rtol=0, atol=1e-5 * sigma["s_expected"] + 1e-7)

    for method, mu in MU.items():
        driver.entropy_disc = EntropyDiscConfig(method=method, mu_low=mu, mu_high=mu, sides="both", max_frac=None)
        mask, metrics = EntropyDiscTrainerMixin.entropy_disc_step(
            driver, advantages=advantages, response_mask=valid.long(),
            old_log_probs=hook["logp"], entropy=hook["entropy"], s_expected=hook["s_expected"],
        )
        s_star = torch.exp(hook["logp"].double()) * (hook["entropy"].double() + hook["logp"].double())
        torch.testing.assert_close(s_star[valid], ref[2][valid], rtol=0, atol=1e-5 * sigma["s_star"])
        s_c = s_star - hook["s_expected"].double()
        torch.testing.assert_close(s_c[valid], ref[4][valid], rtol=0, atol=1e-5 * sigma["s_centered"])
        if method == "clip_b":
            want = clip_b_mask(ref[2], adv_seq, valid, mu_low=mu, mu_high=mu, sides="both", max_frac=None)
        else:
            want = clip_v_mask(ref[4], adv_seq, valid, mu_low=mu, mu_high=mu, sides="both", max_frac=None)
        assert 0.03 * want.n_valid < want.n_clipped < 0.6 * want.n_valid, (method, want.n_clipped)  # clips some, not all
        assert int((mask.keep != want.keep)[valid].sum()) == 0, method
        assert metrics["entropy_disc/clip/n_clipped"] == want.n_clipped
