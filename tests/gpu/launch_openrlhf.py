"""OpenRLHF's real launcher on one GPU: the adapter's example launches, GRPO and PPO with GAE, Clip_V and the autopilot,
a checkpoint and a resume.

Not collected by pytest; run by hand (tests/gpu/launch_openrlhf_README.md has the device commands).

``train --out DIR`` runs ``python -m entropy_discriminator.adapters.openrlhf`` (the launcher, OpenRLHF 0.11's
``train_ppo_ray`` with its Ray workers and DeepSpeed) three times, each with the argument list of an example script
(``examples/openrlhf/*.sh`` with ``ED_PRINT_ARGS=1``, ``N_GPUS=1``: actor, reference, critic and rollout engine
colocated on the one GPU, ZeRO-3, bf16, sleep mode) on the tiny offline inputs of ``tests/adapters/launch_assets.py``
(random Qwen2, BPE tokenizer, GSM8K-style prompts) with the sizes shrunk (:data:`SHRUNK`) and ``--ds.attn_implementation
sdpa`` (flash-attn is not installed), and each run's ``--entropy_disc.*`` settings in place of the example's:

1. ``gae_clip_v``: ``ppo_gae.sh clip_v`` (critic, GAE, KL reward with the reference model), Clip_V mu 1.5 on both
   sides, 5 steps;
2. ``grpo_pilot_full``: ``grpo.sh`` (group_norm, KL loss) with the autopilot (``drop_token``, law calibrated every
   round), 6 steps, a DeepSpeed checkpoint every 3;
3. ``grpo_pilot_resume``: the same launch with ``--ckpt.load_enable`` on a copy of run 2's ``global_step3``
   checkpoint (steps 4-6).

Rollouts: OpenRLHF's own rollout actors with one engine (``--vllm.num_engines 1``); ``tests/gpu/openrlhf_site/vllm``
stands in for vLLM's engine there, generating with Hugging Face (see its docstring), and
``tests/gpu/openrlhf_site/flash_attn`` for an import OpenRLHF makes but never calls here.  The probe
(``tests/gpu/openrlhf_site/sitecustomize.py``) records, in the worker, every round of the adapter: statistics,
advantages, keep-mask, controller state before and after, metrics.  Each launch's output is kept as
``DIR/<run>.log``; the probe's records under ``DIR/<run>/probe``.

``check --out DIR`` (afterwards, one process, no GPU needed) checks, per run: the rounds ran in OpenRLHF's
``PolicyModelActor`` (not in the driver) with the adapter's settings, from the old-policy forward's statistics,
with the vLLM stand-in imported (not a real vLLM) and the engine generating, sleeping and receiving the weights after
every step; every round's keep-mask equals the core library's recomputation from the recorded statistics and
advantages (Clip_V: ``EntropyDiscConfig.compute_mask``; autopilot: a fresh controller loaded with the recorded state
before the round), and so does the controller's state after it; some tokens were clipped; the driver logged each
step's ``entropy_disc/*`` metrics (``Global step N: {...}``) and they equal the worker's; the runs made at least 5
steps.  The resume: the checkpoint's client state holds the controller (``entropy_disc_autopilot``) at step 3, equal
to the state the uninterrupted run's round 4 started from (round 3's, with the law calibration fed after its update);
the resumed run's first round starts from it, its controller steps continue 4, 5, 6 and the driver's global steps
4-6.  It prints a table and exits 1 if a check fails.

Fallbacks, recorded in ``DIR/device.json``: torch's AdamW inside DeepSpeed where FusedAdam cannot be compiled
(automatic; ``--torch-adam`` forces it; the launches then drop ``--ds.enable_sleep``, which DeepSpeed allows only
with FusedAdam), and ``--weight-sync gloo`` where CUDA IPC between processes fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "openrlhf_site"
sys.path.insert(0, str(ROOT / "tests" / "adapters"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_trl import _flat, _state_diff  # noqa: E402  (the controller-state comparison of the TRL launch)

RUNS = ("gae_clip_v", "grpo_pilot_full", "grpo_pilot_resume")
CUT = 3  # the checkpoint the resume starts from
#: The examples' sizes shrunk to the tiny model (the examples' N_GPUS=1 placement is kept as they write it).
SHRUNK = [
    "--vllm.num_engines", "1", "--data.max_len", "96", "--rollout.max_new_tokens", "24",
    "--train.micro_batch_size", "2", "--rollout.micro_batch_size", "2", "--logger.tensorboard_dir", "",
    "--ds.attn_implementation", "sdpa", "--train.seed", "0",
]
#: Per run: example script, its METHOD argument, extra OpenRLHF flags, the adapter's settings.
PLAN = {
    "gae_clip_v": ("ppo_gae.sh", "clip_v", [
        "--data.max_samples", "20", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "1",
        "--train.batch_size", "4", "--actor.adam.lr", "1e-3", "--critic.adam.lr", "1e-3",
    ], {"method": "clip_v", "mu_low": "1.5", "mu_high": "1.5", "sides": "both"}),
    "grpo_pilot_full": ("grpo.sh", "clip_v", [
        "--data.max_samples", "12", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4",
        "--train.batch_size", "8", "--actor.adam.lr", "1e-3", "--ckpt.save_steps", str(CUT),
    ], {"method": "autopilot", "eta": "2.0", "sides": "both", "max_frac": "0.25", "mask_mode": "drop_token",
        "calibrate_every": "1"}),
}
PLAN["grpo_pilot_resume"] = (PLAN["grpo_pilot_full"][0], PLAN["grpo_pilot_full"][1],
                             PLAN["grpo_pilot_full"][2] + ["--ckpt.load_enable"], PLAN["grpo_pilot_full"][3])
MIN_STEPS = 5
REWARD = '''"""Dense rule reward for the tiny random model: the share of digits in the response (query minus prompt)."""


def reward_func(queries, prompts, labels):
    response = queries[0][len(prompts[0]):] if queries[0].startswith(prompts[0]) else queries[0]
    share = sum(c.isdigit() for c in response) / max(1, len(response))
    return {"rewards": float(share), "scores": float(share), "extra_logs": {}}
'''


# ------------------------------------------------------------------------------------------------- train


def example_argv(script: str, method: str, env: dict[str, str]) -> list[str]:
    """The example script's own argument list (its ``ED_PRINT_ARGS=1`` mode) under ``env``."""
    out = subprocess.run(["bash", str(ROOT / "examples" / "openrlhf" / script), method],
                         env={**os.environ, **env, "ED_PRINT_ARGS": "1"}, capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


def launch_env(probe: Path, torch_adam: bool) -> dict[str, str]:
    """The launch's environment: the stand-ins and the probe on ``PYTHONPATH`` (the package itself must be installed)."""
    import torch

    env = {
        **os.environ,
        "RAY_ADDRESS": "local",  # a private Ray instance, whatever the machine's bootstrap file says
        "ED_LAUNCH_PROBE_DIR": str(probe),
        "PYTHONPATH": os.pathsep.join(p for p in [str(SITE), os.environ.get("PYTHONPATH", "")] if p),
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
        "ED_TORCH_ADAM": "1" if torch_adam else "0",
        # Ray: every worker line reaches the log (the check reads the driver's step lines), no usage report, and no
        # memory monitor (whose readings a sandboxed machine may not give), so a worker is only ended by the launch
        "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0",
    }
    if not torch.cuda.is_available():  # a CPU dry run: Ray counts one GPU; the policy actor stops at set_device
        env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"CPU": 4, "GPU": 1})
    return env


