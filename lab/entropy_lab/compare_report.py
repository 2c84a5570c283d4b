"""Tables (markdown + CSV) and plots of ``entropy-discriminator compare``: mean +- 95% t-interval over seeds per arm,
and paired differences (same seed: same warm-up, same training prompts) against the arm's baseline and between
Clip_B / Clip_V and each peer."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

from entropy_discriminator.demo.report import save_figure

from .compare_metrics import EVAL_KS, dh_correlation
from .stats_tests import mean_ci

METRICS = [("avg", "Avg@K"), *[(f"pass@{k}", f"Pass@{k}") for k in EVAL_KS], ("entropy_final", "final H"),
           ("control_frac", "control frac"), ("ppo_clip_frac", "PPO clip frac"), ("dH_corr", "dH corr"),
           ("seconds", "train s")]


def per_seed(results: dict) -> dict[str, dict[int, dict[str, float]]]:
    """``{arm: {seed: {metric: value}}}`` from the raw runs."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for run in results["runs"]:
        recs = run["records"]
        m = {"avg": run["final"]["avg"], "seconds": run["seconds"], "dH_corr": dh_correlation(run["dh_pairs"]),
             "entropy_final": recs[-1]["entropy"] if recs else math.nan,
             "control_frac": sum(r["control_frac"] for r in recs) / max(len(recs), 1),
             "ppo_clip_frac": sum(r["ppo_clip_frac"] for r in recs) / max(len(recs), 1)}
        for k in EVAL_KS:
            m[f"pass@{k}"] = run["final"]["pass"][str(k)] if str(k) in run["final"]["pass"] else run["final"]["pass"][k]
        out.setdefault(run["arm"], {})[run["seed"]] = m
    return out


def _fmt(m: float, h: float, digits: int = 3) -> str:
    if not math.isfinite(m):
        return "n/a"
    return f"{m:.{digits}f} ± {h:.{digits}f}" if math.isfinite(h) else f"{m:.{digits}f}"


def _paired(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], key: str) -> tuple[float, float, int]:
    seeds = sorted(set(a) & set(b))
    m, h = mean_ci([a[s][key] - b[s][key] for s in seeds])
    return m, h, len(seeds)


def _sig(m: float, h: float) -> str:
    if not (math.isfinite(m) and math.isfinite(h)):
        return ""
    return " ▲" if m - h > 0 else (" ▼" if m + h < 0 else "")


