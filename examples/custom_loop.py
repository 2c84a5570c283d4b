"""A complete plain-PyTorch GRPO loop with entropy-discriminator control, on CPU in seconds.

The task is procedurally generated and verifiable: given two digits ``a b``, answer their sum as
two digits.  A small randomly initialised transformer samples ``G`` answers per prompt; the
reward is the share of correct answer digits; advantages are group-normalised (GRPO).  The lines marked
``# <- entropy-discriminator`` are all a custom loop adds: statistics of the sampling policy,
the keep-mask, the masked loss and the metrics.

    python examples/custom_loop.py                      # Clip_V, then vanilla GRPO from the same seed
    python examples/custom_loop.py --method clip_b      # or none; --autopilot hold for the entropy autopilot

mu: unless ``--mu-low`` is given, the first batch chooses it with ``ed.mu_for_share``: the mu that clips
``--target-share`` (default 2 %) of that batch's tokens (docs/choosing-mu.md); it then stays fixed.  On a
10-digit vocabulary the library's default mu = 2.5 clips nothing with Clip_B (the lower tail of S* is short).

By default the run is followed by vanilla GRPO (``none``) from the same seed and weights, and a summary prints
the share of tokens clipped and both final entropies (``--no-baseline`` skips it).  ``--log-jsonl`` writes every
step's metrics (``entropy-discriminator plot`` draws them); ``--save-batch`` saves the first batch's mask inputs
(``entropy-discriminator suggest-mu --batch``).  One torch thread by default (``--threads``), as the demo: the
matrices are tiny, so more threads mostly add synchronisation.

``delta_entropy/predicted`` is Corollary 4's ``-lr Cov_B(A, S_c)`` and ``delta_entropy/realised`` the measured
change of the same tokens' mean entropy after the step; for a network trained with Adam ``lr`` only stands in for
the effective logit step size, so compare their signs and trends, not their sizes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn

import entropy_discriminator as ed

VOCAB = 10 + 2  # digits, <bos>, <sep>
BOS, SEP = 10, 11
PROMPT_LEN, ANSWER_LEN = 4, 2


class TinyLM(nn.Module):
    """A 2-layer causal transformer over the 12-token vocabulary."""

    def __init__(self, dim: int = 64, layers: int = 2, max_len: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, VOCAB]``; answers are digits only, so <bos> and <sep> get ``-inf``."""
        t = tokens.shape[1]
        causal = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        logits = self.head(self.blocks(self.embed(tokens) + self.pos[:t], mask=causal))
        return logits.masked_fill(torch.arange(VOCAB) >= 10, float("-inf"))


