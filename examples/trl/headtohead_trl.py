"""The head-to-head through TRL's real ``GRPOTrainer`` and the TRL adapter, next to the project's
own loop on the same seeds: GRPO vs GRPO + Clip_B (tuned, mu = 2) vs GRPO + Clip_V (mu = 2.5, no cap).

Per seed: one warm start (:func:`~entropy_lab.rl.warm_up`, the pre-registered
config: TinyGPT d 64, 2 layers, 1,000 supervised steps on signed-sum Countdown with uniform targets), shared by both
paths and every arm.  Per (path, arm, seed): RL from it, evaluated at the same checkpoints with the same
:func:`~entropy_lab.headtohead.evaluate_at` (test prompts of ``heldout_sets``, T = 0.7 and 1.0,
64 samples, the evaluation streams of ``eval_stream``), on CPU.

* ``own``: :func:`~entropy_lab.headtohead.run_arm_checkpoints` (the main run's loop, unchanged).
* ``trl``: ``EntropyDiscGRPOTrainer`` (TRL's ``GRPOTrainer`` with the adapter) on
  :class:`~entropy_lab.hf_policy.TinyGPTForCausalLM` holding the same warm-start weights, a word-level
  tokenizer whose ids are the task's, the own loop's training prompts in its order (``shuffle_dataset=False``), and
  the task's exact reward; the trainer settings mirror the own loop (docs/reproduction/headtohead/TRL_PATH.md lists
  them and every remaining difference).

Writes under ``--out``: ``warm/seed*.pt``, ``runs.jsonl`` (one line per (path, arm, seed): per-step ``records`` with
the mean token entropy, the control share and the reward, and ``checkpoints`` with the evaluations, the protocol's
format; ``arm`` is ``"{path}:{setting}"``), ``meta.json`` and ``comparison.md`` (entropy curves, frontier points,
endpoints; ``comparison.json``, ``entropy_curves.csv`` and, with matplotlib, the figures next to it).

GPU run (one H100/H200; TRL trains on the GPU, evaluation and the own loop on CPU cores)::

    PYTHONPATH=.:lab python examples/trl/headtohead_trl.py --seeds 0/1/2 --device cuda --jobs 12 --out OUT

CPU smoke (under 2 minutes)::

    PYTHONPATH=.:lab python examples/trl/headtohead_trl.py --tiny --out /tmp/h2h_trl
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from entropy_lab.headtohead import HeadConfig, run_arm_checkpoints
from entropy_lab.protocol import (
    DELTAS,
    ENDPOINT_KS,
    TEMPERATURES,
    RunSpec,
    comparisons,
    frontier_figure,
    load_jsonl,
    parse_config,
    save_warm_start,
)
from entropy_lab.records import append_jsonl, has_records
from entropy_lab.rl import Arm
from entropy_lab.stats_tests import paired_test

#: The pre-registered warm start (docs/reproduction/headtohead/PREREGISTRATION.md, ``CFG``).
CFG = "d_model=64,n_layers=2,warmup_noise=0,targets=uniform,warmup_steps=1000"
CHECKPOINTS = (0, 10, 20, 30, 40, 60, 80, 100, 125, 150, 200)
PATHS = ("own", "trl")
#: The main run's settings of tuning stages A and B (lr 1e-4; Clip_B mu 2; Clip_V mu 2.5 without cap).
GRPO_LR = 1e-4


def arms(mu_b: float = 2.0, mu_v: float = 2.5) -> dict[str, Arm]:
    """The three arms, named as in the main run (``docs/reproduction/headtohead/main``)."""
    return {
        "grpo": Arm(f"grpo(lr={GRPO_LR:g})", "grpo", lr=GRPO_LR),
        "clip_b": Arm(f"clip_b(mu={mu_b:g})", "clip_b", mask="clip_b", mu=mu_b, lr=GRPO_LR),
        "clip_v": Arm(f"clip_v(mu={mu_v:g},cap=None)", "clip_v", mask="clip_v", mu=mu_v, cap=None, lr=GRPO_LR),
    }


def tiny_setup() -> tuple[HeadConfig, RunSpec]:
    """``--tiny``: a short warm-up, 8 prompts x 8 samples per step, 3 steps, 16 test prompts (CPU smoke)."""
    cfg = replace(parse_config(CFG), warmup_steps=40, prompts_per_step=8)
    return cfg, RunSpec(cfg, (0,), (0, 2, 3), "test", n_prompts=16, samples=64)


# ----------------------------------------------------------------------------------------------------- TRL path


def trl_args(cfg: HeadConfig, arm: Arm, seed: int, steps: int, *, device: str, impl: str, output_dir: str) -> object:
    """``EntropyDiscGRPOConfig`` mirroring the own loop (TRL_PATH.md's table): one generation batch of
    ``prompts_per_step x group_size`` rows per RL step, split into ``minibatches`` optimiser steps (so TRL's
    ``max_steps`` is ``steps * minibatches``), PPO clip 0.2 with token-mean loss, no KL, constant lr, Adam(W, no
    decay), grad-norm 1, fp32, temperature 1, the mask per mini-batch from the current policy (``zero_pg``)."""
    from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig

    method = {"none": "none", "clip_b": "clip_b", "clip_v": "clip_v"}[arm.mask]
    rows = cfg.prompts_per_step * cfg.group_size
    return EntropyDiscGRPOConfig(
        output_dir=output_dir, max_steps=steps * cfg.minibatches, seed=seed + 1,
        # optimiser: Adam as the own loop (AdamW with weight decay 0 is the same update), constant lr, grad-norm 1
        learning_rate=arm.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        # batch: one generation batch per RL step, `minibatches` optimiser steps over shuffled slices of it
        per_device_train_batch_size=rows // cfg.minibatches, gradient_accumulation_steps=1,
        steps_per_generation=cfg.minibatches, num_generations=cfg.group_size, num_iterations=1,
        shuffle_dataset=False, dataloader_num_workers=0,
        # sampling: temperature 1, no top-k / top-p / min-p, exactly response_len tokens (the model has no EOS)
        max_completion_length=cfg.task().response_len, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, mask_truncated_completions=False, generation_kwargs={"use_cache": False},
        # loss: PPO clip eps, token mean over the mini-batch (all completions have one length), no KL, group std
        loss_type="bnpo", epsilon=arm.clip_low, epsilon_high=arm.clip_high, beta=0.0, scale_rewards="group",
        # precision and plumbing
        bf16=False, fp16=False, use_cpu=device == "cpu", gradient_checkpointing=False, disable_dropout=True,
        logging_steps=1, report_to="none", save_strategy="no",
        # the adapter: the arm's mask, per mini-batch from the current policy (as the own loop), monitor always on
        entropy_disc_method=method, entropy_disc_mu_low=arm.mu if method != "none" else None,
        entropy_disc_max_frac="none" if arm.cap is None else str(arm.cap), entropy_disc_sides="negative",
        entropy_disc_mask_mode="zero_pg", entropy_disc_mask_source="current", entropy_disc_impl=impl,
        entropy_disc_log_metrics=True,
    )


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def records_from_logs(logs: dict[int, dict[str, float]], steps: int, minibatches: int) -> list[dict[str, float]]:
    """Own-loop-style per-step records from TRL's per-optimiser-step logs: RL step ``s`` is TRL steps
    ``(s - 1) * minibatches + 1 .. s * minibatches``; ``entropy`` = mean of TRL's ``entropy`` (the training forward's
    mean token entropy, before the update: the own loop's record), ``control_frac`` = mean of the adapter's
    ``entropy_disc/clip/frac``, ``reward`` = the generation batch's mean reward."""
    out = []
    for s in range(1, steps + 1):
        rows = [logs.get((s - 1) * minibatches + j, {}) for j in range(1, minibatches + 1)]
        out.append({
            "step": s,
            "reward": _mean([r.get("reward", math.nan) for r in rows]),
            "entropy": _mean([r.get("entropy", math.nan) for r in rows]),
            "entropy_adapter": _mean([r.get("entropy_disc/entropy/mean", math.nan) for r in rows]),
            "control_frac": _mean([r.get("entropy_disc/clip/frac", 0.0) for r in rows]),
            "ppo_clip_frac": _mean([r.get("clip_ratio/region_mean", math.nan) for r in rows]),
        })
    return out


def run_trl(state: dict[str, torch.Tensor], spec: RunSpec, arm: Arm, seed: int, steps: int, *, device: str,
            impl: str = "auto") -> dict[str, object]:
    """One (arm, seed) through ``EntropyDiscGRPOTrainer``; returns the protocol's run record (``records``,
    ``checkpoints``, ``seconds``) plus TRL's raw per-step logs."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from entropy_discriminator.adapters.trl import EntropyDiscGRPOTrainer
    from entropy_lab.hf_policy import (
        PAD_ID,
        countdown_tokenizer,
        hf_from_tinygpt_state,
        prompt_text,
        train_prompt_stream,
    )

    cfg = spec.cfg
    task = cfg.task()
    checkpoints = tuple(c for c in spec.checkpoints if c <= steps)
    x, t = train_prompt_stream(task, seed, steps, cfg.prompts_per_step)
    dataset = Dataset.from_dict({"prompt": prompt_text(task.prompts(x, t)), "numbers": x.tolist(), "target": t.tolist()})

    def countdown_reward(completion_ids: list[list[int]], numbers: list[list[int]], target: list[int], **_: object) -> list[float]:
        """The task's exact reward on the completion's token ids (a short row is padded with an invalid id)."""
        n = task.response_len
        seen.append((torch.tensor(numbers), torch.tensor(target)))
        ids = torch.tensor([list(c[:n]) + [PAD_ID] * (n - len(c)) for c in completion_ids], dtype=torch.int64)
        return task.rewards(torch.tensor(numbers), torch.tensor(target), ids).tolist()

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model = hf_from_tinygpt_state(state, cfg.model_config())
    evals: list[dict[str, object]] = []
    logs: dict[int, dict[str, float]] = {}
    mb = cfg.minibatches

    class Recorder(TrainerCallback):
        def on_step_end(self, args, st, control, **kwargs):  # noqa: ANN001
            if st.global_step % mb == 0 and st.global_step // mb in checkpoints:
                step = st.global_step // mb
                evals.append({"step": step, **spec.evaluate(model.to_tinygpt("cpu"), seed, spec.checkpoints.index(step))})

    class LogRecorder(TrainerCallback):
        def on_log(self, args, st, control, **kwargs):  # noqa: ANN001
            entry = kwargs.get("logs") or {}
            if "entropy" in entry or "reward" in entry:
                logs.setdefault(st.global_step, {}).update({k: float(v) for k, v in entry.items()
                                                            if isinstance(v, (int, float))})

    t0 = time.perf_counter()
    if 0 in checkpoints:
        evals.append({"step": 0, **spec.evaluate(model.to_tinygpt("cpu"), seed, 0)})
    with tempfile.TemporaryDirectory() as tmp:
        args = trl_args(cfg, arm, seed, steps, device=device, impl=impl, output_dir=tmp)
        trainer = EntropyDiscGRPOTrainer(model=model, reward_funcs=countdown_reward, args=args, train_dataset=dataset,
                                         processing_class=countdown_tokenizer(), callbacks=[Recorder(), LogRecorder()])
        for quiet in (ProgressCallback, PrinterCallback):  # 400 steps x 9 runs of log lines otherwise
            trainer.remove_callback(quiet)
        trainer.train()
    return {"records": records_from_logs(logs, steps, mb), "checkpoints": evals, "seconds": time.perf_counter() - t0,
            "prompts_as_own_loop": _same_prompts(seen, x, t, cfg), "trl_logs": {str(k): v for k, v in sorted(logs.items())}}


def _same_prompts(seen: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, t: torch.Tensor, cfg: HeadConfig) -> bool:
    """Whether TRL's generation batches (as its reward calls saw them) held, step by step, the own loop's prompts of
    that step, each repeated ``group_size`` times in a row."""
    p, g = cfg.prompts_per_step, cfg.group_size
    if len(seen) * p != len(t):
        return False
    return all(torch.equal(xs, x[i * p:(i + 1) * p].repeat_interleave(g, 0)) and torch.equal(ts, t[i * p:(i + 1) * p].repeat_interleave(g))
               for i, (xs, ts) in enumerate(seen))


# ----------------------------------------------------------------------------------------------------- jobs


def _warm_job(job: tuple[RunSpec, int, str]) -> dict[str, object]:
    spec, seed, path = job
    return {"seed": seed, "warmup_seconds": save_warm_start(spec.cfg, seed, path)[1]}


def _run_job(job: tuple[str, RunSpec, Arm, int, int, str, str, str]) -> dict[str, object]:
    path, spec, arm, seed, steps, warm, device, impl = job
    torch.set_num_threads(1)
    state = torch.load(warm, weights_only=True)
    checkpoints = tuple(c for c in spec.checkpoints if c <= steps)
    if path == "own":
        trace = run_arm_checkpoints(state, spec.cfg, arm, seed, checkpoints,
                                    lambda step, model: spec.evaluate(model, seed, spec.checkpoints.index(step)))
        body = {"records": trace.records, "checkpoints": trace.checkpoints, "seconds": trace.seconds}
    else:
        body = run_trl(state, spec, arm, seed, steps, device=device, impl=impl)
    return {"arm": f"{path}:{arm.name}", "path": path, "setting": arm.name, "family": arm.family, "seed": seed,
            **body, "arm_spec": asdict(arm)}


def _pool(fn: Callable, jobs: list, n_proc: int, sink: Callable[[dict], None], log: Callable[[str], None]) -> None:
    """``fn`` over ``jobs`` in ``n_proc`` spawned processes (in this process, in order, when 1); ``sink`` sees each
    result as it lands.  Every job runs on one CPU thread (as the main run); this process's setting is restored."""
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    pool = mp.get_context("spawn").Pool(min(n_proc, len(jobs))) if n_proc > 1 and len(jobs) > 1 else None
    try:
        for i, r in enumerate(map(fn, jobs) if pool is None else pool.imap_unordered(fn, jobs)):
            sink(r)
            log(f"  {i + 1}/{len(jobs)} done ({time.perf_counter() - t0:.0f} s)")
    finally:
        torch.set_num_threads(threads)
        if pool is not None:
            pool.close()
            pool.join()


def run_all(spec: RunSpec, chosen: dict[str, Arm], steps: int, out: Path, *, paths: Sequence[str] = PATHS,
            device: str = "cpu", impl: str = "auto", jobs: int = 1, log: Callable[[str], None] = print) -> Path:
    """Warm starts, then every (path, arm, seed) not yet in ``out/runs.jsonl`` (so a call cut off, or a run split over
    calls, e.g. ``--paths trl`` then ``--paths own``, resumes); rows appended as they land.  ``out/meta.json`` lists
    every call (its settings, software, machine and wall time)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "warm").mkdir(exist_ok=True)
    calls = json.loads((out / "meta.json").read_text())["calls"] if (out / "meta.json").is_file() else []
    def same(call: dict) -> dict:  # what must agree between calls into one folder (seeds may be added)
        return {"steps": call["steps"], **{k: v for k, v in call["spec"].items() if k != "seeds"}}

    here = json.loads(json.dumps({"steps": steps, "spec": asdict(spec)}))
    if calls and same(calls[0]) != same(here):
        raise ValueError(f"{out} holds runs of another config, checkpoints or step count; choose a new --out")
    done = {(r["path"], r["setting"], r["seed"]) for r in load_jsonl(out / "runs.jsonl")} if has_records(out / "runs.jsonl") else set()
    meta = {"spec": asdict(spec), "steps": steps, "arms": {k: asdict(a) for k, a in chosen.items()}, "paths": list(paths),
            "device": device, "impl": impl, "jobs": jobs, "torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if "trl" in paths:
        import transformers
        import trl

        meta.update(trl=trl.__version__, transformers=transformers.__version__)
    calls.append(meta)
    (out / "meta.json").write_text(json.dumps({"calls": calls}, indent=1))
    t0 = time.perf_counter()
    todo = [s for s in spec.seeds if not (out / "warm" / f"seed{s}.pt").is_file()]
    log(f"warm starts: {len(todo)} to build of {len(spec.seeds)}")
    _pool(_warm_job, [(spec, s, str(out / "warm" / f"seed{s}.pt")) for s in todo], jobs,
          lambda r: append_jsonl(out / "warm.jsonl", [r]), log)
    # TRL jobs first: they are the long ones
    work = [(p, spec, a, s, steps, str(out / "warm" / f"seed{s}.pt"), device, impl)
            for p in sorted(paths, key=lambda p: p != "trl") for a in chosen.values() for s in spec.seeds
            if (p, a.name, s) not in done]
    log(f"runs: {len(work)} to do ({len(paths)} paths x {len(chosen)} arms x {len(spec.seeds)} seeds, {len(done)} done "
        f"before), {steps} steps")
    _pool(_run_job, work, jobs, lambda r: append_jsonl(out / "runs.jsonl", [r]), log)
    meta["wall_seconds"] = time.perf_counter() - t0
    (out / "meta.json").write_text(json.dumps({"calls": calls}, indent=1))
    return out / "runs.jsonl"


# ----------------------------------------------------------------------------------------------------- report


def _fmt(v: float, spec: str = ".3f") -> str:
    return "n/a" if v is None or not math.isfinite(v) else format(v, spec)


def entropy_curves(runs: Sequence[dict]) -> dict[str, dict[int, float]]:
    """``{arm label: {step: mean over seeds of the step's mean token entropy}}``."""
    acc: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        for rec in r["records"]:
            acc.setdefault(r["arm"], {}).setdefault(int(rec["step"]), []).append(float(rec["entropy"]))
    return {arm: {s: _mean(v) for s, v in sorted(d.items())} for arm, d in acc.items()}


def report(out: Path, runs: Sequence[dict] | None = None) -> str:
    """``comparison.md`` / ``comparison.json`` / ``entropy_curves.csv`` (and figures) from ``out/runs.jsonl``."""
    runs = list(runs) if runs is not None else load_jsonl(out / "runs.jsonl")
    runs = sorted(runs, key=lambda r: (r["path"], r["family"], r["seed"]))
    settings = list(dict.fromkeys(r["setting"] for r in sorted(runs, key=lambda r: ("grpo", "clip_b", "clip_v").index(r["family"])
                                                                  if r["family"] in ("grpo", "clip_b", "clip_v") else 9)))
    paths = [p for p in PATHS if any(r["path"] == p for r in runs)]
    seeds = sorted({r["seed"] for r in runs})
    curves = entropy_curves(runs)
    dump: dict[str, object] = {"seeds": seeds, "entropy_curves": curves}
    lines = ["# Head-to-head through TRL vs the project's own loop\n",
             f"Seeds {seeds}; arms {settings}; paths {paths}. Mean over seeds unless stated.\n"]
    # entropy curves
    steps = sorted({s for c in curves.values() for s in c})
    shown = sorted({s for s in steps if s in (1, 2, 3) or s % 10 == 0} | {steps[-1]}) if steps else []
    lines += ["## Entropy curves (mean token entropy of the training mini-batches, nats, T = 1)\n",
              "| step | " + " | ".join(f"{p}: {a}" for a in settings for p in paths) + " |",
              "|---" * (1 + len(settings) * len(paths)) + "|"]
    for s in shown:
        lines.append(f"| {s} | " + " | ".join(_fmt(curves.get(f"{p}:{a}", {}).get(s, math.nan)) for a in settings for p in paths) + " |")
    lines.append("")
    with open(out / "entropy_curves.csv", "w") as f:
        f.write("step," + ",".join(f"{p}:{a}" for a in settings for p in paths) + "\n")
        for s in steps:
            f.write(f"{s}," + ",".join(repr(curves.get(f"{p}:{a}", {}).get(s, math.nan)) for a in settings for p in paths) + "\n")
    # per-run summaries: mean entropy, last entropy, control share, reward
    by = {(r["path"], r["setting"], r["seed"]): r for r in runs}
    summary = {}
    lines += ["## Per-arm summaries (mean over seeds; paired TRL - own over seeds with 95% CI)\n",
              "| arm | quantity | own | trl | trl - own | p |", "|---|---|---|---|---|---|"]
    for a in settings:
        for q, fn in (("entropy, mean over steps", lambda r: _mean([x["entropy"] for x in r["records"]])),
                      ("entropy, last step", lambda r: r["records"][-1]["entropy"] if r["records"] else math.nan),
                      ("control share, mean over steps", lambda r: _mean([x["control_frac"] for x in r["records"]])),
                      ("reward, mean over steps", lambda r: _mean([x["reward"] for x in r["records"]]))):
            vals = {p: [fn(by[(p, a, s)]) for s in seeds if (p, a, s) in by] for p in paths}
            row = {p: _mean(v) for p, v in vals.items()}
            pair = [s for s in seeds if all((p, a, s) in by for p in ("own", "trl"))]
            res = paired_test([fn(by[("trl", a, s)]) for s in pair], [fn(by[("own", a, s)]) for s in pair]) if len(pair) > 1 else None
            summary[f"{a}/{q}"] = {**row, "diff": None if res is None else res.mean, "ci95": None if res is None else res.ci95,
                                   "p": None if res is None else res.p}
            lines.append(f"| {a} | {q} | {_fmt(row.get('own', math.nan), '.4f')} | {_fmt(row.get('trl', math.nan), '.4f')} | "
                         + ("n/a | n/a |" if res is None else f"{res.mean:+.4f} ± {_fmt(res.ci95, '.4f')} | {_fmt(res.p, '.3f')} |"))
    lines.append("")
    dump["summary"] = summary
    # frontier points
    frontier = {}
    for temp in TEMPERATURES:
        lines += [f"## Frontier points at T = {temp}: Avg@K / Pass@16 / Pass@64 per checkpoint\n",
                  "| step | " + " | ".join(f"{p}: {a}" for a in settings for p in paths) + " |",
                  "|---" * (1 + len(settings) * len(paths)) + "|"]
        cps = sorted({c["step"] for r in runs for c in r["checkpoints"]})
        for step in cps:
            cells = []
            for a in settings:
                for p in paths:
                    pts = [c[f"T{temp}"] for r in runs if r["path"] == p and r["setting"] == a
                           for c in r["checkpoints"] if c["step"] == step]
                    point = {"avg": _mean([x["avg"] for x in pts]),
                             **{f"pass@{k}": _mean([x["pass"][str(k)] if str(k) in x["pass"] else x["pass"].get(k, math.nan)
                                                    for x in pts]) for k in ENDPOINT_KS}}
                    frontier.setdefault(f"T{temp}", {}).setdefault(f"{p}:{a}", {})[step] = point
                    cells.append(f"{_fmt(point['avg'])} / {_fmt(point['pass@16'])} / {_fmt(point['pass@64'])}")
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
    dump["frontier"] = frontier
    # endpoints: each arm against GRPO within each path, and TRL against own per arm
    grpo = next((a for a in settings if a.startswith("grpo")), None)
    keys = [f"T{t}/d{d}/pass@{k}" for t in TEMPERATURES for d in DELTAS for k in ENDPOINT_KS]
    keys += [f"T{t}/final/{m}" for t in TEMPERATURES for m in ("avg", "pass@16", "pass@64")]
    sections = {}
    if grpo is not None:
        sections["arm - GRPO within each path"] = [(f"{p}:{a}", f"{p}:{grpo}") for p in paths for a in settings if a != grpo]
    if len(paths) == 2:
        sections["TRL - own, same arm (paired by seed)"] = [(f"trl:{a}", f"own:{a}") for a in settings]
    if len(seeds) > 1:
        for title, pairs in sections.items():
            rows = comparisons(runs, pairs, keys)
            dump[title] = rows
            lines += [f"## Endpoints: {title} (Holm over the {len(rows)} tests of this table)\n",
                      "| arm | vs | endpoint | diff ± 95% CI | p | p (Holm) | seeds reached |", "|---|---|---|---|---|---|---|"]
            for r in rows:
                lines.append(f"| {r['arm']} | {r['vs']} | {r['endpoint']} | {_fmt(r['diff'], '+.3f')} ± {_fmt(r['ci95'])} | "
                             f"{_fmt(r['p'], '.4f')} | {_fmt(r['p_holm'], '.4f')} | {r['reached']}/{r['seeds']} |")
            lines.append("")
    else:
        lines.append("(one seed: no paired endpoint tests)\n")
    figures = [frontier_figure(runs, out, temp, k) for temp in TEMPERATURES for k in ENDPOINT_KS]
    entropy_figure(curves, out)
    if any(figures):
        lines.append("Figures: " + ", ".join(p.name for p in figures if p) + ", entropy_curves.png\n")
    text = "\n".join(lines)
    (out / "comparison.md").write_text(text)
    (out / "comparison.json").write_text(json.dumps(dump, indent=1, default=str))
    return text


def entropy_figure(curves: dict[str, dict[int, float]], out: Path) -> Path | None:
    """``entropy_curves.png``: mean token entropy per RL step, one line per (path, arm); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), ls="--" if label.startswith("trl:") else "-", label=label, lw=1)
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean token entropy (nats, T = 1)")
    ax.set_title("entropy curves: own loop (solid) vs TRL + adapter (dashed), mean over seeds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "entropy_curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--seeds", default="0/1/2", help="'/'-separated evaluation seeds (>= 3 to compare with the own loop)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the last checkpoint)")
    ap.add_argument("--checkpoints", default="/".join(map(str, CHECKPOINTS)), help="'/'-separated RL step counts, 0 = start")
    ap.add_argument("--device", default="cpu", help="TRL's device: cpu or cuda (the own loop and evaluation run on CPU)")
    ap.add_argument("--impl", default="auto", help="the adapter's statistics implementation: auto, torch or triton")
    ap.add_argument("--paths", default="own,trl", help="comma-separated subset of own,trl")
    ap.add_argument("--arms", default="grpo,clip_b,clip_v", help="comma-separated subset of grpo,clip_b,clip_v")
    ap.add_argument("--clip-b-mu", type=float, default=2.0, help="Clip_B's mu (tuned: 2)")
    ap.add_argument("--clip-v-mu", type=float, default=2.5, help="Clip_V's mu (main run: 2.5, no cap)")
    ap.add_argument("--config", default=CFG, help="HeadConfig overrides (default: the pre-registered warm start)")
    ap.add_argument("--prompts", type=int, default=200, help="test prompts per evaluation")
    ap.add_argument("--jobs", type=int, default=1, help="parallel processes over (path, arm, seed)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: short warm-up, 8 prompts/step, 3 steps, 16 test prompts")
    ap.add_argument("--report-only", action="store_true", help="rebuild comparison.md from OUT/runs.jsonl")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.report_only:
        print(report(a.out))
        return 0
    if a.tiny:
        cfg, spec = tiny_setup()
        if a.seeds != ap.get_default("seeds"):
            spec = replace(spec, seeds=tuple(int(s) for s in a.seeds.split("/")))
        steps = a.steps or spec.checkpoints[-1]
    else:
        cfg = parse_config(a.config)
        cps = tuple(int(c) for c in a.checkpoints.split("/"))
        steps = a.steps or cps[-1]
        spec = RunSpec(cfg, tuple(int(s) for s in a.seeds.split("/")), tuple(c for c in cps if c <= steps), "test",
                       n_prompts=a.prompts)
    paths = tuple(p for p in a.paths.split(",") if p)
    unknown = set(paths) - set(PATHS)
    all_arms = arms(a.clip_b_mu, a.clip_v_mu)
    unknown |= set(a.arms.split(",")) - set(all_arms)
    if unknown:
        ap.error(f"unknown paths/arms: {sorted(unknown)}")
    chosen = {k: all_arms[k] for k in a.arms.split(",")}
    run_all(spec, chosen, steps, a.out, paths=paths, device=a.device, impl=a.impl, jobs=a.jobs)
    print(report(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
