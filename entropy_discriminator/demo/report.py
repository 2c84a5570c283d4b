"""Plain-text progress, the summary table, CSV files and the PNG plot of the demo."""

from __future__ import annotations

import csv
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, TextIO

from .train import pearson

PLOT_HINT = 'matplotlib is not installed, so no PNG was written; install it from the repository root with: pip install -e ".[plot]"'


class TextProgress:
    """A progress bar ``label [#####-----] done/total info`` on ``stream`` (default stderr): redrawn in place on a
    terminal, else a line every 10%."""

    def __init__(self, label: str, *, stream: TextIO | None = None, width: int = 24) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._last_decile = -1

    def __call__(self, done: int, total: int, info: str | Callable[[], str] = "") -> None:
        frac = done / total if total else 1.0
        decile = int(frac * 10)
        if not self.tty and decile == self._last_decile and done != total:
            return
        self._last_decile = decile
        info = info() if callable(info) else info  # a function: read only now (e.g. a GPU loss, one sync per line)
        fill = int(round(frac * self.width))
        bar = "#" * fill + "-" * (self.width - fill)
        line = f"{self.label:<22} [{bar}] {done:>4}/{total:<4} {time.perf_counter() - self.start:6.1f}s  {info}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def prepare_output_folder(path: Path | str) -> Path:
    """Create the output folder ``path`` (with its parents) if needed and prove that it can be written, by a real
    write (a probe file created and removed; permission bits do not tell for root or ``/proc``).  ``ValueError``
    naming the folder when it is an existing file, lies under a file, or cannot be written."""
    out = Path(path)
    for candidate in (out, *out.parents):
        if candidate.exists() and not candidate.is_dir():
            where = "is an existing file" if candidate == out else f"cannot be a folder: {candidate} is a file"
            raise ValueError(f"{out} {where}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the folder {out}: {exc.strerror or exc}") from None
    try:
        tempfile.TemporaryFile(prefix=".write-probe-", dir=out).close()
    except OSError as exc:
        raise ValueError(f"cannot write in the folder {out} (creating a file there failed: {exc.strerror or exc})") from None
    return out


def write_csv(path: Path, rows: Sequence[dict[str, object]]) -> None:
    """Write ``rows`` (dicts; the union of their keys, in first-seen order, is the header) to ``path``; floats with 7
    significant digits."""
    header = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows({k: (f"{v:.7g}" if isinstance(v, float) else v) for k, v in row.items()} for row in rows)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return ""  # not applicable (e.g. the warm-up row has no clip fraction)
        return f"{value:.4g}" if abs(value) < 1e-3 and value != 0 else f"{value:.3f}"
    return str(value)


def format_table(rows: Sequence[dict[str, object]], columns: Sequence[tuple[str, str]]) -> str:
    """A GitHub-markdown table of ``rows`` with ``columns`` = ``(key, header)`` pairs."""
    head = [h for _, h in columns]
    body = [[_fmt(r.get(k, "")) for k, _ in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(r) for r in body)])


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (the first points average what exists)."""
    return [sum(values[max(0, i + 1 - window) : i + 1]) / min(i + 1, window) for i in range(len(values))]


def have_matplotlib() -> bool:
    """True when matplotlib can be imported (the ``plot`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path | BinaryIO, *, dpi: int) -> None:
    """``tight_layout`` ``fig``, write it as a PNG to ``path`` (a file name or a binary stream) at ``dpi``, close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, format="png")
    pyplot().close(fig)


def plot_demo(path: Path, curves: dict[str, list[dict[str, float]]], *, window: int):
    """Write the demo's PNG and return its figure: batch token entropy and training reward (moving averages over
    ``window`` steps, one line style per arm) on top; below, one panel per arm with the Corollary 4 prediction
    against the realised per-batch ``dH`` (each scaled to max 1) and their Pearson r."""
    plt = pyplot()
    fig = plt.figure(figsize=(15, 8.4))
    grid = fig.add_gridspec(2, 2 * len(curves))
    top = [fig.add_subplot(grid[0, : len(curves)]), fig.add_subplot(grid[0, len(curves) :])]
    for i, (arm, recs) in enumerate(curves.items()):
        steps = [r["step"] for r in recs]
        style = dict(ls=("-", "--", "-.", ":")[i % 4], lw=1.8, color=f"C{i}", label=arm)  # not just colour
        top[0].plot(steps, smooth([r["entropy"] for r in recs], window), **style)
        top[1].plot(steps, smooth([r["reward"] for r in recs], window), **style)
        pred, real = ([r[key] for r in recs] for key in ("pred_dH", "real_dH"))
        scale, rscale = (max(max(abs(v) for v in vals), 1e-30) for vals in (pred, real))
        ax = fig.add_subplot(grid[1, 2 * i : 2 * i + 2])
        ax.scatter([p / scale for p in pred], [x / rscale for x in real], s=9, alpha=0.6, color=f"C{i}")
        ax.axhline(0, color="grey", lw=0.5)
        ax.axvline(0, color="grey", lw=0.5)
        ax.set(title=f"{arm}: dH prediction vs realised, r = {pearson(pred, real):.2f}", xlim=(-1.08, 1.08),
               ylim=(-1.08, 1.08), xlabel="-Cov_B(A*keep, S_c)  (scaled to max 1)")
        if i == 0:
            ax.set_ylabel("realised dH  (scaled to max 1)")
    top[0].set(title=f"mean token entropy of each training batch (moving average, {window} steps)",
               xlabel="GRPO step", ylabel="nats")
    top[1].set(title=f"training reward (moving average, {window} steps)", xlabel="GRPO step", ylabel="pass rate")
    for ax in top:
        ax.legend(fontsize=9)
    save_figure(fig, path, dpi=110)
    return fig

