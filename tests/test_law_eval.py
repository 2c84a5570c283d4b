"""``python -m entropy_lab.law_eval``: the same-batch table and the autopilot runs, end to end (tiny)."""

from __future__ import annotations

import math

import pytest

from entropy_lab import law_eval
from entropy_lab.records import load_jsonl


def test_fit_is_least_squares_with_intercept_and_pearson():
    pred = [0.0, 1.0, 2.0, 3.0]
    real = [1.0, 3.0, 5.0, 7.5]
    f = law_eval.fit(pred, real)
    assert f["slope"] == pytest.approx(2.15) and 0.99 < f["r"] < 1 and f["n"] == 4
    assert math.isnan(law_eval.fit([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])["slope"])


def test_validate_and_autopilot_commands_write_their_tables(tmp_path, capsys):
    out = tmp_path / "law"
    assert law_eval.main(["autopilot", "--setups", "s1", "--seeds", "3", "--steps", "3", "--quick",
                          "--validate-too", "custom,s1", "--out", str(out)]) == 0
    records = load_jsonl(out / "runs.jsonl")
    tags = {(r["setup"], r["tag"]) for r in records}
    assert tags == {("custom", "validate"), ("s1", "validate"), ("s1", "above"), ("s1", "at"), ("s1", "below")}
    for r in records:  # the law's prediction of each optimizer step, on the same mini-batch
        assert math.isfinite(r["exact_dH"]) and math.isfinite(r["real_dH"]) and r["sec_token"] > 0
        if r["tag"] != "validate":
            assert {"autopilot_dropped_frac", "autopilot_entropy", "autopilot_target_entropy"} <= set(r)
        else:  # the second-order and logit-space predictions of the same step
            assert all(math.isfinite(r[k]) for k in ("exact2_dH", "logit1_dH", "logit2_dH"))
    for r in records:  # the fixed contexts are the first mini-batch's: their entropy there is the autopilot's H_0
        if r["tag"] != "validate" and (r["step"], r["mb"]) == (1, 0):
            assert r["autopilot_entropy_fixed"] == pytest.approx(r["autopilot_entropy"], rel=1e-6)
    s1 = [r for r in records if r["setup"] == "s1" and r["tag"] == "validate"]
    assert len(s1) == 6  # 3 RL steps x 2 mini-batches
    # the exact prediction is first order: it tracks the realised change far better than Corollary 4's scale
    assert law_eval.fit([r["exact_dH"] for r in s1], [r["real_dH"] for r in s1])["r"] > 0.9
    law_md = (out / "law.md").read_text()
    assert "exact_dH_slope" in law_md and "| s1 |" in law_md and "| custom |" in law_md
    ap = (out / "autopilot.md").read_text()
    assert ap.count("| s1 |") == 3
    rows = law_eval.autopilot_table(records)
    above = next(r for r in rows if r["target"] == "above")
    assert above["target_final"] > above["h0"]
    assert "exact_dH_slope" in capsys.readouterr().out
    report = tmp_path / "again"
    assert law_eval.main(["report", str(out / "runs.jsonl"), "--out", str(report)]) == 0
    assert (report / "law.md").read_text() == law_md


def test_probe_reading_leaves_training_unchanged():
    """The probe reads the policy on streams of its own: an autopilot run with it trains exactly as one without (every
    record equal but the timings and the probe's field), the probe's steps are step 1 and every probe_every-th, and
    its reading is a mean token entropy (between 0 and log V)."""
    def runs(probe_batches: int) -> list[dict]:
        env = law_eval._fresh_streams(law_eval.make_env("s1", 2, quick=True), "s1", 2)
        probe = law_eval.probe_reader(env, "s1", 2, probe_batches) if probe_batches else None
        return law_eval.run(env, 4, pilot=law_eval._pilot("below"), tag="below", probe=probe, probe_every=3)

    plain, probed = runs(0), runs(2)
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("sec_") and k != "autopilot_entropy_probe"}  # noqa: E731
    assert [strip(r) for r in probed] == [strip(r) for r in plain]
    assert not any("autopilot_entropy_probe" in r for r in plain)
    assert sorted({r["step"] for r in probed if "autopilot_entropy_probe" in r}) == [1, 3]
    vocab = law_eval.make_env("s1", 2, quick=True).model.head.out_features
    assert all(0.0 < r["autopilot_entropy_probe"] < math.log(vocab) for r in probed if "autopilot_entropy_probe" in r)
    with pytest.raises(ValueError, match="S1 / S2"):
        law_eval.probe_reader(law_eval.make_env("custom", 0, quick=True), "custom", 0, 2)


def test_bad_arguments_are_usage_errors(tmp_path):
    with pytest.raises(SystemExit):
        law_eval.main(["validate", "--setups", "demo,nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        law_eval.main(["validate", "--step", "5", "--out", str(tmp_path)])  # no abbreviations
    with pytest.raises(SystemExit):
        law_eval.main(["autopilot", "--probe-batches", "-1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="setup must be one of"):
        law_eval.make_env("other", 0)
