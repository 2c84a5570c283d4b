"""Record files plain or compressed (``entropy_lab.records``), the committed reproduction records, and
the size of the tracked checkout.

The reproduction reports under ``docs/reproduction`` are recomputed here from the committed (compressed) records for
three representative commands, and compared byte for byte with the committed outputs."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entropy_lab import protocol
from entropy_lab.records import (
    COMPRESSED_SUFFIXES,
    append_jsonl,
    has_records,
    load_jsonl,
    open_records,
    read_records_text,
    record_path,
    round_floats,
)

ROOT = Path(__file__).resolve().parents[1]
REPRO = ROOT / "docs" / "reproduction"
#: The tracked checkout (every file ``git ls-files`` lists) stays at most this large: a device call carries it
#: (64 MiB at most).  With the headroom main run's 600 runs and its report (tables, 20 palette-PNG frontier figures
#: of about 30 KB) the checkout is 12.6 MB.
MAX_TRACKED_BYTES = 13 * 1000 * 1000

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10**12), 10**12),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
_rows = st.lists(st.dictionaries(st.text(min_size=1, max_size=8), _scalars, max_size=6), max_size=12)


@settings(max_examples=8, deadline=None)  # each xz stream at preset 9 allocates its 64 MiB dictionary
@given(rows=_rows, split=st.integers(0, 12))
def test_jsonl_reads_the_same_plain_xz_and_gz(tmp_path_factory: pytest.TempPathFactory, rows: list[dict],
                                               split: int) -> None:
    """Rows written plain, as ``.xz`` and as ``.gz`` (the compressed ones in two appends: two streams) read back equal
    to the rows, through ``X`` (the reader finds ``X.xz`` / ``X.gz``) and through the compressed path itself."""
    d = tmp_path_factory.mktemp("jsonl")
    expected = [json.loads(json.dumps(r)) for r in rows]
    (d / "plain").mkdir()
    (d / "plain" / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    for suffix in COMPRESSED_SUFFIXES:
        (d / suffix[1:]).mkdir()
        target = d / suffix[1:] / f"runs.jsonl{suffix}"
        target.touch()  # appending to an empty file, then to a stream
        append_jsonl(target, rows[:split])
        append_jsonl(target, rows[split:])
        assert load_jsonl(d / suffix[1:] / "runs.jsonl") == expected
        assert load_jsonl(target) == expected
    assert load_jsonl(d / "plain" / "runs.jsonl") == expected
    # several files read as their concatenation
    assert load_jsonl(d / "plain" / "runs.jsonl", d / "xz" / "runs.jsonl") == expected + expected


@settings(max_examples=8, deadline=None)
@given(values=st.lists(st.tuples(st.text(max_size=10), st.floats(allow_nan=False, allow_infinity=False)), max_size=20))
def test_csv_reads_the_same_plain_and_compressed(tmp_path_factory: pytest.TempPathFactory,
                                                 values: list[tuple[str, float]]) -> None:
    """A CSV written by :mod:`csv` (``\\r\\n`` rows, quoted newlines in fields) through :func:`open_records` reads
    back the same rows from the plain file and from its ``.xz`` / ``.gz`` forms."""
    d = tmp_path_factory.mktemp("csv")
    rows = [{"name": name, "value": repr(v)} for name, v in values]
    for name in ("a.csv", "b.csv.xz", "c.csv.gz"):
        with open_records(d / name, "w") as f:
            w = csv.DictWriter(f, fieldnames=["name", "value"])
            w.writeheader()
            w.writerows(rows)
    texts = {read_records_text(d / n) for n in ("a.csv", "b.csv", "c.csv")}
    assert len(texts) == 1
    for n in ("a.csv", "b.csv", "c.csv"):
        with open_records(d / n) as f:
            assert list(csv.DictReader(f)) == rows


@given(st.floats(allow_nan=False, allow_infinity=False) | st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_round_floats_keeps_six_significant_digits(x: float) -> None:
    """Every float, however deeply nested, becomes the nearest 6-significant-digit value (relative change at most
    5e-6, idempotent); ints, strings, None and booleans pass unchanged, a tuple becomes a list."""
    nested = {"a": [x, (x, 3)], "b": {"c": x, "d": "s", "e": None, "f": True}}
    got = round_floats(nested)
    y = got["a"][0]
    assert y == float(f"{x:.6g}") and got["a"][1] == [y, 3] and got["b"] == {"c": y, "d": "s", "e": None, "f": True}
    assert abs(y - x) <= 5e-6 * abs(x) and round_floats(got) == got
    assert math.isnan(round_floats([math.nan])[0]) and round_floats(math.inf) == math.inf


def test_plain_file_is_read_before_its_compressed_forms(tmp_path: Path) -> None:
    append_jsonl(tmp_path / "r.jsonl.xz", [{"from": "xz"}])
    append_jsonl(tmp_path / "r.jsonl.gz", [{"from": "gz"}])
    assert record_path(tmp_path / "r.jsonl") == tmp_path / "r.jsonl.xz"
    assert load_jsonl(tmp_path / "r.jsonl") == [{"from": "xz"}]
    append_jsonl(tmp_path / "r.jsonl", [{"from": "plain"}])
    assert load_jsonl(tmp_path / "r.jsonl") == [{"from": "plain"}]


def test_missing_record_names_every_path_tried(tmp_path: Path) -> None:
    missing = tmp_path / "runs.jsonl"
    assert not has_records(missing)
    with pytest.raises(FileNotFoundError) as err:
        load_jsonl(missing)
    for p in (missing, tmp_path / "runs.jsonl.xz", tmp_path / "runs.jsonl.gz"):
        assert str(p) in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"runs\.jsonl\.xz$"):
        record_path(tmp_path / "runs.jsonl.xz")  # a compressed name is taken as it is
    with pytest.raises(ValueError, match="mode"):
        open_records(tmp_path / "x.jsonl", "rb")


def test_protocol_cli_reads_several_compressed_runs_files(tmp_path: Path) -> None:
    """``autopilot-gain`` over two compressed files equals it over their plain concatenation."""
    recs = [{"autopilot_predicted_dh": 0.01 * i * (s + 1), "autopilot_entropy": 0.5 + 0.003 * i * i + 0.01 * s}
            for s in range(2) for i in range(6)]
    runs = [{"arm": "autopilot(hold)", "seed": s, "records": recs[6 * s: 6 * s + 6]} for s in range(2)]
    append_jsonl(tmp_path / "all.jsonl", runs)
    append_jsonl(tmp_path / "a.jsonl.xz", runs[:1])
    append_jsonl(tmp_path / "b.jsonl.gz", runs[1:])
    assert protocol.autopilot_gain(load_jsonl(tmp_path / "a.jsonl.xz", tmp_path / "b.jsonl"), "autopilot(hold)", 50) \
        == protocol.autopilot_gain(load_jsonl(tmp_path / "all.jsonl"), "autopilot(hold)", 50)


# ------------------------------------------------------------------------------- the committed reproduction records


def _committed_records() -> list[Path]:
    return sorted(p for p in REPRO.rglob("*") if p.suffix in COMPRESSED_SUFFIXES)


def test_committed_records_are_compressed_once_and_read() -> None:
    """Every compressed record under docs/reproduction decompresses, has no plain twin beside it (which the readers
    would take instead), and, for JSON lines, parses line by line."""
    found = _committed_records()
    assert len(found) >= 20, found
    for p in found:
        plain = p.with_suffix("")
        assert not plain.exists(), f"{plain} and {p} both exist"
        text = read_records_text(plain)
        assert len(text) > 1000, p
        if plain.suffix == ".jsonl":
            assert all(isinstance(r, dict) for r in load_jsonl(plain)), p


def _parts(folder: str, *names: str) -> list[Path]:
    return [REPRO / folder / n / "runs.jsonl" for n in names]


H2H_MAIN = _parts("headtohead/main", "seeds_0_1_2_3", "seeds_4_5_6_7", "seeds_8_9")
S2_MAIN = _parts("autopilot_eval/s2", "main_0_1_2_3_4", "main_5_6_7_8_9")
STAGE_B = _parts("headtohead/tuning", "stage_b_clip_b_clip_v_clip_cov_kl_cov",
                 "stage_b_forking_tokens_entropy_bonus_unlikely_ppo+clip_b", "stage_b_ppo+clip_v")


def _pairs(report_json: Path) -> list[tuple[str, str]]:
    """The report's pairs, in its first family's order."""
    pairs: list[tuple[str, str]] = []
    for row in next(iter(json.loads(report_json.read_text()).values())):
        if (row["arm"], row["vs"]) not in pairs:
            pairs.append((row["arm"], row["vs"]))
    return pairs


def test_head_to_head_primary_report_recomputes_from_the_compressed_parts(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``protocol report`` on the three compressed main-run parts rewrites ``main/primary.md`` and ``primary.json``
    byte for byte (the frontier figures are left out here: only their drawing takes time)."""
    monkeypatch.setattr(protocol, "frontier_figure", lambda *a, **k: None)
    ref = REPRO / "headtohead" / "main"
    protocol.report(tmp_path, _pairs(ref / "primary.json"), "primary", runs_files=H2H_MAIN)
    for name in ("primary.md", "primary.json"):
        assert (tmp_path / name).read_bytes() == (ref / name).read_bytes(), name


