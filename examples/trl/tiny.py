"""A tiny causal LM, tokenizer and prompt set built locally (no hub access).

Used by ``grpo_entropy_disc.py --tiny`` (a smoke run of the example's code path on any machine)
and by ``tests/adapters/test_trl*.py``.  The model is a randomly initialised 2-layer Llama; the
tokenizer is a word-level ``PreTrainedTokenizerFast`` over a small vocabulary with left padding
(GRPOTrainer requires it).
"""

from __future__ import annotations

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
WORDS = [str(d) for d in range(10)] + ["plus", "minus", "is", "what", "answer", "the", "a", "b", "c", "d"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over ``SPECIAL + WORDS`` (24 + 4 tokens), left padding."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        padding_side="left",
    )
    return tok


def tiny_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, hidden: int = 32, layers: int = 2,
               init_std: float = 0.2, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Randomly initialised Llama (``hidden`` wide, ``layers`` deep) over the tokenizer's vocabulary.

    ``init_std`` (the weights' init std; HF's default is 0.02) is large enough that the next-token
    distributions differ from uniform, so entropies and S* vary across tokens.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False, initializer_range=init_std,
    )
    return LlamaForCausalLM(config).to(dtype)


def tiny_dataset(n: int = 16, *, seed: int = 0) -> Dataset:
    """``n`` prompts "what is x plus y" with the sum's last digit as ``answer``."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randint(0, 10, (n, 2), generator=g).tolist()
    return Dataset.from_dict({
        "prompt": [f"what is {x} plus {y}" for x, y in xs],
        "answer": [str((x + y) % 10) for x, y in xs],
    })


def digit_reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1 when the completion's first digit is the answer, 0.1 per distinct word otherwise (varied rewards)."""
    out = []
    for text, ans in zip(completions, answer):
        digits = [w for w in text.split() if w.isdigit()]
        out.append(1.0 if digits and digits[0] == ans else 0.1 * len(set(text.split())))
    return out
