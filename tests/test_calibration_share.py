"""The lab's check of ``calibrate_share`` (``entropy_lab.calibration_share``): its summary against hand-made records
whose answers are known, and one real RL step's record on a tiny configuration."""

from __future__ import annotations

import math

import pytest

from entropy_lab import calibration_share as cs


def _records(scale: float, steps: int = 41) -> list[dict]:
    """One run whose every share reads ``scale`` times the whole batch's change; cheap = -1e-3 * step-varying."""
    out = []
    for step in range(1, steps + 1):
        real = 0.01 * math.sin(step) + 0.002 * step / steps
        out.append({"setup": "x", "seed": 0, "step": step, "rows": 64, "cheap": -1e-3 * math.cos(step) - 5e-4,
                    "real_1": real, **{f"real_{s}": scale * real for s in cs.SHARES}})
    return out


def test_a_share_equal_to_the_whole_batch_summarises_as_identical():
    for row in cs.summary(_records(1.0)):  # 5 calibration steps (1, 11, 21, 31, 41), all warming the fit in
        assert row["calibrations_compared"] == 0 and math.isnan(row["kappa_ratio_median"])
    rows = cs.summary(_records(1.0, steps=101))
    assert [r["calibrations_compared"] for r in rows] == [6, 6, 6]  # calibrations 6..11 of steps 1, 11, ..., 101
    assert [r["rows_read"] for r in rows] == [32, 16, 8]
    for row in rows:
        assert row["corr_realised"] == pytest.approx(1.0) and row["sd_diff_over_sd_full"] == 0.0
        assert row["kappa_ratio_median"] == pytest.approx(1.0)
        assert row["pred_corr_share"] == pytest.approx(row["pred_corr_whole"])


def test_a_share_that_doubles_the_change_doubles_kappa():
    for row in cs.summary(_records(2.0, steps=101)):
        assert row["kappa_ratio_median"] == pytest.approx(2.0) and row["corr_realised"] == pytest.approx(1.0)
        assert row["sd_diff_over_sd_full"] == pytest.approx(1.0)
        assert row["pred_relerr_share"] != pytest.approx(row["pred_relerr_whole"])


def test_one_real_step_records_the_whole_batch_and_each_share(monkeypatch):
    """A two-step run of the real loop on a tiny configuration (20 warm-up steps): every share's realised change
    is finite and, at share 1 / 2 / 4 / 8 of an evenly divisible batch, the whole batch's is their rows' mean."""
    monkeypatch.setitem(cs.CONFIGS, "tiny", "d_model=16,n_layers=1,warmup_steps=20")
    records = cs.run("tiny", 0, 2)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rows"] > 8 and all(math.isfinite(r[f"real_{s}"]) for s in (1, *cs.SHARES))
        assert math.isfinite(r["cheap"]) and math.isfinite(r["entropy"]) and r["entropy"] > 0


def test_the_committed_summary_recomputes_from_the_committed_records(tmp_path):
    """docs/reproduction/calibration_share: ``report`` on the compressed records writes the committed summary."""
    import json
    import shutil
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "docs" / "reproduction" / "calibration_share"
    shutil.copy(folder / "records.jsonl.xz", tmp_path)
    assert cs.main(["report", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads((folder / "summary.json").read_text())
    assert (tmp_path / "summary.md").read_text() == (folder / "summary.md").read_text()