def write_report(results: dict, out: Path) -> str:
    """Write ``summary.csv``, ``per_seed.csv``, ``paired.csv``, ``tables.md`` and the plots; return the markdown."""
    data = per_seed(results)
    arms = [a["name"] for a in results["arms"]]
    baseline = {a["name"]: a["baseline"] for a in results["arms"]}
    keys = [k for k, _ in METRICS]
    with open(out / "per_seed.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", *keys])
        for arm in arms:
            for seed, m in sorted(data.get(arm, {}).items()):
                w.writerow([arm, seed, *(f"{m[k]:.6g}" for k in keys)])
    lines = []
    cfg = results["config"]
    lines.append(f"Seeds: {len(cfg['seeds'])} per arm (paired), {cfg['rl_steps']} RL steps of {cfg['prompts_per_step']} x "
                 f"{cfg['group_size']} samples, {cfg['eval_prompts']} held-out prompts x {cfg['eval_samples']} samples. "
                 "Mean ± 95% t-interval over seeds. Avg@K is the same for every K (mean correctness of all samples).")
    lines.append(f"Machine: {results.get('cpu_count')} CPU cores, {results.get('jobs')} worker processes on device "
                 f"{results.get('device')} (GPU present: {results.get('cuda')}); torch {results.get('torch')}; wall time "
                 f"{results.get('wall_seconds', float('nan')):.0f} s for the whole comparison.\n")
    # warm-up headroom
    warm = results["warmup"]
    lines.append("### After warm-up (the RL start), per seed\n")
    lines.append("| seed | Avg@K | " + " | ".join(f"Pass@{k}" for k in EVAL_KS) + " |")
    lines.append("|---" * (2 + len(EVAL_KS)) + "|")
    for wr in warm:
        p = wr["eval"]["pass"]
        lines.append(f"| {wr['seed']} | {wr['eval']['avg']:.3f} | " + " | ".join(f"{p[str(k)] if str(k) in p else p[k]:.3f}" for k in EVAL_KS) + " |")
    # per-arm summary
    lines.append("\n### Per arm (mean ± 95% CI over seeds)\n")
    lines.append("| arm | " + " | ".join(lbl for _, lbl in METRICS) + " |")
    lines.append("|---" * (1 + len(METRICS)) + "|")
    summary_rows = []
    for arm in arms:
        vals = data.get(arm, {})
        cells = []
        row = {"arm": arm}
        for k, _ in METRICS:
            m, h = mean_ci([v[k] for v in vals.values()])
            cells.append(_fmt(m, h, 1 if k == "seconds" else 3))
            row[k], row[k + "_ci95"] = m, h
        summary_rows.append(row)
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary_rows[0]) if summary_rows else ["arm"])
        w.writeheader()
        for row in summary_rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    # paired differences against the baseline
    diff_keys = ["avg", *[f"pass@{k}" for k in EVAL_KS], "entropy_final"]
    paired_rows = []
    lines.append("\n### Paired difference to the baseline arm (GRPO, or PPO for the PPO arms); ▲/▼: interval excludes 0\n")
    lines.append("| arm | vs | " + " | ".join("Δ " + dict(METRICS)[k] for k in diff_keys) + " |")
    lines.append("|---" * (2 + len(diff_keys)) + "|")
    for arm in arms:
        base = baseline[arm]
        if arm == base or base not in data or arm not in data:
            continue
        cells = []
        for k in diff_keys:
            m, h, n = _paired(data[arm], data[base], k)
            cells.append(_fmt(m, h) + _sig(m, h))
            paired_rows.append({"arm": arm, "vs": base, "metric": k, "diff": m, "ci95": h, "n": n})
        lines.append(f"| {arm} | {base} | " + " | ".join(cells) + " |")
    # change from the RL start (the warm-up of the same seed)
    start = {w["seed"]: w["eval"] for w in results["warmup"]}
    lines.append("\n### Change from the RL start (same seed's warm-up), paired; ▲/▼: interval excludes 0\n")
    lines.append("| arm | Δ Avg@K | Δ Pass@4 | Δ Pass@16 | Δ Pass@64 |")
    lines.append("|---|---|---|---|---|")
    for arm in arms:
        cells = []
        for k in ("avg", "pass@4", "pass@16", "pass@64"):
            diffs = []
            for seed, m in sorted(data.get(arm, {}).items()):
                if seed in start:
                    ev = start[seed]
                    ref = ev["avg"] if k == "avg" else (ev["pass"].get(k[5:], ev["pass"].get(int(k[5:]))))
                    diffs.append(m[k] - ref)
            dm, dh = mean_ci(diffs)
            cells.append(_fmt(dm, dh) + _sig(dm, dh))
            paired_rows.append({"arm": arm, "vs": "warm-up", "metric": k, "diff": dm, "ci95": dh, "n": len(diffs)})
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    # Clip_B / Clip_V against each GRPO-family peer
    ours = [a for a in arms if ("clip_b" in a or "clip_v" in a) and baseline[a] == "grpo"]
    peers = [a for a in arms if a not in ours and baseline[a] == "grpo"]
    if ours and peers:
        lines.append("\n### Clip_B / Clip_V minus each peer (paired), Avg@K / Pass@16 / Pass@64\n")
        lines.append("| ours | peer | Δ Avg@K | Δ Pass@16 | Δ Pass@64 |")
        lines.append("|---|---|---|---|---|")
        for o in ours:
            for p in peers:
                if o not in data or p not in data:
                    continue
                cells = []
                for k in ("avg", "pass@16", "pass@64"):
                    m, h, n = _paired(data[o], data[p], k)
                    cells.append(_fmt(m, h) + _sig(m, h))
                    paired_rows.append({"arm": o, "vs": p, "metric": k, "diff": m, "ci95": h, "n": n})
                lines.append(f"| {o} | {p} | " + " | ".join(cells) + " |")
    with open(out / "paired.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["arm", "vs", "metric", "diff", "ci95", "n"])
        w.writeheader()
        for row in paired_rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    text = "\n".join(lines) + "\n"
    (out / "tables.md").write_text(text)
    _plots(results, arms, out)
    return text


def plots_available() -> bool:
    """Whether matplotlib can be imported (without it the report has its tables and CSVs but no PNG)."""
    return importlib.util.find_spec("matplotlib") is not None


def _plots(results: dict, arms: list[str], out: Path) -> None:
    """``pass_at_k.png`` (Pass@K against K, mean and 95% band per arm, the warm-up dashed) and ``entropy.png``;
    nothing without matplotlib (:func:`plots_available`; ``run_compare`` says so)."""
    if not plots_available():
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    baseline = {a["name"]: a["baseline"] for a in results["arms"]}
    n = results["config"]["eval_samples"]
    ks = list(range(1, n + 1))

    def curve(passes: list[dict]) -> tuple[list[float], list[float]]:
        ms, hs = [], []
        for k in ks:
            m, h = mean_ci([p[str(k)] if str(k) in p else p[k] for p in passes])
            ms.append(m)
            hs.append(h if math.isfinite(h) else 0.0)
        return ms, hs

    families = [("GRPO family", [a for a in arms if baseline[a] == "grpo"]), ("PPO (GAE) family", [a for a in arms if baseline[a] == "ppo"])]
    families = [f for f in families if f[1]]
    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 4.5), squeeze=False)
    warm_m, _ = curve([w["eval"]["pass"] for w in results["warmup"]])
    for ax, (title, members) in zip(axes[0], families):
        ax.plot(ks, warm_m, "k--", label="after warm-up")
        for arm in members:
            m, h = curve([r["final"]["pass"] for r in results["runs"] if r["arm"] == arm])
            (line,) = ax.plot(ks, m, label=arm)
            ax.fill_between(ks, [a - b for a, b in zip(m, h)], [a + b for a, b in zip(m, h)], color=line.get_color(), alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("K")
        ax.set_ylabel("Pass@K (held out)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    save_figure(fig, out / "pass_at_k.png", dpi=120)

    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 4.5), squeeze=False)
    for ax, (title, members) in zip(axes[0], families):
        for arm in members:
            runs = [r for r in results["runs"] if r["arm"] == arm]
            if not runs:
                continue
            steps = [rec["step"] for rec in runs[0]["records"]]
            m, h = zip(*(mean_ci([r["records"][i]["entropy"] for r in runs]) for i in range(len(steps))))
            h = [x if math.isfinite(x) else 0.0 for x in h]
            (line,) = ax.plot(steps, m, label=arm)
            ax.fill_between(steps, [a - b for a, b in zip(m, h)], [a + b for a, b in zip(m, h)], color=line.get_color(), alpha=0.15)
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean token entropy (rollouts)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    save_figure(fig, out / "entropy.png", dpi=120)
