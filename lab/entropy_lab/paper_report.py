"""Figures and ``report.md`` of ``demo --paper``, from its saved ``paper_results.json`` and ``paper_steps.csv``.

Every verdict in the report is computed from the saved numbers, so the text says what came out.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from entropy_discriminator.demo.report import PLOT_HINT, format_table, have_matplotlib, pyplot, save_figure, smooth
from entropy_discriminator.demo.train import pearson, sign_agreement

from .records import open_records, read_records_text
from .stats_tests import mean_ci

Runs = dict[tuple[str, str, int], list[dict[str, float]]]

TABLE1_ARMS = ("GRPO", "GRPO+Clip_B", "GRPO+Clip_V")
#: Figure 1: Theorem 1's predicted direction of the entropy change, per arm.  ``only`` arms are compared
#: with their starting entropy, ``mask`` arms with vanilla GRPO (the paper's Figure 1 a-b and c-d).
FIG1_EXPECTED = {
    "only S*>0 in pos": -1, "only S*<0 in pos": +1, "only S*>0 in neg": +1, "only S*<0 in neg": -1,
    "mask S*>0 in pos": +1, "mask S*<0 in pos": -1, "mask S*>0 in neg": -1, "mask S*<0 in neg": +1,
}


def tail_mean(values: list[float], frac: float = 0.1) -> float:
    """Mean of the last ``frac`` of ``values`` (at least one)."""
    tail = values[-max(1, int(len(values) * frac)) :]
    return sum(tail) / len(tail)


def load(out: Path) -> tuple[dict, Runs]:
    """``paper_results.json`` and the per-step records keyed by ``(group, arm, seed)``, sorted by step."""
    meta = json.loads(read_records_text(out / "paper_results.json"))
    runs: Runs = {}
    with open_records(out / "paper_steps.csv") as f:
        for row in csv.DictReader(f):
            key = (row["group"], row["arm"], int(row["seed"]))
            runs.setdefault(key, []).append(
                {k: float(v) for k, v in row.items() if k not in ("group", "arm", "seed") and v != ""}
            )
    for recs in runs.values():
        recs.sort(key=lambda r: r["step"])
    return meta, runs


def col(recs: list[dict[str, float]], key: str) -> list[float]:
    """The ``key`` column of per-step records, in step order."""
    return [r[key] for r in recs]


def _pm(m: float, h: float, digits: int = 3) -> str:
    return f"{m:.{digits}f} ± {h:.{digits}f}" if math.isfinite(h) else f"{m:.{digits}f}"


def _seed0(meta: dict) -> int:
    return min(f["seed"] for f in meta["finals"])


# ------------------------------------------------------------------------------------------------ sections


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def section_fig1(meta: dict, runs: Runs) -> tuple[str, str]:
    s0 = _seed0(meta)
    base = runs[("table1", "GRPO", s0)]
    h_start = base[0]["entropy"]
    base_end, base_run = tail_mean(col(base, "entropy")), _mean(col(base, "entropy"))
    rows, ok_end, ok_run = [], 0, 0
    for arm, expected in FIG1_EXPECTED.items():
        recs = runs[("fig1", arm, s0)]
        h_end, h_run = tail_mean(col(recs, "entropy")), _mean(col(recs, "entropy"))
        only = arm.startswith("only")
        d_end = h_end - (h_start if only else base_end)
        d_run = h_run - (h_start if only else base_run)
        a_end, a_run = (d_end > 0) == (expected > 0), (d_run > 0) == (expected > 0)
        ok_end, ok_run = ok_end + a_end, ok_run + a_run
        rows.append({
            "arm": arm, "ref": "start" if only else "GRPO", "d_end": d_end, "d_run": d_run,
            "expected": "up" if expected > 0 else "down", "a_end": "yes" if a_end else "NO", "a_run": "yes" if a_run else "NO",
            "kept": 1.0 - _mean(col(recs, "clip_frac")),
        })
    table = format_table(rows, [("arm", "arm"), ("kept", "tokens kept"), ("ref", "compared with"),
                                ("d_end", "ΔH final"), ("d_run", "ΔH run mean"), ("expected", "Theorem 1"),
                                ("a_end", "agrees (final)"), ("a_run", "agrees (run mean)")])
    verdict = f"{ok_end}/8 by final entropy, {ok_run}/8 by mean entropy over the run"
    idle = [r["arm"] for r in rows if r["kept"] < 1e-3]
    note = (
        f"\n\n{', '.join(idle)}: fewer than 0.1% of the tokens qualify, so the update is nearly empty and the "
        "entropy change is no test of the theorem." if idle else ""
    )
    text = (
        "## Figure 1: the sign of S* predicts the direction of the entropy change\n\n"
        "Each arm trains on a subset of tokens chosen by the sign of S* = p_k(H + log p_k) within positive "
        "(A > 0) or negative (A < 0) samples: *only* keeps just those tokens in the loss, *mask* drops just them. "
        "*only* arms are compared with the starting entropy "
        f"({h_start:.3f}); *mask* arms with vanilla GRPO (final {base_end:.3f}, run mean {base_run:.3f}). "
        "Final = mean token entropy over the last 10% of steps; run mean = over all steps. "
        f"**Arms that move the way Theorem 1 predicts: {verdict}.**\n\n" + table + note + "\n\n![Figure 1](fig1.png)\n"
    )
    return text, verdict


def section_fig2(meta: dict, runs: Runs) -> str:
    s0 = _seed0(meta)
    base = runs[("table1", "GRPO", s0)]
    h_base = tail_mean(col(base, "entropy"))
    h_base_run = _mean(col(base, "entropy"))
    lines = []
    rows = []
    for method, label, t1 in (("clip_b", "Clip_B", "GRPO+Clip_B"), ("clip_v", "Clip_V", "GRPO+Clip_V")):
        pts = [(mu, runs[("fig2", f"{method} mu={mu:g}", s0)]) for mu in meta["mus"]]
        pts.append((meta["mu_table"], runs[("table1", t1, s0)]))
        pts.sort(key=lambda p: p[0])
        fracs = [sum(col(r, "clip_frac")) / len(r) for _, r in pts]
        ents = [tail_mean(col(r, "entropy")) for _, r in pts]
        runs_h = [_mean(col(r, "entropy")) for _, r in pts]
        mono = all(x >= y for x, y in zip(fracs, fracs[1:]))
        above, above_run = sum(e > h_base for e in ents), sum(e > h_base_run for e in runs_h)
        for (mu, _), f, e, m in zip(pts, fracs, ents, runs_h):
            rows.append({"method": label, "mu": mu, "clip": f, "h": e, "dh": e - h_base, "hm": m, "dhm": m - h_base_run})
        lines.append(
            f"- {label}: mean clip fraction {'falls monotonically' if mono else 'does NOT fall monotonically'} as mu grows "
            f"({', '.join(f'{f:.4f}' for f in fracs)}); entropy above vanilla GRPO's in {above}/{len(pts)} settings "
            f"at the end and in {above_run}/{len(pts)} averaged over the run."
        )
    table = format_table(rows, [("method", "method"), ("mu", "mu"), ("clip", "mean clip frac"), ("h", "final H"),
                                ("dh", "ΔH final vs GRPO"), ("hm", "run-mean H"), ("dhm", "ΔH run mean vs GRPO")])
    return (
        "## Figure 2: mu sets the clip fraction and slows the entropy decay\n\n"
        "Negative-advantage tokens below the lower bound are clipped (sides = negative, no cap). "
        f"Vanilla GRPO's entropy: final {h_base:.3f}, run mean {h_base_run:.3f}. On any one batch the tokens clipped "
        "at a larger mu are a subset of those clipped at a smaller one; the fractions below are means over each run's "
        "own trajectory, so they can depart from that order when the runs' policies drift apart.\n\n" + "\n".join(lines) + "\n\n" + table + "\n\n![Figure 2](fig2.png)\n"
    )


def section_fig3_fig5(meta: dict, runs: Runs) -> str:
    recs = [r for s in range(meta["seeds"]) for r in runs.get(("table1", "GRPO", _seed0(meta) + s), [])]
    s_star = [abs(r["s_star_mean"]) for r in recs]
    s_c = [abs(r["s_c_mean"]) for r in recs]
    ratio = (sum(s_star) / len(s_star)) / max(sum(s_c) / len(s_c), 1e-300)
    neg_cov = [-r["cov_adv_sc"] for r in recs]
    pos_part = [r["neg_cov_pos_part"] for r in recs]
    neg_part = [r["neg_cov_neg_part"] for r in recs]
    frac_neg = sum(v < 0 for v in neg_cov) / len(neg_cov)
    return (
        "## Figure 3: the batch mean of S_c is far below that of S*\n\n"
        f"Over every step of every vanilla GRPO run, mean |E_B[S*]| = {sum(s_star) / len(s_star):.3g} and mean "
        f"|E_B[S_c]| = {sum(s_c) / len(s_c):.3g}: a ratio of **{ratio:.3g}** "
        f"(about {math.log10(ratio):.1f} orders of magnitude; Corollary 2 says E_B[S_c] is 0 in expectation).\n\n"
        "![Figure 3 and 5](fig3_fig5.png)\n\n"
        "## Figure 5: -Cov_B(A, S_c) over training\n\n"
        f"-Cov_B(A, S_c) is negative (entropy-decreasing by Corollary 4) in **{100 * frac_neg:.0f}%** of the vanilla "
        f"GRPO steps; mean {sum(neg_cov) / len(neg_cov):.3g}. Split by advantage sign, the positive samples "
        f"contribute {sum(pos_part) / len(pos_part):.3g} and the negative samples {sum(neg_part) / len(neg_part):.3g} "
        "on average (the two parts sum to -E_B[A S_c], which equals -Cov_B(A, S_c) when E_B[A] = 0, as it is here: "
        "every response has the same length).\n"
    )


def section_table1(meta: dict, runs: Runs) -> str:
    cfg = meta["config"]
    finals = {(f["arm"], f["seed"]): f for f in meta["finals"] if f["group"] == "table1"}
    rows = [{"arm": "warm-up (no RL)", "avg": f"{meta['base_eval']['avg_at_k']:.3f}",
             "pass": f"{meta['base_eval']['pass_at_k']:.3f}", "h": "", "r": ""}]
    per_arm = {}
    for arm in TABLE1_ARMS:
        seeds = sorted(s for a, s in finals if a == arm)
        avg = mean_ci([finals[(arm, s)]["avg_at_k"] for s in seeds])
        pas = mean_ci([finals[(arm, s)]["pass_at_k"] for s in seeds])
        ent = mean_ci([tail_mean(col(runs[("table1", arm, s)], "entropy")) for s in seeds])
        rew = mean_ci([tail_mean(col(runs[("table1", arm, s)], "reward")) for s in seeds])
        per_arm[arm] = (avg, pas, ent)
        rows.append({"arm": arm, "avg": _pm(*avg), "pass": _pm(*pas), "h": _pm(*ent), "r": _pm(*rew)})
    table = format_table(rows, [("arm", "method"), ("avg", f"Avg@{cfg['eval_k']}"), ("pass", f"Pass@{cfg['eval_k']}"),
                                ("h", "final entropy"), ("r", "final train reward")])
    g = per_arm["GRPO"]
    notes = []
    for arm in TABLE1_ARMS[1:]:
        avg, pas, ent = per_arm[arm]
        notes.append(
            f"- {arm} vs GRPO: Avg@k {avg[0] - g[0][0]:+.3f}, Pass@k {pas[0] - g[1][0]:+.3f}, "
            f"final entropy {ent[0] - g[2][0]:+.3f}"
        )
    if all(per_arm[arm][1][0] >= 0.999 for arm in TABLE1_ARMS):
        notes.append(
            f"- Pass@{cfg['eval_k']} is saturated (at least 0.999) for every arm: at this k the held-out task is too "
            "easy to test the claim that holding entropy helps exploration."
        )
    return (
        "## Table 1's question: Avg@k and Pass@k of GRPO vs + Clip_B vs + Clip_V\n\n"
        f"{meta['seeds']} seeds per arm (mean ± 95% t-interval over seeds); k = {cfg['eval_k']} samples per held-out "
        f"problem at temperature {cfg['eval_temperature']}, {cfg['eval_prompts']} problems. Clip_B and Clip_V both at "
        f"mu = {meta['mu_table']}, negative side, no cap (the reference Clip_V's mu = 8.5 with a 1e-4 cap clips at "
        "most one token per batch at this scale).\n\n" + table + "\n\n" + "\n".join(notes) +
        "\n\nDifferences whose intervals overlap are not resolved by this many seeds.\n\n![Table 1 curves](table1.png)\n"
    )


def section_theory(meta: dict, runs: Runs) -> str:
    tab_rows = [{"eta": t["step_size"], "corr": t["corr"], "slope": t["slope"], "sign": t["sign"]} for t in meta["tabular"]]
    tab = format_table(tab_rows, [("eta", "step size η"), ("corr", "Pearson r"), ("slope", "slope (1 = exact)"),
                                  ("sign", "sign agreement")])
    net_rows = []
    for arm in TABLE1_ARMS:
        seeds = sorted(s for g, a, s in runs if g == "table1" and a == arm)
        c4, sg, sl, lin = [], [], [], []
        for s in seeds:
            recs = runs[("table1", arm, s)]
            pred, real = col(recs, "pred_dH"), col(recs, "real_dH")
            c4.append(pearson(pred, real))
            sg.append(sign_agreement(pred, real))
            den = sum(p * p for p in pred)
            sl.append(sum(p * r for p, r in zip(pred, real)) / den if den > 0 else math.nan)
            if "pred_lin_dH" in recs[0]:
                lin.append(pearson(col(recs, "pred_lin_dH"), real))
        net_rows.append({"arm": arm, "c4": _pm(*mean_ci(c4)), "sign": _pm(*mean_ci(sg)), "slope": _pm(*mean_ci(sl), 4),
                         "lin": _pm(*mean_ci(lin)) if lin else "n/a"})
    net = format_table(net_rows, [("arm", "arm"), ("c4", "r: Cor. 4 vs realised"), ("sign", "sign agreement"),
                                  ("slope", "fitted effective η"), ("lin", "r: ∇θH·Δθ vs realised")])
    return (
        "## The reviewers' question: does the first-order law predict the realised entropy change?\n\n"
        "**Tabular case** (logits as parameters, each token owns its logit vector, plain SGD, GRPO advantages on the "
        "same task, 100 steps per step size, initialised from the warmed-up network's logits): Corollary 4's "
        "-η Cov_B(A, S_c) against the realised change of the batch-mean entropy at every step.\n\n" + tab +
        "\n\n**Network case** (the Table 1 runs; Adam; per step, the same sampled batch before and after the update): "
        "Corollary 4's -Cov_B(A·keep, S_c) has no known step size for a network whose tokens share parameters, so we "
        "report its correlation and sign agreement with the realised change, and the least-squares step size that "
        "would scale it; the last column is the exact first-order change of the network, ∇θ H_B · Δθ, which tells "
        "whether the gap is the first-order truncation or the tabular assumption. Mean ± 95% interval over seeds.\n\n"
        + net + "\n\n![theory check](theory.png)\n"
    )


# ------------------------------------------------------------------------------------------------- figures


def _figures(out: Path, meta: dict, runs: Runs) -> None:
    plt = pyplot()
    s0 = _seed0(meta)
    base = runs[("table1", "GRPO", s0)]
    w = max(1, len(base) // 20)

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, (action, side, title) in zip(axes.flat, [
        ("only", "pos", "(a) update only, positive samples"), ("only", "neg", "(b) update only, negative samples"),
        ("mask", "pos", "(c) mask, positive samples"), ("mask", "neg", "(d) mask, negative samples")]):
        ax.plot(col(base, "step"), col(base, "entropy"), color="black", label="GRPO (all tokens)")
        for s, color in (("S*>0", "tab:red"), ("S*<0", "tab:blue")):
            recs = runs[("fig1", f"{action} {s} in {side}", s0)]
            ax.plot(col(recs, "step"), col(recs, "entropy"), color=color, label=f"{action} {s}")
        ax.set(title=title, ylabel="mean token entropy")
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("GRPO step")
    save_figure(fig, out / "fig1.png", dpi=100)

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for j, (method, label, t1) in enumerate((("clip_b", "Clip_B", "GRPO+Clip_B"), ("clip_v", "Clip_V", "GRPO+Clip_V"))):
        pts = [(mu, runs[("fig2", f"{method} mu={mu:g}", s0)]) for mu in meta["mus"]]
        pts.append((meta["mu_table"], runs[("table1", t1, s0)]))
        pts.sort(key=lambda p: p[0])
        for mu, recs in pts:
            axes[0, j].plot(col(recs, "step"), smooth(col(recs, "clip_frac"), w), label=f"mu={mu:g}")
            axes[1, j].plot(col(recs, "step"), col(recs, "entropy"), label=f"mu={mu:g}")
        axes[1, j].plot(col(base, "step"), col(base, "entropy"), color="black", label="GRPO")
        axes[0, j].set(title=f"({'ab'[j]}) {label}: clip fraction (moving average)", yscale="log")
        axes[1, j].set(title=f"({'cd'[j]}) {label}: mean token entropy", xlabel="GRPO step")
        for ax in axes[:, j]:
            ax.legend(fontsize=8)
    save_figure(fig, out / "fig2.png", dpi=100)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    axes[0].plot(col(base, "step"), [abs(x) for x in col(base, "s_star_mean")], label="|E_B[S*]|")
    axes[0].plot(col(base, "step"), [abs(x) for x in col(base, "s_c_mean")], label="|E_B[S_c]|")
    axes[0].set(title="Figure 3: batch means (vanilla GRPO, seed %d)" % s0, yscale="log", xlabel="GRPO step")
    axes[1].plot(col(base, "step"), [-x for x in col(base, "cov_adv_sc")], color="black", label="-Cov_B(A, S_c)")
    axes[1].plot(col(base, "step"), col(base, "neg_cov_pos_part"), label="part from A > 0")
    axes[1].plot(col(base, "step"), col(base, "neg_cov_neg_part"), label="part from A < 0")
    axes[1].axhline(0, color="grey", lw=0.5)
    axes[1].set(title="Figure 5: -Cov_B(A, S_c) (vanilla GRPO)", xlabel="GRPO step")
    for ax in axes:
        ax.legend(fontsize=8)
    save_figure(fig, out / "fig3_fig5.png", dpi=100)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm in TABLE1_ARMS:
        seeds = sorted(s for g, a, s in runs if g == "table1" and a == arm)
        curves = [runs[("table1", arm, s)] for s in seeds]
        steps = col(curves[0], "step")
        for ax, key in ((axes[0], "entropy"), (axes[1], "reward")):
            series = [smooth(col(c, key), w) for c in curves]
            stats = [mean_ci([s[i] for s in series]) for i in range(len(steps))]
            m = [x for x, _ in stats]
            h = [0.0 if math.isnan(y) else y for _, y in stats]
            line = ax.plot(steps, m, label=arm)[0]
            ax.fill_between(steps, [a - b for a, b in zip(m, h)], [a + b for a, b in zip(m, h)], alpha=0.2,
                            color=line.get_color())
    axes[0].set(title="mean token entropy (mean ± 95% CI over seeds)", xlabel="GRPO step")
    axes[1].set(title="training reward (moving average; mean ± 95% CI)", xlabel="GRPO step")
    for ax in axes:
        ax.legend(fontsize=8)
    save_figure(fig, out / "table1.png", dpi=100)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    lo = hi = 0.0
    for t in meta["tabular"]:
        eta = t["step_size"]
        x, y = [p / eta for p in t["predicted"]], [r / eta for r in t["realised"]]
        axes[0].scatter(x, y, s=6, label=f"η={eta:g} (r={t['corr']:.4f}, slope {t['slope']:.3f})")
        lo, hi = min(lo, *x, *y), max(hi, *x, *y)
    axes[0].plot([lo, hi], [lo, hi], color="grey", lw=0.8, label="y = x")
    axes[0].set(title="tabular: Cor. 4 vs realised, per unit step", xlabel="-Cov_B(A, S_c)  (= prediction / η)",
                ylabel="realised ΔH_B / η")
    for arm in TABLE1_ARMS:
        recs = [r for g, a, s in runs if g == "table1" and a == arm for r in runs[(g, a, s)]]
        axes[1].scatter(col(recs, "pred_dH"), col(recs, "real_dH"), s=4, alpha=0.4, label=arm)
        if recs and "pred_lin_dH" in recs[0]:
            axes[2].scatter(col(recs, "pred_lin_dH"), col(recs, "real_dH"), s=4, alpha=0.4, label=arm)
    axes[1].set(title="network: Cor. 4 (unit step) vs realised", xlabel="-Cov_B(A·keep, S_c)", ylabel="realised ΔH_B")
    axes[2].set(title="network: ∇θH_B·Δθ vs realised", xlabel="∇θ H_B · Δθ", ylabel="realised ΔH_B")
    for ax in axes:
        ax.axhline(0, color="grey", lw=0.5)
        ax.axvline(0, color="grey", lw=0.5)
        ax.legend(fontsize=7)
    save_figure(fig, out / "theory.png", dpi=100)


def write_report(out: Path) -> Path:
    """Render ``report.md`` (and, with matplotlib, fig1/fig2/fig3_fig5/table1/theory PNGs) under ``out``."""
    meta, runs = load(out)
    cfg = meta["config"]
    fig1, verdict = section_fig1(meta, runs)
    header = (
        "# Entropy dynamics at small scale: a reproduction of the paper's experiments\n\n"
        f"Produced by `entropy-discriminator demo --paper` on **{meta['device']}** (torch {meta['torch']}) in "
        f"{meta['seconds']:.0f} s. Task: {cfg['n_digits']}-digit addition (answer least-significant digit first, exact-match "
        f"reward); policy: a {cfg['n_layers']}-layer transformer, d = {cfg['d_model']}, warmed up for "
        f"{meta['warmup']['steps']:.0f} steps on targets {100 * cfg['warmup_noise']:.0f}% of which are plausible wrong answers; "
        f"then strict on-policy GRPO (one Adam step per batch, lr {cfg['lr']:g}, r = 1), {cfg['grpo_steps']} steps of "
        f"{cfg['prompts_per_step']} prompts x {cfg['group_size']} samples at temperature {cfg['temperature']:g}. "
        "Masks act by zeroing the clipped tokens' policy-gradient term (the loss normaliser is unchanged). Every "
        "number below is computed from `paper_steps.csv` and `paper_results.json` beside this file; nothing is "
        "hand-edited. This is a toy model on a toy task: it tests the paper's mechanisms, not its LLM-scale "
        "numbers.\n\n"
        f"Figure 1: arms that move as Theorem 1 predicts: {verdict}. Each section below states its own result.\n"
    )
    body = [header, fig1, section_fig2(meta, runs), section_fig3_fig5(meta, runs), section_table1(meta, runs),
            section_theory(meta, runs)]
    if have_matplotlib():
        _figures(out, meta, runs)
    else:
        body.append(f"\n_{PLOT_HINT}; then rerun with `entropy-discriminator demo --paper --render-only --out {out}`._\n")
    path = out / "report.md"
    path.write_text("\n".join(body))
    return path
