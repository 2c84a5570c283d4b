"""A verifiable task with headroom and several valid answers per prompt: signed-sum Countdown.

A prompt gives ``m`` numbers ``x_1 .. x_m`` (each in 1..9) and a target ``T``; the response is one coefficient
per number, ``c_i`` in {``+``, ``-``, skip}, and the reward is 1 exactly when ``sum_i c_i x_i == T`` (else 0).
Targets are made by drawing a random coefficient vector, so every prompt has at least one solution, and most
have several (``T`` near 0 has many): a policy can sharpen on one solution (Avg@K up, Pass@K flat) or keep
several alive (Pass@K at large K up).  The causal model must carry a running sum through the response, which a
small transformer only half learns in a short warm-up: the headroom the comparison needs.

Tokens: a prompt is ``x_1 .. x_m = s t u`` (``s`` the target's sign ``+``/``-``, ``t u`` its two decimal digits);
a response is ``m`` tokens from {``+``, ``-``, ``_``}.  Ids: digits ``0-9`` are ``0-9``, ``+`` 10, ``-`` 11,
``=`` 12, ``_`` (skip) 13; the vocabulary has 14 entries.

Warm-up targets are like a base model's samples: a uniformly random *valid* coefficient vector (``warmup_solution
= "random"``), or one reference solution per problem, the first valid vector in the order of
:meth:`CountdownTask.all_coefficients` (``"first"``: like supervised data with one answer per question, it teaches a
sharp policy, confidently wrong where it has not learned the rule); with probability ``noise`` a uniformly random
vector (usually wrong).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

PLUS = 10
MINUS = 11
EQUALS = 12
SKIP = 13
VOCAB_SIZE = 14
#: Coefficient value of each response token id (other ids are not valid responses).
COEF_OF_TOKEN = {PLUS: 1, MINUS: -1, SKIP: 0}


@dataclass(frozen=True)
class CountdownTask:
    """``n_numbers`` numbers in 1..9, coefficients in {+1, -1, 0}; one prompt in ``held_out`` is held out.

    ``targets``: ``"coef"`` draws the target as ``sum_i c_i x_i`` of a uniformly random coefficient vector (targets with
    many solutions are frequent); ``"uniform"`` draws it uniformly from the distinct achievable sums of the numbers
    (every achievable target equally likely, so prompts with one or two solutions are common: harder prompts).
    ``warmup_solution``: which valid vector :meth:`warmup_targets` teaches, ``"random"`` (uniform over the solutions)
    or ``"first"`` (the first solution in the order of :meth:`all_coefficients`).
    """

    n_numbers: int = 6
    held_out: int = 10
    targets: str = "coef"
    warmup_solution: str = "random"

    def __post_init__(self) -> None:
        if not 2 <= self.n_numbers <= 11:
            raise ValueError(f"n_numbers must be in [2, 11] (|T| <= 99 fits two digits), got {self.n_numbers}")
        if self.held_out < 2:
            raise ValueError(f"held_out must be >= 2, got {self.held_out}")
        if self.targets not in ("coef", "uniform"):
            raise ValueError(f"targets must be 'coef' or 'uniform', got {self.targets!r}")
        if self.warmup_solution not in ("random", "first"):
            raise ValueError(f"warmup_solution must be 'random' or 'first', got {self.warmup_solution!r}")

    @property
    def vocab_size(self) -> int:
        """:data:`VOCAB_SIZE` token ids."""
        return VOCAB_SIZE

    @property
    def prompt_len(self) -> int:
        """``m + 4`` tokens: the numbers, ``=``, the target's sign and two digits."""
        return self.n_numbers + 4

    @property
    def response_len(self) -> int:
        """``m`` coefficient tokens."""
        return self.n_numbers

    def all_coefficients(self) -> torch.Tensor:
        """Every coefficient vector, int64 ``[3**m, m]`` (entries in {-1, 0, 1})."""
        return torch.tensor(list(itertools.product((-1, 0, 1), repeat=self.n_numbers)), dtype=torch.int64)

    def sample(self, count: int, generator: torch.Generator, *, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` problems of ``split`` in {"train", "eval"}: numbers int64 ``[count, m]``, targets int64 ``[count]``."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        xs: list[torch.Tensor] = []
        ts: list[torch.Tensor] = []
        got = 0
        while got < count:
            x = torch.randint(1, 10, (2 * count, self.n_numbers), generator=generator)
            c = torch.randint(-1, 2, (2 * count, self.n_numbers), generator=generator)  # drawn in both modes
            t = (c * x).sum(1) if self.targets == "coef" else self._uniform_targets(x, generator)
            is_eval = self.is_eval(x, t)
            keep = is_eval if split == "eval" else ~is_eval
            xs.append(x[keep])
            ts.append(t[keep])
            got += int(keep.sum())
        return torch.cat(xs)[:count], torch.cat(ts)[:count]

    def _uniform_targets(self, numbers: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """int64 ``[N]``: per row, a target drawn uniformly from the distinct values of ``numbers @ coefs.T``."""
        offset = 9 * self.n_numbers
        sums = numbers @ self.all_coefficients().T + offset  # [N, 3**m], in [0, 2 * offset]
        present = torch.zeros(len(numbers), 2 * offset + 1).scatter_(1, sums, 1.0)
        return torch.multinomial(present, 1, generator=generator)[:, 0] - offset

    def is_eval(self, numbers: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """bool ``[N]``: whether a problem belongs to the held-out split (a MINSTD hash of its tokens mod ``held_out``)."""
        key = torch.zeros(len(targets), dtype=torch.int64)
        for col in torch.cat([numbers, (targets + 100)[:, None]], dim=1).T:
            key = (key * 211 + col) % 1_000_003
        return (key * 48271 % 2_147_483_647) % self.held_out == 0

    def prompts(self, numbers: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Prompt tokens, int64 ``[N, m + 4]``."""
        n = len(targets)
        sign = torch.where(targets < 0, MINUS, PLUS)
        mag = targets.abs()
        tail = torch.stack([torch.full((n,), EQUALS), sign, mag // 10, mag % 10], dim=1)
        return torch.cat([numbers, tail], dim=1)

    def coefficients(self, responses: torch.Tensor) -> torch.Tensor:
        """Coefficients int64 ``[N, m]`` of response tokens ``[N, m]``; a token outside {+, -, _} maps to 0."""
        out = torch.zeros_like(responses)
        out = torch.where(responses == PLUS, 1, out)
        return torch.where(responses == MINUS, -1, out)

    def rewards(self, numbers: torch.Tensor, targets: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Exact reward, float32 ``[N]``: 1 where every response token is a coefficient and ``sum c x == T``."""
        responses = responses.cpu()
        well_formed = ((responses == PLUS) | (responses == MINUS) | (responses == SKIP)).all(1)
        hit = (self.coefficients(responses) * numbers).sum(1) == targets
        return (well_formed & hit).float()

    def n_solutions(self, numbers: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Number of valid coefficient vectors per problem, int64 ``[N]`` (out of ``3**m``)."""
        return ((numbers @ self.all_coefficients().T) == targets[:, None]).sum(1)

    def warmup_targets(
        self, numbers: torch.Tensor, targets: torch.Tensor, noise: float, generator: torch.Generator
    ) -> torch.Tensor:
        """Warm-up responses ``[N, m]``: a solution (uniformly random, or the first one: ``warmup_solution``), or with
        probability ``noise`` random tokens."""
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        coefs = self.all_coefficients()
        ok = ((numbers @ coefs.T) == targets[:, None]).float()  # [N, 3**m], every row has a 1
        pick = ok.argmax(1) if self.warmup_solution == "first" else torch.multinomial(ok, 1, generator=generator)[:, 0]
        chosen = coefs[pick]
        random = torch.randint(-1, 2, chosen.shape, generator=generator)
        use_random = torch.rand(len(targets), generator=generator) < noise
        c = torch.where(use_random[:, None], random, chosen)
        return torch.where(c > 0, PLUS, torch.where(c < 0, MINUS, SKIP))


def pass_at_k(n: int, c: torch.Tensor, k: int) -> torch.Tensor:
    """Unbiased Pass@k per prompt from ``c`` correct among ``n`` samples (Chen et al. 2021), float64 ``[P]``.

    ``1 - C(n - c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``; requires ``1 <= k <= n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    out = torch.empty(len(c), dtype=torch.float64)
    for j, cj in enumerate(c.tolist()):
        if n - cj < k:
            out[j] = 1.0
        else:
            out[j] = 1.0 - math.prod(1.0 - k / i for i in range(n - cj + 1, n + 1))
    return out
