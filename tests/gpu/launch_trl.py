"""TRL under ``accelerate launch`` with 2 processes: the adapter's global mask against one process on the global batch.

Not collected by pytest; run by hand (tests/gpu/launch_trl_README.md has the commands and the recorded runs).

``train`` (started by ``accelerate launch --num_processes 2``, one process per GPU, or ``--cpu`` over gloo)
runs the real ``EntropyDiscGRPOTrainer`` on the tiny offline model and prompts (``examples/trl/tiny.py``)
three times:

1. ``clip_v``: Clip_V (mu 1.5, both sides, zero_pg) for ``--steps`` steps;
2. ``pilot_full``: the autopilot (drop_token, law calibrated every batch) for ``2 * --cut`` steps, saving a
   checkpoint every ``--cut`` steps;
3. ``pilot_resume``: a fresh trainer resumed from ``pilot_full``'s checkpoint at step ``--cut``.

A probe wraps the adapter's mask selection (``_patch._select``, as the CPU tests reach it) and records, per
step and per rank, what the adapter computed: its statistics (``TokenStats``), TRL's advantages, the
controller's state before and after the step, and the keep-mask; each rank also keeps the
``entropy_disc/*`` metrics its Trainer logged.  One file per run and rank goes to ``--out``.

``check --out DIR`` (one process, afterwards) concatenates the ranks' batches of each step into the global
batch, recomputes the mask with the core library (``EntropyDiscConfig.compute_mask``; for the autopilot a
fresh controller loaded with the recorded state before the step), once in the statistics' dtype and once in
float64, and checks: the global keep-mask equals the ranks' masks (same dtype: exactly); the controller's
state after each step equals the recomputation's; the resume starts from the checkpoint's controller state
(step ``--cut``), which equals the uninterrupted run's there, and its later steps equal that run's; every
rank logged the same ``entropy_disc/*`` metrics.  It prints a table and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import sys
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS = ("clip_v", "pilot_full", "pilot_resume")
CLIP_V = dict(entropy_disc_method="clip_v", entropy_disc_mu_low=1.5, entropy_disc_mu_high=1.5,
              entropy_disc_sides="both")
PILOT = dict(entropy_disc_method="autopilot", entropy_disc_target_entropy="3.1", entropy_disc_eta=2.0,
             entropy_disc_sides="both", entropy_disc_max_frac="0.25", entropy_disc_mask_mode="drop_token",
             entropy_disc_calibrate_every=1)
STATS_FIELDS = ("logp", "entropy", "s_star", "s_expected", "s_centered", "valid")


def _tiny() -> Any:
    spec = importlib.util.spec_from_file_location("ed_trl_tiny", ROOT / "examples" / "trl" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------- train


def _install_probe(records: list[dict[str, Any]]) -> None:
    """Wrap the adapter's mask selection so that every call appends what it read and returned to ``records``."""
    from entropy_discriminator.adapters.trl import _patch

    original = _patch._select

    def probe(trainer, state, stats, advantages, batch, group):
        pilot = state.config.method == "autopilot"
        before = state.autopilot.state_dict() if pilot else None
        result = original(trainer, state, stats, advantages, batch, group)
        ratio = batch.get("importance_sampling_ratio")
        records.append({
            "step": trainer.state.global_step + 1,
            "stats": {f: getattr(stats, f).detach().cpu() for f in STATS_FIELDS},
            "advantages": advantages.detach().cpu(),
            "ratio": None if ratio is None else ratio.detach().cpu(),
            "keep": result.keep.detach().cpu(),
            "n_clipped": int(result.n_clipped),
            "before": before,
            "after": state.autopilot.state_dict() if pilot else None,
        })
        return result

    _patch._select = probe


def _trainer(out: pathlib.Path, cpu: bool, max_steps: int, settings: dict[str, Any], save_steps: int | None) -> Any:
    from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, EntropyDiscGRPOTrainer

    tiny = _tiny()
    tok = tiny.tiny_tokenizer()
    save = dict(save_strategy="steps", save_steps=save_steps) if save_steps else dict(save_strategy="no")
    args = EntropyDiscGRPOConfig(
        output_dir=str(out), per_device_train_batch_size=8, num_generations=8, max_completion_length=16,
        max_steps=max_steps, learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=cpu, bf16=False,
        disable_dropout=True, beta=0.0, seed=0, **save, **settings)
    return EntropyDiscGRPOTrainer(model=tiny.tiny_model(tok, hidden=64), reward_funcs=tiny.digit_reward, args=args,
                                  train_dataset=tiny.tiny_dataset(256), processing_class=tok)


