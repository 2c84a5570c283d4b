"""The adapter's statistics are those of TRL's own distribution, in every precision set-up.

The real ``GRPOTrainer`` (TRL 1.14 full logits, 1.16 fused LM head) trains one step on CPU over a
Llama of V = 4096, H = 256 (large enough that bf16 rounding of the logits moves S* and the mask:
the earlier adapter, which computed fp32 logits, fails the assertions below in the bf16
set-ups).  Set-ups: fp32 master weights under bf16 autocast (``bf16=True``, what TRL does with a
model name), bf16 weights with and without autocast, fp32 everywhere, fp16 weights (without
autocast: ``fp16=True`` mixed precision needs a GPU in transformers, so fp16 autocast is not
testable on CPU), and ``cast_lm_head_to_fp32`` under bf16 autocast.

For each the test asserts, on the pass the adapter reads (TRL's training forward):

* the test's float64 recomputation of TRL's distribution gives TRL's own log-prob (to 5e-3 relative:
  a GEMM other than TRL's rounds ~1e-4 of the bf16 logits to the neighbouring value; or to TRL's
  own output rounding), so the reference really is TRL's distribution;
* on TRL 1.16 the adapter computed them from the logits tiles of TRL's own fused head (no LM-head
  product of its own; 1.14-1.15: one, from the captured hidden states);
* the adapter's log-prob equals TRL's own per-token log-prob to rounding: |Δ| ≤ 2e-5 (1 + |logp|)
  where TRL's log-prob is fp32 (both are fp32 log-sum-exps over V = 4096 identical rounded logits,
  ~1e-6 apart), ≤ 2 ulp of TRL's dtype where TRL rounds its log-prob to bf16/fp16 (1.14's
  ``log_softmax`` on low-precision logits);
* the Clip_B and Clip_V keep-masks equal those of a float64 recomputation of TRL's distribution
  from the captured hidden states (``EXPECTED`` states, independently of the adapter, how TRL forms
  its logits in each set-up: compute dtype, rounding, temperature): 0 differences, with μ chosen
  so that a handful of tokens is clipped (asserted).
"""

from __future__ import annotations

import pytest
import torch
import trl
from _trl_harness import reference
from datasets import Dataset
from packaging.version import Version
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOTrainer

import entropy_discriminator.adapters.trl._patch as ed_patch
from entropy_discriminator import EntropyDiscConfig
from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, patch, unpatch

VOCAB, HIDDEN, TEMPERATURE = 4096, 256, 0.7
#: thresholds (both sides) that clip a handful of the ~1000 tokens
MU = {"clip_b": 2.0, "clip_v": 2.5}
FUSED = Version(trl.__version__) >= Version("1.15.0")
TAPPED = Version(trl.__version__) >= Version("1.16.0")  # the adapter folds the tiles of TRL's own head
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

#: set-up -> (weights dtype, GRPOConfig overrides)
SETUPS = {
    "fp32_weights_bf16_autocast": (FP32, {"bf16": True}),
    "bf16_weights_bf16_autocast": (BF16, {"bf16": True}),
    "bf16_weights_no_autocast": (BF16, {"bf16": False}),  # GRPOConfig's bf16 defaults to True
    "fp32_everywhere": (FP32, {"bf16": False}),
    "fp16_weights_no_autocast": (FP16, {"bf16": False}),
    "cast_lm_head_to_fp32_bf16_autocast": (FP32, {"bf16": True, "cast_lm_head_to_fp32": True}),
}

