"""The head-to-head protocol: matched-Avg interpolation, Holm, paired t, unbiased Pass@K, the task's
uniform targets, the warm-up identity with the compare harness, and an end-to-end smoke run on a tiny preset."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from entropy_discriminator import EntropyAutopilot, fixed_share_mask, token_stats
from entropy_lab import headtohead, protocol, rl
from entropy_lab.compare import CompareConfig
from entropy_lab.countdown import CountdownTask, pass_at_k
from entropy_lab.headtohead import heldout_sets, run_arm_checkpoints
from entropy_discriminator.demo.model import TinyGPT
from entropy_discriminator.demo.train import LoopConfig
from entropy_discriminator.demo.train import warm_up as demo_warm_up
from entropy_lab.rl import AdaptiveEntropyCoef, Arm, rollout, warm_up
from entropy_lab.protocol import (
    RunSpec,
    comparisons,
    endpoints,
    main_arms,
    parse_arm,
    parse_config,
    primary_keys,
    report,
    run_stage,
    seed_count,
    tuned_arms,
    write_selection,
)
from entropy_lab.records import append_jsonl
from entropy_lab.equivalence import seeds_for_difference, seeds_for_equivalence, tost
from entropy_lab.stats_tests import holm, paired_test, t_quantile_975, t_two_sided_p, value_at_level
from entropy_lab.tuning import (
    SETTINGS_PER_FAMILY,
    adaptive_bonus_arms,
    autopilot_arms,
    fixed_share_arm,
    grid_extensions,
    mean_autopilot_share,
    select,
    stage_a,
    stage_b,
)

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------ matched-Avg reading


def test_value_at_level_hand_case() -> None:
    avgs, vals = [0.20, 0.18, 0.25, 0.30], [1.0, 0.9, 0.5, 0.2]
    # first crossing of 0.22 is between (0.18, 0.9) and (0.25, 0.5): 0.9 + (0.04 / 0.07) * (-0.4)
    assert value_at_level(avgs, vals, 0.22) == pytest.approx(0.9 - 0.4 * 4 / 7)
    assert value_at_level(avgs, vals, 0.30) == pytest.approx(0.2)  # reached exactly at the last checkpoint
    assert value_at_level(avgs, vals, 0.19) == 1.0  # the start is already at the level
    assert math.isnan(value_at_level(avgs, vals, 0.31))  # never reached
    with pytest.raises(ValueError):
        value_at_level([0.1], [0.2, 0.3], 0.1)


@settings(max_examples=200, deadline=None)
@example(steps=[1.0, 0.002, 0.002, 0.6968840866921174, 1.0], start=0.38195955419190386, alpha=0.0, beta=0.0, frac=1.0)
@given(
    steps=st.lists(st.floats(0.001, 1.0), min_size=2, max_size=12),
    start=st.floats(0.0, 0.5),
    alpha=st.floats(-1.0, 1.0),
    beta=st.floats(-2.0, 2.0),
    frac=st.floats(0.0, 1.0),
)
def test_value_at_level_monotone_curves(steps: list[float], start: float, alpha: float, beta: float, frac: float) -> None:
    """On a strictly increasing Avg curve with values linear in Avg, the reading is exact at any reachable level;
    and it always lies between the values of the two bracketing checkpoints."""
    avgs = [start]
    for s in steps:
        avgs.append(avgs[-1] + s)
    vals = [alpha + beta * a for a in avgs]
    # a0 + 1.0 * (aN - a0) can round one ulp above aN, a level the curve never reaches; keep it reachable
    level = min(avgs[0] + frac * (avgs[-1] - avgs[0]), avgs[-1])
    got = value_at_level(avgs, vals, level)
    assert got == pytest.approx(alpha + beta * level, abs=1e-9)
    j = next(i for i, a in enumerate(avgs) if a >= level)
    lo, hi = sorted((vals[max(j - 1, 0)], vals[j]))
    assert lo - 1e-12 <= got <= hi + 1e-12
    assert math.isnan(value_at_level(avgs, vals, avgs[-1] + 1e-3))


# ------------------------------------------------------------------------------------------------- Holm, t-test


def holm_reference(p: list[float]) -> list[float]:
    """Holm by the textbook definition, one hypothesis at a time: with the m finite p-values sorted ascending, the
    adjusted value of the i-th smallest is min(1, max over j <= i of (m - j + 1) * p_(j))."""
    finite = [i for i in range(len(p)) if not math.isnan(p[i])]
    order = sorted(finite, key=lambda i: (p[i], i))
    m = len(order)
    out = [math.nan] * len(p)
    for rank, i in enumerate(order, start=1):
        best = 0.0
        for j in range(1, rank + 1):
            best = max(best, (m - j + 1) * p[order[j - 1]])
        out[i] = min(1.0, best)
    return out


def test_holm_hand_case() -> None:
    # m = 4: sorted 0.01, 0.02, 0.03, 0.04 -> 0.04, 0.06, 0.06, 0.06
    assert holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    got = holm([0.5, math.nan, 0.01])
    assert got[0] == pytest.approx(0.5) and math.isnan(got[1]) and got[2] == pytest.approx(0.02)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(0.0, 1.0), st.just(math.nan)), min_size=0, max_size=30))
def test_holm_matches_reference(p: list[float]) -> None:
    got, ref = holm(p), holm_reference(p)
    assert len(got) == len(p)
    for g, r in zip(got, ref):
        assert (math.isnan(g) and math.isnan(r)) or g == pytest.approx(r, abs=1e-12)
    # Holm never lowers a p-value and rejects a subset of what the unadjusted test rejects
    assert all(math.isnan(x) or g >= x - 1e-15 for g, x in zip(got, p))


def test_t_distribution_values() -> None:
    assert t_quantile_975(1) == pytest.approx(12.7062047, abs=1e-6)
    assert t_quantile_975(9) == pytest.approx(2.2621572, abs=1e-6)
    assert t_two_sided_p(2.2621572, 9) == pytest.approx(0.05, abs=1e-7)
    assert t_two_sided_p(0.0, 5) == pytest.approx(1.0)
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 3, 9, 29):
        for t in (0.3, 1.7, 4.0):
            assert t_two_sided_p(t, df) == pytest.approx(2 * scipy_stats.t.sf(t, df), abs=1e-10)


def test_paired_test_hand_case() -> None:
    # differences 1, 2, 3: mean 2, sd 1, se 1/sqrt(3), t = 2 sqrt(3) on 2 df
    res = paired_test([2.0, 4.0, 6.0, math.nan], [1.0, 2.0, 3.0, 0.0])
    assert res.n == 3 and res.mean == pytest.approx(2.0)
    assert res.ci95 == pytest.approx(4.30265273 / math.sqrt(3), abs=1e-6)
    assert res.p == pytest.approx(t_two_sided_p(2 * math.sqrt(3), 2))
    assert 0.05 < res.p < 0.1
    assert math.isnan(paired_test([1.0], [0.0]).p)


# -------------------------------------------------------------------------------------------------- Pass@K, task


def test_unbiased_pass_at_k() -> None:
    n = 8
    c = torch.arange(n + 1)
    for k in (1, 2, 5, 8):
        ref = [1.0 - math.comb(n - ci, k) / math.comb(n, k) for ci in range(n + 1)]
        assert pass_at_k(n, c, k).tolist() == pytest.approx(ref, abs=1e-12)
    assert pass_at_k(4, torch.tensor([1]), 2).item() == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(n, c, 1).tolist() == pytest.approx([ci / n for ci in range(n + 1)])  # Pass@1 = c / n


def test_uniform_targets_cover_every_achievable_sum() -> None:
    task = CountdownTask(n_numbers=3, targets="uniform")
    x = torch.tensor([[1, 2, 4]]).repeat(6000, 1)
    t = task._uniform_targets(x, torch.Generator().manual_seed(0))
    achievable = set((x[0] @ task.all_coefficients().T).tolist())
    counts = torch.bincount(t + 21)
    assert set(t.tolist()) == achievable  # every achievable sum, nothing else (1, 2, 4: all of -7..7)
    share = counts[counts > 0].double() / len(t)
    assert float(share.max() - share.min()) < 0.03  # uniform: 15 values, 1/15 each
    xs, ts = CountdownTask(n_numbers=5, targets="uniform").sample(300, torch.Generator().manual_seed(1), split="train")
    assert bool((CountdownTask(n_numbers=5).n_solutions(xs, ts) >= 1).all())
    with pytest.raises(ValueError):
        CountdownTask(targets="nope")


def test_first_solution_warm_up_teaches_the_first_valid_vector() -> None:
    task = CountdownTask(n_numbers=4, targets="uniform", warmup_solution="first")
    x, t = task.sample(300, torch.Generator().manual_seed(3), split="train")
    got = task.warmup_targets(x, t, 0.0, torch.Generator().manual_seed(4))
    assert bool(task.rewards(x, t, got).eq(1).all())
    coef = task.coefficients(got)
    for i in range(len(t)):  # no valid vector comes before it in all_coefficients' order (itertools.product)
        first = next(c for c in itertools.product((-1, 0, 1), repeat=4) if sum(a * b for a, b in zip(c, x[i].tolist())) == int(t[i]))
        assert coef[i].tolist() == list(first)
    assert torch.equal(got, task.warmup_targets(x, t, 0.0, torch.Generator().manual_seed(5)))  # one answer per problem
    rand = CountdownTask(n_numbers=4, targets="uniform").warmup_targets(x, t, 0.0, torch.Generator().manual_seed(4))
    assert not torch.equal(got, rand)  # the default draws among the solutions
    assert parse_config("warmup_solution=first,n_numbers=4").task() == CountdownTask(n_numbers=4, warmup_solution="first")
    with pytest.raises(ValueError, match="warmup_solution"):
        CountdownTask(warmup_solution="last")


def test_heldout_sets_are_disjoint_and_held_out() -> None:
    task = CountdownTask(n_numbers=5, targets="uniform")
    (xt, tt), (xv, tv) = heldout_sets(task, 50, 60)
    assert len(tt) == 50 and len(tv) == 60
    assert bool(task.is_eval(xt, tt).all()) and bool(task.is_eval(xv, tv).all())
    test_keys = {(*a.tolist(), int(b)) for a, b in zip(xt, tt)}
    val_keys = [(*a.tolist(), int(b)) for a, b in zip(xv, tv)]
    assert len(set(val_keys)) == 60 and not test_keys & set(val_keys)


def test_warm_up_is_the_demos_and_refuses_the_demos_target_on_countdown() -> None:
    """``rl.warm_up`` is the library demo's warm-up on a fresh seeded TinyGPT; its ``target_avg`` (the demo's
    addition evaluation) is refused by name on another configuration, and ``LoopConfig`` itself names no task."""
    cfg = replace(CompareConfig(d_model=16), warmup_steps=3, warmup_batch=16)
    torch.manual_seed(5)
    model = TinyGPT(cfg.model_config())
    assert demo_warm_up(model, cfg, seed=5, device=torch.device("cpu"))["steps"] == 3
    state = warm_up(cfg, 5)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="target_avg needs a TrainConfig"):
        demo_warm_up(model, cfg, seed=5, device=torch.device("cpu"), target_avg=0.3)
    with pytest.raises(TypeError, match="abstract"):
        LoopConfig()


def test_warm_up_checkpoints_are_the_states_of_shorter_warm_ups() -> None:
    """The one warm-up (the demo's loop through ``rl.warm_up``): its state at step 2 is the final state of a 2-step
    warm-up with the same seed (what ``protocol warm-sweep`` relies on), and its last one is the final state."""
    cfg = replace(CompareConfig(d_model=16), warmup_steps=6, warmup_batch=16)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    final = warm_up(cfg, 3, at_steps=(2, 6), on_step=lambda step, state: seen.update({step: state}))
    short = warm_up(replace(cfg, warmup_steps=2), 3)
    assert sorted(seen) == [2, 6]
    assert all(torch.equal(seen[2][k], short[k]) for k in short) and all(torch.equal(seen[6][k], final[k]) for k in final)
    assert not all(torch.equal(short[k], final[k]) for k in final)


# --------------------------------------------------------------------------------------------- arms and tuning


def test_parse_helpers() -> None:
    arm = parse_arm("v@clip_v:mask=clip_v,mu=1.5,cap=none,lr=3e-4")
    assert (arm.family, arm.mask, arm.mu, arm.cap, arm.lr) == ("clip_v", "clip_v", 1.5, None, 3e-4)
    assert parse_config("d_model=32,targets=uniform,warmup_steps=7").task().targets == "uniform"
    with pytest.raises(ValueError):
        parse_config("nope=1")
    with pytest.raises(ValueError):
        Arm("x", "x", mask="clip_b", loss="kl_cov")


def test_tuning_grids_give_every_family_the_same_budget() -> None:
    arms = [*stage_a(), *stage_b(3e-4, 1e-3)]
    fams: dict[str, int] = {}
    for a in arms:
        fams[a.family] = fams.get(a.family, 0) + 1
    assert len(fams) == 11 and set(fams.values()) == {SETTINGS_PER_FAMILY}
    assert len({a.name for a in arms}) == len(arms)
    assert all(a.lr == 3e-4 for a in stage_b(3e-4, 1e-3) if a.estimator == "grpo")


def test_main_arms_adds_the_second_grpo_lr() -> None:
    sel = [{"grpo": {"chosen": "grpo(lr=0.0003)"}, "ppo": {"chosen": "ppo(lr=0.001)"}},
           {"clip_b": {"chosen": "clip_b(mu=1.5)"}, "kl_cov": {"chosen": None}}]
    arms = main_arms(sel, 3e-4, 1e-3)
    assert [a.name for a in arms] == ["grpo(lr=0.0003)", "ppo(lr=0.001)", "clip_b(mu=1.5)", "grpo(lr=0.001)"]
    with pytest.raises(ValueError):
        main_arms(sel, 1e-3, 1e-3)


def test_endpoints_of_a_synthetic_run() -> None:
    def cp(step: int, avg: float, p64: float) -> dict:
        ev = {"avg": avg, "pass": {"16": p64 - 0.1, "64": p64}}
        return {"step": step, "T0.7": ev, "T1.0": ev}

    run = {"checkpoints": [cp(0, 0.20, 1.0), cp(10, 0.21, 0.9), cp(20, 0.23, 0.7), cp(30, 0.22, 0.6)]}
    e = endpoints(run)
    assert e["T0.7/d0.02/pass@64"] == pytest.approx(0.9 + 0.5 * (0.7 - 0.9))  # 0.22 halfway from 0.21 to 0.23
    assert math.isnan(e["T0.7/d0.04/pass@64"])
    assert e["T0.7/final/pass@64"] == 0.6 and e["T0.7/best/avg"] == 0.23 and e["T0.7/best/pass@64"] == 0.7
    assert set(primary_keys()) <= set(e)


def _tuning_run(arm: Arm, seed: int, p64: float) -> dict:
    """A run whose Avg@K rises by 0.05 in one step and whose Pass@64 there is ``p64`` (its tuning score)."""
    def ev(avg: float) -> dict:
        return {"avg": avg, "pass": {"16": p64, "64": p64}}

    cps = [{"step": 0, "T0.7": ev(0.2), "T1.0": ev(0.2)}, {"step": 10, "T0.7": ev(0.25), "T1.0": ev(0.25)}]
    return {"arm": arm.name, "family": arm.family, "seed": seed, "checkpoints": cps,
            "records": [{"control_frac": 0.0}], "arm_spec": asdict(arm)}


def test_grid_extensions_grow_each_axis_past_an_edge_choice() -> None:
    """A chosen setting at an edge of its family's tried values adds the next rung beyond it on that axis (the other
    fields as chosen); an interior choice, a rung already tried and a ladder's end add nothing."""
    def runs_with(arms: list[Arm], best: str) -> list[dict]:
        return [_tuning_run(a, s, 0.9 if a.name == best else 0.5) for a in arms for s in (100, 101)]

    grid = stage_a() + stage_b(1e-4, 1e-3)
    for best, want in [
        ("grpo(lr=0.0001)", ["grpo(lr=3e-05)"]), ("grpo(lr=0.0003)", []), ("ppo(lr=0.003)", ["ppo(lr=0.01)"]),
        ("clip_b(mu=1)", ["clip_b(mu=0.5)"]), ("clip_b(mu=2.5)", ["clip_b(mu=3)"]), ("clip_b(mu=1.5)", []),
        ("clip_v(mu=2.5,cap=0.02)", ["clip_v(mu=3,cap=0.02)"]), ("kl_cov(ratio=0.02,coef=5)", ["kl_cov(ratio=0.1,coef=5)",
         "kl_cov(ratio=0.02,coef=25)"]), ("clip_cov(ratio=0.02,eps=off)", ["clip_cov(ratio=0.05,eps=off)"]),
        ("forking(rho=0.8)", ["forking(rho=1)"]), ("entropy_bonus(c=0.001)", ["entropy_bonus(c=0.0003)"]),
        ("unlikely(pen=1)", ["unlikely(pen=2)"]),
    ]:  # fmt: skip
        fam = next(a.family for a in grid if a.name == best)
        arms = [a for a in grid if a.family == fam]
        runs = runs_with(arms, best)
        new = grid_extensions(runs, select(runs))
        assert [a.name for a in new] == want, best
        chosen = next(a for a in arms if a.name == best)
        for a in new:  # one field moved, every other as chosen
            moved = [f.name for f in fields(Arm) if f.name != "name" and getattr(a, f.name) != getattr(chosen, f.name)]
            assert len(moved) == 1, (a, moved)
    # the adaptive bonus's targets step by 0.05; a rung already tried and a ladder's end add nothing
    bonus = adaptive_bonus_arms(3e-4)
    runs = runs_with(bonus, "adaptive_bonus(target=0.5)")
    assert [a.name for a in grid_extensions(runs, select(runs))] == ["adaptive_bonus(target=0.45)"]
    forking = [a for a in grid if a.family == "forking_tokens"] + [Arm("forking(rho=1)", "forking_tokens",
                                                                          mask="forking", rho=1.0, lr=1e-4)]
    runs = runs_with(forking, "forking(rho=1)")
    assert grid_extensions(runs, select(runs)) == []
    clip_b = [a for a in grid if a.family == "clip_b"]
    runs = runs_with(clip_b, "clip_b(mu=1)") + [_tuning_run(replace(clip_b[0], name="clip_b(mu=0.5)", mu=0.5), 100, 0.1)]
    assert grid_extensions(runs, select(runs)) == []


