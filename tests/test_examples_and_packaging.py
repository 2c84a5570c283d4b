"""The custom-loop example runs end to end; a non-editable install ships the adapters package."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_custom_loop_example_uses_the_readme_calls():
    """Every ``ed.<function>`` the README's custom-loop diff adds is what examples/custom_loop.py calls."""
    readme = (ROOT / "README.md").read_text()
    diff = readme.split("```diff", 1)[1].split("```", 1)[0]
    calls = set(re.findall(r"ed\.(\w+)\(", "\n".join(line for line in diff.splitlines() if line.startswith("+"))))
    assert {"token_stats", "clip_v_mask", "apply_keep_mask", "EntropyMonitor"} <= calls
    example = (ROOT / "examples" / "custom_loop.py").read_text()
    assert all(f"ed.{name}(" in example for name in calls), calls


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
    assert f"pip install 'entropy-discriminator[{framework}]'" in run.stderr