#: set-up -> (dtype TRL's head computes and rounds the logits in, whether TRL divides the rounded
#: logits by T in that dtype, dtype of TRL's returned log-prob), read from TRL's sources.
EXPECTED = {
    "fp32_weights_bf16_autocast": (BF16, False, FP32),
    "bf16_weights_bf16_autocast": (BF16, False, FP32),
    # 1.14: `logits / T` on bf16 logits and a bf16 `log_softmax`; 1.16: fp32 after the bf16 matmul
    "bf16_weights_no_autocast": (BF16, not FUSED, FP32 if FUSED else BF16),
    "fp32_everywhere": (FP32, False, FP32),
    "fp16_weights_no_autocast": (FP16, not FUSED, FP32 if FUSED else FP16),
    # 1.16 runs its head in fp32 with autocast off; 1.14's fp32 head forward is itself autocast
    "cast_lm_head_to_fp32_bf16_autocast": (FP32 if FUSED else BF16, False, FP32),
}


@pytest.fixture(autouse=True)
def _no_leftover_patch():
    unpatch()
    yield
    unpatch()


def _tokenizer() -> PreTrainedTokenizerFast:
    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="left")


def _model(tok: PreTrainedTokenizerFast, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        tie_word_embeddings=False, initializer_range=0.2,
    )
    return LlamaForCausalLM(config).to(dtype)


def _reward(completions: list[str], **_: object) -> list[float]:
    """Varied rewards (nonzero advantages): the sum of the completion's word indices modulo 7."""
    return [sum(int(w[1:]) for w in text.split() if w[1:].isdigit()) % 7 / 7 for text in completions]


def _prompts() -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (4, 6), generator=g).tolist()
    return Dataset.from_dict({"prompt": [" ".join(f"w{i - 4}" for i in row) for row in ids]})


class Recorder:
    """What TRL and the adapter computed on the pass the adapter read: TRL's per-token log-probs,
    the backbone's hidden states, and the adapter's statistics, advantages and keep-mask."""

    def __init__(self) -> None:
        self.trl_logps: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.completion_ids: list[torch.Tensor] = []
        self.head: list[torch.Tensor] = []  # the LM-head weight [V, H] at each pass
        self.masks: list[tuple] = []
        self.head_passes = 0  # passes where the adapter ran an LM-head product of its own (not TRL's tiles)


def _run(tmp_path, setup: str, method: str, mu: float) -> Recorder:
    dtype, overrides = SETUPS[setup]
    rec = Recorder()
    tok = _tokenizer()

    class Probe(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
            body = self.accelerator.unwrap_model(self.model).base_model

            def grab(_m, _args, out):
                rec.hidden.append(out.last_hidden_state[:, -(logits_to_keep + 1) : -1].detach().clone())

            rec.head.append(self.accelerator.unwrap_model(self.model).get_output_embeddings().weight.detach().clone())
            handle = body.register_forward_hook(grab)
            try:
                out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                 *a, **kw)
            finally:
                handle.remove()
            rec.trl_logps.append(out[0].detach().clone())
            rec.completion_ids.append(input_ids[:, -logits_to_keep:].clone())
            return out

    real_mask = ed_patch.compute_mask

    def record_mask(config, stats, advantages, group):
        result = real_mask(config, stats, advantages, group)
        rec.masks.append((stats, advantages.detach().clone(), result.keep.bool().clone()))
        return result

    args = EntropyDiscGRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=16, num_generations=8,
        max_completion_length=64, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        learning_rate=1e-3, disable_dropout=True, seed=0, temperature=TEMPERATURE,
        entropy_disc_method=method, entropy_disc_mu_low=mu, entropy_disc_mu_high=mu,
        entropy_disc_sides="both", entropy_disc_max_frac="none",
        entropy_disc_calibrate_every=0,  # no after-update pass: the last log-prob pass is the one the adapter read
        **overrides,
    )
    real_head_pass = ed_patch.stats_from_hidden

    def count_head_pass(*a, **kw):
        rec.head_passes += 1
        return real_head_pass(*a, **kw)

    patch(Probe)
    ed_patch.compute_mask, ed_patch.stats_from_hidden = record_mask, count_head_pass
    try:
        trainer = Probe(model=_model(tok, dtype), reward_funcs=_reward, args=args, train_dataset=_prompts(),
                        processing_class=tok)
        trainer.train()
    finally:
        ed_patch.compute_mask, ed_patch.stats_from_hidden = real_mask, real_head_pass
    return rec


