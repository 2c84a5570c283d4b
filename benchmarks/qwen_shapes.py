"""A model with Qwen2.5-0.5B's shapes and a tokenizer over its vocabulary, built locally (no hub).

Shared by the step benchmarks (``trl_step``, ``verl_step``); imports no training framework.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config

VOCAB = 151936
SMOKE_VOCAB = 512
SPECIAL = ["<pad>", "<eos>"]


def qwen25_05b_shapes(smoke: bool) -> Qwen2Config:
    """Qwen2.5-0.5B's architecture (its config.json values), random weights; ``smoke``: a tiny one."""
    if smoke:
        return Qwen2Config(vocab_size=SMOKE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
                           eos_token_id=1, bos_token_id=1)
    return Qwen2Config(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
                       eos_token_id=1, bos_token_id=1)


def tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer whose ids cover the whole vocabulary (any sampled id decodes)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + [f"w{i}" for i in range(vocab_size - len(SPECIAL))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", padding_side="left")
