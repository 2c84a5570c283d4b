"""The ``entropy-discriminator`` command line: every bad argument refused before any work starts.

"Before any work" is asserted, not timed: the demo's and the paper suite's entry points are replaced by
functions that fail the test if called, so a refusal that came only after training started would fail here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import entropy_discriminator
from entropy_discriminator import __main__ as cli
from entropy_discriminator.demo import runner
from entropy_discriminator.demo.report import prepare_output_folder
from entropy_lab import compare, paper

DEMO_USAGE = "usage: entropy-discriminator demo"


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The demo's and the paper suite's entry points fail the test if called; cwd is a fresh folder."""

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started although an argument is bad")

    monkeypatch.setattr(runner, "run_demo", started)
    monkeypatch.setattr(paper, "run_paper", started)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``main(argv)``; assert exit status 2, the demo's usage and no traceback; return stderr."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(DEMO_USAGE) and "Traceback" not in err, err
    return err


BAD_VALUES = [
    (["--max-frac-v", "5"], "--max-frac-v"),
    (["--max-frac-v", "-0.1"], "--max-frac-v"),
    (["--max-frac-v", "many"], "--max-frac-v"),
    (["--mu-b", "-1"], "--mu-b"),
    (["--mu-b", "nan"], "--mu-b"),
    (["--mu-v", "abc"], "--mu-v"),
    (["--mu-v", "-0.5"], "--mu-v"),
    (["--steps", "2"], "--steps"),
    (["--steps", "3.5"], "--steps"),
    (["--threads", "0"], "--threads"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
    (["--autopilot", "warm"], "--autopilot"),
    (["--autopilot", "-0.5"], "--autopilot"),
    (["--autopilot", "nan"], "--autopilot"),
    (["--device", "mps"], "--device"),
    (["--device", "cuda:abc"], "--device"),
    (["--device", "cuda:99"], "--device"),  # no CUDA here, or fewer than 100 GPUs
    (["--paper", "--seeds", "1"], "--seeds"),
    (["--paper", "--jobs", "0"], "--jobs"),
    (["--paper", "--size", "big"], "--size"),
    (["--quick", "--paper"], "--paper"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]

# Options of another mode are refused, never silently ignored.
WRONG_MODE = [
    (["--seeds", "3"], "--seeds: only applies with --paper"),
    (["--quick", "--jobs", "2"], "--jobs: only applies with --paper"),
    (["--size", "gpu"], "--size: only applies with --paper"),
    (["--render-only"], "--render-only: only applies with --paper"),
    (["--paper", "--threads", "2"], "--threads: does not apply with --paper"),
    (["--paper", "--mu-b", "3"], "--mu-b: does not apply with --paper"),
    (["--paper", "--max-frac-v", "0.1"], "--max-frac-v: does not apply with --paper"),
    (["--paper", "--autopilot", "hold"], "--autopilot: does not apply with --paper"),
    (["--paper", "--render-only", "--steps", "5"], "--steps: does not apply with --render-only"),
    (["--paper", "--render-only", "--device", "cpu"], "--device: does not apply with --render-only"),
    (["--paper", "--render-only", "--seed", "0"], "--seed: does not apply with --render-only"),  # 0 is given too
]


@pytest.mark.parametrize(("args", "named"), BAD_VALUES + WRONG_MODE, ids=[" ".join(a) for a, _ in BAD_VALUES + WRONG_MODE])
def test_every_bad_argument_is_refused_before_any_work(
    args: list[str], named: str, no_work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["demo", *args, "--out", str(no_work / "out")], capsys)
    assert named in err
    assert not (no_work / "out").exists() and not any(no_work.iterdir())  # nothing written either


def _out_cases(tmp: Path) -> list[tuple[Path, str]]:
    a_file = tmp / "a_file"
    a_file.write_text("not a folder")
    cases = [(a_file, "is an existing file"), (a_file / "sub" / "out", f"{a_file} is a file")]
    if Path("/proc/self").is_dir():
        # procfs refuses new files even to root, so this case holds in CI containers that run as root
        cases += [(Path("/proc/self"), "cannot write in the folder"), (Path("/proc/self/no/such"), "cannot create")]
    if os.geteuid() != 0:  # permission bits bind only non-root users
        read_only = tmp / "read_only"
        read_only.mkdir(mode=0o555)
        cases.append((read_only, "cannot write in the folder"))
    return cases


def test_out_that_cannot_be_written_is_refused_before_any_work(
    no_work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = _out_cases(no_work)
    assert len(cases) >= 3  # a file, a path under a file, and a folder that cannot be written
    for out, why in cases:
        for mode in ([], ["--quick"], ["--paper"]):
            err = refused(["demo", *mode, "--out", str(out)], capsys)
            assert "argument --out:" in err and why in err, err


def test_render_only_needs_saved_results(no_work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["demo", "--paper", "--render-only", "--out", str(no_work)], capsys)
    assert "argument --out:" in err and "paper_results.json" in err


def test_output_folder_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    out = prepare_output_folder(tmp_path / "new" / "folder")
    assert out.is_dir() and not any(out.iterdir())


def test_valid_arguments_reach_the_demo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Given options reach the options objects; options not given keep the objects' defaults."""
    seen: list[object] = []
    monkeypatch.setattr(runner, "run_demo", seen.append)
    monkeypatch.setattr(paper, "run_paper", seen.append)
    argv = ["demo", "--quick", "--out", str(tmp_path / "d"), "--max-frac-v", "0.01", "--seed", "3", "--mu-b", "0"]
    assert cli.main(argv) == 0
    assert cli.main(["demo", "--paper", "--size", "cpu-small", "--jobs", "2", "--out", str(tmp_path / "p")]) == 0
    demo, suite = seen
    assert demo == runner.DemoOptions(out=tmp_path / "d", quick=True, max_frac_v=0.01, seed=3, mu_b=0.0)
    assert suite == paper.PaperOptions(out=tmp_path / "p", size="cpu-small", jobs=2)
    assert (tmp_path / "d").is_dir() and (tmp_path / "p").is_dir()


def test_demo_api_checks_mask_settings_before_warm_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("warm-up started although max_frac_v is bad")

    monkeypatch.setattr(runner, "warm_up", started)
    with pytest.raises(ValueError, match="max_frac"):
        runner.run_demo(runner.DemoOptions(out=tmp_path, quick=True, max_frac_v=5.0, device="cpu"))
    with pytest.raises(ValueError, match="mu_low"):
        runner.run_demo(runner.DemoOptions(out=tmp_path, quick=True, mu_b=-1.0, device="cpu"))


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"entropy-discriminator {entropy_discriminator.__version__}\n"
    assert cli.main(["demo", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert help_text.startswith(DEMO_USAGE)
    steps_help = help_text.split("options:", 1)[1].split("--steps STEPS", 1)[1].split("--threads")[0]
    assert "minimum 3" in steps_help


def test_bad_argument_in_a_fresh_process_fails_fast_without_traceback(tmp_path: Path) -> None:
    """As a user runs it: exit status 2 and the demo's usage within seconds (loose bound for busy CI machines)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for args in (["--max-frac-v", "5"], ["--out", str(a_file)]):
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "entropy_discriminator", "demo", *args], capture_output=True, text=True, timeout=120,
            cwd=tmp_path,
        )
        assert proc.returncode == 2 and proc.stderr.startswith(DEMO_USAGE), proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""
        assert time.perf_counter() - start < 60


def test_empty_out_is_refused_not_the_current_folder(no_work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--out ""`` would write into the current folder: a usage error naming --out."""
    err = refused(["demo", "--out", ""], capsys)
    assert "argument --out: must name a folder" in err and not any(no_work.iterdir())
    assert cli.main(["compare", "--out", " "]) == 2
    err = capsys.readouterr().err
    assert "argument --out: must name a folder" in err and "Traceback" not in err


def test_mask_errors_name_the_option_as_typed(no_work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--mu-b -1`` names ``--mu-b``, never the config field behind it."""
    for option in ("--mu-b", "--mu-v", "--max-frac-v"):
        err = refused(["demo", option, "-1"], capsys)
        assert f"argument {option}: must be" in err and "entropy_disc." not in err, err


def test_threads_above_the_cores_warn(monkeypatch: pytest.MonkeyPatch, no_work: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[runner.DemoOptions] = []
    monkeypatch.setattr(runner, "run_demo", calls.append)
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    assert cli.main(["demo", "--quick", "--threads", "64", "--out", str(no_work / "o")]) == 0
    assert "warning: --threads 64 is more than this machine's 2 CPU cores" in capsys.readouterr().err
    assert cli.main(["demo", "--quick", "--threads", "2", "--out", str(no_work / "o")]) == 0
    assert "warning" not in capsys.readouterr().err and len(calls) == 2


def test_compare_render_only_without_saved_runs_is_a_usage_error(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert cli.main(["compare", "--render-only", "--out", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: entropy-discriminator compare") and "Traceback" not in err
    assert f"argument --out: {missing} holds no meta.json or results.json" in err and not missing.exists()


def test_compare_help_shows_its_default_preset_and_no_gpu_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compare", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "95%%" not in text and "95% CI" in text
    assert "{smoke,full}" in text and "smoke (the default)" in text and "gpu" not in text.lower()


def test_compare_presets_are_the_labs() -> None:
    assert cli.COMPARE_PRESETS == tuple(compare.PRESETS)


#: Python source that makes ``import entropy_lab`` fail as it does where the lab is not installed.
LAB_HIDDEN = """import sys
class NoLab:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "entropy_lab":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoLab())
"""


@pytest.mark.parametrize("argv", [["compare"], ["compare", "--preset", "full", "--jobs", "2"], ["demo", "--paper"],
                                  ["demo", "--paper", "--render-only", "--out", "somewhere"]])
def test_lab_commands_without_the_lab_say_how_to_install_it(argv: list[str], tmp_path: Path) -> None:
    """Without ``entropy_lab`` (a fresh interpreter whose import system finds no such module), ``compare`` and
    ``demo --paper`` are usage errors naming ``pip install -e ./lab``; ``compare --help`` still works."""
    code = LAB_HIDDEN + f"from entropy_discriminator.__main__ import main; sys.exit(main({argv!r}))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "pip install -e ./lab" in res.stderr, res.stderr
    assert res.stderr.startswith(f"usage: entropy-discriminator {argv[0]}") and not any(tmp_path.iterdir())
    code = code.replace(repr(argv), repr(["compare", "--help"]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and "{smoke,full}" in res.stdout, res.stderr


def test_compare_says_when_it_writes_no_png(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without matplotlib, ``compare`` says up front that it writes no PNG (it used to skip them silently)."""
    monkeypatch.setattr(compare, "plots_available", lambda: False)
    monkeypatch.setattr(compare, "render", lambda out, log: {})
    lines: list[str] = []
    compare.run_compare(compare.CompareOptions(out=tmp_path, render_only=True), log=lines.append)
    assert lines and "matplotlib is not installed, so no PNG plots are written" in lines[0]


def test_one_demo_time_in_cli_readme_and_docs(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's run time is stated once, the same way, in the CLI help, README and docs/demo.md."""
    assert cli.main(["--help"]) == 0
    top = " ".join(capsys.readouterr().out.split())
    root = Path(__file__).resolve().parents[1]
    for text in (top, (root / "README.md").read_text(), (root / "docs" / "demo.md").read_text()):
        flat = " ".join(text.split())
        assert "about a minute on 2" in flat
        assert not any(s in flat for s in ("1-2 minutes", "five minutes", "a few minutes"))


def test_default_output_folders_are_git_ignored() -> None:
    root = Path(__file__).resolve().parents[1]
    ignored = set((root / ".gitignore").read_text().split())
    defaults = {*cli.DEMO_DEFAULT_OUT.values(), cli.build_parser()._subparsers._group_actions[0].choices["compare"]
                .get_default("out")}
    assert {f"/{Path(d).parts[0]}/" for d in defaults} <= ignored


@pytest.mark.parametrize(("text", "target"), [("hold", "hold"), ("0.4", 0.4), ("0", 0.0)])
def test_autopilot_target_reaches_a_fourth_arm(text: str, target: object, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """``--autopilot`` adds GRPO+Autopilot with that target; without it the demo keeps its three arms."""
    seen: list[runner.DemoOptions] = []
    monkeypatch.setattr(runner, "run_demo", seen.append)
    assert cli.main(["demo", "--quick", "--autopilot", text, "--out", str(tmp_path / "d")]) == 0
    arms = runner.demo_arms(seen[0])
    assert [a.name for a in arms] == ["GRPO", "GRPO+Clip_B", "GRPO+Clip_V", "GRPO+Autopilot"]
    assert arms[-1].method == "autopilot" and arms[-1].target_entropy == target
    assert [a.name for a in runner.demo_arms(runner.DemoOptions())] == ["GRPO", "GRPO+Clip_B", "GRPO+Clip_V"]
