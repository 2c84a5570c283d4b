"""The head-to-head: a warm start that has learned signed-sum Countdown, RL arms with every peer
hyperparameter exposed, and checkpoint evaluation at several temperatures on disjoint held-out prompt sets.

RL is the harness's one loop, :func:`entropy_lab.rl.rl_steps` (verl-style: sample ``prompts_per_step x group_size``
responses at temperature 1 with the current policy, advantages once, ``minibatches`` shuffled optimiser steps with
PPO's clipped surrogate, token-mean, grad-norm 1), in which every setting the tuning stage varies is a field of
:class:`~entropy_lab.rl.Arm` (learning rate, PPO clip ratios, Clip_V's cap, forking tokens' rho, Clip-Cov's bounds,
KL-Cov's coefficient, the rank penalty); here the policy is evaluated at fixed checkpoints during RL.

Evaluation (:func:`evaluate_at`): ``samples`` samples of each prompt of a fixed prompt set at temperature ``T``;
``avg`` = mean correctness (Avg@K for every K), ``pass@K`` = mean over prompts of the unbiased estimator
``1 - C(n - c, K) / C(n, K)`` (:func:`~entropy_lab.countdown.pass_at_k`).  The sampling stream of a
checkpoint evaluation depends on (seed, checkpoint index, temperature) only, so the arms of a seed share it (paired).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from entropy_discriminator.demo.model import TinyGPT

from .compare import CompareConfig
from .compare_metrics import EVAL_KS
from .countdown import CountdownTask, pass_at_k
from .rl import Arm, rl_steps


@dataclass(frozen=True)
class HeadConfig(CompareConfig):
    """:class:`~entropy_lab.compare.CompareConfig` plus the task's target distribution and the warm-up's solution
    (:class:`~entropy_lab.countdown.CountdownTask` ``targets``: ``coef`` or ``uniform``; ``warmup_solution``:
    ``random`` or ``first``)."""

    targets: str = "coef"
    warmup_solution: str = "random"

    def task(self) -> CountdownTask:
        return CountdownTask(n_numbers=self.n_numbers, targets=self.targets, warmup_solution=self.warmup_solution)


def heldout_sets(task: CountdownTask, n_test: int, n_val: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Disjoint test and validation prompt sets from the held-out split: test = the first ``n_test`` held-out problems
    of generator seed 12345 (the compare harness's evaluation prompts when ``n_test = 200``); validation = the first
    ``n_val`` held-out problems of generator seed 54321 that are not in the test set (and not repeated)."""
    test = task.sample(n_test, torch.Generator().manual_seed(12345), split="eval")
    seen = {tuple(r) for r in torch.cat([test[0], test[1][:, None]], 1).tolist()}
    gen = torch.Generator().manual_seed(54321)
    xs: list[torch.Tensor] = []
    ts: list[torch.Tensor] = []
    while len(xs) < n_val:
        x, t = task.sample(n_val, gen, split="eval")
        for xi, ti in zip(x, t):
            key = (*xi.tolist(), int(ti))
            if key not in seen and len(xs) < n_val:
                seen.add(key)
                xs.append(xi)
                ts.append(ti)
    return test, (torch.stack(xs), torch.stack(ts))


@torch.no_grad()
def evaluate_at(
    model: TinyGPT,
    task: CountdownTask,
    prompts: tuple[torch.Tensor, torch.Tensor],
    *,
    samples: int,
    temperature: float,
    stream: int,
    chunk: int = 256,
    batched: bool = False,
) -> dict[str, object]:
    """``samples`` samples per prompt at ``temperature`` (sampling generator seeded with ``stream``).

    Returns ``avg`` = ``sum_p c_p / (P n)``, ``pass`` = ``{K: mean_p (1 - C(n - c_p, K) / C(n, K))}`` for K in
    :data:`EVAL_KS` up to ``samples``, and ``correct`` = the counts ``c_p``.  ``chunk`` rows are sampled at a time
    (small chunks run faster on one CPU core); the draws depend on ``chunk``, so it is fixed for a whole study.
    ``batched``: the same draws from one forward over all rows per token (:func:`_generate_in_chunk_order`), for a
    GPU, where 256-row forwards are bound by kernel launches.
    """
    x, t = prompts
    gen = torch.Generator().manual_seed(stream)
    rows = task.prompts(x, t).repeat_interleave(samples, 0)
    xr, tr = x.repeat_interleave(samples, 0), t.repeat_interleave(samples, 0)
    ok, device = [], next(model.parameters()).device
    if batched and temperature > 0:
        seq = _generate_in_chunk_order(model, rows.to(device), task.response_len, temperature, gen, chunk)
        ok.append(task.rewards(xr, tr, seq[:, task.prompt_len :]))
    else:
        for start in range(0, len(rows), chunk):
            seq = model.generate(rows[start : start + chunk].to(device), task.response_len, temperature=temperature,
                                 generator=gen)
            ok.append(task.rewards(xr[start : start + chunk], tr[start : start + chunk], seq[:, task.prompt_len :]))
    correct = torch.cat(ok).view(-1, samples).sum(1).to(torch.int64)
    return {
        "avg": float(correct.double().mean() / samples),
        "pass": {k: float(pass_at_k(samples, correct, k).mean()) for k in EVAL_KS if k <= samples},
        "correct": correct.tolist(),
    }


