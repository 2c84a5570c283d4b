"""The TRL examples' documented CPU commands run as written on a machine without a GPU.

Each runs in a fresh process with no CUDA device visible, with only ``--max_steps`` shortened (earlier they
stopped at once with transformers' "Your setup doesn't support bf16/gpu").
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

from entropy_discriminator.__main__ import main as cli

from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples" / "trl"
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], env=CPU_ONLY, capture_output=True, text=True, timeout=600)


def test_tiny_example_runs_on_cpu_as_documented(tmp_path):
    """``grpo_entropy_disc.py --tiny`` without ``--use_cpu`` or ``--bf16 False``: its default mu clips tokens, it
    prints the effect, ``--save_steps`` writes checkpoints whose ``trainer_state.json`` the plot command reads, and
    ``--save_batch`` writes a batch that ``suggest-mu`` reads."""
    out = tmp_path / "out"
    done = run(str(EXAMPLES / "grpo_entropy_disc.py"), "--tiny", "--output_dir", str(out), "--entropy_disc_method",
               "clip_v", "--max_steps", "2", "--save_steps", "2", "--summary_json", str(tmp_path / "s.json"),
               "--save_batch", str(tmp_path / "batch.pt"))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())["summary"]
    assert summary["last"]["entropy_disc/tokens/valid"] > 0
    assert summary["last"]["entropy_disc/entropy/mean"] > 0
    assert summary["mean"]["entropy_disc/clip/frac"] > 0  # --tiny's mu (TINY_MU) acts
    printed = re.search(r"^clip_v: clipped ([\d.]+)% of the tokens", done.stdout, re.M)
    assert printed and float(printed.group(1)) > 0, done.stdout[-2000:]
    state = out / "checkpoint-2" / "trainer_state.json"
    assert state.is_file(), sorted(p.name for p in out.iterdir())
    assert cli(["plot", str(state), "--out", str(tmp_path / "run.png")]) == 0
    assert cli(["suggest-mu", "--batch", str(tmp_path / "batch.pt"), "--method", "clip_v"]) == 0


def test_compare_tiny_runs_on_cpu_as_documented(tmp_path):
    """The comparison shows the effect: Clip_V clips tokens, and its entropy differs from ``none``'s."""
    done = run(str(EXAMPLES / "compare_tiny.py"), "--out_dir", str(tmp_path), "--methods", "none,clip_v",
               "--", "--max_steps", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads((tmp_path / "table.json").read_text())
    assert set(table) == {"none", "clip_v"}
    assert table["clip_v"]["mean"]["entropy_disc/clip/frac"] > 0 and table["none"]["mean"]["entropy_disc/clip/frac"] == 0
    assert table["clip_v"]["last"]["entropy_disc/entropy/mean"] != table["none"]["last"]["entropy_disc/entropy/mean"]
    assert "clip_v: clipped" in done.stdout and "nats/token against none" in done.stdout


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
