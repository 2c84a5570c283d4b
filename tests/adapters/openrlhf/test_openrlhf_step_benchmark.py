"""``python -m benchmarks.openrlhf_step --smoke`` end to end on the CPU: every arm of the step-cost benchmark runs.

The benchmark builds OpenRLHF's real ``DeepspeedStrategy`` (``deepspeed.initialize``: ZeRO-2, bf16),
``Actor`` and ``ActorPPOTrainer`` on a tiny random Qwen2 model and runs, per step and arm, the
old-policy forward and ``ppo_train`` with the adapter patched in (``monitor``, ``clip_b``, ``clip_v``)
or not (``off``).  On a machine without a GPU it redirects CUDA calls to the CPU
(``tests/gpu/openrlhf_step_on_cpu.py``) and uses the flash_attn / vllm / ray stand-ins of
``tests/gpu/openrlhf_step.py``; it runs in a subprocess so that the redirection stays out of this
test process.  Timings are not checked (the CPU is shared); what is checked is that each arm did
the work its configuration asks for.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="needs OpenRLHF's environment: nox -s openrlhf")
pytest.importorskip("openrlhf", reason="needs OpenRLHF's environment: nox -s openrlhf")

ROOT = Path(__file__).resolve().parents[3]
ARMS = ["off", "monitor", "clip_b", "clip_v"]


def test_smoke_benchmark_runs_every_arm(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.openrlhf_step", "--smoke", "--steps", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "openrlhf_step.csv", newline="") as f:
        rows = {r["arm"]: r for r in csv.DictReader(f)}
    assert list(rows) == ARMS
    for arm, r in rows.items():
        for key in ("old_log_prob_s", "update_s", "total_s"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (arm, key, r[key])
        assert float(r["total_s"]) == pytest.approx(float(r["old_log_prob_s"]) + float(r["update_s"]))
        assert math.isfinite(float(r["policy_loss_step1"])), arm
        if arm == "off":  # stock OpenRLHF: no statistics pass, no metrics
            assert float(r["stats_pass_s"]) == 0.0 and int(r["n_valid_step1"]) == 0
            assert float(r["total_vs_off_pct"]) == 0.0 and float(r["stats_pass_vs_off_pct"]) == 0.0
            continue
        assert 0 < float(r["stats_pass_vs_off_pct"]) < math.inf, arm
        assert 0 < float(r["stats_pass_s"]) < float(r["update_s"]), arm  # the adapter's round start inside ppo_train
        assert float(r["from_forward"]) == 1.0, arm  # every step's statistics came from the old-policy forward
        assert 0 < float(r["stats_in_forward_s"]) < float(r["old_log_prob_s"]), arm  # ... timed inside it
        assert float(r["adapter_s"]) == pytest.approx(float(r["stats_in_forward_s"]) + float(r["stats_pass_s"]))
        assert int(r["n_valid_step1"]) == 8 * 16, arm  # every response token of the buffer was scored
        assert math.isfinite(float(r["total_vs_off_pct"])), arm
    assert "| clip_v |" in proc.stdout