def run_launch(out: Path, name: str, assets: dict[str, Path], timeout: int, torch_adam: bool, sync: str) -> int:
    script, method, extra, settings = PLAN[name]
    run_dir = out / name
    probe = run_dir / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "ckpt"
    if name == "grpo_pilot_resume":  # a copy of the full run's checkpoint at step CUT, as the only (latest) one
        src = out / "grpo_pilot_full" / "ckpt" / "_actor" / f"global_step{CUT}"
        if not src.is_dir():
            raise SystemExit(f"{src} is missing: run grpo_pilot_full first")
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(src, ckpt / "_actor" / f"global_step{CUT}")
        (ckpt / "_actor" / "latest").write_text(f"global_step{CUT}")
    env = {"N_GPUS": "1", "MODEL": str(assets["model"]), "REWARD_FN": str(assets["reward"]),
           "DATA": str(assets["data"]), "INPUT_KEY": "prompt", "LABEL_KEY": "answer", "OUT": str(run_dir / "out")}
    from entropy_discriminator.adapters.openrlhf import split_argv

    _, stock = split_argv(example_argv(script, method, env))  # the run's --entropy_disc.* settings replace the example's
    if torch_adam:  # DeepSpeed offloads (sleeps) only a FusedAdam optimizer's states
        stock = [a for a in stock if a != "--ds.enable_sleep"]
    argv = stock + SHRUNK + extra + ["--ckpt.path", str(ckpt)] + (["--vllm.sync_backend", "gloo"] if sync == "gloo" else [])
    argv += [str(x) for k, v in settings.items() for x in (f"--entropy_disc.{k}", v)]
    cmd = [sys.executable, "-m", "entropy_discriminator.adapters.openrlhf", *argv]
    (run_dir / "argv.json").write_text(json.dumps(cmd, indent=0))
    started = time.time()
    with open(out / f"{name}.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=run_dir, env=launch_env(probe, torch_adam), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # the launcher, its Ray instance and workers: one process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
            log.write(f"\nlaunch_openrlhf.py: {name} stopped after {timeout} s (--timeout)\n")
    print(f"{name}: exit {code} after {time.time() - started:.0f} s (log {out / f'{name}.log'})", flush=True)
    return code


def build_fused_adam() -> tuple[str, bool]:
    """Compile DeepSpeed's FusedAdam op now (just in time, into torch's extension cache, which the launches' workers
    then load), outside the launches' time limits.  Returns ``(what happened, torch_adam)``: where it cannot be built,
    the launches fall back to torch's AdamW (``--torch-adam``), and the reason is kept in ``device.json``."""
    started = time.time()
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if arch and not all(re.fullmatch(r"\d+\.\d+(\+PTX)?", cc) for cc in arch.replace(" ", ";").split(";") if cc):
        # DeepSpeed's JIT builder parses each entry as MAJOR.MINOR[+PTX]: an image's "9.0a" stops it (int("0a")).
        # The launches inherit this process's environment, so the workers load the same build.
        import torch

        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{a}.{b}" for a, b in caps)
        print(f"TORCH_CUDA_ARCH_LIST {arch!r} -> {os.environ['TORCH_CUDA_ARCH_LIST']!r} for DeepSpeed", flush=True)
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder

        FusedAdamBuilder().load()
    except Exception as exc:  # noqa: BLE001  (any build failure: the fallback, with its reason recorded)
        message = f"failed after {time.time() - started:.0f} s: {type(exc).__name__}: {exc}"
        print(f"FusedAdam {message}; the launches use torch's AdamW (--torch-adam)", flush=True)
        return message, True
    message = f"built or loaded in {time.time() - started:.0f} s"
    print(f"FusedAdam {message}", flush=True)
    return message, False


def train(out: Path, runs: list[str], timeout: int, torch_adam: bool, sync: str) -> int:
    import torch

    from launch_assets import write_model, write_prompts_jsonl

    out.mkdir(parents=True, exist_ok=True)
    assets = {"model": write_model(out / "assets" / "model"), "data": write_prompts_jsonl(out / "assets" / "p.jsonl", 64),
              "reward": out / "assets" / "reward.py"}
    assets["reward"].write_text(REWARD)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    fused_adam = None
    if torch.cuda.is_available() and not torch_adam:
        fused_adam, torch_adam = build_fused_adam()
    (out / "device.json").write_text(json.dumps({"device": device, "torch": torch.__version__, "torch_adam": torch_adam,
                                                 "fused_adam_build": fused_adam, "weight_sync": sync}))
    codes = []
    for name in runs:
        codes.append(run_launch(out, name, assets, timeout, torch_adam, sync))
        if codes[-1] != 0 and name == "grpo_pilot_full":
            break  # the resume needs its checkpoint
    return max(codes) if codes else 0


# ------------------------------------------------------------------------------------------------- check


def rounds(out: Path, name: str) -> list[dict[str, Any]]:
    import torch

    return [torch.load(p, weights_only=False) for p in sorted((out / name / "probe").glob("round-*.pt"))]


def engine_events(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted((out / name / "probe").glob("engine-*.jsonl"))
            for line in p.read_text().splitlines()]


_STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})")
_ED_VALUE = re.compile(r"'(entropy_disc/[^']+)': (nan|-?inf|[-+0-9.eE]+)")


