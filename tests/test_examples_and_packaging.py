"""The custom-loop example runs end to end; a non-editable install ships the adapters package."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import entropy_discriminator as ed
from entropy_discriminator.__main__ import main as ed_main
from entropy_discriminator.recipe import load_batch
from entropy_discriminator.runlog import read_run

ROOT = Path(__file__).resolve().parents[1]


def _custom_loop(*argv: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "custom_loop.py"), *argv], capture_output=True,
                          text=True, timeout=600, check=True).stdout


def _summary(out: str) -> dict[str, tuple[float, float]]:
    """``{method: (clipped share, last entropy)}`` from the summary the custom loop prints."""
    found = re.findall(r"^  (\w+) +clipped +([\d.]+)% of the tokens .* entropy [\d.]+ -> ([\d.]+)$", out, re.M)
    return {method: (float(share) / 100, float(last)) for method, share, last in found}


def test_custom_loop_default_clips_tokens_and_holds_entropy(tmp_path):
    """The default run (Clip_V, mu chosen on batch 0 for 2 %) clips tokens and ends with another entropy than the
    vanilla GRPO run it prints beside it; ``lr`` reaches the monitor; the log it writes plots."""
    log = tmp_path / "run.jsonl"
    out = _custom_loop("--steps", "8", "--log-jsonl", str(log), "--save-batch", str(tmp_path / "batch.pt"))
    assert "entropy_disc/clip/frac" in out and "entropy_disc/cov/adv_s_centered" in out
    assert "entropy_disc/delta_entropy/predicted" in out and "entropy_disc/delta_entropy/realised" in out
    assert "1 torch thread(s)" in out
    summary = _summary(out)
    assert set(summary) == {"clip_v", "none"}, out
    assert summary["clip_v"][0] > 0 and summary["none"][0] == 0
    assert summary["clip_v"][1] != summary["none"][1]
    mu = float(re.search(r"clip_v: mu_low ([\d.e+-]+) clips", out).group(1))
    batch = load_batch(tmp_path / "batch.pt")  # the batch mu was chosen on: the real mask clips the target there
    share = ed.clip_v_mask(batch["s_centered"], batch["advantages"], batch["valid"], mu_low=mu).clip_frac
    assert abs(share - 0.02) <= 1 / batch["valid"].sum().item()
    rows = read_run(log)
    assert len(rows) == 8 and all(r["clip/frac"] >= 0 for r in rows)
    assert ed_main(["plot", str(log), "--out", str(tmp_path / "run.png")]) == 0


@pytest.mark.parametrize("argv, method", [(["--method", "clip_b"], "clip_b"), (["--autopilot", "hold"], "autopilot")])
def test_custom_loop_clip_b_and_autopilot_clip_tokens(argv, method):
    """``--method clip_b`` (mu chosen on batch 0) and ``--autopilot hold`` drop tokens: not the same as ``none``."""
    summary = _summary(_custom_loop(*argv, "--steps", "4", "--no-baseline"))
    assert set(summary) == {method} and summary[method][0] > 0


def test_custom_loop_refuses_method_with_autopilot():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_loop.py"), "--method", "clip_b",
                          "--autopilot", "hold"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "give --method or --autopilot, not both" in run.stderr


def _code(line: str) -> str:
    """A line's code: no diff marker, no comment, no surrounding blanks."""
    return line.split("#", 1)[0].strip()


def test_readme_diff_is_the_working_code_of_custom_loop():
    """Every line of the README's custom-loop diff, added or context, is a line of examples/custom_loop.py
    (an earlier diff passed ``policy(seq)`` logits against the completion labels, without the shift)."""
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
    """The verl examples check GPUs, vLLM and the data before verl starts Ray (without the checks it hung silently);
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


def test_wheel_and_sdist_build_from_the_clone_and_the_wheel_installs(tmp_path):
    """The clone builds a wheel and an sdist (setuptools' PEP 517 hooks, no network) with the one version of
    ``entropy_discriminator/_version.py``; the wheel installed in a fresh virtual environment runs
    ``entropy-discriminator --version``."""
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".nox", "__pycache__", "*.egg-info", "build", "dist", "reproduction", "*out")
    shutil.copytree(ROOT, src, ignore=skip)
    dist = tmp_path / "dist"
    hooks = ("from setuptools import build_meta as b; import pathlib, sys; d = sys.argv[1]; "
             "pathlib.Path(d, 'names').write_text(b.build_wheel(d) + ' ' + b.build_sdist(d))")
    subprocess.run([sys.executable, "-c", hooks, str(dist)], cwd=src, capture_output=True, timeout=600, check=True)
    names = (dist / "names").read_text().split()
    version = ed.__version__
    assert names[0] == f"entropy_discriminator-{version}-py3-none-any.whl"
    # the sdist's name: normalised with an underscore (PEP 625, newer setuptools) or, in older ones, the project's name
    assert names[1] in (f"entropy_discriminator-{version}.tar.gz", f"entropy-discriminator-{version}.tar.gz")
    assert f'__version__ = "{version}"' in (ROOT / "entropy_discriminator" / "_version.py").read_text()
    assert "version =" not in (ROOT / "pyproject.toml").read_text().split("[project]", 1)[1].split("\n[", 1)[0]
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text()
    # the library's wheel holds the demo the README runs and not the research harness, which builds on its own (lab/)
    files = zipfile.ZipFile(dist / names[0]).namelist()
    demo = {Path(f).name for f in files if f.startswith("entropy_discriminator/demo/")}
    assert demo == {f"{m}.py" for m in ("__init__", "model", "report", "runner", "task", "theory", "train")}, demo
    assert not any(f.startswith("entropy_lab") for f in files)
    subprocess.run([sys.executable, "-c", hooks, str(dist / "lab")], cwd=src / "lab", capture_output=True, timeout=600,
                   check=True)
    lab_wheel = (dist / "lab" / "names").read_text().split()[0]
    lab_files = zipfile.ZipFile(dist / "lab" / lab_wheel).namelist()
    assert {"entropy_lab/compare.py", "entropy_lab/protocol.py", "entropy_lab/paper.py"} <= set(lab_files)
    assert not any(f.startswith("entropy_discriminator/") for f in lab_files)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # torch and the other requirements come from this interpreter's site-packages, listed after the venv's own (a
    # directory named in a .pth file is not a site directory: its own .pth files, such as an editable install's
    # hook into the clone, are not run)
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    Path(venv_site, "_test_requirements.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(dist / names[0])],
                   check=True, timeout=300, cwd=tmp_path)
    out = subprocess.run([str(venv / "bin" / "entropy-discriminator"), "--version"], capture_output=True, text=True,
                         timeout=300, check=True, cwd=tmp_path).stdout
    assert out.strip() == f"entropy-discriminator {version}"
    where = subprocess.run([str(python), "-c", "import entropy_discriminator as e; print(e.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where  # the installed wheel, not the clone
