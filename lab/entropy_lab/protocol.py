"""``python -m entropy_lab.protocol``: the pre-registered head-to-head protocol.

Stages (each a subcommand; every job's result is appended to a JSON-lines file as it lands, so a run cut off keeps
what it finished):

* ``warm-sweep``: candidate warm starts (model size x warm-up length), each evaluated at several warm-up step counts
  on the test prompts at every evaluation temperature (how the start was chosen);
* ``run``: warm up each seed once, then every (seed, arm) with checkpoint evaluations (the tuning stage runs it on the
  tuning seeds and validation prompts, the main run on the evaluation seeds and test prompts);
* ``tune-a`` / ``tune-b`` / ``tune-c``: the tuning stages (:mod:`~entropy_lab.tuning`; ``tune-c``:
  TRL's adaptive entropy bonus) on the tuning seeds and validation prompts, then ``select``;
* ``extend``: grow a tuning stage's grids where the chosen setting lies at an edge, until it is interior;
* ``seeds``: the main run's seed count from the tuning runs' paired spread (:func:`seed_count`);
* ``main``: the selected arms on the evaluation seeds and test prompts (``--families`` restricts them; the family
  ``autopilot`` adds the entropy autopilot's one default setting, which is not tuned; ``fixed_share`` its control,
  a constant share equal to the autopilot's mean share in tuning, ``--fixed-share-from``);
* ``report``: endpoints, paired tests with Holm's adjustment, the frontier figure, from a ``run`` folder;
* ``warm``: only warm up seeds into a ``--warm-cache`` (for a later stage of the same configuration);
* ``autopilot-gain``: how the realised entropy change follows the autopilot's prediction (:func:`autopilot_gain`).
* ``autopilot-trace``: what the autopilot's controller did, step by step, averaged over seeds (:func:`autopilot_trace`).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from entropy_discriminator.autopilot import DEFAULT_MAX_FRAC as AUTOPILOT_MAX_FRAC
from entropy_discriminator.demo.model import TinyGPT
from entropy_discriminator.demo.report import save_figure

from .compare import CompareConfig, _pool_map
from .headtohead import HeadConfig, eval_stream, evaluate_at, heldout_sets, run_arm_checkpoints
from .equivalence import detectable_difference, equivalence_margin, seeds_for_difference, seeds_for_equivalence, tost
from .records import append_jsonl, load_jsonl, round_floats
from .rl import Arm, warm_up
from .stats_tests import holm, paired_test, value_at_level
from .tuning import (
    adaptive_bonus_arms,
    autopilot_arms,
    fixed_share_arm,
    grid_extensions,
    mean_autopilot_share,
    second_lr,
    select,
    stage_a,
    stage_b,
)

#: Evaluation temperatures: the paper's (0.7, primary) and the sampling temperature of training (1.0).
TEMPERATURES = (0.7, 1.0)


def parse_config(spec: str, base: HeadConfig | None = None) -> HeadConfig:
    """``"d_model=128,n_layers=4,warmup_lr=1e-3"`` -> ``replace(base, ...)`` with each value cast to the field's
    type (ints, floats; ``seeds`` as ``0/1/2``)."""
    base = base or HeadConfig()
    types = {f.name: type(getattr(base, f.name)) for f in fields(base)}
    kw: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ValueError(f"config: expected FIELD=VALUE with FIELD in {sorted(types)}, got {item!r}")
        kw[key] = tuple(int(v) for v in value.split("/")) if key == "seeds" else types[key](float(value)) if types[key] is int else types[key](value)
    return replace(base, **kw)


def parse_arm(spec: str) -> Arm:
    """``"NAME[@FAMILY]:FIELD=V,..."`` -> :class:`Arm` (family defaults to NAME; ``cap=none`` for no cap,
    ``target_entropy=hold`` or a number, booleans as ``true`` / ``false``)."""
    head, _, body = spec.partition(":")
    name, _, family = head.partition("@")
    types = {f.name: f.type for f in fields(Arm)}
    kw: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in types or key in ("name", "family"):
            raise ValueError(f"arm {name}: expected FIELD=VALUE with FIELD in {sorted(types)}, got {item!r}")
        default = getattr(Arm(name="x", family="x"), key)
        if isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"arm {name}: {key} must be true or false, got {value!r}")
            kw[key] = value.lower() in ("true", "1")
        elif key == "target_entropy":
            kw[key] = value if value == "hold" else float(value)
        elif isinstance(default, str):
            kw[key] = value
        elif key == "cap":
            kw[key] = None if value.lower() == "none" else float(value)
        elif isinstance(default, int):
            kw[key] = int(value)
        else:
            kw[key] = float(value)
    return Arm(name=name, family=family or name, **kw)


def _append(path: Path, row: dict[str, object]) -> None:
    """Append one record, its floats at :data:`~entropy_lab.records.RECORD_DIGITS` significant digits, so that a
    selection made on the machine reads exactly the numbers that are committed."""
    append_jsonl(path, [round_floats(row)])


# ------------------------------------------------------------------------------------------------ warm-up sweep


def _warm_sweep_job(job: tuple[str, CompareConfig, int, tuple[int, ...], int, int, str]) -> dict[str, object]:
    """Warm up one (candidate, seed) to the largest step count, evaluating on the test prompts at each step count."""
    name, cfg, seed, at_steps, n_prompts, samples, sink = job
    torch.set_num_threads(1)
    task = cfg.task()
    test, _ = heldout_sets(task, n_prompts, 1)
    t0 = time.perf_counter()

    def on_step(step: int, state: dict[str, torch.Tensor]) -> None:
        model = TinyGPT(cfg.model_config())
        model.load_state_dict(state)
        for temp in TEMPERATURES:
            ev = evaluate_at(model, task, test, samples=samples, temperature=temp, stream=10_000 + seed)
            _append(Path(sink), {"candidate": name, "seed": seed, "step": step, "temperature": temp, "avg": ev["avg"],
                                 "pass": ev["pass"], "seconds": time.perf_counter() - t0, "config": asdict(cfg)})

    warm_up(replace(cfg, warmup_steps=max(at_steps)), seed, at_steps=at_steps, on_step=on_step)
    return {"candidate": name, "seed": seed, "seconds": time.perf_counter() - t0}


def warm_sweep(candidates: dict[str, CompareConfig], seeds: Sequence[int], at_steps: tuple[int, ...], out: Path, *,
               jobs: int, n_prompts: int = 200, samples: int = 64, log: Callable[[str], None] = print) -> Path:
    """Every (candidate, seed): the start at each of ``at_steps`` warm-up steps, on ``n_prompts`` test prompts x
    ``samples`` samples at each of :data:`TEMPERATURES`; rows appended to ``out/warm_sweep.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    sink = out / "warm_sweep.jsonl"
    work = [(name, cfg, s, at_steps, n_prompts, samples, str(sink)) for name, cfg in candidates.items() for s in seeds]
    _pool_map(_warm_sweep_job, work, jobs, log, lambda r: log(f"  {r['candidate']} seed {r['seed']}: {r['seconds']:.0f} s"))
    return sink


