"""Plot and summarise a run's ``entropy_disc/*`` metrics, the rows of :func:`~entropy_discriminator.runlog.read_run`
(``entropy-discriminator plot``)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .demo.report import pyplot
from .demo.train import pearson
from .runlog import series


def summarise_run(rows: list[dict[str, float]]) -> dict[str, float]:
    """Headline numbers of a run: steps, entropy first/last, clipped share (mean, median, steps with none clipped),
    and the Pearson correlation of predicted and realised entropy change over the steps that log both (NaN when
    fewer than 3).  Absent metrics give NaN."""
    _, entropy = series(rows, "entropy/mean")
    _, frac = series(rows, "clip/frac")
    both = [(r["delta_entropy/predicted"], r["delta_entropy/realised"]) for r in rows
            if math.isfinite(r.get("delta_entropy/predicted", math.nan))
            and math.isfinite(r.get("delta_entropy/realised", math.nan))]
    return {"steps": float(len(rows)), "entropy_first": entropy[0] if entropy else math.nan,
            "entropy_last": entropy[-1] if entropy else math.nan,
            "clip_frac_mean": sum(frac) / len(frac) if frac else math.nan,
            "clip_frac_median": statistics.median(frac) if frac else math.nan,
            "steps_clipping_none": float(sum(f == 0 for f in frac)) if frac else math.nan,
            "dH_corr": pearson([p for p, _ in both], [r for _, r in both])}


def format_summary(summary: dict[str, float]) -> str:
    """``summarise_run``'s numbers as a few lines of text."""
    lines = [
        f"steps logged                {summary['steps']:.0f}",
        f"entropy (nats/token)        {summary['entropy_first']:.4f} -> {summary['entropy_last']:.4f} (first -> last)",
        f"clipped share               mean {summary['clip_frac_mean']:.4f}, median {summary['clip_frac_median']:.4f}; "
        f"{summary['steps_clipping_none']:.0f} step(s) clipped none"
        if math.isfinite(summary["clip_frac_mean"]) else "clipped share               not logged (no mask)",
    ]
    if math.isfinite(summary["dH_corr"]):
        lines.append(f"corr(predicted, realised dH) {summary['dH_corr']:.3f}")
    return "\n".join(lines)


def plot_run(rows: list[dict[str, float]], out: str | Path, *, title: str = "") -> Path:
    """Write to ``out`` (PNG) three panels against the step: the batch-mean token entropy (p10-p90 band, and the
    autopilot's target when logged), the clipped share, and the predicted and realised entropy change when logged.
    Needs matplotlib (``pip install -e ".[plot]"``)."""
    try:
        plt = pyplot()
    except ImportError as exc:
        raise ImportError('entropy-discriminator plot needs matplotlib: pip install -e ".[plot]" from the clone') from exc
    fig, (ax_h, ax_c, ax_d) = plt.subplots(1, 3, figsize=(14, 3.8))
    steps, entropy = series(rows, "entropy/mean")
    ax_h.plot(steps, entropy, label="entropy/mean")
    (s10, p10), (s90, p90) = series(rows, "entropy/p10"), series(rows, "entropy/p90")
    if p10 and s10 == s90:
        ax_h.fill_between(s10, p10, p90, alpha=0.2, label="p10-p90")
    ts, target = series(rows, "autopilot/target_entropy")
    if target:
        ax_h.plot(ts, target, "--", label="autopilot target")
    ax_h.set(xlabel="step", ylabel="nats/token", title="token entropy")
    ax_h.legend(fontsize=8)
    ax_c.plot(*series(rows, "clip/frac"), label="clip/frac")
    ap_steps, ap_frac = series(rows, "autopilot/dropped_frac")
    if ap_frac:
        ax_c.plot(ap_steps, ap_frac, label="autopilot/dropped_frac")
    ax_c.set(xlabel="step", ylabel="share of valid tokens", title="clipped share")
    ax_c.legend(fontsize=8)
    changes = {name: series(rows, f"delta_entropy/{name}") for name in ("predicted", "realised")}
    for name, (x, y) in changes.items():
        if y:
            ax_d.plot(x, y, label=name)
    ax_d.axhline(0.0, color="grey", lw=0.5)
    ax_d.set(xlabel="step", ylabel="nats/token", title="entropy change per step")
    if any(y for _, y in changes.values()):
        ax_d.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
