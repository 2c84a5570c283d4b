"""The demo end to end (``demo --quick``), its CLI, and the tabular theory check.

Nothing is stubbed: the quick demo trains a real (tiny) transformer on CPU.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entropy_discriminator.__main__ import main
from entropy_discriminator.demo.task import AdditionTask
from entropy_discriminator.demo.theory import tabular_check
from entropy_discriminator.demo.report import TextProgress, format_table
from entropy_discriminator.demo.runner import PRESETS, summary_columns
from entropy_discriminator.demo.train import ArmSpec, TrainConfig, group_advantages, pearson

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("GRPO", "GRPO+Clip_B", "GRPO+Clip_V")
PER_STEP = ("reward", "entropy", "s_star_mean", "s_c_mean", "clip_frac", "cov_adv_sc", "pred_dH", "real_dH", "loss")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``entropy-discriminator demo --quick`` in a subprocess, as a user (and CI) runs it."""
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [sys.executable, "-m", "entropy_discriminator", "demo", "--quick", "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def _finite(text: str) -> bool:
    return math.isfinite(float(text))


def test_quick_demo_prints_table_of_three_arms(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    rows = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 4  # header, separator, warm-up row, three arms
    k = PRESETS["quick"].eval_k
    assert f" Avg@{k} | Pass@{k} " in rows[0]  # the actual k, as in the README's Avg@8 | Pass@8
    warm = [c.strip() for c in rows[2].split("|")[1:-1]]
    assert warm[0] == "warm-up (no RL)" and all(_finite(c) for c in warm[1:5]) and warm[5:] == ["", "", ""]
    for arm in ARMS:
        line = next(r for r in rows if r.split("|")[1].strip() == arm)
        cells = [c.strip() for c in line.split("|")[2:-1]]
        assert len(cells) == 7 and all(_finite(c) for c in cells), line
    assert "Theory check, tabular case" in stdout
    assert (out / "demo_table.md").read_text().count("|") > 20


def _summary_rows(path: Path) -> list[dict[str, object]]:
    with path.open() as f:
        return [{k: (v if k == "arm" else float(v or "nan")) for k, v in r.items()} for r in csv.DictReader(f)]


def _cells(markdown: str, first_cell: str = "arm") -> list[list[str]]:
    """The cells of the markdown table whose header starts with ``first_cell`` (separator row dropped)."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and line.split("|")[1].strip() == first_cell)
    table = [line for line in lines[start:] if line.startswith("|")][: len(ARMS) + 3]
    return [[c.strip() for c in line.split("|")[1:-1]] for i, line in enumerate(table) if i != 1]


@pytest.mark.parametrize("folder", ["demo_cpu", "demo_gpu_h100"])
def test_docs_demo_tables_are_what_the_demo_prints(folder: str) -> None:
    """docs/demo_*/demo_table.md is the renderer's table of the saved summary (full preset's k, blank
    not-applicable cells); the README and docs/demo.md show the CPU table's cells."""
    docs = ROOT / "docs" / folder
    rows = _summary_rows(docs / "demo_summary.csv")
    table = format_table(rows, summary_columns(PRESETS["full"].eval_k))
    text = (docs / "demo_table.md").read_text()
    assert text.startswith(table + "\n\n"), text
    if folder == "demo_cpu":
        for page in (ROOT / "README.md", ROOT / "docs" / "demo.md"):
            assert _cells(page.read_text()) == _cells(text), page


def test_quick_demo_csv_has_every_step_of_every_arm(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    with (out / "demo_steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    steps = PRESETS["quick"].grpo_steps
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        assert [int(r["step"]) for r in mine] == list(range(steps))
        for r in mine:
            assert all(_finite(r[k]) for k in PER_STEP), r
    clip_b = [float(r["clip_frac"]) for r in rows if r["arm"] == "GRPO+Clip_B"]
    vanilla = [float(r["clip_frac"]) for r in rows if r["arm"] == "GRPO"]
    assert max(vanilla) == 0.0 and max(clip_b) > 0.0  # the mask acts in the Clip_B arm only
    with (out / "demo_summary.csv").open() as f:
        summary = {r["arm"]: r for r in csv.DictReader(f)}
    for arm in ARMS:
        for key in ("entropy_final", "reward_final", "avg_at_k", "pass_at_k", "clip_frac", "dH_corr", "dH_sign"):
            assert _finite(summary[arm][key]), (arm, key)
        assert 0.0 <= float(summary[arm]["pass_at_k"]) <= 1.0
        assert float(summary[arm]["avg_at_k"]) <= float(summary[arm]["pass_at_k"])


def test_quick_demo_writes_png(quick_run: tuple[Path, str]) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is installed in the core nox session")
    png = quick_run[0] / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_tabular_first_order_law_is_near_exact() -> None:
    """Logits as parameters: Corollary 4 predicts each step's realised batch dH (corr > 0.99, slope ~1)."""
    task = AdditionTask(n_digits=2)
    gen = torch.Generator().manual_seed(0)
    a, b = task.sample(16, gen, split="train")
    init = torch.randn(16, task.response_len, 12, generator=gen, dtype=torch.float64)
    init += 2.5 * torch.nn.functional.one_hot(task.answers(a, b), 12)
    small = tabular_check(task, init_logits=init, a=a, b=b, group_size=8, steps=25, step_size=0.01, seed=1)
    assert small.corr > 0.999 and abs(small.slope - 1.0) < 0.02 and small.sign == 1.0
    big = tabular_check(task, init_logits=init, a=a, b=b, group_size=8, steps=25, step_size=1.0, seed=1)
    # the O(eta^2) remainder shows at large steps: agreement degrades, as a first-order law should
    assert abs(big.slope - 1.0) > abs(small.slope - 1.0)


def test_group_advantages_are_zero_mean_per_group() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4)
    assert torch.allclose(adv.view(2, 4).sum(1), torch.zeros(2), atol=1e-6)
    assert adv[0] > 0 > adv[1] and torch.all(adv[4:] == 0)


def test_task_rewards_and_noise() -> None:
    task = AdditionTask(n_digits=3)
    a, b = torch.tensor([999, 123, 0]), torch.tensor([1, 877, 0])
    ans = task.answers(a, b)
    assert ans.tolist() == [[0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 0]]  # 1000, 1000, 0 least significant first
    assert task.rewards(a, b, ans).tolist() == [1.0, 1.0, 1.0]
    gen = torch.Generator().manual_seed(0)
    a, b = task.sample(2000, gen, split="train")
    noisy = task.warmup_targets(a, b, 0.3, gen)
    wrong = 1.0 - float(task.rewards(a, b, noisy).mean())
    assert 0.15 < wrong < 0.3  # forgetting carries is a no-op on carry-free sums
    ea, eb = task.sample(500, gen, split="eval")
    assert bool(task.is_eval(ea, eb).all()) and not bool(task.is_eval(a, b).any())
    assert 0.05 < float(task.is_eval(a, b + 1).float().mean()) < 0.15  # ~1 in held_out=10, whatever b's last digit
    assert len(set((eb % 10).tolist())) == 10


def test_bad_arguments_name_the_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="method"):
        ArmSpec("x", method="clip_x")
    with pytest.raises(ValueError, match="group_size"):
        TrainConfig(group_size=1)
    with pytest.raises(ValueError, match="n_digits"):
        AdditionTask(n_digits=0)
    assert main(["demo", "--quick", "--steps", "1", "--out", "unused"]) == 2
    assert "--steps" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["demo", "--quick", "--device", "cuda", "--out", "unused"]) == 2
        assert "--device" in capsys.readouterr().err


