"""The TRL examples' documented CPU commands run as written on a machine without a GPU (issue 24).

Each runs in a fresh process with no CUDA device visible, with only ``--max_steps`` shortened; before
issue 24 they stopped at once with transformers' "Your setup doesn't support bf16/gpu".
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples" / "trl"
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], env=CPU_ONLY, capture_output=True, text=True, timeout=600)


def test_tiny_example_runs_on_cpu_as_documented(tmp_path):
    """``grpo_entropy_disc.py --tiny`` without ``--use_cpu`` or ``--bf16 False``."""
    done = run(str(EXAMPLES / "grpo_entropy_disc.py"), "--tiny", "--output_dir", str(tmp_path / "out"),
               "--entropy_disc_method", "clip_v", "--max_steps", "2", "--summary_json", str(tmp_path / "s.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())["summary"]
    assert summary["last"]["entropy_disc/tokens/valid"] > 0
    assert summary["last"]["entropy_disc/entropy/mean"] > 0


def test_compare_tiny_runs_on_cpu_as_documented(tmp_path):
    done = run(str(EXAMPLES / "compare_tiny.py"), "--out_dir", str(tmp_path), "--methods", "none,clip_v",
               "--", "--max_steps", "2", "--tiny_hidden", "64")
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads((tmp_path / "table.json").read_text())
    assert set(table) == {"none", "clip_v"} and "entropy_disc/clip/frac" in table["clip_v"]["mean"]


def test_readme_config_line_works_on_this_machine(tmp_path):
    """README's ``EntropyDiscGRPOConfig(output_dir="out", entropy_disc_method="clip_b")``: bf16 only where supported."""
    code = ("from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig\n"
            "args = EntropyDiscGRPOConfig(output_dir='out', entropy_disc_method='clip_b')\n"
            "print(args.bf16, args.entropy_disc_config().resolved())\n")
    done = subprocess.run([sys.executable, "-c", code], env=CPU_ONLY, capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "(2.5,", "None)"]
    assert EntropyDiscGRPOConfig(output_dir=str(tmp_path), use_cpu=True).bf16  # TRL's default kept where it works