# ------------------------------------------------------------------------------------------------- run stage


@dataclass(frozen=True)
class RunSpec:
    """One ``run`` stage: the config, its seeds, the checkpoints (RL step counts, 0 = the start), the prompt set
    (``test`` or ``val``, :func:`~entropy_lab.headtohead.heldout_sets`) and its size."""

    cfg: HeadConfig
    seeds: tuple[int, ...]
    checkpoints: tuple[int, ...]
    prompt_set: str = "test"
    n_prompts: int = 200
    samples: int = 64
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.prompt_set not in ("test", "val"):
            raise ValueError(f"prompt_set must be 'test' or 'val', got {self.prompt_set!r}")
        if self.device != "cpu" and not (self.device.startswith("cuda") and torch.cuda.is_available()):
            raise ValueError(f"device must be 'cpu' or, on a machine with CUDA, 'cuda[:N]'; got {self.device!r}")
        if len(self.checkpoints) < 2 or sorted(set(self.checkpoints)) != list(self.checkpoints) or self.checkpoints[0] < 0:
            raise ValueError(f"checkpoints must be >= 2 increasing step counts >= 0, got {self.checkpoints}")

    def prompts(self) -> tuple[torch.Tensor, torch.Tensor]:
        test, val = heldout_sets(self.cfg.task(), self.n_prompts, self.n_prompts)
        return test if self.prompt_set == "test" else val

    def evaluate(self, model: TinyGPT, seed: int, checkpoint: int) -> dict[str, object]:
        """``{"T0.7": {"avg", "pass"}, "T1.0": ...}`` at :data:`TEMPERATURES` (per-prompt counts dropped)."""
        out = {}
        for temp in TEMPERATURES:
            ev = evaluate_at(model, self.cfg.task(), self.prompts(), samples=self.samples, temperature=temp,
                             stream=eval_stream(seed, checkpoint, temp), batched=self.device != "cpu")
            out[f"T{temp}"] = {"avg": ev["avg"], "pass": ev["pass"]}
        return out


