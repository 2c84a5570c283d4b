"""``python -m entropy_discriminator.demo.protocol``: the pre-registered head-to-head protocol of issue 21.

Stages (each a subcommand; every job's result is appended to a JSON-lines file as it lands, so a run cut off keeps
what it finished):

* ``warm-sweep``: candidate warm starts (model size x warm-up length), each evaluated at several warm-up step counts
  on the test prompts at every evaluation temperature (how the start was chosen);
* ``run``: warm up each seed once, then every (seed, arm) with checkpoint evaluations (the tuning stage runs it on the
  tuning seeds and validation prompts, the main run on the evaluation seeds and test prompts);
* ``report``: endpoints, paired tests with Holm's adjustment, the frontier figure, from a ``run`` folder.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from .compare import CompareConfig, _pool_map
from .headtohead import Arm, HeadConfig, eval_stream, evaluate_at, heldout_sets, run_arm_checkpoints, warm_up_checkpoints
from .model import TinyGPT

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
    """``"NAME[@FAMILY]:FIELD=V,..."`` -> :class:`Arm` (family defaults to NAME; ``cap=none`` for no cap)."""
    head, _, body = spec.partition(":")
    name, _, family = head.partition("@")
    types = {f.name: f.type for f in fields(Arm)}
    kw: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in types or key in ("name", "family"):
            raise ValueError(f"arm {name}: expected FIELD=VALUE with FIELD in {sorted(types)}, got {item!r}")
        default = getattr(Arm(name="x", family="x"), key)
        if isinstance(default, str):
            kw[key] = value
        elif key == "cap":
            kw[key] = None if value.lower() == "none" else float(value)
        else:
            kw[key] = float(value)
    return Arm(name=name, family=family or name, **kw)


def _append(path: Path, row: dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


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

    warm_up_checkpoints(replace(cfg, warmup_steps=max(at_steps)), seed, at_steps, on_step)
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
    (``test`` or ``val``, :func:`~entropy_discriminator.demo.headtohead.heldout_sets`) and its size."""

    cfg: HeadConfig
    seeds: tuple[int, ...]
    checkpoints: tuple[int, ...]
    prompt_set: str = "test"
    n_prompts: int = 200
    samples: int = 64

    def __post_init__(self) -> None:
        if self.prompt_set not in ("test", "val"):
            raise ValueError(f"prompt_set must be 'test' or 'val', got {self.prompt_set!r}")
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
                             stream=eval_stream(seed, checkpoint, temp))
            out[f"T{temp}"] = {"avg": ev["avg"], "pass": ev["pass"]}
        return out


def _warm_job(job: tuple[RunSpec, int, str]) -> dict[str, object]:
    spec, seed, path = job
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    state = warm_up_checkpoints(spec.cfg, seed, (), lambda step, st: None)
    torch.save(state, path)
    model = TinyGPT(spec.cfg.model_config())
    model.load_state_dict(state)
    return {"seed": seed, "warmup_seconds": time.perf_counter() - t0, "start": spec.evaluate(model, seed, 0)}


def _arm_job(job: tuple[RunSpec, Arm, int, str]) -> dict[str, object]:
    spec, arm, seed, path = job
    torch.set_num_threads(1)
    state = torch.load(path, weights_only=True)
    trace = run_arm_checkpoints(state, spec.cfg, arm, seed, spec.checkpoints,
                                lambda step, model: spec.evaluate(model, seed, spec.checkpoints.index(step)))
    return {**asdict(trace), "arm_spec": asdict(arm)}


def run_stage(spec: RunSpec, arms: Sequence[Arm], out: Path, *, jobs: int, log: Callable[[str], None] = print) -> Path:
    """Warm up every seed (``out/warm/seed*.pt``; the start's evaluation in ``out/starts.jsonl``), then run every
    (seed, arm) with its checkpoint evaluations (one JSON line per run in ``out/runs.jsonl``); ``out/meta.json``
    records the spec, the arms, the software and the machine."""
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "warm").mkdir(exist_ok=True)
    meta = {"spec": asdict(spec), "arms": [asdict(a) for a in arms], "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "jobs": jobs}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    t0 = time.perf_counter()
    log(f"run: {len(spec.seeds)} seeds x {len(arms)} arms, checkpoints {spec.checkpoints}, {spec.prompt_set} prompts")
    _pool_map(_warm_job, [(spec, s, str(out / "warm" / f"seed{s}.pt")) for s in spec.seeds], jobs, log,
              lambda r: _append(out / "starts.jsonl", r))
    work = [(spec, a, s, str(out / "warm" / f"seed{s}.pt")) for s in spec.seeds for a in arms]
    _pool_map(_arm_job, work, jobs, log, lambda r: _append(out / "runs.jsonl", r))
    meta["wall_seconds"] = time.perf_counter() - t0
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out / "runs.jsonl"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of the protocol (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m entropy_discriminator.demo.protocol", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ws = sub.add_parser("warm-sweep", help="candidate warm starts at several warm-up lengths")
    ws.add_argument("--candidate", action="append", required=True, metavar="NAME:FIELD=V,...",
                    help="a CompareConfig override per candidate, e.g. 'd128L4:d_model=128,n_layers=4'")
    ws.add_argument("--seeds", default="100/101/102", help="warm-up seeds, '/'-separated (tuning seeds)")
    ws.add_argument("--steps", default="300/600/1200/2400", help="warm-up step counts evaluated, '/'-separated")
    ws.add_argument("--prompts", type=int, default=200)
    ws.add_argument("--samples", type=int, default=64)
    ws.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ws.add_argument("--out", type=Path, required=True)
    rn = sub.add_parser("run", help="warm up each seed, then every (seed, arm) with checkpoint evaluations")
    rn.add_argument("--config", default="", help="HeadConfig overrides FIELD=V,... (the pre-registered warm start)")
    rn.add_argument("--arm", action="append", required=True, metavar="NAME[@FAMILY]:FIELD=V,...")
    rn.add_argument("--seeds", required=True, help="'/'-separated seeds")
    rn.add_argument("--checkpoints", required=True, help="'/'-separated RL step counts, 0 = the start")
    rn.add_argument("--prompt-set", choices=("test", "val"), required=True)
    rn.add_argument("--prompts", type=int, default=200)
    rn.add_argument("--samples", type=int, default=64)
    rn.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    rn.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        spec = RunSpec(parse_config(args.config), tuple(int(s) for s in args.seeds.split("/")),
                       tuple(int(s) for s in args.checkpoints.split("/")), args.prompt_set, args.prompts, args.samples)
        run_stage(spec, [parse_arm(a) for a in args.arm], args.out, jobs=args.jobs)
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