def make_prompts(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts ``<bos> a b <sep>`` and the answers ``(a + b) // 10, (a + b) % 10``."""
    ab = torch.randint(0, 10, (n, 2), generator=gen)
    prompts = torch.cat([torch.full((n, 1), BOS), ab, torch.full((n, 1), SEP)], dim=1)
    total = ab.sum(1)
    return prompts, torch.stack([total // 10, total % 10], dim=1)


@torch.no_grad()
def sample(model: TinyLM, prompts: torch.Tensor, gen: torch.Generator, temperature: float) -> torch.Tensor:
    """Sample ANSWER_LEN digit tokens per prompt; returns the full sequences."""
    seq = prompts
    for _ in range(ANSWER_LEN):
        logits = model(seq)[:, -1, :10] / temperature  # the digits (the others are -inf)
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--method", choices=["none", "clip_b", "clip_v"], default=None, help="the mask (default clip_v)")
    parser.add_argument(
        "--autopilot", metavar="TARGET", default=None,
        help="drop tokens with ed.EntropyAutopilot instead of a mask: 'hold' or a target entropy in nats/token",
    )
    parser.add_argument("--mu-low", type=float, default=None, help="mask bound in batch stds (default: chosen on batch 0)")
    parser.add_argument("--target-share", type=float, default=0.02, help="share the chosen mu clips on batch 0 (default 0.02)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest for tiny models)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the vanilla GRPO run and the comparison")
    parser.add_argument("--log-jsonl", default=None, help="write the controlled run's metrics here, one JSON line per step")
    parser.add_argument("--save-batch", default=None, help="save the first batch's mask inputs here (torch file)")
    args = parser.parse_args(argv)
    if args.autopilot is not None and args.method is not None:
        parser.error("--autopilot replaces the mask: give --method or --autopilot, not both")
    if args.autopilot is not None and args.autopilot != "hold":
        try:
            args.autopilot = float(args.autopilot)
        except ValueError:
            parser.error(f"argument --autopilot: must be 'hold' or a number (nats/token), got {args.autopilot!r}")
    args.method = "autopilot" if args.autopilot is not None else args.method or "clip_v"
    return args


def train(args: argparse.Namespace, method: str, log: list[dict[str, float]]) -> dict[str, float]:
    """GRPO with ``method`` from seed ``args.seed``; appends each step's metrics to ``log``; returns the last step's."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    monitor = ed.EntropyMonitor()  # <- entropy-discriminator
    pilot = ed.EntropyAutopilot(args.autopilot) if method == "autopilot" else None  # <- entropy-discriminator
    mu_low = args.mu_low
    start = time.time()
    for step in range(args.steps):
        prompts, answers = make_prompts(args.prompts, gen)
        prompts, answers = prompts.repeat_interleave(args.group, 0), answers.repeat_interleave(args.group, 0)
        seq = sample(model, prompts, gen, args.temperature)  # [B, PROMPT_LEN + ANSWER_LEN]: prompt + answer
        completion = seq[:, PROMPT_LEN:]
        reward = (completion == answers).float().mean(1)  # share of correct digits
        grouped = reward.view(-1, args.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).reshape(-1)
        response_mask = torch.ones_like(completion, dtype=torch.bool)

        with torch.no_grad():  # <- entropy-discriminator: statistics of the policy that sampled the batch
            logits = model(seq[:, :-1])[:, PROMPT_LEN - 1 :]  # [B, ANSWER_LEN, V]: position t predicts token t+1
            stats = ed.token_stats(logits, completion, temperature=args.temperature)  # <- entropy-discriminator
        if step == 0 and args.save_batch and method == args.method:  # the first batch of the controlled run
            ed.save_batch(args.save_batch, s_star=stats.s_star, s_centered=stats.s_centered, advantages=adv,
                          valid=response_mask)
        scores = {"clip_b": stats.s_star, "clip_v": stats.s_centered}.get(method)
        if mu_low is None and scores is not None:  # <- entropy-discriminator: mu that clips the target share of batch 0
            found = ed.mu_for_share(scores, adv, response_mask, target_share=args.target_share, method=method)
            mu_low = found.mu
            print(f"  {method}: mu_low {mu_low:g} clips {found.share:.2%} of batch 0 (ed.mu_for_share)")
        mask = None  # <- entropy-discriminator: the keep-mask of this batch (Clip_V, Clip_B or the autopilot's)
        if method == "clip_v":
            mask = ed.clip_v_mask(stats, adv, response_mask, mu_low=mu_low)  # <- entropy-discriminator: reads stats.s_centered
        elif method == "clip_b":
            mask = ed.clip_b_mask(stats, adv, response_mask, mu_low=mu_low)  # <- entropy-discriminator: reads stats.s_star
        elif pilot is not None:
            mask = pilot.from_stats(stats, adv, lr=args.lr).mask  # <- entropy-discriminator

        logits = model(seq[:, :-1])[:, PROMPT_LEN - 1 :]  # the current policy, with gradients
        logp = torch.log_softmax(logits / args.temperature, -1).gather(-1, completion[..., None])[..., 0]
        ratio = torch.exp(logp - stats.logp)  # 1 on-policy; kept to show the PPO form
        pg_losses = -adv[:, None] * ratio
        loss_mask = response_mask.float()
        if mask is not None:  # <- entropy-discriminator
            pg_losses, loss_mask = ed.apply_keep_mask(pg_losses, mask.keep, loss_mask)
        loss = (pg_losses * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

        metrics = monitor.from_stats(stats, advantages=adv, mask=mask, lr=args.lr)  # <- entropy-discriminator
        with torch.no_grad():  # the same tokens under the updated policy: the realised entropy change
            after = ed.token_stats(model(seq[:, :-1])[:, PROMPT_LEN - 1 :], completion, temperature=args.temperature)
        metrics.update(monitor.realised(stats.entropy, after.entropy, response_mask))  # <- entropy-discriminator
        log.append({"step": step, "method": method, "reward": float(reward.mean()), **metrics})
        if step % 10 == 0 or step == args.steps - 1:
            print(
                f"  {method} step {step:3d}  reward {reward.mean():.3f}  "
                f"entropy {metrics['entropy_disc/entropy/mean']:.3f}  "
                f"clip {metrics.get('entropy_disc/clip/frac', 0.0):.4f}  "
                f"dH predicted {metrics['entropy_disc/delta_entropy/predicted']:+.2e} "
                f"realised {metrics['entropy_disc/delta_entropy/realised']:+.2e}"
            )
    print(f"  {method} done in {time.time() - start:.1f}s")
    return metrics


def summary(log: list[dict[str, float]], method: str) -> tuple[float, float, float]:
    """``(mean clipped share over the steps, first entropy, last entropy)`` of ``method``'s steps in ``log``."""
    rows = [r for r in log if r["method"] == method]
    frac = [r.get("entropy_disc/clip/frac", 0.0) for r in rows]
    return sum(frac) / len(frac), rows[0]["entropy_disc/entropy/mean"], rows[-1]["entropy_disc/entropy/mean"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = [args.method] + ([] if args.no_baseline or args.method == "none" else ["none"])
    print(
        f"GRPO on two-digit addition, {' then '.join(methods)}: {args.steps} steps of {args.prompts} prompts x "
        f"{args.group} samples, {torch.get_num_threads()} torch thread(s)"
    )
    log: list[dict[str, float]] = []
    metrics = {method: train(args, method, log) for method in methods}
    print(f"{args.method}: last step's metrics:")
    for key, value in sorted(metrics[args.method].items()):
        print(f"  {key:40s} {value: .5g}")
    if args.log_jsonl:
        with open(args.log_jsonl, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in log if row["method"] == args.method)
    print(f"summary (seed {args.seed}, {args.steps} steps):")
    for method in methods:
        frac, first, last = summary(log, method)
        print(f"  {method:9s} clipped {frac:6.2%} of the tokens (mean over steps)  entropy {first:.3f} -> {last:.3f}")
    if len(methods) == 2:
        held = summary(log, methods[0])[2] - summary(log, "none")[2]
        print(f"  entropy at the last step: {held:+.3f} nats/token against none ({methods[0]} vs vanilla GRPO)")


if __name__ == "__main__":
    main()
