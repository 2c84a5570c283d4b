"""Tiny offline inputs for the launch tests (no hub access, ~1 MB): a random Qwen2, a BPE tokenizer
trained here, and GSM8K-style prompts in verl's and OpenRLHF's data layouts."""

from __future__ import annotations

import json
from pathlib import Path

#: A random Qwen2 small enough for a CPU: hidden 128, 2 layers, 2 heads of size 64.
QWEN2 = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 512}
VOCAB = 400
#: A minimal chat template (verl's dataset applies the tokenizer's chat template to each prompt).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def problems(n: int) -> list[tuple[str, str]]:
    """``n`` GSM8K-style (question, numeric answer) pairs."""
    out = []
    for i in range(n):
        a, b = 3 + i, 7 + 2 * i
        out.append((f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?", str(a + b)))
    return out


def write_model(path: Path, seed: int = 0) -> Path:
    """A random Qwen2 (:data:`QWEN2`) and its BPE tokenizer, trained on :func:`problems`, saved in ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"{q} The answer is #### {a}" for q, a in problems(64)]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None, **QWEN2)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def write_verl_parquet(path: Path, n: int, split: str) -> Path:
    """GSM8K in the layout of verl's ``examples/data_preprocess/gsm8k.py`` (chat prompt, rule reward)."""
    import pandas as pd

    rows = [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": a},
         "extra_info": {"split": split, "index": i, "answer": a, "question": q}}
        for i, (q, a) in enumerate(problems(n))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def write_prompts_jsonl(path: Path, n: int) -> Path:
    """GSM8K prompts as OpenRLHF reads them (``--data.input_key prompt --data.label_key answer``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in problems(n)))
    return path
