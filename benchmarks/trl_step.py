"""Cost of the TRL adapter in a real GRPO step, one CUDA GPU.

A model with Qwen2.5-0.5B's shapes (Qwen2 config, 24 layers, hidden 896, vocabulary 151936, tied
embeddings; random weights) saved to a local path and given to ``GRPOTrainer`` BY PATH, a
word-level tokenizer over the same vocabulary, 8 prompts x 8 generations x 512 completion tokens per
step (HF generation), TRL's defaults otherwise (dapo, one iteration, one micro-batch of 64
completions = the generation batch, so the adapter reads TRL's training forward).  Rows:

* ``fp32_bf16``: fp32 weights on disk, loaded by name with ``bf16=True`` (what TRL does given a
  model name: fp32 master weights, bf16 autocast);
* ``bf16``: ``model_init_kwargs={"dtype": torch.bfloat16}`` (bf16 weights), ``bf16=True``;

each with gradient checkpointing on and off.  Per row the arms, each ``--steps`` optimiser steps from
the same initial weights, in one process: ``clip_v_gen`` (Clip_V with real generation, completions
recorded; in the first row and GC setting only), then ``off`` (stock ``GRPOTrainer``), ``monitor``,
``clip_b``, ``clip_v`` with the recorded completions replayed, so every arm of every row trains on
identical batches (generation time is no part of the measured non-generation step).

Per step: wall time (CUDA-synchronised), the time inside the model's ``generate`` only (so any
adapter work elsewhere counts against the adapter), the rest (= the non-generation part), and the
adapter functions' own time (statistics, mask and metrics; each synchronised); per arm: peak
allocated GPU memory.  Medians of steps 2..N (N = ``--steps``, default 5: 4 timed steps).  Writes ``benchmarks/results/<card>/trl_step.csv``
(or ``--out``) and prints a table with ratios vs ``off`` of the same row.

    python -m benchmarks trl-step [--steps 4] [--completion 512] [--rows fp32_bf16,bf16] [--gc on,off]
        [--step-cost benchmarks/results/step_cost.csv]
    python -m benchmarks trl-step --tiny --device cpu     # the code path on a tiny model, CPU

Also writes ``step_cost.csv`` (columns card, framework, setup, adapter_share: the adapter's own
time per step over the stock arm's non-generation step, per row, GC setting and arm, with the law
calibration's after-update pass (one no-grad forward of ``calibrate_share`` of one batch in
``calibrate_every``, the defaults) spread over the batches it serves, and without it).
On TRL 1.16 the adapter's statistics come from the tiles of TRL's own fused LM head (a
``VocabFold`` read of each tile, timed with CUDA events inside TRL's pass); ``head_pass_calls``
counts the passes where it computed them from hidden states instead (a head product of its own).
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import GenerationMixin, Qwen2ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import entropy_discriminator.adapters.trl._patch as ed_patch
from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, unpatch
from entropy_discriminator.adapters.trl._tap import HeadTap
from entropy_discriminator.vocab_fold import VocabFold

if __package__ in (None, ""):  # run as a script (python benchmarks/trl_step.py): the repository root, for benchmarks/
    sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks.common import free_memory, step_cost_card, step_cost_pair, sync, timed, write_step_cost
from benchmarks.qwen_shapes import SMOKE_VOCAB, SPECIAL, qwen25_05b_shapes, tokenizer


def prompts(n: int, length: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(len(SPECIAL), SMOKE_VOCAB, (n, length), generator=g).tolist()
    return Dataset.from_dict({"prompt": [" ".join(f"w{i}" for i in row) for row in ids]})


def reward(completions: list[str], **_: Any) -> list[float]:
    """Varied rewards (so advantages are nonzero): distinct words modulo 7."""
    return [(len(set(text.split())) % 7) / 7 for text in completions]


class Clock(TrainerCallback):
    """Per optimiser step: CUDA-synchronised wall time; ``STEP[0]`` is the index of the running step."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._t = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        sync()
        STEP[0] = len(self.steps)
        self._t = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        sync()
        self.steps.append(time.perf_counter() - self._t)


STEP = [0]  # the optimiser step running now (set by Clock)


class Timed:
    """Wraps ``owner.name``; ``per_step(n)`` gives its time summed per optimiser step.

    ``events=False``: wall time, the GPU synchronised before and after each call (host work and
    synchronisations count).  ``events=True``: the GPU time between CUDA events around each call,
    without synchronising (for functions called many times inside TRL's own passes, whose work
    would otherwise be serialised with TRL's).
    """

    def __init__(self, owner: Any, name: str, events: bool = False) -> None:
        self.owner, self.name, self.real = owner, name, owner.__dict__[name]
        self.calls: list[tuple[int, Any]] = []  # (step, seconds or (start, end) events)
        real, calls = getattr(owner, name), self.calls
        events = events and torch.cuda.is_available()

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if events:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = real(*args, **kwargs)
                end.record()
                calls.append((STEP[0], (start, end)))
                return out
            out, seconds = timed(real, *args, **kwargs)
            calls.append((STEP[0], seconds))
            return out

        setattr(owner, name, wrapper)

    def per_step(self, n: int) -> list[float]:
        sync()
        total = [0.0] * n
        for step, t in self.calls:
            if step < n:
                total[step] += t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3
        return total

    def restore(self) -> None:
        setattr(self.owner, self.name, self.real)


