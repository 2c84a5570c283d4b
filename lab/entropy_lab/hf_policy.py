"""The head-to-head's :class:`~entropy_discriminator.demo.model.TinyGPT` as a transformers causal LM, for the TRL path
of the head-to-head (the same task and warm start through TRL's ``GRPOTrainer`` and the TRL adapter).

Needs ``transformers`` and ``tokenizers`` (installed with the ``trl`` extra); the core package never imports this
module.  Nothing here imports TRL.

* :class:`TinyGPTForCausalLM`: the same modules as ``TinyGPT`` (token and position embeddings, the pre-LayerNorm
  blocks, the final LayerNorm, the linear head with bias), split as transformers splits a causal LM: ``model`` (the
  backbone, ``base_model``; its output's ``last_hidden_state`` is ``ln_f(x)``, where the TRL adapter reads its hidden
  states) and ``lm_head`` (``get_output_embeddings``), plus ``GenerationMixin``.  No KV cache: every generation step
  runs the whole sequence (sequences are 15 tokens long).  Left padding is refused (``TinyGPT`` has learned
  positions and no attention mask; the task's prompts all have one length, so nothing is ever padded).
  :func:`hf_from_tinygpt_state` / :func:`tinygpt_state` convert the state dicts both ways (same tensors, renamed), so
  the wrapped model's logits are ``TinyGPT``'s on the same weights.
* :func:`countdown_tokenizer`: a word-level tokenizer over the task's 14 token ids (``0``-``9``, ``+``, ``-``, ``=``,
  ``_``), so a token's id is the task's id, plus ``<pad>`` (14) and ``<eos>`` (15) that the model cannot emit (its
  head has 14 rows): completions are always ``response_len`` tokens, as in the project's own loop.
* :func:`prompt_text` / :func:`train_prompt_stream`: the own loop's training prompts, in its order (seed-determined),
  as text rows for a dataset read in order.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerFast, PretrainedConfig
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from entropy_discriminator.demo.model import ModelConfig, TinyGPT, add_trunk, trunk

from .countdown import EQUALS, MINUS, PLUS, SKIP, VOCAB_SIZE, CountdownTask

#: Text of each task token id (index = id).
TOKEN_TEXT = [str(d) for d in range(10)] + ["+", "-", "=", "_"]
assert len(TOKEN_TEXT) == VOCAB_SIZE and TOKEN_TEXT[PLUS] == "+" and TOKEN_TEXT[MINUS] == "-"
assert TOKEN_TEXT[EQUALS] == "=" and TOKEN_TEXT[SKIP] == "_"
PAD, EOS = "<pad>", "<eos>"
#: Ids of ``<pad>`` and ``<eos>`` in :func:`countdown_tokenizer` (outside the model's 14 logits).
PAD_ID, EOS_ID = VOCAB_SIZE, VOCAB_SIZE + 1


class TinyGPTConfig(PretrainedConfig):
    """:class:`~entropy_discriminator.demo.model.ModelConfig` as a transformers config (``tie_word_embeddings``
    off: TinyGPT's head is its own weight and bias)."""

    model_type = "entropy_disc_tinygpt"

    def __init__(self, vocab_size: int = VOCAB_SIZE, max_len: int = 16, d_model: int = 64, n_layers: int = 2,
                 n_heads: int = 4, **kwargs: object) -> None:
        self.vocab_size, self.max_len, self.d_model, self.n_layers, self.n_heads = vocab_size, max_len, d_model, n_layers, n_heads
        self.hidden_size = d_model
        self.num_hidden_layers = n_layers
        self.num_attention_heads = n_heads
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)

    @classmethod
    def from_model_config(cls, mcfg: ModelConfig, **kwargs: object) -> TinyGPTConfig:
        return cls(vocab_size=mcfg.vocab_size, max_len=mcfg.max_len, d_model=mcfg.d_model, n_layers=mcfg.n_layers,
                   n_heads=mcfg.n_heads, **kwargs)

    def model_config(self) -> ModelConfig:
        return ModelConfig(self.vocab_size, self.max_len, self.d_model, self.n_layers, self.n_heads)


def _check_unpadded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None and not bool((attention_mask != 0).all()):
        raise ValueError("TinyGPTForCausalLM has learned positions and no attention mask: padded rows are not "
                         "supported (every Countdown prompt has the same length, and completions never end early)")