@torch.no_grad()
def _generate_in_chunk_order(model: TinyGPT, rows: torch.Tensor, n_new: int, temperature: float,
                             gen: torch.Generator, chunk: int) -> torch.Tensor:
    """What the loop ``for each chunk of rows: model.generate(chunk, n_new, ...)`` samples, from one forward over all
    ``rows`` [N, P] per new token: a CPU draw of ``torch.multinomial`` advances ``gen`` by an amount that depends only
    on the probability tensor's shape, so the generator state at each (chunk, token) of that loop is found first by
    drawing from placeholder tensors of the same shapes, and each chunk's real draw starts from its state.  Returns
    int64 [N, P + n_new]; ``gen`` ends where the loop would leave it."""
    seq, starts = rows, range(0, len(rows), chunk)
    n_vocab = model.head.out_features
    states: dict[tuple[int, int], torch.Tensor] = {}
    for s in starts:
        for i in range(n_new):
            states[s, i] = gen.get_state()
            torch.multinomial(torch.ones(len(rows[s : s + chunk]), n_vocab), 1, generator=gen)
    end = gen.get_state()
    for i in range(n_new):
        probs = torch.softmax(model(seq)[:, -1].float() / temperature, dim=-1).cpu()
        nxt = []
        for s in starts:
            gen.set_state(states[s, i])
            nxt.append(torch.multinomial(probs[s : s + chunk], 1, generator=gen))
        seq = torch.cat([seq, torch.cat(nxt).to(seq.device)], dim=1)
    gen.set_state(end)
    return seq


def eval_stream(seed: int, checkpoint: int, temperature: float) -> int:
    """Sampling seed of one checkpoint evaluation: shared by every arm of ``seed`` (common random numbers)."""
    return 10_000 + 1_000 * seed + 10 * checkpoint + int(round(temperature * 10))


@dataclass
class ArmTrace:
    """One (arm, seed) run: per-step training records and the evaluations at each checkpoint."""

    arm: str
    family: str
    seed: int
    records: list[dict[str, float]] = field(default_factory=list)
    checkpoints: list[dict[str, object]] = field(default_factory=list)
    seconds: float = 0.0


def run_arm_checkpoints(
    state: dict[str, torch.Tensor],
    cfg: CompareConfig,
    arm: Arm,
    seed: int,
    checkpoints: tuple[int, ...],
    on_checkpoint: Callable[[int, TinyGPT], dict[str, object]],
    *,
    device: torch.device = torch.device("cpu"),
) -> ArmTrace:
    """RL (:func:`entropy_lab.rl.rl_steps`, on ``device``; sampling on the CPU's generators either way) from
    ``state`` for ``max(checkpoints)`` steps, a record per step (numbered from 1; its fields are :func:`~entropy_lab.rl.rl_steps`'s); after each step count in
    ``checkpoints`` (0 = the start) records ``on_checkpoint(step, model)`` with ``step`` added.  Training prompts and
    the rollout sampling stream depend on ``seed`` only (paired across arms)."""
    out = ArmTrace(arm=arm.name, family=arm.family, seed=seed)
    t0 = time.perf_counter()
    for step, model, rec, _ in rl_steps(state, cfg, arm, seed, max(checkpoints), device=device):
        if rec is not None:
            out.records.append({"step": step, **rec})
        if step in checkpoints:
            out.checkpoints.append({"step": step, **on_checkpoint(step, model)})
    out.seconds = time.perf_counter() - t0
    return out


__all__ = [
    "EVAL_KS",
    "HeadConfig",
    "ArmTrace",
    "eval_stream",
    "evaluate_at",
    "heldout_sets",
    "run_arm_checkpoints",
]
