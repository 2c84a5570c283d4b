"""A small causal transformer policy in plain PyTorch (pre-LayerNorm GPT blocks, learned positions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of :class:`TinyGPT`."""

    vocab_size: int
    max_len: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def add_trunk(model: nn.Module, cfg: ModelConfig) -> None:
    """Register TinyGPT's trunk on ``model`` in TinyGPT's parameter order: ``cfg``, ``tok`` (token embedding), ``pos``
    (learned positions), ``blocks`` (``n_layers`` pre-norm blocks) and ``ln_f``; :func:`trunk` runs it."""
    model.cfg = cfg
    model.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
    model.pos = nn.Embedding(cfg.max_len, cfg.d_model)
    model.blocks = nn.ModuleList(_Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
    model.ln_f = nn.LayerNorm(cfg.d_model)


def trunk(model: nn.Module, tokens: torch.Tensor, name: str = "tokens") -> torch.Tensor:
    """TinyGPT's final hidden states [B, L, d] for ``tokens`` [B, L] int64, on a ``model`` with :func:`add_trunk`'s
    modules; ``ValueError`` naming ``name`` when ``L > max_len``."""
    t = tokens.shape[1]
    if t > model.cfg.max_len:
        raise ValueError(f"{name} has length {t} > max_len {model.cfg.max_len}")
    x = model.tok(tokens) + model.pos(torch.arange(t, device=tokens.device))
    for block in model.blocks:
        x = block(x)
    return model.ln_f(x)


class TinyGPT(nn.Module):
    """``forward(tokens [B, L] int64) -> logits [B, L, V] float32``; position ``i`` predicts token ``i + 1``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        add_trunk(self, cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(trunk(self, tokens))

    def response_logits(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Logits [B, T, V] that predict the response tokens ``sequences[:, prompt_len:]`` (T of them)."""
        return self(sequences[:, :-1])[:, prompt_len - 1 :]

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, n_new: int, *, temperature: float,
                 generator: torch.Generator) -> torch.Tensor:
        """Sample ``n_new`` tokens after ``prompts`` [B, P] from ``softmax(logits.float() / temperature)`` (0: greedy);
        returns [B, P + n_new] int64.  ``ValueError`` when ``temperature < 0``."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        seq = prompts
        for _ in range(n_new):
            logits = self(seq)[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                # sample on CPU with the CPU generator so runs are reproducible across devices
                nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(seq.device)
            seq = torch.cat([seq, nxt], dim=1)
        return seq