def save_warm_start(cfg: CompareConfig, seed: int, path: str) -> tuple[dict[str, torch.Tensor], float]:
    """Warm up ``seed`` on one thread (:func:`entropy_lab.rl.warm_up`), save the state dict to ``path``; returns
    ``(state, seconds)``."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    state = warm_up(cfg, seed)
    torch.save(state, path)
    return state, time.perf_counter() - t0


def warm_cache_path(cache: Path, cfg: CompareConfig, seed: int) -> Path:
    """``cache/<key>/seed{seed}.pt``: ``key`` hashes every field of ``cfg`` and the torch version, so that a warm
    start is reused only by a stage of the same configuration on the same torch build (a warm-up depends on both)."""
    blob = json.dumps({"cfg": asdict(cfg), "torch": torch.__version__}, sort_keys=True, default=str)
    return cache / hashlib.sha1(blob.encode()).hexdigest()[:16] / f"seed{seed}.pt"


def cached_warm_start(cfg: CompareConfig, seed: int, cache: Path) -> tuple[Path, float]:
    """``(path, seconds)``: ``seed``'s warm start in ``cache`` (:func:`warm_cache_path`), warmed up now
    (:func:`save_warm_start`, ``seconds`` > 0) unless it is there already (``seconds`` 0).  A new file appears whole
    (written aside, then renamed), so a stage reading the cache meanwhile never sees a partial one."""
    path = warm_cache_path(cache, cfg, seed)
    if path.exists():
        return path, 0.0
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    _, seconds = save_warm_start(cfg, seed, str(partial))
    os.replace(partial, path)
    return path, seconds


def _warm_job(job: tuple[RunSpec, int, str, str | None]) -> dict[str, object]:
    spec, seed, path, cache = job
    torch.set_num_threads(1)  # as save_warm_start: one thread per pool process, on the cache-hit path too
    if cache:
        cached, seconds = cached_warm_start(spec.cfg, seed, Path(cache))
        shutil.copyfile(cached, path)
        state = torch.load(path, weights_only=True)
    else:
        cached, (state, seconds) = None, save_warm_start(spec.cfg, seed, path)
    model = TinyGPT(spec.cfg.model_config())
    model.load_state_dict(state)
    row = {"seed": seed, "warmup_seconds": seconds, "start": spec.evaluate(model, seed, 0)}
    return {**row, "warm_reused_from": str(cached)} if seconds == 0.0 and cached is not None else row


def _fill_job(job: tuple[CompareConfig, int, str]) -> dict[str, object]:
    cfg, seed, cache = job
    path, seconds = cached_warm_start(cfg, seed, Path(cache))
    return {"seed": seed, "warmup_seconds": seconds, "path": str(path)}


def fill_warm_cache(cfg: CompareConfig, seeds: Sequence[int], cache: Path, *, jobs: int,
                    log: Callable[[str], None] = print) -> list[dict[str, object]]:
    """Warm up each seed into ``cache`` (:func:`warm_cache_path`) and nothing else, so that a later stage of the same
    configuration starts its runs at once (:func:`cached_warm_start`; a seed already there is left as it is)."""
    return _pool_map(_fill_job, [(cfg, s, str(cache)) for s in seeds], jobs, log,
                     lambda r: log(f"  seed {r['seed']}: {r['warmup_seconds']:.0f} s"))


def _arm_job(job: tuple[RunSpec, Arm, int, str]) -> dict[str, object]:
    spec, arm, seed, path = job
    torch.set_num_threads(1)
    if spec.device != "cpu":  # deterministic CUDA kernels: a run depends only on its seed, arm and platform
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    state = torch.load(path, weights_only=True)
    trace = run_arm_checkpoints(state, spec.cfg, arm, seed, spec.checkpoints,
                                lambda step, model: spec.evaluate(model, seed, spec.checkpoints.index(step)),
                                device=torch.device(spec.device))
    return {**asdict(trace), "arm_spec": asdict(arm)}


def run_stage(spec: RunSpec, arms: Sequence[Arm], out: Path, *, jobs: int, log: Callable[[str], None] = print,
              warm_cache: Path | None = None) -> Path:
    """Warm up every seed (``out/warm/seed*.pt``; the start's evaluation in ``out/starts.jsonl``), then run every
    (seed, arm) with its checkpoint evaluations (one JSON line per run in ``out/runs.jsonl``); ``out/meta.json``
    records the spec, the arms, the software and the machine.

    ``warm_cache``: a folder shared by the stages of one set-up; a seed's warm start found there
    (:func:`warm_cache_path`: same configuration, same torch build) is copied instead of warmed up again, and a new
    one is stored there.  A warm-up is deterministic given its seed and configuration on one software and hardware
    stack, so reusing it does not change a run; ``starts.jsonl`` marks reused starts (``warm_reused_from``)."""
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "warm").mkdir(exist_ok=True)
    meta = {"spec": asdict(spec), "arms": [asdict(a) for a in arms], "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "jobs": jobs,
            "cuda": torch.cuda.get_device_name(torch.device(spec.device)) if spec.device != "cpu" else None,
            "warm_cache": None if warm_cache is None else str(warm_cache)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    t0 = time.perf_counter()
    log(f"run: {len(spec.seeds)} seeds x {len(arms)} arms, checkpoints {spec.checkpoints}, {spec.prompt_set} prompts")
    cache = str(warm_cache) if warm_cache is not None else None
    _pool_map(_warm_job, [(spec, s, str(out / "warm" / f"seed{s}.pt"), cache) for s in spec.seeds], jobs, log,
              lambda r: _append(out / "starts.jsonl", r))
    work = [(spec, a, s, str(out / "warm" / f"seed{s}.pt")) for s in spec.seeds for a in arms]
    _pool_map(_arm_job, work, jobs, log, lambda r: _append(out / "runs.jsonl", r))
    meta["wall_seconds"] = time.perf_counter() - t0
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out / "runs.jsonl"


# ------------------------------------------------------------------------------------------ endpoints and report

#: Pre-registered matched-accuracy levels: Avg@K of the seed's own start plus these (at each temperature).
DELTAS = (0.02, 0.04)
ENDPOINT_KS = (16, 64)


def endpoints(run: dict) -> dict[str, float]:
    """Every endpoint of one (arm, seed) run, keyed ``T{T}/{which}/{metric}``: ``which`` = ``d{delta}`` (Pass@K where
    Avg@K first reaches the run's start Avg@K + delta, :func:`value_at_level`; nan if never), ``final`` (last
    checkpoint: Avg@K and Pass@K) and ``best`` (the checkpoint of highest Avg@K: Avg@K and Pass@K there)."""
    out: dict[str, float] = {}
    for temp in TEMPERATURES:
        cps = [c[f"T{temp}"] for c in run["checkpoints"]]
        avgs = [c["avg"] for c in cps]
        best = max(range(len(cps)), key=avgs.__getitem__)
        for k in ENDPOINT_KS:
            passes = [c["pass"][str(k)] for c in cps]
            for d in DELTAS:
                out[f"T{temp}/d{d}/pass@{k}"] = value_at_level(avgs, passes, avgs[0] + d)
            out[f"T{temp}/final/pass@{k}"] = passes[-1]
            out[f"T{temp}/best/pass@{k}"] = passes[best]
        out[f"T{temp}/final/avg"] = avgs[-1]
        out[f"T{temp}/best/avg"] = avgs[best]
    return out


def primary_keys(temperature: float = 0.7) -> list[str]:
    """The pre-registered primary endpoints: Pass@16 and Pass@64 at both matched levels."""
    return [f"T{temperature}/d{d}/pass@{k}" for d in DELTAS for k in ENDPOINT_KS]


def endpoints_by_arm(runs: Sequence[dict]) -> dict[str, dict[int, dict[str, float]]]:
    """``{arm: {seed: endpoints(run)}}`` of every run (:func:`endpoints`)."""
    per: dict[str, dict[int, dict[str, float]]] = {}
    for r in runs:
        per.setdefault(r["arm"], {})[r["seed"]] = endpoints(r)
    return per


def comparisons(runs: Sequence[dict], pairs: Sequence[tuple[str, str]], keys: Sequence[str],
                margin: float | None = None, min_share: float = 0.8) -> list[dict[str, object]]:
    """Paired tests (:func:`paired_test`, seeds where both runs have a finite value) of ``arm - vs`` for every pair and
    key, with Holm's adjustment over exactly these ``len(pairs) * len(keys)`` tests (one family).

    With ``margin``: also the TOST of each difference against ``(-margin, margin)`` (:func:`~.equivalence.tost`),
    its p-values Holm-adjusted over the family on their own (``p_tost``, ``p_tost_holm``), and the ``verdict``:
    ``no claim`` when fewer than ``min_share`` of the pair's seeds reach the endpoint in both arms (paired ``n``),
    else ``better`` / ``worse`` (Holm-adjusted t test at 0.05, by the sign), ``matches`` (Holm-adjusted TOST at
    0.05) or ``inconclusive``."""
    per = endpoints_by_arm(runs)
    rows: list[dict[str, object]] = []
    for arm, vs in pairs:
        seeds = sorted(set(per.get(arm, {})) & set(per.get(vs, {})))
        for key in keys:
            a = [per[arm][s][key] for s in seeds]
            b = [per[vs][s][key] for s in seeds]
            res = paired_test(a, b)
            rows.append({"arm": arm, "vs": vs, "endpoint": key, "diff": res.mean, "ci95": res.ci95, "p": res.p,
                         "n": res.n, "reached": sum(map(math.isfinite, a)), "seeds": len(seeds)})
            if margin is not None:
                rows[-1]["p_tost"] = tost(a, b, margin).p
    for row, adj in zip(rows, holm([float(r["p"]) for r in rows])):
        row["p_holm"] = adj
    if margin is not None:
        for row, adj in zip(rows, holm([float(r["p_tost"]) for r in rows])):
            row["p_tost_holm"] = adj
            differs = row["p_holm"] <= 0.05
            row["verdict"] = ("no claim" if row["n"] < min_share * row["seeds"]
                              else ("better" if row["diff"] > 0 else "worse") if differs
                              else "matches" if adj <= 0.05 else "inconclusive")
    return rows


def seed_count(runs: Sequence[dict], pairs: Sequence[tuple[str, str]], *, detect: float, margin: float,
               tests: int, n_min: int = 10, n_max: int = 40, temperature: float = 0.7) -> dict[str, object]:
    """The main run's seed count from the tuning runs' paired spread (a pre-registration's power rule).

    ``sd`` = the largest standard deviation over seeds of the paired differences ``arm - vs`` over ``pairs`` and the
    primary endpoints (:func:`primary_keys`; seeds where both are finite).  An endpoint finite on fewer than 2 tuning
    seeds has no SD: it is listed under ``undefined`` (with its count of finite seeds) and left out of the maximum;
    ``n = max(n_min, min(n_max, max(n_d, n_e)))`` with ``n_d`` the least seeds whose Holm-first-step test over
    ``tests`` tests detects ``detect`` at 80 % power and ``n_e`` the least whose TOST shows equivalence within
    ``margin`` at 80 % power (:mod:`~entropy_lab.equivalence`).  Also returns every SD, both counts, whether the cap
    bound, and the difference and margin the design reaches at ``n``."""
    if not pairs:
        raise ValueError("pairs: no comparison given")
    per = endpoints_by_arm(runs)
    sds: dict[str, float] = {}
    undefined: dict[str, int] = {}
    for arm, vs in pairs:
        seeds = sorted(set(per.get(arm, {})) & set(per.get(vs, {})))
        for key in primary_keys(temperature):
            d = [per[arm][s][key] - per[vs][s][key] for s in seeds]
            d = [x for x in d if math.isfinite(x)]
            if len(d) < 2:
                undefined[f"{arm} - {vs}: {key}"] = len(d)
            else:
                sds[f"{arm} - {vs}: {key}"] = statistics.stdev(d)
    if not sds:
        raise ValueError(f"pairs: no endpoint is finite on 2 tuning seeds ({undefined})")
    sd = max(sds.values())
    n_d = seeds_for_difference(sd, detect, tests=tests, n_max=100_000)
    n_e = seeds_for_equivalence(sd, margin, n_max=100_000)
    n = max(n_min, min(n_max, max(n_d, n_e)))
    return {"sd": sds, "undefined": undefined, "sd_max": sd, "n_difference": n_d, "n_equivalence": n_e, "n": n,
            "capped": max(n_d, n_e) > n_max, "detectable_at_n": detectable_difference(sd, n, tests=tests), "margin_at_n": equivalence_margin(sd, n)}


#: Families drawn as baselines (black) in the frontier figures: the tuned GRPO and PPO lr and GRPO's second lr.
BASELINE_FAMILIES = ("grpo", "grpo_second_lr", "ppo")


def _frontier_line(rs: Sequence[dict], temperature: float, k: int) -> tuple[list[float], list[float], list[float]]:
    """Mean over seeds of (Avg@K, Pass@k) at each checkpoint, and 1.96 standard errors of Pass@k over seeds."""
    xs, ys, es = [], [], []
    for i in range(min(len(r["checkpoints"]) for r in rs)):
        a = [r["checkpoints"][i][f"T{temperature}"]["avg"] for r in rs]
        p = [r["checkpoints"][i][f"T{temperature}"]["pass"][str(k)] for r in rs]
        m = sum(p) / len(p)
        sd = math.sqrt(sum((v - m) ** 2 for v in p) / (len(p) - 1)) if len(p) > 1 else 0.0
        xs.append(sum(a) / len(a))
        ys.append(m)
        es.append(1.96 * sd / math.sqrt(len(p)))
    return xs, ys, es


def frontier_figure(runs: Sequence[dict], out: Path, temperature: float = 0.7, k: int = 64,
                    prefix: str = "") -> Path | None:
    """``{prefix}frontier_T{T}_pass{k}.png``: per arm, the mean over seeds of (Avg@K, Pass@k) at each checkpoint
    joined in training order, with bars of +-1.96 standard errors of Pass@k over seeds; ``None`` without matplotlib.

    One panel per estimator (arms whose name starts with ``ppo`` on the right, the rest on the left); the
    baselines (families ``grpo`` / ``ppo``) are drawn in black, one line style per learning rate, every other arm
    in a colour of its own.  Dotted verticals: the pre-registered levels, the start's mean Avg@K + 0.02 / + 0.04.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from PIL import Image  # a dependency of matplotlib
    except ImportError:
        return None
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["arm"], []).append(r)
    panels = [[a for a in by if not a.split(":")[-1].startswith("ppo")], [a for a in by if a.split(":")[-1].startswith("ppo")]]
    panels = [arms for arms in panels if arms]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), sharey=True, squeeze=False)
    start = [r["checkpoints"][0][f"T{temperature}"]["avg"] for r in runs]
    level0 = sum(start) / len(start)
    colours = plt.get_cmap("tab10").colors
    for ax, arms in zip(axes[0], panels):
        n_colour = n_base = 0
        for arm in sorted(arms):
            xs, ys, es = _frontier_line(by[arm], temperature, k)
            if by[arm][0]["family"] in BASELINE_FAMILIES:
                style = {"color": "black", "ls": ("-", "--", ":")[min(n_base, 2)], "lw": 2.0, "zorder": 3}
                n_base += 1
            else:
                style = {"color": colours[n_colour % len(colours)], "ls": "-", "lw": 1.2}
                n_colour += 1
            ax.errorbar(xs, ys, yerr=es, marker="o", ms=3, capsize=2, elinewidth=0.8, label=arm, **style)
        for d in (0.02, 0.04):
            ax.axvline(level0 + d, color="grey", ls=":", lw=0.8)
        ax.set_xlabel(f"Avg@K (T = {temperature})")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"Pass@{k} (T = {temperature})")
    fig.suptitle(f"accuracy-diversity frontier over checkpoints (mean over {len(start) // max(len(by), 1)} seeds, "
                 "bars 95%)\ndotted: start + 0.02 / + 0.04", fontsize=10)
    path = out / f"{prefix}frontier_T{temperature}_pass{k}.png"
    buf = io.BytesIO()
    save_figure(fig, buf, dpi=120)
    # line plots keep their look in 256 colours at a third of the RGBA file's size (the records travel with the repo)
    Image.open(buf).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path