def test_extend_stage_runs_extensions_until_the_choice_is_interior(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """The loop runs each round's extensions into extend{k}/ and selects over everything: a score that keeps rising
    toward smaller mu moves the choice down the ladder until the ladder ends (0.5), then stops."""
    arms = [a for a in stage_b(1e-4, 1e-3) if a.family == "clip_b"]
    score = lambda a: 1.0 - a.mu / 10  # noqa: E731  best at the smallest mu
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(_tuning_run(a, s, score(a))) + "\n" for a in arms
                                                 for s in (100, 101)))
    ran: list[list[str]] = []

    def fake_stage(spec, new_arms, out, **kw):  # noqa: ANN001, ANN003
        ran.append([a.name for a in new_arms])
        out.mkdir(parents=True)
        (out / "runs.jsonl").write_text("".join(json.dumps(_tuning_run(a, s, score(a))) + "\n" for a in new_arms
                                                for s in (100, 101)))
        return out / "runs.jsonl"

    monkeypatch.setattr(protocol, "run_stage", fake_stage)
    sel = protocol.extend_stage(None, tmp_path, jobs=1, log=lambda m: None)
    assert ran == [["clip_b(mu=0.5)"]] and sel["clip_b"]["chosen"] == "clip_b(mu=0.5)"
    assert json.loads((tmp_path / "selection.json").read_text())["clip_b"]["chosen"] == "clip_b(mu=0.5)"
    assert sorted(p.name for p in tmp_path.glob("extend*")) == ["extend1"]


