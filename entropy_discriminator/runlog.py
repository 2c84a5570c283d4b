"""A training run's logged ``entropy_disc/*`` metrics, read from the log each framework writes.

:func:`read_run` returns one row per logged step, ``{"step": s, "<name>": value, ...}``, every metric named by what
follows ``entropy_disc/`` (``entropy/mean``, ``clip/frac``, ...) whatever prefix the framework put before it.  It
reads a TRL ``trainer_state.json`` (or any JSON holding a ``log_history`` list, e.g. ``--summary_json``), verl's file
logger JSON lines ``{"step": s, "data": {...}}`` or console lines ``step:s - key:value - ...``, and JSON lines of flat
dicts with a ``step`` key (``examples/custom_loop.py --log-jsonl``, or any framework's metrics exported that way).
Other lines are skipped; a file with no ``entropy_disc/`` metric at all is refused by name.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

#: What every metric name carries, after any framework prefix.
MARKER = "entropy_disc/"


def read_run(path: str | Path) -> list[dict[str, float]]:
    """Rows ``{"step": float, metric: float}`` in logged order, one per logged step that has ``entropy_disc/`` metrics
    (a log of the module docstring's kinds; non-numeric values dropped).  ``ValueError`` naming the file when it holds
    no ``entropy_disc/`` metric; ``FileNotFoundError`` when it does not exist."""
    path = Path(path)
    text = path.read_text()
    records = _json_document(text)
    if records is None:
        records = [r for line in text.splitlines() if (r := _line(line)) is not None]
    rows = []
    for index, record in enumerate(records):
        if row := _metrics(record):
            step = record.get("step", index)
            rows.append({"step": float(step) if _number(step) else float(index), **row})
    if not rows:
        raise ValueError(
            f"{path} holds no {MARKER}* metric: expected a TRL trainer_state.json, verl's file or console log, or "
            f"JSON lines of metrics (with the adapter's metrics on)"
        )
    return rows


def _json_document(text: str) -> list[dict] | None:
    """The records of a whole-file JSON document with a ``log_history`` list (TRL), else None."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(doc, dict) and isinstance(doc.get("log_history"), list):
        return [r for r in doc["log_history"] if isinstance(r, dict)]
    if isinstance(doc, dict):  # a one-line JSON-lines file
        return [_flatten(doc)]
    return None


def _line(line: str) -> dict | None:
    """One record from a JSON line (flat, or verl's ``{"step", "data"}``) or a verl console line; else None."""
    line = line.strip()
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return None
        return _flatten(record) if isinstance(record, dict) else None
    if line.startswith("step:") and " - " in line:
        record: dict[str, object] = {}
        for part in line.split(" - "):
            key, _, value = part.partition(":")
            with contextlib.suppress(ValueError):  # also a part with no value
                record[key.strip()] = float(value)
        return record
    return None


def _flatten(record: dict) -> dict:
    """verl's file-logger record ``{"step": s, "data": {...}}`` as one flat dict; other records unchanged."""
    if isinstance(record.get("data"), dict):
        return {"step": record.get("step"), **record["data"]}
    return record


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metrics(record: dict) -> dict[str, float]:
    """The record's numeric ``entropy_disc/`` metrics, named by what follows the marker."""
    return {key.split(MARKER, 1)[1]: float(value) for key, value in record.items()
            if isinstance(key, str) and MARKER in key and _number(value)}


def series(rows: list[dict[str, float]], name: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of metric ``name`` over the rows that have it with a finite value."""
    pairs = [(r["step"], r[name]) for r in rows if name in r and math.isfinite(r[name])]
    return [s for s, _ in pairs], [v for _, v in pairs]
