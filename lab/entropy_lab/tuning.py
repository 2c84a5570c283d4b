"""Equal-budget tuning grids of the head-to-head and the pre-registered selection rule.

Every family gets :data:`SETTINGS_PER_FAMILY` settings.  Stage A tunes the learning rate of the two estimators (GRPO,
PPO); stage B tunes every other family at its estimator's stage-A learning rate.  Tuning runs use the tuning seeds and
the validation prompts only (:func:`entropy_lab.protocol.run_stage` with ``prompt_set="val"``).
The autopilot evaluation (docs/reproduction/autopilot_eval) adds stage C, TRL's adaptive entropy bonus
(:func:`adaptive_bonus_arms`, four settings at the stage-A GRPO rate), and the entropy autopilot, which is not tuned
(:func:`autopilot_arms`: one default setting).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from .rl import Arm
from .stats_tests import value_at_level

SETTINGS_PER_FAMILY = 4
LRS = (1e-4, 3e-4, 1e-3, 3e-3)


def stage_a() -> list[Arm]:
    """GRPO and PPO at each learning rate of :data:`LRS`."""
    return [Arm(f"grpo(lr={lr:g})", "grpo", lr=lr) for lr in LRS] + [
        Arm(f"ppo(lr={lr:g})", "ppo", estimator="ppo", baseline="ppo", lr=lr) for lr in LRS
    ]


def stage_b(grpo_lr: float, ppo_lr: float) -> list[Arm]:
    """Every other family, four settings each, at the stage-A learning rate of its estimator.

    Clip-Cov's and KL-Cov's ratios reach the 2-5% token shares that Clip_B (mu 1.5) acted on in the pilot (3.9%);
    Clip-Cov's 0.02 is also tried with PPO's ratio clip effectively off (``clip_low = 1``: lower bound 0,
    ``clip_high = 1e9``) next to eps = 0.2."""
    g = dict(lr=grpo_lr)
    p = dict(lr=ppo_lr, estimator="ppo", baseline="ppo")
    arms = [Arm(f"clip_b(mu={m:g})", "clip_b", mask="clip_b", mu=m, **g) for m in (1.0, 1.5, 2.0, 2.5)]
    arms += [Arm(f"clip_v(mu={m:g},cap={c})", "clip_v", mask="clip_v", mu=m, cap=c, **g)
             for m in (1.5, 2.5) for c in (None, 0.02)]
    arms += [Arm(f"clip_cov(ratio={r:g})", "clip_cov", loss="clip_cov", cov_ratio=r, **g) for r in (2e-4, 5e-3, 2e-2)]
    arms += [Arm("clip_cov(ratio=0.02,eps=off)", "clip_cov", loss="clip_cov", cov_ratio=2e-2, clip_low=1.0,
                 clip_high=1e9, **g)]
    arms += [Arm(f"kl_cov(ratio={r:g},coef={c:g})", "kl_cov", loss="kl_cov", cov_ratio=r, kl_coef=c, **g)
             for r in (2e-3, 2e-2) for c in (1.0, 5.0)]
    arms += [Arm(f"forking(rho={r:g})", "forking_tokens", mask="forking", rho=r, **g) for r in (0.1, 0.2, 0.5, 0.8)]
    arms += [Arm(f"entropy_bonus(c={c:g})", "entropy_bonus", entropy_coef=c, **g) for c in (1e-3, 3e-3, 1e-2, 3e-2)]
    arms += [Arm(f"unlikely(pen={x:g})", "unlikely", shaping="unlikely", rank_penalty=x, **g) for x in (0.1, 0.25, 0.5, 1.0)]
    arms += [Arm(f"ppo+clip_b(mu={m:g})", "ppo+clip_b", mask="clip_b", mu=m, **p) for m in (1.0, 1.5, 2.0, 2.5)]
    arms += [Arm(f"ppo+clip_v(mu={m:g},cap={c})", "ppo+clip_v", mask="clip_v", mu=m, cap=c, **p)
             for m in (1.5, 2.5) for c in (None, 0.02)]
    return arms


def autopilot_arms(grpo_lr: float, calibrate_every: int = 0) -> list[Arm]:
    """The entropy autopilot, evaluated untuned: its one default setting, holding the starting entropy, at the
    stage-A GRPO learning rate (``eta`` = that rate; the core's cap 0.05 and sides ``negative``), its cheap score
    calibrated every ``calibrate_every`` RL steps (0: not calibrated; :class:`~entropy_lab.rl.Arm`)."""
    return [Arm("autopilot(hold)", "autopilot", mask="autopilot", lr=grpo_lr, calibrate_every=calibrate_every)]


def fixed_share_arm(grpo_lr: float, share: float) -> Arm:
    """The control for the autopilot: the same candidates in the same order at a constant ``share`` (the
    autopilot's mean dropped share over the tuning runs, :func:`mean_autopilot_share`), untuned like the autopilot."""
    return Arm(f"fixed_share({share:.3g})", "fixed_share", mask="fixed_share", share=share, lr=grpo_lr)


def mean_autopilot_share(runs: Sequence[dict], arm: str = "autopilot(hold)") -> float:
    """The mean over ``arm``'s runs and their RL steps of ``autopilot_dropped_frac`` (the share the autopilot
    dropped), refused by name when no run of ``arm`` records it."""
    shares = [r["autopilot_dropped_frac"] for run in runs if run.get("arm") == arm for r in run.get("records", [])
              if "autopilot_dropped_frac" in r]
    if not shares:
        raise ValueError(f"no run of arm {arm!r} records autopilot_dropped_frac")
    return sum(shares) / len(shares)


#: Adaptive bonus targets below the start's token entropy (nats): the targets are ``start - offset``.
ADAPTIVE_TARGET_OFFSETS = (0.2, 0.1, 0.05, 0.0)


def adaptive_bonus_arms(grpo_lr: float, start_entropy: float = 0.70) -> list[Arm]:
    """TRL's adaptive entropy bonus (Skywork-OR1, ``use_adaptive_entropy``) with TRL's defaults (initial coefficient
    0, delta 0.005, coefficient in [0, 1]), :data:`SETTINGS_PER_FAMILY` settings (equal budget): ``entropy_target`` =
    ``start_entropy`` minus each of :data:`ADAPTIVE_TARGET_OFFSETS`, rounded to 3 decimals (the main run's token
    entropy starts at about 0.70 nats and GRPO ends at about 0.50: targets 0.5, 0.6, 0.65 and 0.7)."""
    targets = [round(start_entropy - d, 3) for d in ADAPTIVE_TARGET_OFFSETS]
    return [Arm(f"adaptive_bonus(target={t:g})", "adaptive_bonus", adaptive_entropy=True, entropy_coef=0.0,
                entropy_target=t, lr=grpo_lr) for t in targets]


def tuning_score(runs: Sequence[dict], temperature: float = 0.7, delta: float = 0.04, k: int = 64) -> float:
    """Pre-registered tuning endpoint of one setting: mean over its tuning seeds of Pass@``k`` where Avg@K first
    reaches (start Avg@K + ``delta``) at ``temperature`` (:func:`~entropy_lab.stats_tests.value_at_level`);
    ``nan`` unless every seed reaches that level (a setting that does not train is not eligible)."""
    vals = []
    for run in runs:
        cps = run["checkpoints"]
        avgs = [c[f"T{temperature}"]["avg"] for c in cps]
        vals.append(value_at_level(avgs, [c[f"T{temperature}"]["pass"][str(k)] for c in cps], avgs[0] + delta))
    return sum(vals) / len(vals) if vals and all(math.isfinite(v) for v in vals) else math.nan


def select(runs: Sequence[dict]) -> dict[str, dict[str, object]]:
    """Per family, the setting with the highest :func:`tuning_score` at delta 0.04; if no setting of the family
    reaches it on every seed, the highest score at delta 0.02; if none reaches that either, ``None``.  Ties go to
    the lexicographically first setting name.  Returns
    ``{family: {"chosen": name or None, "rule": ..., "scores": {name: {"d0.04", "d0.02", "control_frac"}}}}``."""
    fams: dict[str, dict[str, list[dict]]] = {}
    for r in runs:
        fams.setdefault(r["family"], {}).setdefault(r["arm"], []).append(r)
    out: dict[str, dict[str, object]] = {}
    for fam, settings in sorted(fams.items()):
        scores = {}
        for name, rs in sorted(settings.items()):
            recs = [x for r in rs for x in r["records"]]
            scores[name] = {"d0.04": tuning_score(rs, delta=0.04), "d0.02": tuning_score(rs, delta=0.02),
                            "control_frac": sum(x["control_frac"] for x in recs) / max(len(recs), 1)}
        chosen, rule = None, "no setting reached start + 0.02 on every tuning seed"
        for key in ("d0.04", "d0.02"):
            ok = {n: s[key] for n, s in scores.items() if math.isfinite(s[key])}
            if ok:
                chosen, rule = max(ok, key=ok.__getitem__), f"best Pass@64 at start + {key[1:]} (T = 0.7)"
                break
        out[fam] = {"chosen": chosen, "rule": rule, "scores": scores}
    return out


LR_LADDER = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
MU_LADDER = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)
#: Where a family's grid grows when its chosen setting lies at an edge: ``family -> ((field, label in the setting's
#: name, ladder), ...)``, one entry per axis.  ``None`` as the ladder: steps of :data:`TARGET_STEP` (the adaptive
#: bonus's entropy target, kept >= 0).  Clip_V's cap and the autopilot are not tuned along a ladder.
LADDERS: dict[str, tuple[tuple[str, str, tuple[float, ...] | None], ...]] = {
    "grpo": (("lr", "lr", LR_LADDER),),
    "ppo": (("lr", "lr", LR_LADDER),),
    "clip_b": (("mu", "mu", MU_LADDER),),
    "ppo+clip_b": (("mu", "mu", MU_LADDER),),
    "clip_v": (("mu", "mu", MU_LADDER),),
    "ppo+clip_v": (("mu", "mu", MU_LADDER),),
    "clip_cov": (("cov_ratio", "ratio", (5e-5, 2e-4, 1e-3, 5e-3, 2e-2, 5e-2, 1e-1)),),
    "kl_cov": (("cov_ratio", "ratio", (2e-4, 2e-3, 2e-2, 1e-1)), ("kl_coef", "coef", (0.2, 1.0, 5.0, 25.0))),
    "forking_tokens": (("rho", "rho", (0.05, 0.1, 0.2, 0.5, 0.8, 1.0)),),
    "entropy_bonus": (("entropy_coef", "c", (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)),),
    "unlikely": (("rank_penalty", "pen", (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)),),
    "adaptive_bonus": (("entropy_target", "target", None),),
}
TARGET_STEP = 0.05


def _beyond(value: float, edge: str, ladder: tuple[float, ...] | None) -> float | None:
    """The next value past ``value`` on ``ladder`` toward ``edge`` (``"low"`` / ``"high"``); None at its end."""
    if ladder is None:
        nxt = round(value + (TARGET_STEP if edge == "high" else -TARGET_STEP), 6)
        return nxt if nxt >= 0 else None
    i = min(range(len(ladder)), key=lambda j: abs(math.log(ladder[j] / value)))  # value's rung
    j = i + 1 if edge == "high" else i - 1
    return ladder[j] if 0 <= j < len(ladder) else None


def grid_extensions(runs: Sequence[dict], selection: dict[str, dict[str, object]]) -> list[Arm]:
    """The settings that grow each family's grid where its chosen setting lies at an edge.

    For a family of :data:`LADDERS` with a chosen setting, on each axis: if the chosen value is the smallest (largest)
    value of that field among the family's settings in ``runs`` and more than one value was tried, the next rung of
    the ladder below (above) it, every other field as in the chosen setting.  A rung already tried, or past the
    ladder's end, adds nothing.  Tuning repeats tune -> select -> extend until this is empty, so every chosen setting
    is interior on every axis or at a ladder's end (reported).  ``runs``: a stage's records (``arm_spec`` = the arm's
    fields)."""
    arms = {r["arm"]: Arm(**r["arm_spec"]) for r in runs}
    out: list[Arm] = []
    for fam, sel in sorted(selection.items()):
        name = sel.get("chosen")
        if not name or fam not in LADDERS:
            continue
        chosen = arms[str(name)]
        tried = [a for a in arms.values() if a.family == fam]
        for field, label, ladder in LADDERS[fam]:
            values = sorted({getattr(a, field) for a in tried})
            here = getattr(chosen, field)
            if len(values) < 2 or values[0] < here < values[-1]:
                continue
            nxt = _beyond(here, "low" if here == values[0] else "high", ladder)
            if nxt is None:
                continue
            new_name = str(name).replace(f"{label}={here:g}", f"{label}={nxt:g}", 1)
            if new_name == name:
                raise ValueError(f"setting {name!r} does not name its {field} as {label}={here:g}")
            if new_name not in arms and all(a.name != new_name for a in out):
                out.append(replace(chosen, name=new_name, **{field: nxt}))
    return out


def second_lr(selected: float) -> float:
    """The frontier's second GRPO learning rate: the grid neighbour above the selected one (below for the largest);
    the grid is :data:`LRS`, or :data:`LR_LADDER` for a rate an extension of the grid chose."""
    grid = LRS if selected in LRS else LR_LADDER
    i = grid.index(selected)
    return grid[i + 1] if i + 1 < len(grid) else grid[i - 1]


__all__ = [
    "ADAPTIVE_TARGET_OFFSETS", "LADDERS", "LRS", "SETTINGS_PER_FAMILY", "adaptive_bonus_arms", "autopilot_arms",
    "fixed_share_arm", "grid_extensions", "mean_autopilot_share", "second_lr", "select", "stage_a", "stage_b",
    "tuning_score",
]
