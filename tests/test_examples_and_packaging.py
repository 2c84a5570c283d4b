"""The custom-loop example runs end to end; a non-editable install ships the adapters package."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_custom_loop_example_runs_and_prints_metrics():
    """One torch thread by default (as the demo), and ``lr`` reaches the monitor: the predicted entropy
    change is logged next to the realised one."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_loop.py"), "--method", "clip_v", "--steps", "3", "--prompts", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "entropy_disc/clip/frac" in out and "entropy_disc/cov/adv_s_centered" in out
    assert "entropy_disc/delta_entropy/predicted" in out and "entropy_disc/delta_entropy/realised" in out
    assert "1 torch thread(s)" in out
    assert out.count("step ") == 2  # step 0 and the last step


def _code(line: str) -> str:
    """A line's code: no diff marker, no comment, no surrounding blanks."""
    return line.split("#", 1)[0].strip()


def test_readme_diff_is_the_working_code_of_custom_loop():
    """Every line of the README's custom-loop diff, added or context, is a line of examples/custom_loop.py
    (issue 24: the diff passed ``policy(seq)`` logits against the completion labels, without the shift)."""
    readme = (ROOT / "README.md").read_text()
    diff = readme.split("```diff", 1)[1].split("```", 1)[0]
    lines = [line for line in diff.splitlines() if line.strip()]
    assert all(line[0] in "+ " for line in lines), lines
    example = {_code(line) for line in (ROOT / "examples" / "custom_loop.py").read_text().splitlines()}
    missing = [line for line in lines if _code(line[1:]) and _code(line[1:]) not in example]
    assert not missing, missing
    added = "\n".join(line for line in lines if line.startswith("+"))
    assert {"token_stats", "clip_v_mask", "apply_keep_mask"} <= set(re.findall(r"ed\.(\w+)\(", added))
    assert "seq[:, :-1]" in diff  # the one-token shift between logits and labels


def test_install_is_from_the_clone_everywhere():
    """The package is not on the package index: README, docs and examples install from a clone."""
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Installation", 1)[1].split("\n## ", 1)[0]
    assert "git clone" in install and install.index("git clone") < install.index('pip install -e ".[plot]"')
    for extra in ("trl", "verl", "openrlhf"):
        assert f'pip install -e ".[{extra}]"' in install
    assert "CUDA" in install.split('".[openrlhf]"', 1)[1].split("\n\n", 1)[0]  # flash-attn builds from source
    assert "13 GB of disk" in readme.split("pip install nox && nox", 1)[0].rsplit("## ", 1)[-1]
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.*")]
    pages += [ROOT / "entropy_discriminator" / "demo" / "report.py"]
    for page in pages:
        text = page.read_text()
        assert not re.search(r"pip install ['\"]?entropy-discriminator\[", text), page


def test_gpu_only_examples_say_so_and_stop_at_once(tmp_path):
    """The verl examples check GPUs, vLLM and the data before verl starts Ray (issue 24: it hung silently);
    every shell example says GPU-only in its first comment line."""
    for script in (ROOT / "examples").rglob("*.sh"):
        assert "GPU only" in script.read_text().splitlines()[1], script
    start = time.perf_counter()
    run = subprocess.run(["bash", str(ROOT / "examples" / "verl" / "grpo_clip_b.sh")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "DATA_DIR": str(tmp_path / "gsm8k")})
    assert run.returncode == 1 and run.stdout == "", run.stderr
    assert f"no data file {tmp_path / 'gsm8k' / 'train.parquet'}" in run.stderr
    assert "data_preprocess/gsm8k.py" in run.stderr
    if not torch.cuda.is_available():
        assert "CUDA GPU(s) (N_GPUS), this machine has 0" in run.stderr
    assert time.perf_counter() - start < 60


def test_install_instructions_put_the_cpu_torch_build_first():
    """A CPU-only user installs torch's CPU build before the package (else pip pulls the CUDA build)."""
    cpu_torch = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    for page in (ROOT / "README.md", ROOT / "docs" / "demo.md"):
        text = page.read_text()
        assert cpu_torch in text, page
        assert text.index(cpu_torch) < text.index('pip install -e ".[plot]"'), page


def test_non_editable_install_imports_adapters(tmp_path):
    """``pip install .`` (no -e) must map adapters/ to entropy_discriminator.adapters."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "--target", str(target), str(ROOT)],
        check=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert (target / "entropy_discriminator" / "adapters" / "_patching.py").is_file()
    code = (
        "import entropy_discriminator, entropy_discriminator.adapters as a, entropy_discriminator.adapters._patching as p;"
        "print(entropy_discriminator.__file__); print(a.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env={"PYTHONPATH": str(target)}
    ).stdout.splitlines()
    assert all(line.startswith(str(target)) for line in out), out


@pytest.mark.parametrize("framework", ["verl", "trl"])
def test_adapter_without_its_framework_names_the_extra(framework):
    """Importing an adapter whose framework is absent says which extra to install (not a bare ModuleNotFoundError)."""
    if importlib.util.find_spec(framework) is not None:
        pytest.skip(f"{framework} is installed in this environment; the check needs an environment without it")
    code = f"import entropy_discriminator.adapters.{framework}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert f"ImportError: entropy_discriminator.adapters.{framework} needs" in run.stderr
    assert f"pip install -e '.[{framework}]'" in run.stderr
