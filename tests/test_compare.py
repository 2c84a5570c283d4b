"""``entropy-discriminator compare``: the Countdown task, Pass@k, and the smoke preset end to end through the CLI.

Nothing is stubbed: the smoke preset warms up and trains real (tiny) transformers on CPU in every arm.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entropy_discriminator.__main__ import main
from entropy_lab.compare import (
    PRESETS,
    CompareArm,
    CompareOptions,
    default_arms,
)
from entropy_lab.stats_tests import mean_ci
from entropy_lab.countdown import (
    MINUS,
    PLUS,
    SKIP,
    CountdownTask,
    pass_at_k,
)


def test_countdown_reward_is_exact():
    task = CountdownTask(n_numbers=3)
    x = torch.tensor([[3, 5, 7], [3, 5, 7]])
    t = torch.tensor([1, 1])  # 3 - 5 ... : -3 - 5 + 7 = -1 no; 3 + 5 - 7 = 1 yes
    resp = torch.tensor([[PLUS, PLUS, MINUS], [MINUS, PLUS, SKIP]])
    assert task.rewards(x, t, resp).tolist() == [1.0, 0.0]
    assert task.rewards(x, t, torch.tensor([[PLUS, PLUS, 3], [PLUS, PLUS, MINUS]])).tolist() == [0.0, 1.0]


def test_countdown_solutions_counted_by_brute_force():
    task = CountdownTask(n_numbers=4)
    x, t = task.sample(20, torch.Generator().manual_seed(0), split="train")
    got = task.n_solutions(x, t)
    for i in range(20):
        n = sum(sum(c * v for c, v in zip(cs, x[i].tolist())) == int(t[i]) for cs in itertools.product((-1, 0, 1), repeat=4))
        assert int(got[i]) == n >= 1


def test_countdown_splits_are_disjoint_and_warmup_targets_solve_when_noise_free():
    task = CountdownTask(n_numbers=5)
    g = torch.Generator().manual_seed(1)
    xe, te = task.sample(200, g, split="eval")
    xt, tt = task.sample(200, g, split="train")
    assert task.is_eval(xe, te).all() and not task.is_eval(xt, tt).any()
    assert task.rewards(xt, tt, task.warmup_targets(xt, tt, 0.0, g)).eq(1).all()
    prompts = task.prompts(xt, tt)
    assert prompts.shape == (200, task.prompt_len) and int(prompts.max()) < 14


@pytest.mark.parametrize("n, c, k", [(10, 0, 3), (10, 10, 3), (10, 3, 1), (10, 3, 5), (64, 7, 16), (5, 2, 5)])
def test_pass_at_k_is_the_combinatorial_formula(n, c, k):
    want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert float(pass_at_k(n, torch.tensor([c]), k)[0]) == pytest.approx(want, abs=1e-12)


def test_mean_ci_uses_student_t():
    m, h = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert math.isnan(mean_ci([1.0])[1])


def test_options_refuse_bad_settings():
    with pytest.raises(ValueError, match="preset"):
        CompareOptions(preset="huge")
    with pytest.raises(ValueError, match="seeds"):
        CompareOptions(seeds=1)
    with pytest.raises(ValueError, match="baselines"):
        CompareOptions(arms=("grpo+clip_b",)).arm_list()
    with pytest.raises(ValueError, match="mask"):
        CompareArm("x", loss="kl_cov", mask="clip_b")
    assert main(["compare", "--jobs", "0"]) == 2


def test_sensitivity_arms_are_selectable_and_checked():
    names = ("grpo", "clip_cov(ratio=0.02)", "kl_cov(ratio=0.02)", "entropy_bonus(c=0.05)")
    arms = CompareOptions(arms=names).arm_list()
    assert [a.name for a in arms] == list(names) and arms[1].cov_ratio == 0.02 and arms[3].entropy_coef == 0.05
    with pytest.raises(ValueError, match="cov_ratio"):
        CompareArm("x", cov_ratio=0.1)
    with pytest.raises(ValueError, match="cov_ratio"):
        CompareArm("x", loss="clip_cov", cov_ratio=0.0)


def test_default_arms_cover_the_issue():
    names = [a.name for a in default_arms(1.5)]
    assert len(names) == len(set(names)) == 12
    assert {a.baseline for a in default_arms(1.5)} == {"grpo", "ppo"}


def test_smoke_preset_end_to_end(tmp_path: Path):
    """The CI smoke run, as a user runs it (< 60 s on 2 cores): every arm, two paired seeds, tables and plots."""
    out = tmp_path / "cmp"
    proc = subprocess.run(
        [sys.executable, "-m", "entropy_discriminator", "compare", "--preset", "smoke", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    arms = [a.name for a in default_arms(PRESETS["smoke"].tuned_mu_b)]
    assert sorted((r["arm"], r["seed"]) for r in res["runs"]) == sorted((a, s) for a in arms for s in (0, 1))
    for r in res["runs"]:
        assert 0.0 <= r["final"]["avg"] <= 1.0
        p = [r["final"]["pass"][str(k)] for k in (1, 4, 16, 64)]
        assert p == sorted(p) and p[0] == pytest.approx(r["final"]["avg"])
        assert len(r["records"]) == PRESETS["smoke"].rl_steps
        assert all(math.isfinite(x) for pair in r["dh_pairs"] for x in pair)
    forking = [r for r in res["runs"] if r["arm"] == "forking_tokens"]
    assert all(0.6 < rec["control_frac"] < 0.9 for r in forking for rec in r["records"])
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["arm"] for r in rows] == arms
    with open(out / "paired.csv") as f:
        paired = list(csv.DictReader(f))
    assert {r["vs"] for r in paired} >= {"grpo", "ppo"}
    assert "Paired difference" in (out / "tables.md").read_text()
    for png in ("pass_at_k.png", "entropy.png"):
        assert (out / png).stat().st_size > 1000
    # a cut-off run keeps its finished jobs: drop one seed's runs and re-render from the saved files
    for p in (out / "runs").glob("seed1_*.json"):
        p.unlink()
    assert main(["compare", "--render-only", "--out", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert {r["seed"] for r in again["runs"]} == {0} and len(again["runs"]) == len(arms)


def test_report_does_not_import_the_runner_and_presets_are_named_for_what_they_are():
    """compare_report.py no longer imports compare.py (they imported each other); no CPU preset is called "gpu"."""
    code = ("import sys, entropy_lab.compare_report as r; "
            "assert 'entropy_lab.compare' not in sys.modules, 'circle'; print(r.EVAL_KS)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "(1, 4, 16, 64)", proc.stderr
    assert set(PRESETS) == {"smoke", "full"}