def report(run_dir: Path, pairs: Sequence[tuple[str, str]], name: str = "report",
           runs_files: Sequence[Path] = (), margin: float | None = None) -> str:
    """``{name}.md`` and ``{name}.json`` under ``run_dir``: the primary family at T = 0.7 (Holm over it), the
    same endpoints at T = 1.0 and the secondary endpoints (each its own Holm family), and the frontier figures of
    the pairs' arms (:func:`frontier_figure`, files prefixed ``{name}_`` unless ``name`` is ``"report"``); from
    ``runs_files`` read in order (default ``run_dir/runs.jsonl``; plain or compressed, :mod:`.records`).  With
    ``margin``, each table adds the TOST p-value (Holm-adjusted) and the verdict of :func:`comparisons`."""
    runs = load_jsonl(*(runs_files or [run_dir / "runs.jsonl"]))
    families = {
        "primary (T = 0.7)": primary_keys(0.7),
        "primary endpoints at T = 1.0": primary_keys(1.0),
        "secondary: final checkpoint (T = 0.7)": ["T0.7/final/avg", *[f"T0.7/final/pass@{k}" for k in ENDPOINT_KS]],
        "secondary: best Avg@K checkpoint (T = 0.7)": ["T0.7/best/avg", *[f"T0.7/best/pass@{k}" for k in ENDPOINT_KS]],
    }
    lines, dump = [], {}
    for title, keys in families.items():
        rows = comparisons(runs, pairs, keys, margin)
        dump[title] = rows
        extra = "" if margin is None else f" TOST p (Holm, margin {margin:g}) | verdict |"
        lines += [f"### {title}: {len(rows)} tests, Holm at 0.05\n",
                  "| arm | vs | endpoint | diff ± 95% CI | p | p (Holm) | seeds reached | paired n |" + extra,
                  "|---|---|---|---|---|---|---|---|" + ("" if margin is None else "---|---|")]
        for r in rows:
            tail = "" if margin is None else f" {r['p_tost_holm']:.4f} | {r['verdict']} |"
            lines.append(f"| {r['arm']} | {r['vs']} | {r['endpoint']} | {r['diff']:+.3f} ± {r['ci95']:.3f} | {r['p']:.4f} | "
                         f"{r['p_holm']:.4f} | {r['reached']}/{r['seeds']} | {r['n']} |" + tail)
        lines.append("")
    drawn = [r for r in runs if r["arm"] in {a for pair in pairs for a in pair}]
    for temp in TEMPERATURES:
        for k in ENDPOINT_KS:
            frontier_figure(drawn, run_dir, temp, k, prefix="" if name == "report" else f"{name}_")
    text = "\n".join(lines)
    (run_dir / f"{name}.md").write_text(text)
    (run_dir / f"{name}.json").write_text(json.dumps(dump, indent=1))
    return text


