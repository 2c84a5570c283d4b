"""Record files of the demo and the protocol (JSON lines, CSV, JSON), plain or compressed.

A record file ``X`` may be stored as ``X`` or, compressed, as ``X.xz`` or ``X.gz`` (the reproduction records under
``docs/reproduction`` are stored as ``.xz``; ``xzcat X.xz`` / ``zcat X.gz`` print them). Every reader of a record goes
through :func:`open_records`, which reads ``X`` if it exists, else ``X.xz``, else ``X.gz``, so a report recomputes
from compressed records exactly as from plain ones. Writers pick the compression from the path's suffix.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

#: Compressed forms a record ``X`` may take, in the order they are looked for after ``X`` itself.
COMPRESSED_SUFFIXES = (".xz", ".gz")


def _candidates(path: Path) -> list[Path]:
    if path.suffix in COMPRESSED_SUFFIXES:
        return [path]
    return [path, *(path.with_name(path.name + s) for s in COMPRESSED_SUFFIXES)]


def record_path(path: str | Path) -> Path:
    """The file that holds record ``path``: ``path`` if it is a file, else ``path.xz``, else ``path.gz`` (a path that
    already ends in ``.xz`` / ``.gz`` is taken as it is). Raises ``FileNotFoundError`` naming every path tried."""
    tried = _candidates(Path(path))
    for p in tried:
        if p.is_file():
            return p
    raise FileNotFoundError(f"no record file {' or '.join(str(p) for p in tried)}")


def has_records(path: str | Path) -> bool:
    """Whether :func:`record_path` finds ``path`` (plain or compressed)."""
    return any(p.is_file() for p in _candidates(Path(path)))


def open_records(path: str | Path, mode: str = "r") -> TextIO:
    """Open record ``path`` as text (UTF-8). ``mode`` ``"r"``: the file :func:`record_path` finds, decompressed when it
    ends in ``.xz`` / ``.gz``; ``"w"`` / ``"a"``: ``path`` itself, compressed when it ends in ``.xz`` (preset 9) or
    ``.gz`` (level 9, no timestamp); appending to a compressed file adds a stream that :func:`open_records` reads back
    after the earlier ones. Line endings are neither translated nor added (``newline=""``, as :mod:`csv` needs)."""
    if mode not in ("r", "w", "a"):
        raise ValueError(f"mode must be 'r', 'w' or 'a', got {mode!r}")
    p = record_path(path) if mode == "r" else Path(path)
    if p.suffix == ".xz":
        raw = lzma.open(p, mode + "b", preset=None if mode == "r" else 9)
        return io.TextIOWrapper(raw, encoding="utf-8", newline="")
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.GzipFile(p, mode + "b", compresslevel=9, mtime=0), encoding="utf-8", newline="")
    return open(p, mode, encoding="utf-8", newline="")


def read_records_text(path: str | Path) -> str:
    """The whole text of record ``path`` (plain or compressed, as :func:`open_records`)."""
    with open_records(path) as f:
        return f.read()


def load_jsonl(*paths: str | Path) -> list[dict]:
    """The rows of one or more JSON-lines record files, in order (blank lines skipped): several files read as their
    concatenation."""
    rows: list[dict] = []
    for path in paths:
        with open_records(path) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


#: Significant digits of the floats the protocol's records keep (:func:`round_floats`).
RECORD_DIGITS = 6


def round_floats(value: object, digits: int = RECORD_DIGITS) -> object:
    """``value`` with every float (in nested lists, tuples and dicts) rounded to ``digits`` significant digits,
    ``float(f"{x:.{digits}g}")``; nan and inf stay as they are, other values are returned unchanged (a tuple comes
    back as a list, as JSON has it).  Six digits keep every reported figure (three decimals) and shrink a run's
    compressed record by about 40 %."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, (list, tuple)):
        return [round_floats(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: round_floats(v, digits) for k, v in value.items()}
    return value


def append_jsonl(path: str | Path, rows: Iterable[dict[str, object]]) -> None:
    """Append ``rows`` to the JSON-lines file ``path``, one ``json.dumps`` line each (compressed by suffix)."""
    with open_records(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
