"""``python -m entropy_lab.calibration_share``: does the law calibration's after-update pass need the whole batch?

The adapters calibrate ``kappa`` (:mod:`entropy_discriminator.law_scale`) from the realised change of a calibration
batch's mean token entropy, read by one no-grad pass after the update.  ``calibrate_share`` lets that pass read only
the rows :func:`~entropy_discriminator.law_scale.calibration_rows` picks.  This harness checks the estimate on the
same batches: it trains plain GRPO (Adam, the set-up's PPO clip, mini-batches and gradient clipping, as
:func:`entropy_lab.law_eval.run`) and, for every RL step, reads the entropy of **every** token of the step's batch
before and after that step's updates.  Per step it records the whole-batch cheap prediction
``-lr Cov_B(A, r S_c)``, the realised change over all rows and over the rows each share picks.  The report compares,
per share, (a) the realised estimate with the whole batch's (correlation, the SD of the difference over the SD of
the whole-batch change) and (b) ``kappa`` fitted as the adapters fit it (one pair every ``calibrate_every`` steps,
:class:`~entropy_discriminator.law.Calibration`) from the share's pairs and from the whole batch's: their ratio
at every calibration after the first five, and the out-of-sample prediction ``kappa * cheap`` of the next
calibration batch's whole-batch change (correlation with it, median relative error).

    PYTHONPATH=.:lab python -m entropy_lab.calibration_share run --out DIR [--steps 200 --seeds 0 1 2 --jobs 2]
    PYTHONPATH=.:lab python -m entropy_lab.calibration_share report DIR    # DIR/records.jsonl (or .xz): summary.md/.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from entropy_discriminator import batch_entropy_change, token_stats
from entropy_discriminator.baselines import ppo_clip_losses
from entropy_discriminator.law import Calibration
from entropy_discriminator.law_scale import calibration_rows

from .law_eval import head_env
from .records import load_jsonl

#: Set-ups: the autopilot evaluation's S1 and the headroom head-to-head's (``protocol`` configurations).
CONFIGS = {
    "s1": "d_model=64,n_layers=2,warmup_noise=0,targets=uniform,warmup_steps=1000",
    "headroom": "n_numbers=7,d_model=64,n_layers=2,warmup_noise=0,targets=uniform,warmup_solution=first,"
                "warmup_steps=750",
}
#: Shares compared with the whole batch (1.0).
SHARES = (0.5, 0.25, 0.125)
#: The adapters' default schedule: one calibration batch every this many.
EVERY = 10


def run(setup: str, seed: int, steps: int, warm: Path | None = None) -> list[dict[str, float]]:
    """``steps`` RL steps of plain GRPO on ``setup`` (from the warm start saved at ``warm``, else warmed up now);
    one record per step (module docstring)."""
    env = head_env(setup, CONFIGS[setup], seed, warm=warm)
    params = dict(env.model.named_parameters())
    plist = list(params.values())
    opt = torch.optim.Adam(plist, lr=env.lr)
    records = []
    for step in range(1, steps + 1):
        batch = env.sample()
        with torch.no_grad():
            before = token_stats(env.logits(params, batch.seq), batch.resp)
        valid = torch.ones_like(batch.resp, dtype=torch.bool)
        cheap = batch_entropy_change(batch.adv, before.s_centered, valid, lr=env.lr)
        for idx in torch.randperm(len(batch.seq), generator=env.generator).chunk(env.minibatches):
            logits = env.logits(params, batch.seq[idx])
            lp = torch.log_softmax(logits, -1).gather(-1, batch.resp[idx][..., None])[..., 0]
            pg, _ = ppo_clip_losses(lp, batch.old_lp[idx], batch.adv[idx], clip_ratio_low=env.ppo_clip,
                                    clip_ratio_high=env.ppo_clip)
            opt.zero_grad(set_to_none=True)
            pg.mean().backward()
            torch.nn.utils.clip_grad_norm_(plist, env.grad_clip)
            opt.step()
        with torch.no_grad():
            after = token_stats(env.logits(params, batch.seq), batch.resp)
        change = (after.entropy.double() - before.entropy.double()).mean(1)  # per row; every token is valid
        rec = {"setup": setup, "seed": seed, "step": step, "rows": len(change), "cheap": cheap,
               "entropy": float(before.entropy.double().mean()), "real_1": float(change.mean())}
        for share in SHARES:
            rec[f"real_{share}"] = float(change[calibration_rows(len(change), share)].mean())
        records.append(rec)
    return records


def _job(job: tuple[str, int, int, Path | None]) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    return run(*job)


def _corr(x: Sequence[float], y: Sequence[float]) -> float:
    return statistics.correlation(x, y) if len(x) > 2 else math.nan


def summary(records: Sequence[dict]) -> list[dict[str, object]]:
    """One row per (set-up, share): the module docstring's (a) and (b) over every run of the set-up."""
    out = []
    for setup in sorted({r["setup"] for r in records}):
        runs: dict[int, list[dict]] = {}
        for r in records:
            if r["setup"] == setup:
                runs.setdefault(r["seed"], []).append(r)
        for share in SHARES:
            key = f"real_{share}"
            full = [r["real_1"] for rs in runs.values() for r in rs]
            part = [r[key] for rs in runs.values() for r in rs]
            diff = [p - f for p, f in zip(part, full)]
            ratios, pred_full, pred_part, target = [], [], [], []
            for rs in runs.values():
                cal_full, cal_part = Calibration(), Calibration()
                due = [r for r in sorted(rs, key=lambda r: r["step"]) if (r["step"] - 1) % EVERY == 0]
                for i, r in enumerate(due):
                    if i >= 5:  # out of sample: the kappas fitted on the earlier calibration batches
                        ratios.append(cal_part.scale / cal_full.scale)
                        pred_full.append(cal_full.scale * r["cheap"])
                        pred_part.append(cal_part.scale * r["cheap"])
                        target.append(r["real_1"])
                    cal_full.update(r["cheap"], r["real_1"])
                    cal_part.update(r["cheap"], r[key])
            rel = [abs(p - t) / abs(t) for p, t in zip(pred_part, target) if t]
            rel_full = [abs(p - t) / abs(t) for p, t in zip(pred_full, target) if t]
            out.append({
                "setup": setup, "share": share, "runs": len(runs), "steps": len(full),
                "rows_read": int(calibration_rows(runs[min(runs)][0]["rows"], share).numel()),
                "rows": runs[min(runs)][0]["rows"],
                "corr_realised": _corr(part, full),
                "sd_diff_over_sd_full": statistics.pstdev(diff) / statistics.pstdev(full),
                "kappa_ratio_median": statistics.median(ratios) if ratios else math.nan,
                "kappa_ratio_p10": statistics.quantiles(ratios, n=10)[0] if len(ratios) > 1 else math.nan,
                "kappa_ratio_p90": statistics.quantiles(ratios, n=10)[-1] if len(ratios) > 1 else math.nan,
                "pred_corr_share": _corr(pred_part, target), "pred_corr_whole": _corr(pred_full, target),
                "pred_relerr_share": statistics.median(rel) if rel else math.nan,
                "pred_relerr_whole": statistics.median(rel_full) if rel_full else math.nan,
                "calibrations_compared": len(ratios),
            })  # fmt: skip
    return out


def markdown(rows: Sequence[dict]) -> str:
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m entropy_lab.calibration_share", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--setups", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--steps", type=int, default=200)
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--warm-dir", type=Path, default=None,
                   help="a folder of protocol warm starts seed<N>.pt of the set-up (one set-up only)")
    s = sub.add_parser("report")
    s.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        if args.warm_dir is not None and len(args.setups) != 1:
            p.error("--warm-dir holds the warm starts of one set-up: name it with --setups")
        jobs = [(setup, seed, args.steps, args.warm_dir and args.warm_dir / f"seed{seed}.pt")
                for setup in args.setups for seed in args.seeds]
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.map(_job, jobs)
        with (args.out / "records.jsonl").open("w") as f:
            for recs in results:
                for rec in recs:
                    f.write(json.dumps(rec) + "\n")
    rows = summary(load_jsonl(args.out / "records.jsonl"))  # or its .xz / .gz form
    (args.out / "summary.md").write_text(markdown(rows))
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