def _trl_logits(weight: torch.Tensor, hidden: torch.Tensor, setup: str) -> torch.Tensor:
    """float64 logits z of TRL's distribution (``EXPECTED``): hidden and W in TRL's compute dtype,
    exact product rounded to it, divided by T in float64 (or in that dtype, rounded again)."""
    compute, t_low, _ = EXPECTED[setup]
    logits = (hidden.to(compute).double() @ weight.to(compute).double().T).to(compute)
    if t_low:
        return (logits / TEMPERATURE).to(compute).double()
    return logits.double() / TEMPERATURE


def _reference_keep(z: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
                    method: str, mu: float) -> torch.Tensor:
    """tests/reference.py's float64 statistics of ``z`` and its plain-Python Clip_B / Clip_V."""
    ref = reference.reference_token_stats(z, labels, temperature=1.0)
    score = ref["s_star"] if method == "clip_b" else ref["s_centered"]
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).expand_as(valid)
    keep = reference.reference_outlier_keep(
        score.flatten().tolist(), adv.flatten().tolist(), valid.flatten().tolist(), recentre=method == "clip_b",
        mu_low=mu, mu_high=mu, sides="both", max_frac=None)
    return torch.tensor(keep).reshape(valid.shape)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_adapter_reads_trls_own_distribution(tmp_path, setup):
    rec = _run(tmp_path, setup, "clip_v", MU["clip_v"])
    assert len(rec.masks) == 1 and rec.trl_logps, "one masked pass (the training forward)"
    # TRL 1.16: the statistics are folded from the tiles of TRL's fused head (no head product of ours)
    assert rec.head_passes == (0 if TAPPED else 1), rec.head_passes
    stats, advantages, keep_v = rec.masks[0]
    trl_logp, hidden = rec.trl_logps[-1], rec.hidden[-1]  # the training forward: the pass the adapter read
    valid = stats.valid
    assert int(valid.sum()) >= 500, "enough completion tokens for a few clipped ones"

    _, _, logp_dtype = EXPECTED[setup]
    assert trl_logp.dtype == logp_dtype
    bound = 2e-5 if logp_dtype == FP32 else 2 * torch.finfo(logp_dtype).eps
    gap = (stats.logp.double() - trl_logp.double()).abs()[valid]
    assert float((gap / (1 + trl_logp.double().abs()[valid])).max()) <= bound, (setup, float(gap.max()))

    z = _trl_logits(rec.head[-1], hidden, setup)
    labels = rec.completion_ids[-1].masked_fill(~valid, -100)
    ref_logp = reference.reference_token_stats(z, labels, temperature=1.0)["logp"]
    # one bf16 ulp apart in ~1e-4 of the logits (another GEMM's accumulation order), plus TRL's own
    # rounding of its log-prob where it returns it in bf16/fp16
    ref_gap = ((ref_logp - trl_logp.double()).abs() / (1 + trl_logp.double().abs()))[valid]
    assert float(ref_gap.max()) <= max(5e-3, bound), f"the reference is not TRL's distribution ({float(ref_gap.max())})"
    clip_b = EntropyDiscConfig(method="clip_b", mu_low=MU["clip_b"], mu_high=MU["clip_b"], sides="both",
                               max_frac=None)
    keep_b = ed_patch.compute_mask(clip_b, stats, advantages, None).keep.bool()  # the adapter's Clip_B
    for method, keep in (("clip_b", keep_b), ("clip_v", keep_v)):
        ref_keep = _reference_keep(z, labels, advantages, valid, method, MU[method])
        clipped = int((~ref_keep & valid).sum())
        assert 1 <= clipped <= 40, f"{method}: mu={MU[method]} clips {clipped} tokens; pick one that clips a handful"
        assert int((keep != ref_keep)[valid].sum()) == 0, (setup, method, clipped, int((~keep & valid).sum()))

