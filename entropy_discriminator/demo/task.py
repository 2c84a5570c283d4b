"""The demo's verifiable task: addition of two ``n``-digit numbers, answer written least-significant digit first.

A prompt is ``a_1 .. a_n + b_1 .. b_n =`` (digits most-significant first, zero padded); the response is the ``n + 1``
digits of ``a + b`` least-significant first, so a causal model can carry.  Reward: 1 for the exact answer, else 0.
Token ids: digits ``0-9`` are ``0-9``, ``+`` is 10, ``=`` is 11.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLUS = 10
EQUALS = 11
VOCAB_SIZE = 12


@dataclass(frozen=True)
class AdditionTask:
    """``n_digits``-digit addition; one problem in ``held_out`` (by a hash of ``(a, b)``) is kept for evaluation."""

    n_digits: int = 3
    held_out: int = 10

    def __post_init__(self) -> None:
        if not 1 <= self.n_digits <= 6:
            raise ValueError(f"n_digits must be in [1, 6], got {self.n_digits}")
        if self.held_out < 2:
            raise ValueError(f"held_out must be >= 2, got {self.held_out}")

    @property
    def vocab_size(self) -> int:
        """:data:`VOCAB_SIZE` token ids."""
        return VOCAB_SIZE

    @property
    def prompt_len(self) -> int:
        """``2 n + 2`` tokens: both operands, ``+`` and ``=``."""
        return 2 * self.n_digits + 2

    @property
    def response_len(self) -> int:
        """``n + 1`` answer digits."""
        return self.n_digits + 1

    def sample(self, count: int, generator: torch.Generator, *, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` operand pairs (int64 ``[count]`` each) from ``split`` in {"train", "eval"}."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        a = b = torch.empty(0, dtype=torch.int64)
        while len(a) < count:
            new_a, new_b = (torch.randint(0, 10**self.n_digits, (2 * count,), generator=generator) for _ in range(2))
            keep = self.is_eval(new_a, new_b) == (split == "eval")
            a, b = torch.cat([a, new_a[keep]]), torch.cat([b, new_b[keep]])
        return a[:count], b[:count]

    def is_eval(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """bool [N]: whether problem ``(a, b)`` is held out, by a MINSTD hash of ``a * 10**n + b`` modulo
        ``held_out`` (a plain modulus would hold out only the ``b`` ending in 0)."""
        x = (a * 10**self.n_digits + b) % 1_000_003
        return (x * 48271 % 2_147_483_647) % self.held_out == 0

    def _digits(self, x: torch.Tensor, width: int, *, lsb_first: bool) -> torch.Tensor:
        """Decimal digits of int64 ``x`` [N] as int64 [N, width]."""
        powers = 10 ** torch.arange(width, dtype=torch.int64, device=x.device)
        d = (x[:, None] // powers) % 10  # lsb first
        return d if lsb_first else d.flip(1)

    def prompts(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Prompt tokens, int64 ``[N, 2n + 2]``."""
        plus, eq = (torch.full((len(a), 1), tok, dtype=torch.int64, device=a.device) for tok in (PLUS, EQUALS))
        digits_a, digits_b = (self._digits(x, self.n_digits, lsb_first=False) for x in (a, b))
        return torch.cat([digits_a, plus, digits_b, eq], dim=1)

    def answers(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Correct responses, int64 ``[N, n + 1]`` (digits of ``a + b``, least significant first)."""
        return self._digits(a + b, self.response_len, lsb_first=True)

    def rewards(self, a: torch.Tensor, b: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Exact-match reward, float32 ``[N]``: 1 where ``responses`` [N, n + 1] equals the answer, else 0."""
        return (responses == self.answers(a, b).to(responses.device)).all(dim=1).float()

    def warmup_targets(self, a: torch.Tensor, b: torch.Tensor, noise: float, generator: torch.Generator) -> torch.Tensor:
        """Warm-up targets [N, n + 1]: the answer, or with probability ``noise`` a plausible wrong one (so the policy
        keeps entropy on the decision tokens): half of those forget every carry (digit-wise ``(a_i + b_i) mod 10``),
        the other half move one random digit by +-1 (mod 10)."""
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        n = len(a)
        ans = self.answers(a, b)
        no_carry = sum(self._digits(x, self.response_len, lsb_first=True) for x in (a, b)) % 10
        pos = torch.randint(0, self.response_len, (n,), generator=generator)
        step = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
        off_by_one = ans.clone()
        rows = torch.arange(n)
        off_by_one[rows, pos] = (off_by_one[rows, pos] + step) % 10
        u = torch.rand(n, generator=generator)
        out = torch.where((u < noise / 2)[:, None], no_carry, ans)
        return torch.where(((u >= noise / 2) & (u < noise))[:, None], off_by_one, out)