def logged_steps(log: str) -> dict[int, dict[str, float]]:
    """Global step -> the ``entropy_disc/*`` metrics in the driver's ``Global step N: {...}`` line."""
    out = {}
    for m in _STEP_LINE.finditer(log):
        out[int(m.group(1))] = {k: float(v) for k, v in _ED_VALUE.findall(m.group(2))}
    return out


def recompute(rec: dict[str, Any]) -> tuple[Any, Any]:
    """The keep-mask of the core library on the round's recorded inputs, and the controller's state after it."""
    from entropy_discriminator import TokenStats
    from entropy_discriminator.adapters.openrlhf._patch import decode_settings

    config, _ = decode_settings(rec["settings"])
    stats = TokenStats(**rec["stats"])
    if config.method != "autopilot":
        return config.compute_mask(advantages=rec["advantages"], valid=stats.valid, s_star=stats.s_star,
                                   s_centered=stats.s_centered).keep, None
    pilot = config.build_autopilot(None, vocab_size=rec["vocab_size"])
    if rec["before"] is not None:
        pilot.load_state_dict(rec["before"])
    result = pilot.from_stats(stats, rec["advantages"], lr=rec["step_size"], ratio=None)
    return result.mask.keep, pilot.state_dict()


def state_diff(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float:
    """Largest relative difference of two controller states (``launch_trl``'s, with None for no controller)."""
    if a is None or b is None:
        return 0.0 if a is b else math.inf
    return _state_diff(a, b)


def checkpoint_client_state(out: Path) -> dict[str, Any]:
    """The client state of the full run's DeepSpeed checkpoint at step CUT (rank 0's model-states file)."""
    import torch

    folder = out / "grpo_pilot_full" / "ckpt" / "_actor" / f"global_step{CUT}"
    files = sorted(folder.glob("*model_states.pt"))
    if not files:
        raise SystemExit(f"no *model_states.pt in {folder}")
    return torch.load(files[0], weights_only=False, map_location="cpu")


def check(out: Path) -> int:
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    device = json.loads((out / "device.json").read_text())
    print(f"device: {device['device']}, torch {device['torch']}; DeepSpeed optimizer: "
          f"{'torch AdamW (--torch-adam)' if device['torch_adam'] else 'FusedAdam'} (FusedAdam build: "
          f"{device.get('fused_adam_build')}); weight sync: {device.get('weight_sync', 'ipc')}")
    print(f"{'run':<19}{'round':>6}{'step':>5}{'tokens':>7}{'valid':>7}{'clipped':>8}{'frac':>8}{'diff':>6}"
          f"{'state':>9}{'logged clip/frac':>18}")
    recs = {name: rounds(out, name) for name in RUNS}
    for name in RUNS:
        if not (out / f"{name}.log").exists():
            failures.append(f"{name}: no log (the launch did not run)")
            continue
        steps = logged_steps((out / f"{name}.log").read_text())
        offset = CUT if name == "grpo_pilot_resume" else 0
        rs = recs[name]
        expect(len(rs) > 0, f"{name}: the adapter ran no round (no probe record)")
        expect(sorted(steps) == list(range(offset + 1, offset + len(rs) + 1)),
               f"{name}: driver logged global steps {sorted(steps)}, expected {offset + 1}..{offset + len(rs)}")
        expect(len({r['pid'] for r in rs}) <= 1, f"{name}: rounds from several processes")
        events = engine_events(out, name)
        kinds = [e["event"] for e in events]
        update = "update_weight" if device.get("weight_sync") == "gloo" else "update_weight_cuda_ipc"
        expect(kinds.count("generate") > 0 and update in kinds and "sleep" in kinds,
               f"{name}: the rollout engine did not generate, sleep and receive weights ({sorted(set(kinds))})")
        syncs = sum(1 for i, k in enumerate(kinds) if k == update and (i == 0 or kinds[i - 1] != k))
        expect(syncs >= len(rs), f"{name}: {syncs} weight syncs to the engine for {len(rs)} steps")
        clipped_total = 0
        for i, r in enumerate(rs):
            step = offset + i + 1
            expect(any(s.endswith("ppo_actor.PolicyModelActor") for s in r["selves"]),
                   f"{name} round {i + 1}: not in PolicyModelActor ({r['selves'][:4]})")
            expect(r["pid"] != os.getpid() and r["vllm_stand_in"], f"{name} round {i + 1}: wrong process or vLLM")
            expect(r["source"] == "forward", f"{name} round {i + 1}: statistics from the fallback pass")
            keep, after = recompute(r)
            diff = int((keep != r["keep"]).sum())
            expect(diff == 0, f"{name} step {step}: {diff} mask entries differ from the recomputation")
            valid = r["stats"]["valid"]
            clipped = int((~r["keep"] & valid).sum())
            clipped_total += clipped
            state = "-"
            if after is not None:
                worst = state_diff(after, r["after"])
                expect(worst <= 1e-9, f"{name} step {step}: controller state differs (rel {worst:.1e})")
                state = "equal" if worst == 0 else f"{worst:.0e}"
                expect(r["after"]["step"] == step, f"{name} step {step}: controller at step {r['after']['step']}")
            logged = steps.get(step, {})
            ours = {k: v for k, v in r["metrics"].items() if not k.startswith("entropy_disc/timing/")}
            same = all(k in logged and (logged[k] == v or abs(logged[k] - v) <= 1e-6 * max(1.0, abs(v))
                                        or (math.isnan(v) and math.isnan(logged[k]))) for k, v in ours.items())
            expect(same and ours, f"{name} step {step}: the driver's entropy_disc/* metrics differ from the worker's")
            frac = logged.get("entropy_disc/clip/frac", float("nan"))
            print(f"{name:<19}{i + 1:>6}{step:>5}{valid.numel():>7}{int(valid.sum()):>7}{clipped:>8}"
                  f"{clipped / max(1, int(valid.sum())):>8.4f}{diff:>6}{state:>9}{frac:>18.4f}")
        expect(clipped_total > 0, f"{name}: no token was clipped in any round (the comparison is vacuous)")
    expect(len(recs["gae_clip_v"]) >= MIN_STEPS and len(recs["grpo_pilot_full"]) >= MIN_STEPS,
           f"fewer than {MIN_STEPS} steps in a run")
    # the resume
    full, resumed = recs["grpo_pilot_full"], recs["grpo_pilot_resume"]
    try:
        client = checkpoint_client_state(out)
    except SystemExit as exc:
        failures.append(str(exc))
        client = {}
    saved = client.get("entropy_disc_autopilot")
    expect(saved is not None and saved["step"] == CUT, f"checkpoint global_step{CUT}: controller state missing or "
           f"not at step {CUT}")
    # saved after round CUT's update, so with that round's law calibration (end_round): the state the uninterrupted
    # run's round CUT + 1 started from
    expect(len(full) > CUT and state_diff(saved, full[CUT]["before"]) == 0.0,
           f"the checkpoint's controller state is not the one the uninterrupted run's round {CUT + 1} started from")
    expect(bool(resumed) and state_diff(resumed[0]["before"], saved) == 0.0,
           "the resumed run's first round did not start from the checkpoint's controller state")
    resumed_steps = [(r["after"] or {}).get("step") for r in resumed]
    expect(resumed_steps == [CUT + 1, CUT + 2, CUT + 3], f"the resumed controller's steps {resumed_steps} are not 4, 5, 6")
    print(f"resume: checkpoint global_step{CUT} (client state global_step {client.get('global_step')}) controller step "
          f"{None if saved is None else saved['step']}; resumed round 1 starts from it: "
          f"{bool(resumed) and state_diff(resumed[0]['before'], saved) == 0.0}; resumed controller steps "
          f"{resumed_steps}")
    print("entropy_disc/* metrics the driver logged:")
    for name in (n for n in RUNS if (out / f"{n}.log").exists()):
        for step, metrics in logged_steps((out / f"{name}.log").read_text()).items():
            print(f"  {name} step {step}: " + json.dumps({k.removeprefix("entropy_disc/"): round(v, 5)
                                                          for k, v in sorted(metrics.items())}))
    for f in failures:
        print("FAIL:", f)
    print("ALL CHECKS PASSED" if not failures else f"{len(failures)} CHECK(S) FAILED")
    return 1 if failures else 0


def archive(out: Path, path: Path) -> None:
    """What ``check`` reads (logs, probe records, engine events, the checkpoint's model-states file) as one ``.tgz``,
    so that ``check`` can be run again elsewhere on its contents."""
    with tarfile.open(path, "w:gz") as tar:
        for item in ["device.json", *(f"{n}.log" for n in RUNS)]:
            if (out / item).exists():
                tar.add(out / item, arcname=item)
        for name in RUNS:
            if (out / name / "probe").is_dir():
                tar.add(out / name / "probe", arcname=f"{name}/probe")
        folder = Path("grpo_pilot_full") / "ckpt" / "_actor" / f"global_step{CUT}"
        for f in sorted((out / folder).glob("*model_states.pt")):
            tar.add(f, arcname=str(folder / f.name))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("mode", choices=("train", "check"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="train: which launches, in order")
    parser.add_argument("--timeout", type=int, default=280, help="train: seconds per launch")
    parser.add_argument("--torch-adam", action="store_true",
                        help="train: torch's AdamW in DeepSpeed instead of FusedAdam (a fallback where DeepSpeed cannot "
                        "compile FusedAdam just in time; see openrlhf_site/sitecustomize.py)")
    parser.add_argument("--weight-sync", choices=("ipc", "gloo"), default="ipc",
                        help="train: ipc (OpenRLHF's colocated default: CUDA IPC handles) or gloo (--vllm.sync_backend "
                        "gloo: OpenRLHF's broadcast path, over the stand-in's gloo group; a fallback where CUDA IPC "
                        "fails; see openrlhf_site/vllm/distributed)")
    parser.add_argument("--archive", type=Path, default=None,
                        help="check: first write what it reads to this .tgz (see archive())")
    ns = parser.parse_args(argv)
    if ns.mode == "train":
        return train(ns.out, ns.runs, ns.timeout, ns.torch_adam, ns.weight_sync)
    if ns.archive is not None:
        archive(ns.out, ns.archive)
    return check(ns.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