ARMS = ("off", "monitor", "clip_b", "clip_v")
ROWS = {"fp32_bf16": None, "bf16": torch.bfloat16}  # row -> model_init_kwargs dtype (None: as saved, fp32)


def run_arm(arm: str, row: str, gc: bool, path: Path, tok, data, ns, recorded: list | None) -> dict:
    """Train ``ns.steps`` steps in one arm; ``recorded`` None: real generation (recorded), else replayed."""
    cpu = ns.device == "cpu"
    dtype = ROWS[row]
    common = dict(output_dir=str(ns.tmp / f"{row}_{gc}_{arm}"), per_device_train_batch_size=ns.batch,
                  num_generations=8, max_completion_length=ns.completion, max_steps=ns.steps, learning_rate=1e-6,
                  logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_dropout=True,
                  use_cpu=cpu, bf16=True, gradient_checkpointing=gc,
                  model_init_kwargs=None if dtype is None else {"dtype": dtype})
    method = {"off": None, "monitor": "none", "clip_b": "clip_b", "clip_v": "clip_v", "clip_v_gen": "clip_v"}[arm]
    unpatch()
    args = GRPOConfig(**common) if method is None else EntropyDiscGRPOConfig(**common, entropy_disc_method=method)
    real_generate = GRPOTrainer._generate
    store: list = []
    queue = iter(recorded or [])

    def source(self: GRPOTrainer, prompts: list) -> Any:
        if recorded is not None:
            return copy.deepcopy(next(queue))
        out = real_generate(self, prompts)
        store.append(copy.deepcopy(out))
        return out

    GRPOTrainer._generate = source
    gen_t = Timed(GenerationMixin, "generate")
    timers = [Timed(ed_patch, name) for name in ("stats_from_hidden", "_mask_micro_batch", "_mask_generation_batch")]
    timers += [Timed(HeadTap, "stats"), Timed(VocabFold, "fold", events=True)]
    calibration = Timed(ed_patch, "_extra_pass")  # the after-update pass of one batch in calibrate_every
    clock = Clock()
    trainer = GRPOTrainer(model=str(path), reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          callbacks=[clock])
    free_memory()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    finally:
        for timer in (gen_t, *timers, calibration):
            timer.restore()
        GRPOTrainer._generate = real_generate
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    logs = [h for h in trainer.state.log_history if "entropy" in h]
    state = trainer.__dict__.get(ed_patch._CLASS_STATE_ATTR, (None, None))[1]
    route = getattr(state, "plan", None)
    every = state.config.calibrate_every if state is not None else 0
    share = state.config.calibrate_share if state is not None else 0.0
    calib = [t for _, t in calibration.calls]
    n = len(clock.steps)
    gen = gen_t.per_step(n) if recorded is None else [0.0] * n  # replayed: no generate call
    adapter = [sum(col) for col in zip(*[t.per_step(n) for t in timers])]
    fold = timers[-1].per_step(n)
    sel = slice(1, ns.steps)  # steps 2..N
    out = {
        "row": row, "gradient_checkpointing": gc, "weights": str(next(trainer.model.parameters()).dtype),
        "arm": arm,
        "route": route.route if route is not None else "",
        "generation": "real" if recorded is None else "replayed",
        "step_s": statistics.median(clock.steps[sel]),
        "generation_s": statistics.median(gen[sel]),
        "rest_s": statistics.median([s - g for s, g in zip(clock.steps[sel], gen[sel])]),
        "adapter_s": statistics.median(adapter[sel]),
        "tap_fold_s": statistics.median(fold[sel]),
        # the calibration's after-update pass (a no-grad forward of calibrate_share of one batch in
        # calibrate_every): its mean time, and that time spread over the calibrate_every batches it serves
        "calibration_pass_s": statistics.mean(calib) if calib else 0.0,
        "calibration_s": statistics.mean(calib) / every if calib and every else 0.0,
        "calibrate_every": every,
        "calibrate_share": share,
        "calibration_passes": len(calib),
        "head_pass_calls": len(timers[0].calls),
        "peak_gib": peak,
        "entropy_trl": logs[0].get("entropy", float("nan")),
        "entropy_disc_mean": logs[0].get("entropy_disc/entropy/mean", float("nan")),
        "clip_frac": logs[0].get("entropy_disc/clip/frac", float("nan")),
        "steps_s": " ".join(f"{s:.3f}" for s in clock.steps),
    }
    del trainer
    free_memory()
    unpatch()
    if recorded is None:
        out["_recorded"] = store
    return out