def test_paper_suite_smoke_renders_every_section(tmp_path: Path) -> None:
    """``demo --paper`` at its CPU smoke size, through two spawned workers, then ``--render-only``."""
    pytest.importorskip("matplotlib", reason="the plot extra is installed in the core nox session")
    out = tmp_path / "paper"
    args = ["demo", "--paper", "--size", "cpu-small", "--device", "cpu", "--steps", "6", "--seeds", "2", "--jobs", "2"]
    assert main([*args, "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    for heading in ("## Figure 1", "## Figure 2", "## Figure 3", "## Figure 5", "## Table 1", "## The reviewers"):
        assert heading in report
    assert "nan ±" not in report and "move the way Theorem 1 predicts" in report
    with (out / "paper_steps.csv").open() as f:
        runs = {(r["group"], r["arm"], r["seed"]) for r in csv.DictReader(f)}
    assert len(runs) == 2 * 3 + 8 + 2 * 2  # Table 1 (2 seeds x 3 arms), Figure 1 (8 arms), Figure 2 (2 mus x 2)
    for name in ("fig1.png", "fig2.png", "fig3_fig5.png", "table1.png", "theory.png"):
        (out / name).unlink()
    assert main(["demo", "--paper", "--render-only", "--out", str(out)]) == 0
    assert (out / "theory.png").exists() and (out / "report.md").read_text() == report


def test_without_matplotlib_says_how_to_install_and_still_writes_csv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from entropy_discriminator.demo import runner

    monkeypatch.setattr(runner, "have_matplotlib", lambda: False)
    buf = io.StringIO()
    result = runner.run_demo(runner.DemoOptions(out=tmp_path, quick=True, steps=3, device="cpu"), stream=buf)
    assert 'from the repository root with: pip install -e ".[plot]"' in buf.getvalue()
    assert not (tmp_path / "demo.png").exists() and "png" not in result["files"]
    with (tmp_path / "demo_steps.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 3 * 3


def test_demo_plot_tells_the_arms_apart(tmp_path: Path) -> None:
    """Panels 1-2: one line style per arm; the dH scatter: one panel per arm with its r (before: one cloud of
    ~600 overlapping dots)."""
    pytest.importorskip("matplotlib", reason="the plot extra is installed in the core nox session")
    from entropy_discriminator.demo.report import plot_demo

    gen = torch.Generator().manual_seed(0)
    curves = {
        arm: [{"step": s, "entropy": 1.0 / (s + 1), "reward": s / 20, "pred_dH": float(p), "real_dH": float(p + e)}
              for s, (p, e) in enumerate(zip(torch.randn(20, generator=gen), 0.1 * torch.randn(20, generator=gen)))]
        for arm in ("GRPO", "GRPO+Clip_B", "GRPO+Clip_V")
    }
    fig = plot_demo(tmp_path / "demo.png", curves, window=3)
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert len(fig.axes) == 2 + len(curves)
    for ax in fig.axes[:2]:
        assert len({line.get_linestyle() for line in ax.lines}) == len(curves)
    for ax, arm in zip(fig.axes[2:], curves):
        r = pearson([c["pred_dH"] for c in curves[arm]], [c["real_dH"] for c in curves[arm]])
        assert ax.get_title() == f"{arm}: dH prediction vs realised, r = {r:.2f}" and len(ax.collections) == 1


def test_dh_correlation_range_in_the_text_is_the_tables() -> None:
    """README and docs/demo.md quote the network's dH corr range as the CPU table has it (once 0.45 for 0.444)."""
    root = Path(__file__).resolve().parents[1]
    with open(root / "docs" / "demo_cpu" / "demo_summary.csv") as f:
        corr = [float(r["dH_corr"]) for r in csv.DictReader(f) if r["dH_corr"] not in ("", "nan")]
    low, high = f"{min(corr):.2f}", f"{max(corr):.2f}"
    assert f"r = {low}-{high}" in (root / "README.md").read_text()
    assert f"r = {low}–{high}" in (root / "docs" / "demo.md").read_text()


def test_autopilot_arm_drops_within_its_cap_and_only_through_its_drops() -> None:
    """The demo's autopilot arm (target "hold", default cap 5%) on the quick preset: every step drops at most
    floor(0.05 n) tokens, some step drops some, and up to its first drop it is vanilla GRPO step for step
    (same seed, same samples): the arm differs only through the tokens it drops."""
    from dataclasses import replace

    from entropy_discriminator.demo.model import TinyGPT
    from entropy_discriminator.demo.train import run_arm, warm_up

    cfg = replace(PRESETS["quick"], grpo_steps=12)
    torch.manual_seed(0)
    model = TinyGPT(cfg.model_config())
    warm_up(model, cfg, seed=0, device=torch.device("cpu"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grpo = run_arm(state, cfg, ArmSpec("GRPO"), seed=0, device=torch.device("cpu"))
    pilot = run_arm(state, cfg, ArmSpec("AP", method="autopilot", target_entropy="hold"), seed=0, device=torch.device("cpu"))
    n_tokens = cfg.prompts_per_step * cfg.group_size * cfg.task().response_len
    fracs = [r["clip_frac"] for r in pilot.records]
    assert all(f <= math.floor(0.05 * n_tokens) / n_tokens + 1e-12 for f in fracs), fracs
    first = next(i for i, f in enumerate(fracs) if f > 0)  # StopIteration (a failure) if it never drops
    for ours, theirs in zip(pilot.records[: first + 1], grpo.records[: first + 1]):
        assert ours["entropy"] == theirs["entropy"] and ours["reward"] == theirs["reward"]
    assert pilot.records[first]["loss"] != grpo.records[first]["loss"]


def test_autopilot_arm_settings_are_checked_by_the_core() -> None:
    with pytest.raises(ValueError, match="entropy_disc.target_entropy"):
        ArmSpec("AP", method="autopilot", target_entropy=-1.0)
    with pytest.raises(ValueError, match="entropy_disc.max_frac"):
        ArmSpec("AP", method="autopilot", max_frac=2.0)


def test_progress_reads_a_function_info_only_for_the_lines_it_writes() -> None:
    """A function ``info`` (the warm-up's loss, a GPU sync to read) is called once per written line, not per step."""
    import io

    out, calls = io.StringIO(), []

    def info() -> str:
        calls.append(1)
        return f"loss {len(calls)}"

    bar = TextProgress("warm-up", stream=out)
    for step in range(1, 101):
        bar(step, 100, info)
    lines = out.getvalue().splitlines()
    assert len(calls) == len(lines) == 11  # the first step, then the first step of each decile 10 %, ..., 100 %
    assert lines[-1].endswith(f"loss {len(calls)}") and "100/100" in lines[-1]