def train(out: pathlib.Path, steps: int, cut: int) -> None:
    cpu = not torch.cuda.is_available()
    records: list[dict[str, Any]] = []
    _install_probe(records)
    plan = (("clip_v", steps, CLIP_V, None, None),
            ("pilot_full", 2 * cut, PILOT, cut, None),
            ("pilot_resume", 2 * cut, PILOT, None, out / "pilot_full" / f"checkpoint-{cut}"))
    for name, max_steps, settings, save_steps, resume in plan:
        records.clear()
        trainer = _trainer(out / name, cpu, max_steps, settings, save_steps)
        world, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
        if world != 2:
            raise SystemExit(f"start this under accelerate launch --num_processes 2 (got {world} process)")
        trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
        device = trainer.accelerator.device
        torch.save({
            "run": name, "rank": rank, "world": world, "records": list(records),
            "log_history": trainer.state.log_history,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": torch.distributed.get_backend(), "settings": settings,
            "vocab_size": trainer.model.config.vocab_size if hasattr(trainer.model, "config")
            else trainer.accelerator.unwrap_model(trainer.model).config.vocab_size,
            "learning_rate": trainer.args.learning_rate,
        }, out / f"{name}_rank{rank}.pt")
        print(f"rank {rank} ({device}): {name} done, {len(records)} masked batches, global step "
              f"{trainer.state.global_step}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------- check


def _concat(parts: list[torch.Tensor], fill: Any) -> torch.Tensor:
    """(B_r, T_r) tensors of the ranks -> (sum B_r, max T_r), right-padded with ``fill`` (TRL pads each rank's
    completions to its own longest one)."""
    width = max(p.size(1) for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.size(1)), value=fill) for p in parts])


def _global_stats(recs: list[dict[str, Any]], dtype: torch.dtype | None) -> Any:
    from entropy_discriminator import TokenStats

    fields = {}
    for f in STATS_FIELDS:
        t = _concat([r["stats"][f] for r in recs], False if f == "valid" else 0.0)
        fields[f] = t if f == "valid" or dtype is None else t.to(dtype)
    return TokenStats(**fields)


def _split(keep: torch.Tensor, recs: list[dict[str, Any]]) -> list[torch.Tensor]:
    out, row = [], 0
    for r in recs:
        b, t = r["keep"].shape
        out.append(keep[row:row + b, :t])
        row += b
    return out


def _recompute(run: dict[str, Any], recs: list[dict[str, Any]], dtype: torch.dtype | None) -> tuple[Any, Any]:
    """The keep-mask of one process on the global batch, and the controller's state after it (autopilot)."""
    from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig

    config = EntropyDiscGRPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True,
                                   **run["settings"]).entropy_disc_config()
    stats = _global_stats(recs, dtype)
    adv = torch.cat([r["advantages"] for r in recs])
    adv = adv if dtype is None else adv.to(dtype)
    if config.method != "autopilot":
        return config.compute_mask(advantages=adv, valid=stats.valid, s_star=stats.s_star,
                                   s_centered=stats.s_centered).keep, None
    pilot = config.build_autopilot(None, vocab_size=run["vocab_size"])
    pilot.load_state_dict(recs[0]["before"])
    ratio = None if recs[0]["ratio"] is None else _concat([r["ratio"].expand_as(r["keep"]).float()
                                                            for r in recs], 1.0)
    result = pilot.from_stats(stats, adv, lr=config.step_size(run["learning_rate"]), ratio=ratio)
    return result.mask.keep, pilot.state_dict()


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def _state_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest relative difference between two controller states (inf when keys or non-float entries differ)."""
    fa, fb = _flat(a), _flat(b)
    if fa.keys() != fb.keys():
        return math.inf
    worst = 0.0
    for key, x in fa.items():
        y = fb[key]
        if isinstance(x, float) and isinstance(y, float):
            if math.isnan(x) and math.isnan(y):
                continue
            worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-300) if x != y else 0.0)
        elif x != y:
            return math.inf
    return worst


def _ed_logs(run: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Global step -> the ``entropy_disc/*`` metrics logged at it (a resumed run's history starts with the
    checkpoint's)."""
    return {h["step"]: {k: v for k, v in sorted(h.items()) if k.startswith("entropy_disc/")}
            for h in run["log_history"] if any(k.startswith("entropy_disc/") for k in h)}