def test_seed_count_follows_the_tuning_runs_paired_sd(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The SD is the largest over pairs and primary endpoints of the seeds' paired differences; n follows the
    equivalence module's counts, floored at n_min and capped at n_max; on the committed headroom pilot it is the
    SD START.md reports (0.072 at +0.04 / Pass@64)."""
    base = {100: 0.60, 101: 0.70, 102: 0.65}
    shift = {100: 0.01, 101: 0.03, 102: 0.05}  # differences of SD 0.02
    runs = [_tuning_run(Arm("g", "grpo"), s, p) for s, p in base.items()]
    runs += [_tuning_run(Arm("c", "clip_b", mask="clip_b"), s, base[s] + shift[s]) for s in base]
    out = seed_count(runs, [("c", "g")], detect=0.03, margin=0.02, tests=16)
    assert out["sd_max"] == pytest.approx(0.02) and len(out["sd"]) == 4
    n_d, n_e = seeds_for_difference(0.02, 0.03, tests=16), seeds_for_equivalence(0.02, 0.02)
    assert (out["n_difference"], out["n_equivalence"]) == (n_d, n_e)
    assert out["n"] == max(10, min(40, max(n_d, n_e))) and not out["capped"]
    assert seed_count(runs, [("c", "g")], detect=0.3, margin=0.3, tests=1)["n"] == 10  # the floor
    capped = seed_count(runs, [("c", "g")], detect=0.001, margin=0.001, tests=16)
    assert capped["n"] == 40 and capped["capped"] and capped["detectable_at_n"] > 0.001
    # An endpoint finite on fewer than 2 tuning seeds (an arm that reached a level on one seed) has no SD: it is
    # listed under "undefined" and left out of the maximum, and with no SD at all the count is refused.
    lone = _tuning_run(Arm("c1", "clip_v", mask="clip_v"), 100, base[100] + 0.5)
    partial = seed_count(runs + [lone], [("c", "g"), ("c1", "g")], detect=0.03, margin=0.02, tests=16)
    assert partial["sd_max"] == pytest.approx(0.02) and len(partial["sd"]) == 4
    assert len(partial["undefined"]) == 4 and set(partial["undefined"].values()) == {1}
    with pytest.raises(ValueError, match="no endpoint is finite on 2"):
        seed_count(runs[:1] + runs[3:4], [("c", "g")], detect=0.03, margin=0.02, tests=16)
    pilot = ROOT / "docs" / "reproduction" / "headroom" / "pilot" / "runs.jsonl.xz"
    protocol.main(["seeds", str(pilot), "--pair", "grpo_lr3e-4|grpo_lr1e-4", "--detect", "0.05", "--margin", "0.05",
                   "--tests", "4"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["sd_max"] == pytest.approx(0.072, abs=5e-4)


def test_comparisons_with_a_margin_give_tost_and_verdicts(tmp_path: Path) -> None:
    """A tiny steady difference matches, a large steady one is better (or worse), a noisy one is inconclusive, one
    that fewer than 80 % of the seeds reach in both arms makes no claim; TOST p-values are Holm-adjusted over the
    family on their own; the report shows them only when a margin is given."""
    seeds = range(12)
    base = {s: 0.5 + 0.01 * (s % 5) for s in seeds}
    shifts = {"same": [0.001 * (-1) ** s for s in seeds], "up": [0.05 + 0.002 * (s % 3) for s in seeds],
              "down": [-0.05 - 0.002 * (s % 3) for s in seeds], "noisy": [0.06 * (-1) ** s for s in seeds]}
    runs = [_tuning_run(Arm("g", "grpo"), s, base[s]) for s in seeds]
    runs += [_tuning_run(Arm(a, a), s, base[s] + d[i]) for a, d in shifts.items() for i, s in enumerate(seeds)]
    rare = [_tuning_run(Arm("rare", "rare"), s, base[s] + 0.05) for s in seeds]
    for r in rare[:3]:  # 9 of 12 seeds (75 %) reach the level: a large steady gain, but no claim
        r["checkpoints"][1]["T0.7"]["avg"] = 0.2
    pairs = [(a, "g") for a in shifts]
    rows = comparisons(runs, pairs, ["T0.7/d0.02/pass@64"], margin=0.02)
    assert [r["verdict"] for r in rows] == ["matches", "better", "worse", "inconclusive"]
    few = comparisons(runs + rare, [*pairs, ("rare", "g")], ["T0.7/d0.02/pass@64"], margin=0.02)[-1]
    assert (few["n"], few["seeds"], few["p_holm"] < 0.05, few["verdict"]) == (9, 12, True, "no claim")
    lenient = comparisons(runs + rare, [("rare", "g")], ["T0.7/d0.02/pass@64"], 0.02, min_share=0.75)
    assert lenient[0]["verdict"] == "better"
    assert [r["p_tost_holm"] for r in rows] == pytest.approx(holm([r["p_tost"] for r in rows]))
    with_margin = [r["p_tost"] for r in rows]
    d = [base[s] + shifts["same"][i] - base[s] for i, s in enumerate(seeds)]
    assert with_margin[0] == pytest.approx(tost(d, [0.0] * len(d), 0.02).p)
    assert "verdict" not in comparisons(runs, pairs, ["T0.7/d0.02/pass@64"])[0]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert "verdict" in report(tmp_path, pairs, margin=0.02) and "verdict" not in report(tmp_path, pairs)


def test_report_draws_the_frontier_of_its_pairs_arms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each comparison family's figures show only the arms of its pairs, under files named for the family."""
    drawn: list[tuple[set[str], float, int, str]] = []
    monkeypatch.setattr(protocol, "frontier_figure",
                        lambda runs, out, t, k, prefix="": drawn.append(({r["arm"] for r in runs}, t, k, prefix)))
    runs = [_tuning_run(Arm(a, a), s, 0.5 + 0.01 * s + 0.02 * i) for i, a in enumerate("gxyz") for s in range(4)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    report(tmp_path, [("x", "g"), ("y", "g")], name="peers")
    assert {(frozenset(a), p) for a, _, _, p in drawn} == {(frozenset("gxy"), "peers_")}
    assert sorted((t, k) for _, t, k, _ in drawn) == sorted((t, k) for t in protocol.TEMPERATURES for k in (16, 64))
    drawn.clear()
    report(tmp_path, [("z", "g")])
    assert {(frozenset(a), p) for a, _, _, p in drawn} == {(frozenset("gz"), "")}


# ---------------------------------------------------------------------------------------------- end-to-end smoke


def test_protocol_smoke(tmp_path: Path) -> None:
    """Warm-up, three arms x two seeds with checkpoints, selection and the report, on a tiny preset (seconds)."""
    cfg = parse_config("d_model=16,n_heads=2,warmup_steps=20,warmup_batch=32,prompts_per_step=4,group_size=4,targets=uniform")
    spec = RunSpec(cfg, (100, 101), (0, 1, 3), "val", n_prompts=6, samples=64)
    arms = [Arm("grpo(lr=0.001)", "grpo"), Arm("clip_b(mu=1)", "clip_b", mask="clip_b", mu=1.0),
            Arm("ppo(lr=0.001)", "ppo", estimator="ppo", baseline="ppo")]
    run_stage(spec, arms, tmp_path, jobs=1, log=lambda s: None)
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    assert len(runs) == 6 and len(starts) == 2
    for r in runs:
        assert [c["step"] for c in r["checkpoints"]] == [0, 1, 3] and len(r["records"]) == 3
        start = next(s["start"] for s in starts if s["seed"] == r["seed"])
        assert r["checkpoints"][0]["T0.7"] == start["T0.7"]  # checkpoint 0 is the shared start (same stream)
        assert 0.0 <= r["checkpoints"][-1]["T1.0"]["pass"]["64"] <= 1.0
        floats = [x for rec in r["records"] for x in rec.values() if isinstance(x, float)]
        assert floats and all(x == float(f"{x:.6g}") for x in floats)  # stored at 6 significant digits
    sel = write_selection(tmp_path)
    assert set(sel) == {"grpo", "clip_b", "ppo"} and (tmp_path / "selection.md").is_file()
    text = report(tmp_path, [("clip_b(mu=1)", "grpo(lr=0.001)")], name="smoke")
    assert "primary (T = 0.7): 4 tests" in text and (tmp_path / "smoke.json").is_file()
    if importlib.util.find_spec("matplotlib"):  # the figures are 256-colour palette PNGs
        from PIL import Image

        figure = Image.open(tmp_path / "smoke_frontier_T0.7_pass64.png")
        assert figure.mode == "P" and figure.size[0] > 600


def test_warm_cache_reuses_starts_without_changing_runs(tmp_path: Path) -> None:
    """A stage with a warm cache stores its warm starts; a later stage of the same configuration reuses them (no
    warm-up: ``warmup_seconds`` 0, ``warm_reused_from`` set) and its runs equal those of a stage without the cache;
    another configuration gets another cache entry."""
    cfg = parse_config("d_model=16,n_heads=2,warmup_steps=20,warmup_batch=32,prompts_per_step=4,group_size=4,targets=uniform")
    spec = RunSpec(cfg, (100,), (0, 2), "val", n_prompts=6, samples=16)
    arms = [Arm("grpo(lr=0.001)", "grpo")]
    cache = tmp_path / "cache"
    lines = {}
    for name, warm in (("plain", None), ("first", cache), ("second", cache)):
        run_stage(spec, arms, tmp_path / name, jobs=1, log=lambda s: None, warm_cache=warm)
        lines[name] = [json.loads(x) for x in (tmp_path / name / "runs.jsonl").read_text().splitlines()]
        lines[name + "/starts"] = [json.loads(x) for x in (tmp_path / name / "starts.jsonl").read_text().splitlines()]
    assert "warm_reused_from" not in lines["first/starts"][0] and lines["first/starts"][0]["warmup_seconds"] > 0
    reused = lines["second/starts"][0]
    assert reused["warmup_seconds"] == 0.0 and Path(reused["warm_reused_from"]).is_file()
    assert reused["start"] == lines["plain/starts"][0]["start"]
    for key in ("records", "checkpoints"):
        assert lines["second"][0][key] == lines["first"][0][key] == lines["plain"][0][key]
    filled = tmp_path / "filled"
    assert protocol.main(["warm", "--config", "d_model=16,n_heads=2,warmup_steps=20,warmup_batch=32,"
                          "prompts_per_step=4,group_size=4,targets=uniform", "--seeds", "100", "--jobs", "1",
                          "--warm-cache", str(filled)]) == 0
    run_stage(spec, arms, tmp_path / "after_fill", jobs=1, log=lambda s: None, warm_cache=filled)
    after = [json.loads(x) for x in (tmp_path / "after_fill" / "runs.jsonl").read_text().splitlines()]
    after_start = json.loads((tmp_path / "after_fill" / "starts.jsonl").read_text().splitlines()[0])
    assert after_start["warmup_seconds"] == 0.0 and after_start["start"] == lines["plain/starts"][0]["start"]
    assert after[0]["records"] == lines["plain"][0]["records"] and not list(filled.rglob("*.partial"))
    threads = torch.get_num_threads()
    try:  # a cache hit evaluates the start on one thread, as a fresh warm-up does (no oversubscribed pool)
        torch.set_num_threads(2)
        protocol._warm_job((spec, 100, str(tmp_path / "hit.pt"), str(filled)))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    other = parse_config("d_model=16,n_heads=2,warmup_steps=21,warmup_batch=32,prompts_per_step=4,group_size=4,targets=uniform")
    assert protocol.warm_cache_path(cache, other, 100) != protocol.warm_cache_path(cache, cfg, 100)
    assert protocol.warm_cache_path(cache, cfg, 100).parent == Path(reused["warm_reused_from"]).parent


# ------------------------------------------------------------------ the autopilot and TRL's adaptive bonus

TINY = "d_model=16,n_heads=2,warmup_steps=20,warmup_batch=32,prompts_per_step=4,group_size=4,targets=uniform"


def _tiny_state(cfg: CompareConfig, seed: int) -> dict[str, torch.Tensor]:
    return warm_up(cfg, seed)


def _weights(step: int, model: TinyGPT) -> dict[str, object]:
    return {"w": [float(p.detach().double().sum()) for p in model.parameters()]}


def test_issue23_tuning_settings() -> None:
    (pilot,) = autopilot_arms(3e-4)
    assert (pilot.name, pilot.family, pilot.mask, pilot.lr, pilot.target_entropy) == (
        "autopilot(hold)", "autopilot", "autopilot", 3e-4, "hold")
    assert pilot.autopilot_config().build_autopilot().max_frac == 0.05  # the core's default cap
    arms = adaptive_bonus_arms(3e-4, 0.70)
    assert len(arms) == SETTINGS_PER_FAMILY == 4
    assert [a.name for a in arms] == [f"adaptive_bonus(target={t})" for t in ("0.5", "0.6", "0.65", "0.7")]
    assert [a.entropy_target for a in arms] == [0.5, 0.6, 0.65, 0.7]
    assert all(a.family == "adaptive_bonus" and a.adaptive_entropy and a.entropy_coef == 0.0 and a.lr == 3e-4
               and (a.entropy_coef_delta, a.entropy_coef_min, a.entropy_coef_max) == (0.005, 0.0, 1.0) for a in arms)
    parsed = parse_arm("a@adaptive_bonus:adaptive_entropy=true,entropy_target=0.6")
    assert parsed.adaptive_entropy is True and parsed.entropy_target == 0.6
    assert parse_arm("p@autopilot:mask=autopilot,target_entropy=hold").target_entropy == "hold"
    assert parse_arm("p@autopilot:mask=autopilot,target_entropy=0.5").target_entropy == 0.5
    with pytest.raises(ValueError):
        Arm("x", "x", mask="autopilot", target_entropy="nope")


def test_adaptive_entropy_coef_follows_trl_rule() -> None:
    """TRL 1.16: applied = coef if the previous step's entropy <= target (inf before the first), then
    coef += delta if this step's entropy <= target else -= delta, clamped to [min, max]."""
    c = AdaptiveEntropyCoef(coef=0.0, target=0.6, delta=0.005, lo=0.0, hi=0.012)
    applied = [c.applied()]
    coefs = []
    for h in (0.7, 0.55, 0.5, 0.6, 0.65, 0.59, 0.8, 0.8, 0.8):
        c.update(h)
        coefs.append(c.coef)
        applied.append(c.applied())
    assert coefs == pytest.approx([0.0, 0.005, 0.01, 0.012, 0.007, 0.012, 0.007, 0.002, 0.0])
    assert applied == pytest.approx([0.0, 0.0, 0.005, 0.01, 0.012, 0.0, 0.012, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        AdaptiveEntropyCoef(coef=0.0, target=0.6, lo=1.0, hi=0.0)


def test_adaptive_bonus_arm_in_the_loop() -> None:
    """A target below any entropy reached never applies the coefficient: bit-identical to plain GRPO; a target above
    every entropy applies delta, 2 delta, ... from the second optimiser step on (two mini-batches a step)."""
    cfg = parse_config(TINY)
    state = _tiny_state(cfg, 100)
    grpo = run_arm_checkpoints(state, cfg, Arm("g", "grpo"), 100, (0, 3), _weights)
    low = run_arm_checkpoints(state, cfg, Arm("a", "adaptive_bonus", adaptive_entropy=True, entropy_target=0.0),
                              100, (0, 3), _weights)
    assert grpo.checkpoints == low.checkpoints
    assert [{k: r[k] for k in g} for r, g in zip(low.records, grpo.records)] == grpo.records
    assert all(r["entropy_coef_applied"] == 0.0 and r["entropy_coef"] == 0.0 for r in low.records)
    high = run_arm_checkpoints(state, cfg, Arm("a", "adaptive_bonus", adaptive_entropy=True, entropy_target=50.0),
                               100, (0, 2), _weights)
    assert [r["entropy_coef_applied"] for r in high.records] == pytest.approx([0.0025, 0.0125])
    assert [r["entropy_coef"] for r in high.records] == pytest.approx([0.01, 0.02])
    assert high.checkpoints[-1] != grpo.checkpoints[-1]


def _first_rollout(cfg: CompareConfig, state: dict[str, torch.Tensor], seed: int):
    """The first RL step's rollout of ``seed`` from ``state``, done directly (the loop's seeds and streams), and the
    old policy's statistics of its whole batch: ``(model, task, rollout, stats)``."""
    task = cfg.task()
    torch.manual_seed(seed)
    model = TinyGPT(cfg.model_config())
    model.load_state_dict(state)
    x, t = task.sample(cfg.prompts_per_step, torch.Generator().manual_seed(seed), split="train")
    ro = rollout(model, None, task, x, t, cfg.group_size, torch.Generator().manual_seed(seed + 1), "none", 0.25,
                 torch.device("cpu"))
    with torch.no_grad():
        stats = token_stats(model.response_logits(ro.seq, task.prompt_len).float(), ro.resp)
    return model, task, ro, stats


def _spy_control(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> tuple[list, list[int]]:
    """Record every result of the arm's per-step control ``owner.name`` (the controller's step or the mask) and,
    for every mini-batch update (``rl.policy_update``), how many tokens its keep-mask drops: ``(results,
    dropped)``, filled while the patches hold."""
    results: list = []
    dropped: list[int] = []
    core, core_update = getattr(owner, name), rl.policy_update

    def spy(*a, **k):  # noqa: ANN002, ANN003
        results.append(core(*a, **k))
        return results[-1]

    def spy_update(*a, keep_mask=None, **k):  # noqa: ANN001, ANN002, ANN003
        dropped.append(int((~keep_mask).sum()))
        return core_update(*a, keep_mask=keep_mask, **k)

    monkeypatch.setattr(owner, name, spy)
    monkeypatch.setattr(rl, "policy_update", spy_update)
    return results, dropped


def test_autopilot_arm_matches_the_core_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """One controller step per RL step on the old policy's statistics of the whole batch: the first step's mask is
    the one a fresh core EntropyAutopilot gives on the same rollout, the mini-batches drop exactly its tokens, and
    at a high learning rate (entropy falling) it drops tokens."""
    cfg = parse_config(TINY)
    seed, arm = 101, Arm("autopilot(hold)", "autopilot", mask="autopilot", lr=3e-2)
    state = _tiny_state(cfg, seed)
    results, dropped = _spy_control(monkeypatch, EntropyAutopilot, "from_stats")
    trace = run_arm_checkpoints(state, cfg, arm, seed, (0, 6), lambda step, model: {})
    assert len(results) == 6 and len(dropped) == 6 * cfg.minibatches
    monkeypatch.undo()
    # the same rollout, stepped directly on the core controller
    _, _, ro, stats = _first_rollout(cfg, state, seed)
    ref = EntropyAutopilot("hold").from_stats(stats, ro.adv, lr=3e-2)
    assert torch.equal(ref.keep, results[0].keep) and ref.predicted_dh_after == results[0].predicted_dh_after
    for i, (res, rec) in enumerate(zip(results, trace.records)):
        assert sum(dropped[i * cfg.minibatches : (i + 1) * cfg.minibatches]) == res.mask.n_clipped
        assert rec["control_frac"] == pytest.approx(res.dropped_frac)
        assert rec["autopilot_target_entropy"] == results[0].entropy  # "hold": the first batch's entropy
    assert max(r["control_frac"] for r in trace.records) > 0


def test_calibrated_autopilot_arm_feeds_same_batch_pairs_to_its_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """``calibrate_every=k``: on RL steps 1, k+1, ... the arm records the whole batch's cheap prediction (recomputed
    here from the same rollout) and the realised change of the same tokens' mean entropy over that step's updates
    (recomputed from the policy after step 1); the controller's scale is then realised / cheap (one pair, least
    squares through 0), and the other steps record no pair."""
    cfg = parse_config(TINY)
    seed, arm = 7, parse_arm("ap@autopilot:mask=autopilot,lr=0.03,calibrate_every=2")  # seed 7: step 1 has rewards to compare
    assert arm.calibrate_every == 2 and type(arm.calibrate_every) is int
    state = _tiny_state(cfg, seed)
    _, task, ro, stats = _first_rollout(cfg, state, seed)
    after: dict[str, float] = {}

    def read(step: int, model: TinyGPT) -> dict[str, object]:
        if step == 1:
            with torch.no_grad():
                h = token_stats(model.response_logits(ro.seq, task.prompt_len).float(), ro.resp).entropy
            after["realised"] = float((h - stats.entropy).double().mean())
        return {}

    trace = run_arm_checkpoints(state, cfg, arm, seed, (0, 1, 5), read)
    recs = trace.records
    assert [("autopilot_cheap_dh" in r) for r in recs] == [True, False, True, False, True]
    a, y = ro.adv.double().flatten(), stats.s_centered.double().flatten()
    cheap = float(-0.03 * ((a - a.mean()) * (y - y.mean())).mean())
    assert cheap != 0 and recs[0]["autopilot_cheap_dh"] == pytest.approx(cheap, rel=1e-6)
    assert recs[0]["autopilot_realised_dh"] == pytest.approx(after["realised"], rel=1e-6, abs=1e-9)
    fed = recs[0]["autopilot_scale_skipped"] == 0.0
    assert fed == (after["realised"] / cheap > 0)  # a pair that would make the scale non-positive is left out
    assert recs[0]["autopilot_scale"] == pytest.approx(after["realised"] / cheap if fed else 1.0, rel=1e-6)
    assert recs[1]["autopilot_scale"] == recs[0]["autopilot_scale"]  # unchanged without a pair
    with pytest.raises(ValueError, match="calibrate_every is the autopilot's"):
        Arm("x", "x", mask="clip_b", calibrate_every=3)
    with pytest.raises(ValueError, match="calibrate_every must be an int"):
        Arm("x", "x", mask="autopilot", calibrate_every=-1)


def test_fixed_share_arm_drops_the_autopilots_first_tokens_at_a_constant_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed-share control: every RL step, on the old policy's statistics of the whole batch, the core
    fixed_share_mask with the autopilot's order drops floor(share * N) tokens (fewer only when fewer candidates
    exist), the mini-batches drop exactly those, and the first step's mask is the one the core gives on the same
    rollout."""
    cfg = parse_config(TINY)
    seed, arm = 101, parse_arm("fs@fixed_share:mask=fixed_share,share=0.04,lr=0.03")
    state = _tiny_state(cfg, seed)
    results, dropped = _spy_control(monkeypatch, rl, "fixed_share_mask")
    trace = run_arm_checkpoints(state, cfg, arm, seed, (0, 8), lambda step, model: {})
    monkeypatch.undo()
    assert len(results) == 8 and len(dropped) == 8 * cfg.minibatches
    for i, (res, rec) in enumerate(zip(results, trace.records)):
        limit = int(0.04 * res.mask.n_valid)
        assert sum(dropped[i * cfg.minibatches : (i + 1) * cfg.minibatches]) == res.mask.n_clipped <= limit
        assert res.mask.n_clipped == limit or not res.mask.capped  # the share, unless the candidates ran out
        assert rec["control_frac"] == pytest.approx(res.dropped_frac)
        assert rec["fixed_share_predicted_dh"] == res.predicted_dh_after and "autopilot_entropy" not in rec
    assert max(r.mask.n_clipped for r in results) > 0
    model, task, ro, stats = _first_rollout(cfg, state, seed)
    ref = fixed_share_mask(stats.s_centered, ro.adv, stats.valid, share=0.04, lr=0.03)  # the autopilot's defaults
    assert torch.equal(ref.keep, results[0].keep)
    with pytest.raises(ValueError, match="share"):
        Arm("x", "x", mask="fixed_share", share=0.0)
    with pytest.raises(ValueError, match="keep_mask"):
        rl.policy_update(model, torch.optim.SGD(model.parameters(), lr=0.1), ro.seq, ro.resp, ro.adv,
                         torch.ones_like(ro.resp, dtype=torch.bool), ro.old_lp, task.prompt_len, arm, torch.Generator())


def test_fixed_share_is_the_autopilots_mean_share_in_tuning() -> None:
    runs = [{"arm": "autopilot(hold)", "seed": s, "records": [{"autopilot_dropped_frac": f} for f in fr]}
            for s, fr in ((100, [0.0, 0.02, 0.04]), (101, [0.05, 0.05, 0.02]))]
    runs.append({"arm": "grpo(lr=0.0003)", "seed": 100, "records": [{"entropy": 0.7}]})
    assert mean_autopilot_share(runs) == pytest.approx(0.03)
    arm = fixed_share_arm(3e-4, mean_autopilot_share(runs))
    assert (arm.name, arm.family, arm.mask, arm.share, arm.lr) == ("fixed_share(0.03)", "fixed_share", "fixed_share",
                                                                   pytest.approx(0.03), 3e-4)
    with pytest.raises(ValueError, match="autopilot_dropped_frac"):
        mean_autopilot_share(runs[2:])


def test_main_families_restricts_arms(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sel = [{"grpo": {"chosen": "grpo(lr=0.0003)"}, "ppo": {"chosen": "ppo(lr=0.001)"}},
           {"clip_b": {"chosen": "clip_b(mu=1.5)"}}, {"adaptive_bonus": {"chosen": "adaptive_bonus(target=0.6)"}}]
    names = lambda arms: [a.name for a in arms]  # noqa: E731
    assert names(main_arms(sel, 3e-4, 1e-3, ["autopilot", "adaptive_bonus"])) == [
        "adaptive_bonus(target=0.6)", "autopilot(hold)"]
    assert names(main_arms([], 3e-4, 1e-3, ["autopilot"])) == ["autopilot(hold)"]
    assert names(main_arms([], 3e-4, 1e-3, ["autopilot", "fixed_share"], fixed_share=0.03)) == [
        "autopilot(hold)", "fixed_share(0.03)"]
    with pytest.raises(ValueError, match="fixed_share"):
        main_arms([], 3e-4, 1e-3, ["fixed_share"])
    assert names(main_arms(sel, 3e-4, 1e-3, ["clip_b", "grpo_second_lr"])) == ["clip_b(mu=1.5)", "grpo(lr=0.001)"]
    assert names(main_arms(sel[:2], 3e-4, 1e-3)) == [  # unchanged without families
        "grpo(lr=0.0003)", "ppo(lr=0.001)", "clip_b(mu=1.5)", "grpo(lr=0.001)"]
    with pytest.raises(ValueError):
        main_arms(sel, 3e-4, 1e-3, ["kl_cov"])
    with pytest.raises(ValueError):
        main_arms(sel, 1e-3, 1e-3, ["grpo"])
    seen: list[tuple[RunSpec, list[Arm]]] = []
    monkeypatch.setattr(protocol, "run_stage", lambda spec, arms, out, **kw: seen.append((spec, list(arms))))
    monkeypatch.setattr(protocol, "write_selection", lambda out: {})
    (tmp_path / "sel.json").write_text(json.dumps(sel[2]))
    protocol.main(["main", "--selection", str(tmp_path / "sel.json"), "--families", "autopilot,adaptive_bonus",
                   "--grpo-lr", "3e-4", "--ppo-lr", "1e-3", "--seeds", "0/1", "--out", str(tmp_path / "m")])
    protocol.main(["tune-c", "--grpo-lr", "3e-4", "--out", str(tmp_path / "c")])
    autopilot_runs = tmp_path / "autopilot_tuning.jsonl"
    autopilot_runs.write_text("".join(json.dumps({"arm": "autopilot(hold)", "seed": s, "records": [
        {"autopilot_dropped_frac": f}]}) + "\n" for s, f in ((100, 0.02), (101, 0.04))))
    protocol.main(["main", "--families", "fixed_share", "--fixed-share-from", str(autopilot_runs),
                   "--grpo-lr", "3e-4", "--ppo-lr", "1e-3", "--seeds", "0/1", "--out", str(tmp_path / "f")])
    assert [(a.name, a.share) for a in seen.pop()[1]] == [("fixed_share(0.03)", pytest.approx(0.03))]
    (spec_m, arms_m), (spec_c, arms_c) = seen
    assert names(arms_m) == ["adaptive_bonus(target=0.6)", "autopilot(hold)"] and spec_m.prompt_set == "test"
    assert arms_m[1].lr == 3e-4 and arms_m[0].lr == 3e-4
    assert names(arms_c) == names(adaptive_bonus_arms(3e-4)) and spec_c.prompt_set == "val"
    assert spec_c.seeds == (100, 101, 102)


def test_autopilot_gain_recovers_a_known_gain() -> None:
    """Synthetic records whose realised change is g · predicted + noise: the estimate's interval holds g, the
    correlation is positive, and a wrong arm or an arm without autopilot records is refused by name."""
    gen = torch.Generator().manual_seed(3)
    g_true, runs = 3.0e4, []
    for seed in range(8):
        pred = (torch.randn(120, generator=gen, dtype=torch.float64) * 1e-6).tolist()
        h = [0.7]
        for x in pred[:-1]:
            h.append(h[-1] + g_true * x + 0.01 * torch.randn((), generator=gen, dtype=torch.float64).item())
        runs.append({"arm": "autopilot(hold)", "seed": seed, "records": [
            {"autopilot_predicted_dh": x, "autopilot_entropy": e} for x, e in zip(pred, h)]})
    out = protocol.autopilot_gain(runs, "autopilot(hold)", n_boot=400)
    assert out["n"] == 8 * 119 and out["seeds"] == 8
    assert out["g_lo"] < g_true < out["g_hi"] and abs(out["g"] / g_true - 1) < 0.1 and out["corr"] > 0.5
    with pytest.raises(ValueError, match="no run of arm 'x'"):
        protocol.autopilot_gain(runs, "x")
    with pytest.raises(ValueError, match="no autopilot records"):
        protocol.autopilot_gain([{"arm": "grpo", "seed": 0, "records": [{"entropy": 0.5}]}], "grpo")


def test_autopilot_trace_summarises_hand_built_records() -> None:
    """Two seeds of three steps, numbers chosen by hand: every summary equals its value worked out here, a step
    missing from one run is left out of the entropy rows, and a wrong arm or an arm without records is refused."""
    def rec(step: int, h: float, drop: float, pred: float, tgt: float) -> dict[str, float]:
        return {"step": step, "entropy": h + 0.01, "autopilot_entropy": h, "autopilot_target_entropy": 0.7,
                "autopilot_dropped_frac": drop, "autopilot_predicted_dh": pred, "autopilot_target_dh": tgt}

    runs = [
        {"arm": "autopilot(hold)", "seed": 0, "records": [rec(1, 0.70, 0.0, 1e-7, 0.0), rec(2, 0.66, 0.05, 1e-7, 0.02),
                                                          rec(3, 0.68, 0.0495, -1e-7, 0.01)]},
        {"arm": "autopilot(hold)", "seed": 1, "records": [rec(1, 0.72, 0.01, 0.0, 0.0), rec(2, 0.70, 0.03, 0.0, 0.01)]},
        {"arm": "grpo", "seed": 0, "records": [{"step": 1, "entropy": 0.5}, {"step": 2, "entropy": 0.4}]},
    ]
    out = protocol.autopilot_trace(runs, "autopilot(hold)", cap=0.05, steps=(1, 2, 3))
    assert out["seeds"] == 2 and out["steps"] == 5 and out["target"] == pytest.approx(0.7)
    assert out["entropy"] == pytest.approx({1: 0.71, 2: 0.68})  # step 3 is not in seed 1's run
    assert out["dropped"] == pytest.approx((0.05 + 0.0495 + 0.01 + 0.03) / 5)
    assert out["at_cap"] == pytest.approx(2 / 5)  # 0.05 and 0.0495 are within tol of the cap
    assert out["met"] == pytest.approx(2 / 5)  # seed 0 step 1 (1e-7 >= 0) and seed 1 step 1 (0 >= 0)
    assert out["arm_entropy"]["grpo"] == pytest.approx({1: 0.5, 2: 0.4})
    assert out["arm_entropy"]["autopilot(hold)"] == pytest.approx({1: 0.72, 2: 0.69})
    with pytest.raises(ValueError, match="no run of arm 'x'"):
        protocol.autopilot_trace(runs, "x", cap=0.05)
    with pytest.raises(ValueError, match="no autopilot records"):
        protocol.autopilot_trace(runs, "grpo", cap=0.05)


def test_main_runs_a_setting_an_extension_added(tmp_path: Path) -> None:
    """A chosen setting that only a grid extension ran (e.g. PPO + Clip_V at mu 0.5, below the first grid) is in no
    grid function: the main run takes it from the tuning records beside the selection (``tuned_arms``), exactly as it
    ran, and refuses a chosen name found nowhere, or a record that contradicts the grid."""
    first = next(a for a in stage_b(1e-4, 1e-4) if a.name == "ppo+clip_v(mu=1.5,cap=0.02)")
    extended = replace(first, name="ppo+clip_v(mu=0.5,cap=0.02)", mu=0.5)
    stage = tmp_path / "stage_b"
    (stage / "extend1").mkdir(parents=True)
    append_jsonl(stage / "runs.jsonl", [_tuning_run(first, s, 0.5) for s in (100, 101)])
    append_jsonl(stage / "extend1" / "runs.jsonl", [_tuning_run(extended, s, 0.9) for s in (100, 101)])
    sel = {"ppo+clip_v": {"chosen": extended.name}}
    (stage / "selection.json").write_text(json.dumps(sel))
    tuned = tuned_arms(stage / "selection.json")
    assert sorted(a.name for a in tuned) == sorted([first.name, extended.name])
    assert main_arms([sel], 1e-4, 1e-4, ["ppo+clip_v"], tuned=tuned) == [extended]
    with pytest.raises(ValueError, match="in no grid and in no tuning record"):
        main_arms([sel], 1e-4, 1e-4, ["ppo+clip_v"])
    with pytest.raises(ValueError, match="ran as"):
        main_arms([sel], 1e-4, 1e-4, ["ppo+clip_v"], tuned=[replace(first, mu=2.0)])


@settings(max_examples=6, deadline=None)
@given(n_prompts=st.integers(1, 9), samples=st.integers(1, 40), chunk=st.integers(1, 70), scale=st.floats(0.5, 4.0),
       temperature=st.sampled_from([0.7, 1.0]), stream=st.integers(0, 10_000))
def test_batched_evaluation_draws_what_the_chunked_loop_draws(n_prompts: int, samples: int, chunk: int, scale: float,
                                                              temperature: float, stream: int) -> None:
    """The GPU path's evaluation (one forward over every row per token) reproduces the chunked loop's draws exactly,
    with chunk sizes that do not divide the rows, on random models (scaled weights: flat to peaked rows)."""
    cfg = parse_config("n_numbers=3,d_model=16,n_layers=1")
    torch.manual_seed(stream)
    model = TinyGPT(cfg.model_config())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    task = cfg.task()
    x, t = heldout_sets(task, n_prompts, 1)[0]
    rows = task.prompts(x, t).repeat_interleave(samples, 0)
    gen = torch.Generator().manual_seed(stream)
    chunked = torch.cat([model.generate(rows[s : s + chunk], task.response_len, temperature=temperature, generator=gen)
                         for s in range(0, len(rows), chunk)])
    gen_b = torch.Generator().manual_seed(stream)
    batched = headtohead._generate_in_chunk_order(model, rows, task.response_len, temperature, gen_b, chunk)
    assert torch.equal(batched, chunked)
    assert torch.equal(gen_b.get_state(), gen.get_state())


def test_run_spec_refuses_a_device_it_cannot_use() -> None:
    cfg = parse_config("n_numbers=3,d_model=16,n_layers=1")
    with pytest.raises(ValueError, match="device"):
        RunSpec(cfg, (0,), (0, 1), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            RunSpec(cfg, (0,), (0, 1), device="cuda")