def test_stage_b_selection_recomputes_from_the_compressed_parts(tmp_path: Path) -> None:
    """``protocol select`` on tuning stage B's three compressed parts rewrites ``stage_b/selection.json`` and
    ``selection.md`` byte for byte."""
    assert protocol.main(["select", str(tmp_path), *[a for p in STAGE_B for a in ("--runs", str(p))]]) == 0
    ref = REPRO / "headtohead" / "tuning" / "stage_b"
    for name in ("selection.json", "selection.md"):
        assert (tmp_path / name).read_bytes() == (ref / name).read_bytes(), name


def test_s2_autopilot_gain_recomputes_from_the_compressed_parts() -> None:
    """``protocol autopilot-gain`` on S2's two compressed main parts prints ``s2/report/autopilot_gain.json``."""
    saved = json.loads((REPRO / "autopilot_eval" / "s2" / "report" / "autopilot_gain.json").read_text())
    got = protocol.autopilot_gain(load_jsonl(*S2_MAIN), "autopilot(hold)")
    assert json.dumps(got, indent=1) == json.dumps(saved, indent=1)
    assert not any(isinstance(v, float) and math.isnan(v) for v in got.values())


# ------------------------------------------------------------------------------------------ size of the checkout


def test_tracked_checkout_stays_light() -> None:
    """The files ``git ls-files`` lists sum to at most 13 MB (records go in compressed: docs/reproduction/README.md)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the tracked files cannot be listed")
    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not the root of a git checkout: the tracked files cannot be listed")
    res = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    files = [ROOT / name for name in res.stdout.decode().split("\0") if name]
    sizes = {str(p.relative_to(ROOT)): p.lstat().st_size for p in files if p.is_symlink() or p.exists()}
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= MAX_TRACKED_BYTES, f"tracked checkout is {total / 1e6:.2f} MB > {MAX_TRACKED_BYTES / 1e6:g} MB; largest: {biggest}"