def check(out: pathlib.Path, cut: int) -> int:
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    runs = {name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)] for name in RUNS}
    first = runs["clip_v"][0]
    print(f"device: {first['device']} x {first['world']} processes, backend {first['backend']}")
    print(f"{'run':<13}{'step':>5}{'rows':>6}{'valid':>7}{'clipped':>8}{'frac':>8}{'diff':>6}{'diff64':>7}"
          f"{'state':>10}{'  logged entropy_disc/clip/frac r0 r1':>38}")
    for name, ranks in runs.items():
        expect(len(ranks[0]["records"]) == len(ranks[1]["records"]) > 0, f"{name}: record counts differ or are 0")
        logs = [_ed_logs(r) for r in ranks]
        expect(logs[0] == logs[1], f"{name}: the ranks logged different entropy_disc/* metrics")
        clipped_total = 0
        for recs in zip(*(r["records"] for r in ranks)):
            recs = list(recs)
            step = recs[0]["step"]
            expect(all(r["step"] == step for r in recs), f"{name}: ranks at different steps")
            expect(all(r["before"] == recs[0]["before"] for r in recs), f"{name} step {step}: states differ")
            keep, after = _recompute(ranks[0], recs, None)
            keep64, _ = _recompute(ranks[0], recs, torch.float64)
            got = [r["keep"] for r in recs]
            diff = sum(int((a != b).sum()) for a, b in zip(_split(keep, recs), got))
            diff64 = sum(int((a != b).sum()) for a, b in zip(_split(keep64, recs), got))
            expect(diff == 0, f"{name} step {step}: {diff} mask entries differ from the one-process recomputation")
            valid = _global_stats(recs, None).valid
            clipped = int((~keep & valid).sum())
            clipped_total += clipped
            expect(all(r["n_clipped"] == clipped for r in recs), f"{name} step {step}: n_clipped differs")
            state = "-"
            if after is not None:
                worst = max(_state_diff(after, r["after"]) for r in recs)
                expect(worst <= 1e-12, f"{name} step {step}: controller state differs (rel {worst:.1e})")
                state = f"{worst:.0e}" if worst else "equal"
            fracs = [lg.get(step, {}).get("entropy_disc/clip/frac", float("nan")) for lg in logs]
            expect(all(abs(f - clipped / max(1, int(valid.sum()))) < 1e-6 for f in fracs),
                   f"{name} step {step}: the logged entropy_disc/clip/frac is not the recomputed share")
            print(f"{name:<13}{step:>5}{valid.size(0):>6}{int(valid.sum()):>7}{clipped:>8}"
                  f"{clipped / max(1, int(valid.sum())):>8.4f}{diff:>6}{diff64:>7}{state:>10}"
                  f"{fracs[0]:>30.4f}{fracs[1]:>8.4f}")
        expect(clipped_total > 0, f"{name}: no token was clipped at any step (the mask comparison is vacuous)")
    # The resume: the controller starts where the checkpoint (and the uninterrupted run) stood.  The checkpoint
    # holds the state after step `cut`'s law calibration (fed at the end of that optimizer step), which is the
    # uninterrupted controller's state before step `cut + 1`.
    saved = json.loads((out / "pilot_full" / f"checkpoint-{cut}" / "trainer_state.json").read_text())
    saved = saved["stateful_callbacks"]["EntropyDiscAutopilot"]
    full, resumed = runs["pilot_full"][0]["records"], runs["pilot_resume"][0]["records"]
    at_cut = next(r for r in full if r["step"] == cut + 1)["before"]
    expect(saved["step"] == cut and saved == at_cut, "checkpoint's controller state != the run's at the cut")
    expect(resumed[0]["step"] == cut + 1 and resumed[0]["before"] == saved,
           "the resumed controller did not start from the checkpoint's state")
    later = [r for r in full if r["step"] > cut]
    same = len(later) == len(resumed) and all(
        torch.equal(a["keep"], b["keep"]) and a["after"] == b["after"] for a, b in zip(later, resumed))
    expect(same, "the resumed steps differ from the uninterrupted run's")
    tail = [{s: h for s, h in _ed_logs(r).items() if s > cut} for r in (runs["pilot_full"][0],
                                                                       runs["pilot_resume"][0])]
    expect(sorted(tail[1]) == list(range(cut + 1, 2 * cut + 1)), "the resumed run logged no metrics at some step")
    expect(tail[0] == tail[1], "the resumed run logged other entropy_disc/* metrics than the uninterrupted run")
    print(f"resume: checkpoint-{cut} controller step {saved['step']}, h_start {saved['h_start']:.6f}, h_smooth "
          f"{saved['h_smooth']:.6f}; resumed run starts at step {resumed[0]['step']} from it: "
          f"{resumed[0]['before'] == saved}; steps {cut + 1}-{2 * cut} (masks, controller states, entropy_disc/* "
          f"logs) equal to the uninterrupted run's: {same and tail[0] == tail[1]}")
    print("entropy_disc/* metrics logged by rank 0 (rank 1 logged the same:"
          f" {all(_ed_logs(r[0]) == _ed_logs(r[1]) for r in runs.values())}):")
    for name, ranks in runs.items():
        for step, h in _ed_logs(ranks[0]).items():
            if name == "pilot_resume" and step <= cut:
                continue  # the checkpoint's history, logged by pilot_full
            print(f"  {name} step {step}: "
                  + json.dumps({k.removeprefix("entropy_disc/"): round(v, 5) for k, v in h.items()}))
    for f in failures:
        print("FAIL:", f)
    print("ALL CHECKS PASSED" if not failures else f"{len(failures)} CHECK(S) FAILED")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("mode", choices=("train", "check"))
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=5, help="Clip_V steps")
    parser.add_argument("--cut", type=int, default=3, help="autopilot checkpoint step (the run takes 2 * cut)")
    ns = parser.parse_args(argv)
    if ns.mode == "train":
        ns.out.mkdir(parents=True, exist_ok=True)
        train(ns.out, ns.steps, ns.cut)
        return 0
    return check(ns.out, ns.cut)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