class TinyGPTBackbone(nn.Module):
    """TinyGPT without its head: ``forward(input_ids, attention_mask=None) -> BaseModelOutput`` whose
    ``last_hidden_state`` [B, L, d] is ``ln_f`` of the last block's output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        add_trunk(self, cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: object) -> BaseModelOutput:
        _check_unpadded(input_ids, attention_mask)
        return BaseModelOutput(last_hidden_state=trunk(self, input_ids, "input_ids"))


class TinyGPTForCausalLM(PreTrainedModel, GenerationMixin):
    """TinyGPT as a transformers causal LM (module docstring); ``forward(input_ids, attention_mask=None) ->
    CausalLMOutput(logits [B, L, V])``, the logits ``TinyGPT.forward`` gives on the same weights."""

    config_class = TinyGPTConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["_Block"]

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__(config)
        self.model = TinyGPTBackbone(config.model_config())
        self.lm_head = nn.Linear(config.d_model, config.vocab_size)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """PyTorch's own initialisation (as TinyGPT); the head-to-head always loads a warmed-up state."""

    def get_input_embeddings(self) -> nn.Module:
        return self.model.tok

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: object) -> CausalLMOutput:
        hidden = self.model(input_ids, attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                               labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs: object) -> dict[str, object]:
        """The whole sequence at every step (no KV cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def to_tinygpt(self, device: str | torch.device = "cpu") -> TinyGPT:
        """A :class:`TinyGPT` with a copy of these weights (float32) on ``device``."""
        model = TinyGPT(self.config.model_config())
        model.load_state_dict({k: v.float() for k, v in tinygpt_state(self).items()})
        return model.to(device)


def hf_from_tinygpt_state(state: dict[str, torch.Tensor], mcfg: ModelConfig, **config_kwargs: object) -> TinyGPTForCausalLM:
    """A :class:`TinyGPTForCausalLM` holding ``state`` (a ``TinyGPT`` state dict, e.g. a warm start)."""
    model = TinyGPTForCausalLM(TinyGPTConfig.from_model_config(mcfg, **config_kwargs))
    renamed = {("lm_head." + k[5:] if k.startswith("head.") else "model." + k): v for k, v in state.items()}
    model.load_state_dict(renamed, strict=True)
    return model


def tinygpt_state(model: TinyGPTForCausalLM) -> dict[str, torch.Tensor]:
    """The ``TinyGPT`` state dict of ``model`` (detached CPU copies)."""
    out = {}
    for k, v in model.state_dict().items():
        name = "head." + k[8:] if k.startswith("lm_head.") else k[len("model."):]
        out[name] = v.detach().cpu().clone()
    return out


def countdown_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ids 0-13 are the task's tokens (:data:`TOKEN_TEXT`), 14 ``<pad>``, 15 ``<eos>``;
    whitespace-separated text, no special tokens added, left padding (TRL requires it)."""
    vocab = {tok: i for i, tok in enumerate([*TOKEN_TEXT, PAD, EOS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=PAD,
                                   padding_side="left")


def prompt_text(prompt_ids: torch.Tensor) -> list[str]:
    """Prompt token rows [N, P] -> whitespace-joined text (``countdown_tokenizer`` maps it back to the same ids)."""
    return [" ".join(TOKEN_TEXT[i] for i in row) for row in prompt_ids.tolist()]


def train_prompt_stream(task: CountdownTask, seed: int, steps: int, per_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training problems of the own loop's ``steps`` RL steps for ``seed``
    (:func:`~entropy_lab.headtohead.run_arm_checkpoints` draws ``per_step`` per step from a generator
    seeded with ``seed``), concatenated in order: numbers [steps * per_step, m], targets [steps * per_step]."""
    gen = torch.Generator().manual_seed(seed)
    xs, ts = zip(*(task.sample(per_step, gen, split="train") for _ in range(steps)))
    return torch.cat(xs), torch.cat(ts)


__all__ = [
    "EOS_ID",
    "PAD_ID",
    "TOKEN_TEXT",
    "TinyGPTBackbone",
    "TinyGPTConfig",
    "TinyGPTForCausalLM",
    "countdown_tokenizer",
    "hf_from_tinygpt_state",
    "prompt_text",
    "tinygpt_state",
    "train_prompt_stream",
]