def step_cost_rows(rows: list[dict], card: str) -> list[dict]:
    """Two rows per precision row, GC setting and adapter arm (replayed batches): the adapter's own
    time per step (median) over the stock arm's non-generation step time of the same row, with the
    law calibration's after-update pass spread over its ``calibrate_every`` batches (the default
    set-up, ``.../calibrate_every=N,calibrate_share=S``) and without it (``calibrate_every=0``)."""
    base = {(r["row"], r["gradient_checkpointing"]): r["rest_s"] for r in rows if r["arm"] == "off"}
    out = []
    for r in rows:
        if r["arm"] not in ARMS[1:]:
            continue
        setup = f"{r['row']}/gc_{'on' if r['gradient_checkpointing'] else 'off'}/{r['arm']}"
        out += step_cost_pair(card, "trl", setup, adapter_s=r["adapter_s"], calibration_s=r["calibration_s"],
                              stock_s=base[(r["row"], r["gradient_checkpointing"])], every=r["calibrate_every"],
                              share=r["calibrate_share"])
    return out


def write_results(rows: list[dict], card: str, ns: argparse.Namespace) -> list[dict]:
    """Write ``trl_step.csv`` (every arm) and the step-cost rows; returns the latter."""
    folder = next((c for c in ("h100", "h200") if c in card.lower()), card.lower())  # the results/ folder names
    out = ns.out or Path(__file__).resolve().parent / "results" / folder
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "trl_step.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shares = step_cost_rows(rows, card)
    write_step_cost(ns.step_cost or out / "step_cost.csv", shares)
    return shares


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=5, help="optimiser steps per arm; the first is warm-up")
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64, help="completions per step (8 per prompt)")
    parser.add_argument("--rows", default="fp32_bf16,bf16", help=f"comma-separated, of {list(ROWS)}")
    parser.add_argument("--gc", default="off,on", help="gradient checkpointing settings, comma-separated")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--step-cost", type=Path, default=None,
                        help="the adapter-share CSV (default: step_cost.csv beside trl_step.csv)")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/trl_step"))
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path only")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ns = parser.parse_args(argv)
    rows_asked = [r for r in ns.rows.split(",") if r]
    if any(r not in ROWS for r in rows_asked):
        raise ValueError(f"--rows must name rows of {list(ROWS)}, got {ns.rows!r}")
    gcs = [{"on": True, "off": False}[g] for g in ns.gc.split(",") if g]
    card = f"cpu_{'tiny' if ns.tiny else 'full'}" if ns.device == "cpu" else step_cost_card(torch.cuda.get_device_name())
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen25_05b_shapes(ns.tiny)).to(torch.float32)
    path = ns.tmp / "model_fp32"
    model.save_pretrained(path)  # fp32 weights on disk; each arm loads them by path
    tok, data = tokenizer(model.config.vocab_size), prompts(ns.batch // 8 * ns.steps)
    del model
    rows: list[dict] = []
    recorded: list | None = None
    for row in rows_asked:
        for gc in gcs:
            group = []
            if recorded is None:  # the first row and GC setting generates (HF generate); every arm replays it
                first = run_arm("clip_v_gen", row, gc, path, tok, data, ns, None)
                recorded = first.pop("_recorded")
                group.append(first)
            group += [run_arm(arm, row, gc, path, tok, data, ns, recorded) for arm in ARMS]
            base = next(r for r in group if r["arm"] == "off")
            for r in group:
                r["card"] = card
                r["rest_vs_off_pct"] = 100 * (r["rest_s"] / base["rest_s"] - 1)
                r["peak_vs_off_pct"] = 100 * (r["peak_gib"] / base["peak_gib"] - 1)
            rows += group
            shares = write_results(rows, card, ns)  # after every row group: a cut-off run keeps what it measured
    print(f"card {card}; medians of steps 2-{ns.steps}; {ns.batch} completions x {ns.completion} tokens")
    print("| row | GC | arm | generation | route | step s | generate s | rest s | adapter s | rest vs off | peak GiB "
          "| peak vs off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {'on' if r['gradient_checkpointing'] else 'off'} | {r['arm']} | {r['generation']} | "
              f"{r['route']} | {r['step_s']:.3f} | {r['generation_s']:.3f} | {r['rest_s']:.3f} | {r['adapter_s']:.4f} | "
              f"{r['rest_vs_off_pct']:+.1f}% | {r['peak_gib']:.2f} | {r['peak_vs_off_pct']:+.1f}% |")
    print("| card | framework | setup | adapter_share |\n|---|---|---|---|")
    for r in shares:
        print(f"| {r['card']} | {r['framework']} | {r['setup']} | {r['adapter_share']:.4f} |")
    for r in rows:
        print(f"{r['row']} gc={r['gradient_checkpointing']} {r['arm']} ({r['weights']}): first-step entropy TRL "
              f"{r['entropy_trl']} adapter {r['entropy_disc_mean']} clip_frac {r['clip_frac']}; steps {r['steps_s']}")


if __name__ == "__main__":
    main()