def _autopilot_runs(runs: Sequence[dict], arm: str, key: str) -> list[dict]:
    """``arm``'s runs, refused by name when there is none or when their step records lack the autopilot's ``key``."""
    mine = [r for r in runs if r["arm"] == arm]
    if not mine:
        raise ValueError(f"no run of arm {arm!r}; arms present: {sorted({r['arm'] for r in runs})}")
    if any(not r["records"] or key not in r["records"][0] for r in mine):
        raise ValueError(f"runs of {arm!r} carry no autopilot records ({key})")
    return mine


def autopilot_gain(runs: Sequence[dict], arm: str, n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """How the realised change of the measured batch entropy follows the autopilot's prediction, in ``arm``'s runs.

    Over each pair of consecutive steps (t, t+1) of every seed: ``x = autopilot_predicted_dh`` at t (the predicted
    change over the kept tokens, with the arm's η) and ``y = autopilot_entropy[t+1] − autopilot_entropy[t]`` (both
    measured on the old policy's batch). Returns ``n``, ``seeds``, ``corr`` (Pearson, x and y), the gain
    ``g = Σxy / Σx²`` (least squares through 0: realised ≈ g · predicted), ``g_lo`` / ``g_hi`` (2.5 / 97.5 %
    percentiles of g over ``n_boot`` resamplings of whole seeds), ``pred_sd`` and ``realised_sd`` (the standard
    deviations of x and y: the second is the batch-to-batch noise the feedback law reads)."""
    pairs = {r["seed"]: [(a["autopilot_predicted_dh"], b["autopilot_entropy"] - a["autopilot_entropy"])
                         for a, b in zip(r["records"][:-1], r["records"][1:])]
             for r in _autopilot_runs(runs, arm, "autopilot_predicted_dh")}
    seeds = sorted(pairs)
    sums = {s: (sum(x * y for x, y in pairs[s]), sum(x * x for x, _ in pairs[s])) for s in seeds}
    xs = [x for s in seeds for x, _ in pairs[s]]
    ys = [y for s in seeds for _, y in pairs[s]]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    gen = torch.Generator().manual_seed(seed)
    boot = []
    for _ in range(n_boot):
        pick = [seeds[i] for i in torch.randint(len(seeds), (len(seeds),), generator=gen).tolist()]
        num, den = sum(sums[s][0] for s in pick), sum(sums[s][1] for s in pick)
        boot.append(num / den if den > 0 else math.nan)
    boot.sort()
    num, den = sum(v[0] for v in sums.values()), sum(v[1] for v in sums.values())
    return {"n": n, "seeds": len(seeds), "corr": sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan,
            "g": num / den if den > 0 else math.nan, "g_lo": boot[int(0.025 * (n_boot - 1))],
            "g_hi": boot[int(0.975 * (n_boot - 1))], "pred_sd": math.sqrt(sxx / n), "realised_sd": math.sqrt(syy / n)}


def autopilot_trace(runs: Sequence[dict], arm: str, cap: float, steps: Sequence[int] = (1, 50, 100, 150, 200),
                    tol: float = 1e-3) -> dict[str, object]:
    """What the autopilot of ``arm`` did, from its per-step records, averaged over its runs (seeds).

    Returns ``target`` (mean of the first step's ``autopilot_target_entropy``), ``entropy`` (``{step: mean
    autopilot_entropy}``, the measured batch entropy at each of ``steps`` present in every run), ``dropped`` (mean
    ``autopilot_dropped_frac`` over all steps), ``at_cap`` (share of steps with ``dropped_frac ≥ cap − tol``),
    ``met`` (share of steps with ``autopilot_predicted_dh ≥ autopilot_target_dh``: the kept tokens' predicted change
    reached the step's target), ``steps`` (step records counted) and ``seeds``; and ``arm_entropy`` (``{arm: {step:
    mean entropy}}`` of every arm in ``runs``, its ``entropy`` field, for comparison)."""
    mine = _autopilot_runs(runs, arm, "autopilot_dropped_frac")
    recs = [x for r in mine for x in r["records"]]

    def at(rs: list[dict], key: str) -> dict[int, float]:
        by_step = [{x["step"]: x[key] for x in r["records"]} for r in rs]
        return {s: sum(b[s] for b in by_step) / len(by_step) for s in steps if all(s in b for b in by_step)}

    arms = sorted({r["arm"] for r in runs})
    return {"seeds": len(mine), "steps": len(recs),
            "target": sum(r["records"][0]["autopilot_target_entropy"] for r in mine) / len(mine),
            "entropy": at(mine, "autopilot_entropy"),
            "dropped": sum(x["autopilot_dropped_frac"] for x in recs) / len(recs),
            "at_cap": sum(x["autopilot_dropped_frac"] >= cap - tol for x in recs) / len(recs),
            "met": sum(x["autopilot_predicted_dh"] >= x["autopilot_target_dh"] for x in recs) / len(recs),
            "arm_entropy": {a: at([r for r in runs if r["arm"] == a], "entropy") for a in arms}}


def write_selection(run_dir: Path, runs_files: Sequence[Path] = ()) -> dict[str, dict[str, object]]:
    """Apply :func:`entropy_lab.tuning.select` to ``runs_files`` read in order (default
    ``run_dir/runs.jsonl``); write ``selection.json`` and ``selection.md`` under ``run_dir`` (every setting's scores
    and the share of tokens its control acted on)."""
    sel = select(load_jsonl(*(runs_files or [run_dir / "runs.jsonl"])))
    (run_dir / "selection.json").write_text(json.dumps(sel, indent=1))
    lines = ["| family | setting | Pass@64 at start+0.02 | Pass@64 at start+0.04 | control share | chosen |", "|---|---|---|---|---|---|"]
    for fam, s in sel.items():
        for name, sc in s["scores"].items():
            lines.append(f"| {fam} | {name} | {sc['d0.02']:.3f} | {sc['d0.04']:.3f} | {sc['control_frac']:.4f} | "
                         f"{'**yes** (' + str(s['rule']) + ')' if name == s['chosen'] else ''} |")
    (run_dir / "selection.md").write_text("\n".join(lines) + "\n")
    return sel


def extend_stage(spec: RunSpec, run_dir: Path, *, jobs: int, rounds: int = 4, log: Callable[[str], None] = print,
                 warm_cache: Path | None = None) -> dict[str, dict[str, object]]:
    """Grow a tuning stage's grids until every chosen setting is interior (:func:`~entropy_lab.tuning.grid_extensions`):
    select over ``run_dir/runs.jsonl`` and ``run_dir/extend*/runs.jsonl``, run the extensions into
    ``run_dir/extend{k}`` (:func:`run_stage`), and repeat, at most ``rounds`` times; the last selection is written
    to ``run_dir/selection.json`` (and ``.md``) and returned."""
    files = [run_dir / "runs.jsonl", *sorted(run_dir.glob("extend*/runs.jsonl"), key=lambda p: int(p.parent.name[6:]))]
    for _ in range(rounds):
        new = grid_extensions(load_jsonl(*files), write_selection(run_dir, files))
        if not new:
            break
        log(f"extend: {[a.name for a in new]}")
        files.append(run_stage(spec, new, run_dir / f"extend{len(files)}", jobs=jobs, log=log, warm_cache=warm_cache))
    return write_selection(run_dir, files)


def main_arms(selections: Sequence[dict[str, dict[str, object]]], grpo_lr: float, ppo_lr: float,
              families: Sequence[str] | None = None, start_entropy: float = 0.70,
              fixed_share: float | None = None, autopilot_calibrate_every: int = 0,
              tuned: Sequence[Arm] = ()) -> list[Arm]:
    """The main run's arms: the chosen setting of every family in ``selections`` (:func:`write_selection` outputs),
    as defined by :func:`~entropy_lab.tuning.stage_a` / ``stage_b(grpo_lr, ppo_lr)`` /
    ``adaptive_bonus_arms(grpo_lr, start_entropy)`` or, for a setting an extension of the grid added, as ``tuned``
    (the arms the tuning runs recorded, :func:`tuned_arms`; a name in both must define the same arm), plus GRPO at
    :func:`~entropy_lab.tuning.second_lr` of the chosen GRPO rate (the frontier's second GRPO line).
    A family with no chosen setting is left out (and reported as not reached).

    ``families``: only the arms of these families (``grpo_second_lr`` names the second GRPO line); the family
    ``autopilot`` (never tuned, so in no selection) adds :func:`~entropy_lab.tuning.autopilot_arms`'
    default setting at ``grpo_lr`` (its cheap score calibrated every ``autopilot_calibrate_every`` RL steps, 0 never),
    and ``fixed_share`` the autopilot's control at the share ``fixed_share``
    (:func:`~entropy_lab.tuning.fixed_share_arm`; required then).  The selections must then choose GRPO at
    ``grpo_lr`` only if ``grpo`` or ``grpo_second_lr`` is among them.  A family neither in a selection nor one of
    those raises ``ValueError``."""
    pool = (*stage_a(), *stage_b(grpo_lr, ppo_lr), *adaptive_bonus_arms(grpo_lr, start_entropy))
    by_name = {a.name: a for a in pool}
    for arm in tuned:
        if by_name.setdefault(arm.name, arm) != arm:
            raise ValueError(f"tuned: {arm.name} ran as {arm}, the grid defines it as {by_name[arm.name]}")
    chosen = [str(s["chosen"]) for sel in selections for s in sel.values() if s["chosen"]]
    missing = [n for n in chosen if n not in by_name]
    if missing:
        raise ValueError(f"chosen settings {missing} are in no grid and in no tuning record (pass tuned=)")
    if families is not None:
        wanted = set(families)
        unknown = wanted - {f for sel in selections for f in sel} - {"autopilot", "fixed_share", "grpo_second_lr"}
        if unknown:
            raise ValueError(f"families {sorted(unknown)} are in no selection (and are not autopilot / fixed_share / "
                             "grpo_second_lr)")
        if "fixed_share" in wanted and fixed_share is None:
            raise ValueError("the family fixed_share needs fixed_share (the autopilot's mean share in tuning)")
        arms = [by_name[n] for n in chosen if by_name[n].family in wanted]
        if wanted & {"grpo", "grpo_second_lr"}:
            grpo = next((by_name[n] for n in chosen if by_name[n].family == "grpo"), None)
            if grpo is None or grpo.lr != grpo_lr:
                raise ValueError(f"the selections must choose GRPO at lr {grpo_lr:g}, got {grpo}")
            if "grpo_second_lr" in wanted:
                arms.append(Arm(f"grpo(lr={second_lr(grpo_lr):g})", "grpo_second_lr", lr=second_lr(grpo_lr)))
        if "autopilot" in wanted:
            arms += autopilot_arms(grpo_lr, autopilot_calibrate_every)
        if "fixed_share" in wanted:
            arms.append(fixed_share_arm(grpo_lr, fixed_share))
        return arms
    arms = [by_name[n] for n in chosen]
    grpo = next((a for a in arms if a.family == "grpo"), None)
    if grpo is None or grpo.lr != grpo_lr:
        raise ValueError(f"the selections must choose GRPO at lr {grpo_lr:g}, got {grpo}")
    second = second_lr(grpo.lr)
    arms.append(Arm(f"grpo(lr={second:g})", "grpo_second_lr", lr=second))
    return arms


def tuned_arms(selection: Path) -> list[Arm]:
    """The arms the tuning runs beside a ``selection.json`` ran (``runs.jsonl`` and ``extend*/runs.jsonl`` in its
    folder, plain or compressed), one per name, as their records' ``arm_spec`` define them."""
    files = [f for pat in ("runs.jsonl*", "extend*/runs.jsonl*") for f in sorted(selection.parent.glob(pat))]
    return list({r["arm"]: Arm(**r["arm_spec"]) for r in load_jsonl(*files)}.values()) if files else []


WARM_CACHE_HELP = ("folder of warm starts shared by the stages of one set-up: a seed's warm start of the same "
                   "configuration and torch build is reused instead of warmed up again")
DEVICE_HELP = ("where the RL steps and checkpoint evaluations run: cpu (default) or cuda[:N]; warm-ups and the start's "
               "evaluation stay on the CPU, and sampling draws from the CPU's generators either way")
RUNS_HELP = "runs.jsonl files, read in order as their concatenation (each plain, or compressed as .xz / .gz)"
RUNS_OPTION_HELP = ("a runs.jsonl to read instead of DIR/runs.jsonl (repeat for several, read in order as their "
                    "concatenation; plain, or compressed as .xz / .gz)")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of the protocol (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m entropy_lab.protocol", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ws = sub.add_parser("warm-sweep", allow_abbrev=False, help="candidate warm starts at several warm-up lengths")
    ws.add_argument("--candidate", action="append", required=True, metavar="NAME:FIELD=V,...",
                    help="a CompareConfig override per candidate, e.g. 'd128L4:d_model=128,n_layers=4'")
    ws.add_argument("--seeds", default="100/101/102", help="warm-up seeds, '/'-separated (tuning seeds)")
    ws.add_argument("--steps", default="300/600/1200/2400", help="warm-up step counts evaluated, '/'-separated")
    ws.add_argument("--prompts", type=int, default=200)
    ws.add_argument("--samples", type=int, default=64)
    ws.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ws.add_argument("--out", type=Path, required=True)
    rn = sub.add_parser("run", allow_abbrev=False, help="warm up each seed, then every (seed, arm) with checkpoint evaluations")
    rn.add_argument("--config", default="", help="HeadConfig overrides FIELD=V,... (the pre-registered warm start)")
    rn.add_argument("--arm", action="append", required=True, metavar="NAME[@FAMILY]:FIELD=V,...")
    rn.add_argument("--seeds", required=True, help="'/'-separated seeds")
    rn.add_argument("--checkpoints", required=True, help="'/'-separated RL step counts, 0 = the start")
    rn.add_argument("--prompt-set", choices=("test", "val"), required=True)
    rn.add_argument("--device", default="cpu", help=DEVICE_HELP)
    rn.add_argument("--prompts", type=int, default=200)
    rn.add_argument("--samples", type=int, default=64)
    rn.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    rn.add_argument("--out", type=Path, required=True)
    rn.add_argument("--warm-cache", type=Path, default=None, help=WARM_CACHE_HELP)
    for name, hlp in (("tune-a", "stage A: GRPO and PPO learning rates"), ("tune-b", "stage B: every other family"),
                      ("tune-c", "stage C: TRL's adaptive entropy bonus, four targets")):
        tp = sub.add_parser(name, allow_abbrev=False, help=hlp + " on the tuning seeds and validation prompts")
        tp.add_argument("--config", default="")
        tp.add_argument("--seeds", default="100/101/102")
        tp.add_argument("--checkpoints", default="0/10/20/30/40/60/80/100/125/150/200")
        tp.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
        tp.add_argument("--out", type=Path, required=True)
        tp.add_argument("--warm-cache", type=Path, default=None, help=WARM_CACHE_HELP)
        if name == "tune-b":
            tp.add_argument("--grpo-lr", type=float, required=True)
            tp.add_argument("--ppo-lr", type=float, required=True)
            tp.add_argument("--families", default=None,
                            help="comma-separated subset of stage B's families (to split it over several calls)")
        if name == "tune-c":
            tp.add_argument("--grpo-lr", type=float, required=True)
            tp.add_argument("--start-entropy", type=float, default=0.70,
                            help="the start's token entropy (nats): targets start - 0.2 / 0.1 / 0.05 / 0")
    mp_ = sub.add_parser("main", allow_abbrev=False, help="the main run: the selected arms on evaluation seeds and test prompts")
    mp_.add_argument("--config", default="")
    mp_.add_argument("--selection", action="append", type=Path, default=[], help="selection.json of a tuning stage")
    mp_.add_argument("--grpo-lr", type=float, required=True)
    mp_.add_argument("--ppo-lr", type=float, required=True)
    mp_.add_argument("--families", default=None,
                     help="comma-separated families to run (default: every selected family and grpo_second_lr); "
                          "'autopilot' adds the autopilot's default setting at --grpo-lr, 'fixed_share' its control "
                          "at the share of --fixed-share-from")
    mp_.add_argument("--fixed-share-from", type=Path, action="append", default=[], metavar="RUNS",
                     help="runs.jsonl of the autopilot on the tuning seeds: the fixed share is its mean dropped share "
                          "(repeat for several files)")
    mp_.add_argument("--start-entropy", type=float, default=0.70,
                     help="as tune-c's (names the adaptive_bonus settings of a stage-C selection)")
    mp_.add_argument("--autopilot-calibrate-every", type=int, default=0, metavar="K",
                     help="the autopilot arm calibrates its cheap score every K RL steps as the adapters do "
                          "(default 0: uncalibrated, as the earlier evaluations ran)")
    mp_.add_argument("--seeds", required=True)
    mp_.add_argument("--checkpoints", default="0/10/20/30/40/60/80/100/125/150/200")
    mp_.add_argument("--device", default="cpu", help=DEVICE_HELP)
    mp_.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    mp_.add_argument("--out", type=Path, required=True)
    mp_.add_argument("--warm-cache", type=Path, default=None, help=WARM_CACHE_HELP)
    wc = sub.add_parser("warm", allow_abbrev=False, help="only warm up seeds into a warm cache (for a later stage of the same config)")
    wc.add_argument("--config", default="")
    wc.add_argument("--seeds", required=True, help="'/'-separated seeds")
    wc.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    wc.add_argument("--warm-cache", type=Path, required=True, help=WARM_CACHE_HELP)
    gp = sub.add_parser("autopilot-gain", allow_abbrev=False, help="realised vs predicted entropy change of an autopilot arm's runs")
    gp.add_argument("runs", type=Path, nargs="+", help=RUNS_HELP)
    gp.add_argument("--arm", default="autopilot(hold)")
    tr = sub.add_parser("autopilot-trace", allow_abbrev=False, help="what an autopilot arm's controller did: target, entropy, drops")
    tr.add_argument("runs", type=Path, nargs="+", help=RUNS_HELP)
    tr.add_argument("--arm", default="autopilot(hold)")
    tr.add_argument("--cap", type=float, default=AUTOPILOT_MAX_FRAC, help="the arm's cap on the dropped share")
    ex = sub.add_parser("extend", allow_abbrev=False,
                        help="grow a tuning folder's grids until every chosen setting is interior, then select")
    ex.add_argument("dir", type=Path, help="a tuning stage's folder (runs.jsonl; extensions go to dir/extend*/)")
    ex.add_argument("--config", default="")
    ex.add_argument("--seeds", default="100/101/102")
    ex.add_argument("--checkpoints", default="0/10/20/30/40/60/80/100/125/150/200")
    ex.add_argument("--rounds", type=int, default=4, help="at most this many rounds of extensions")
    ex.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ex.add_argument("--warm-cache", type=Path, default=None, help=WARM_CACHE_HELP)
    sc = sub.add_parser("seeds", allow_abbrev=False, help="the main run's seed count from the tuning runs' paired SD")
    sc.add_argument("runs", type=Path, nargs="+", help=RUNS_HELP)
    sc.add_argument("--pair", action="append", required=True, metavar="ARM|VS")
    sc.add_argument("--detect", type=float, required=True, help="the difference to detect at 80 %% power after Holm")
    sc.add_argument("--margin", type=float, required=True, help="the equivalence margin TOST should reach at 80 %% power")
    sc.add_argument("--tests", type=int, required=True, help="tests in the Holm family")
    sc.add_argument("--n-min", type=int, default=10)
    sc.add_argument("--n-max", type=int, default=40)
    sp = sub.add_parser("select", allow_abbrev=False, help="apply the pre-registered selection rule to a tuning folder")
    sp.add_argument("dir", type=Path)
    sp.add_argument("--runs", type=Path, action="append", default=[], help=RUNS_OPTION_HELP)
    rp = sub.add_parser("report", allow_abbrev=False, help="endpoints, paired tests with Holm, frontier figures of a run folder")
    rp.add_argument("dir", type=Path)
    rp.add_argument("--runs", type=Path, action="append", default=[], help=RUNS_OPTION_HELP)
    rp.add_argument("--name", default="report", help="file stem of the tables (one per comparison family)")
    rp.add_argument("--pair", action="append", required=True, metavar="ARM|VS", help="a paired comparison ARM - VS (arm names as in the run)")
    rp.add_argument("--margin", type=float, default=None,
                    help="an equivalence margin: adds each difference's TOST p-value (Holm) and its verdict")
    args = ap.parse_args(argv)
    if args.cmd in ("tune-a", "tune-b", "tune-c"):
        spec = RunSpec(parse_config(args.config), tuple(int(s) for s in args.seeds.split("/")),
                       tuple(int(s) for s in args.checkpoints.split("/")), "val")
        if args.cmd == "tune-a":
            arms = stage_a()
        elif args.cmd == "tune-b":
            arms = stage_b(args.grpo_lr, args.ppo_lr)
        else:
            arms = adaptive_bonus_arms(args.grpo_lr, args.start_entropy)
        if getattr(args, "families", None):
            wanted = set(args.families.split(","))
            unknown = wanted - {a.family for a in arms}
            if unknown:
                raise SystemExit(f"--families: unknown {sorted(unknown)}")
            arms = [a for a in arms if a.family in wanted]
        run_stage(spec, arms, args.out, jobs=args.jobs, warm_cache=args.warm_cache)
        sel = write_selection(args.out)
        print(json.dumps({f: s["chosen"] for f, s in sel.items()}))
        if args.cmd == "tune-a" and sel["grpo"]["chosen"]:
            lr = next(a.lr for a in stage_a() if a.name == sel["grpo"]["chosen"])
            print(f"frontier's second GRPO lr: {second_lr(lr):g}")
    if args.cmd == "main":
        spec = RunSpec(parse_config(args.config), tuple(int(s) for s in args.seeds.split("/")),
                       tuple(int(s) for s in args.checkpoints.split("/")), "test", device=args.device)
        sels = [json.loads(p.read_text()) for p in args.selection]
        fams = args.families.split(",") if args.families else None
        share = mean_autopilot_share(load_jsonl(*args.fixed_share_from)) if args.fixed_share_from else None
        arms = main_arms(sels, args.grpo_lr, args.ppo_lr, fams, args.start_entropy, share,
                         args.autopilot_calibrate_every, [a for p in args.selection for a in tuned_arms(p)])
        if not arms:
            raise SystemExit("main: no arm to run (no selected setting in the requested families)")
        run_stage(spec, arms, args.out, jobs=args.jobs, warm_cache=args.warm_cache)
    if args.cmd == "warm":
        fill_warm_cache(parse_config(args.config), [int(s) for s in args.seeds.split("/")], args.warm_cache,
                        jobs=args.jobs)
    if args.cmd == "autopilot-gain":
        print(json.dumps(autopilot_gain(load_jsonl(*args.runs), args.arm), indent=1))
    if args.cmd == "autopilot-trace":
        print(json.dumps(autopilot_trace(load_jsonl(*args.runs), args.arm, args.cap), indent=1))
    if args.cmd == "extend":
        spec = RunSpec(parse_config(args.config), tuple(int(s) for s in args.seeds.split("/")),
                       tuple(int(s) for s in args.checkpoints.split("/")), "val")
        sel = extend_stage(spec, args.dir, jobs=args.jobs, rounds=args.rounds, warm_cache=args.warm_cache)
        print(json.dumps({f: s["chosen"] for f, s in sel.items()}))
    if args.cmd == "seeds":
        print(json.dumps(seed_count(load_jsonl(*args.runs), [tuple(p.split("|", 1)) for p in args.pair],
                                    detect=args.detect, margin=args.margin, tests=args.tests, n_min=args.n_min,
                                    n_max=args.n_max), indent=1))
    if args.cmd == "select":
        print(json.dumps({f: s["chosen"] for f, s in write_selection(args.dir, args.runs).items()}))
    if args.cmd == "report":
        print(report(args.dir, [tuple(p.split("|", 1)) for p in args.pair], args.name, args.runs, args.margin))
    if args.cmd == "run":
        spec = RunSpec(parse_config(args.config), tuple(int(s) for s in args.seeds.split("/")),
                       tuple(int(s) for s in args.checkpoints.split("/")), args.prompt_set, args.prompts, args.samples,
                       args.device)
        run_stage(spec, [parse_arm(a) for a in args.arm], args.out, jobs=args.jobs, warm_cache=args.warm_cache)
    if args.cmd == "warm-sweep":
        cands = {}
        for c in args.candidate:
            name, _, spec = c.partition(":")
            cands[name] = parse_config(spec)
        warm_sweep(cands, [int(s) for s in args.seeds.split("/")], tuple(int(s) for s in args.steps.split("/")), args.out,
                   jobs=args.jobs, n_prompts=args.prompts, samples=args.samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
