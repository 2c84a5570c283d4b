"""``python -m benchmarks.verl_step --smoke`` end to end on the CPU: every arm of the step-cost benchmark runs.

The benchmark builds verl's real actor worker (``ActorRolloutRefWorker.init_model``: HF load, FSDP2
wrap, optimizer) for each arm, stock and with the adapter, and runs the old-log-prob pass, the
adapter's driver step and verl's update on a tiny random Qwen2 model.  On a machine without an
accelerator verl falls back to its CUDA platform, so the benchmark installs a CPU platform
(``benchmarks/verl_inprocess.use_cpu_platform``); it runs in a subprocess so that platform and
its one-rank process group stay out of this test process.  Timings are not checked (the CPU is
shared); what is checked is that each arm did the work its configuration asks for.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")

ROOT = Path(__file__).resolve().parents[3]
ARMS = ["off", "monitor", "clip_b", "clip_v", "off_fused", "monitor_fused", "clip_b_fused", "clip_v_fused"]


def test_smoke_benchmark_runs_every_arm(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.verl_step", "--smoke", "--steps", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "verl_step.csv", newline="") as f:
        rows = {r["arm"]: r for r in csv.DictReader(f)}
    assert list(rows) == ARMS
    for arm, r in rows.items():
        for key in ("old_log_prob_s", "update_s", "total_s", "build_s"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (arm, key, r[key])
        assert math.isfinite(float(r["pg_loss_step1"])), arm
        stock = arm.startswith("off")
        assert r["baseline"] == ("off_fused" if "fused" in arm else "off")
        assert (r["fused_kernels"] == "True") == ("fused" in arm)
        if stock:  # stock verl: no statistics in the pass, no driver work
            assert r["e_p_s_in_pass"] == "False" and r["n_valid"] == ""
            assert float(r["driver_s"]) == 0.0 and float(r["hook_s"]) == 0.0 and float(r["adapter_vs_base_pct"]) == 0.0
            continue
        assert 0 < float(r["adapter_vs_base_pct"]) < math.inf, arm
        assert r["e_p_s_in_pass"] == "True", arm  # every arm takes logp, H and E_p[S] from the hook's one distribution
        assert r["from_hidden"] == str("fused" in arm), arm
        assert float(r["driver_s"]) > 0 and 0 < float(r["hook_s"]) < float(r["old_log_prob_s"]), arm
        assert float(r["n_valid"]) == 8 * 16, arm  # the driver's metrics (and mask) saw every response token
        assert 0 <= int(r["n_clipped"]) <= float(r["n_valid"]), arm
        if arm.startswith("monitor"):
            assert int(r["n_clipped"]) == 0
        # the driver read the hook's entropy of verl's own logits: verl's entropy to its rounding (its fused kernel
        # returns it in bf16: half an ulp is 2^-9 relative), and S_c = S* - E_p[S] from the hook is finite, not all 0
        assert float(r["entropy_mean"]) == pytest.approx(float(r["entropy_verl"]), rel=2**-9), arm
        assert math.isfinite(float(r["s_centered_std"])) and float(r["s_centered_std"]) > 0, arm
        assert int(r["n_metrics"]) > 0, arm
    assert "| clip_v_fused |" in proc.stdout
