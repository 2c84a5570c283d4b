"""verl 0.9.1's real ``main_ppo`` launch with the adapter, on the device's GPUs: train, then check.

Not collected by pytest; run by hand (tests/gpu/launch_verl_README.md has the commands and the results).

``train --out DIR [--gpus N]`` runs ``python -m verl.trainer.main_ppo`` three times, each with the command line
of an example script (``examples/verl/*.sh``, recorded as ``test_verl_examples.overrides_of`` records it) and the
tiny offline inputs of ``tests/adapters/launch_assets.py`` (a random Qwen2, a BPE tokenizer, GSM8K-layout
parquet), sizes shrunk, on ``N`` GPUs of one node (FSDP, data parallel ``N``):

1. ``grpo_clip_v``: ``grpo_clip_v.sh`` (GRPO, KL loss, so ``drop_token``) with Clip_V at mu 1.5 below and
   above, both sides, ``--steps`` steps;
2. ``gae_pilot_full``: ``ppo_gae_clip_v.sh`` (PPO with GAE and verl's critic) with the autopilot in place of
   Clip_V (target entropy ``--target``, ``max_frac`` 0.25, both sides, ``drop_token``), ``2 * --cut`` steps,
   a checkpoint every ``--cut`` steps;
3. ``gae_pilot_resume``: the same command resumed from ``gae_pilot_full``'s ``global_step_<cut>``
   (``trainer.resume_mode=resume_path``), up to step ``2 * --cut``.

Everything is verl's own: its Hydra config, ``TaskRunnerV1``, the adapter's ``EntropyDiscTrainerSync``, verl's
Ray worker group (the adapter's ``EntropyDiscActorRolloutRefWorker``, FSDP, fp32 parameters), reward loop,
agent loop, TransferQueue, naive weight sync and checkpoints.  Two things stand in: the critic loads with SDPA
attention (``verl_sdpa_critic.py``: verl 0.9.1 writes flash-attn, which is not installed, into its value-model
loader), and the rollout engine:
``tests/adapters/verl/hf_rollout.py`` (HF generation), registered through verl's rollout registries
(``actor_rollout_ref.rollout.name=hf``).  ``verl_launch_probe.py``, which verl loads in every process
(``VERL_USE_EXTERNAL_MODULES``), records what the adapter computed: per step in the driver (the inputs and
outputs of its advantage step, the controller's state before and after), per micro-batch in each worker (the
engine hook's three fields) and at each checkpoint; verl's own file logger keeps every metric it logged.

``check --out DIR`` (one process, afterwards, CPU is enough) checks the runs found in ``DIR`` (``train --only``
trains some), per run and step:

* **the adapter acted in the workers**: every response token's ``(log p, H, E_p[S])`` that the driver masked
  with is a triple the engine hook returned in a worker during that step's old-log-prob pass, and with
  ``N > 1`` GPUs every rank contributed tokens to every step;
* **one-process recomputation**: the keep-mask equals the core library's on the whole batch
  (``EntropyDiscConfig.compute_mask``; the autopilot: a fresh controller loaded with the recorded state before
  the step, whose state after must equal the recorded one), exactly in the statistics' fp32 (float64: the
  count of differences is reported); at step 1 of the runs that start from the initial weights, the hook's
  per-token ``log p``, ``H`` and ``E_p[S]`` over the whole batch (all ranks' rows) equal a float64 forward of
  the initial model in this process (``--tol``);
* verl logged the adapter's ``entropy_disc/*`` metrics at every step, and ``entropy_disc/clip/frac`` is the
  recomputed share; the rollout generated every step with the weights verl synced after the previous step;
* **the resume continued the controller**: ``gae_pilot_full``'s checkpoint at ``--cut`` holds the controller's
  state that the run carried into step ``--cut + 1`` (after step ``--cut``'s mask and law calibration; in the probe
  and in ``entropy_disc_autopilot.json``), the resumed run loaded exactly that state and started its step
  ``--cut + 1`` from it, and verl's resumed dataloader gave it the
  prompts of the uninterrupted run's steps (the responses are sampled anew, so later states are not compared);
* Clip_V clipped some tokens (the comparisons are not vacuous).

It prints a table and the ``entropy_disc/*`` metrics per step, and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

HERE = pathlib.Path(__file__).resolve().parent
ADAPTER_TESTS = HERE.parent / "adapters" / "verl"
sys.path[:0] = [str(HERE.parent / "adapters"), str(ADAPTER_TESTS)]

RUNS = ("grpo_clip_v", "gae_pilot_full", "gae_pilot_resume")
CLIP_V = {"method": "clip_v", "mu_low": 1.5, "mu_high": 1.5, "sides": "both"}
PILOT = {"method": "autopilot", "max_frac": 0.25, "sides": "both", "mask_mode": "drop_token"}
#: The examples' sizes shrunk to the tiny model (per GPU: micro-batches of 2 sequences).
SHRUNK = [
    "data.train_batch_size=4", "data.val_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.optim.lr=1e-4", "critic.optim.lr=1e-4",
    "trainer.total_epochs=100", "trainer.test_freq=-1", "trainer.val_before_train=False",
    "trainer.logger=[console,file]", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "data.dataloader_num_workers=0", f"reward.custom_reward_function.path={pathlib.Path(__file__).resolve()}",
    "+ray_kwargs.ray_init.include_dashboard=False",
    # the stand-in rollout (tests/adapters/verl/hf_rollout.py), with its log-probs (the autopilot's ratio r)
    "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.calculate_log_probs=True",
    # fp32 parameters, no autocast: the hook's statistics can be checked against float64 to fp32 rounding
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    # verl asks for flash-attn by default, which the device does not have (the critic: verl_sdpa_critic.py)
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
]
#: CPU smoke runs only: FSDP1 refuses CPU modules (``sync_module_states``); FSDP2 runs them over gloo.
CPU_SMOKE = ["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2", "critic.strategy=fsdp2"]
N_TRAIN, N_TEST = 64, 8
FIELDS = ("old_log_probs", "entropy", "s_expected")  # entropy_disc_step's names of the hook's three fields


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None,
                  **kwargs: Any) -> float:
    """The runs' reward (verl's ``custom_reward_function``): the share of digits among the response's characters.

    GSM8K's exact-answer reward is 0 for every response of the random model, so every advantage would be 0 and
    no mask would have anything to act on; this one varies within each group of responses."""
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))


def _ed(settings: dict[str, Any]) -> list[str]:
    return [f"+entropy_disc.{k}={v}" for k, v in settings.items()]


def _plan(out: pathlib.Path, steps: int, cut: int, target: str) -> list[tuple[str, str, list[str]]]:
    pilot = _ed({**PILOT, "target_entropy": target})
    full = out / "gae_pilot_full" / "ckpt"
    return [
        ("grpo_clip_v", "grpo_clip_v.sh", [*_ed(CLIP_V), f"trainer.total_training_steps={steps}",
                                            "trainer.save_freq=-1"]),
        ("gae_pilot_full", "ppo_gae_clip_v.sh", [*pilot, f"trainer.total_training_steps={2 * cut}",
                                                  f"trainer.save_freq={cut}"]),
        ("gae_pilot_resume", "ppo_gae_clip_v.sh", [*pilot, f"trainer.total_training_steps={2 * cut}",
                                                    f"trainer.save_freq={cut}", "trainer.resume_mode=resume_path",
                                                    f"trainer.resume_from_path={full / f'global_step_{cut}'}"]),
    ]


# ------------------------------------------------------------------------------------------------- train


def _overrides(script: str, assets: pathlib.Path, run_dir: pathlib.Path, gpus: int, extra: list[str]) -> list[str]:
    from test_verl_examples import overrides_of
    from test_verl_launch import _merged

    base = overrides_of(script, DATA_DIR=str(assets / "data"), MODEL=str(assets / "model"), N_GPUS=str(gpus))
    if any(e.startswith("+entropy_disc.method=autopilot") for e in extra):
        base = [o for o in base if not o.startswith("+entropy_disc.mu_low=")]  # Clip_V's bound, not the autopilot's
    own = [f"trainer.default_local_dir={run_dir / 'ckpt'}", f"hydra.run.dir={run_dir / 'hydra'}"]
    return _merged(base, [*SHRUNK, *own, *extra])


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "verl", "ray", "tensordict", "TransferQueue", "entropy-discriminator"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def train(out: pathlib.Path, gpus: int, steps: int, cut: int, target: str, only: list[str], cpu_smoke: bool) -> int:
    from launch_assets import write_model, write_verl_parquet

    assets = out / "assets"
    if not (assets / "model" / "config.json").exists():
        write_model(assets / "model")
        write_verl_parquet(assets / "data" / "train.parquet", N_TRAIN, "train")
        write_verl_parquet(assets / "data" / "test.parquet", N_TEST, "test")
    cuda = torch.cuda.is_available()
    meta = {"gpus": gpus, "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda
            else ["cpu"], "versions": _versions(), "steps": steps, "cut": cut, "target": target,
            "python": sys.version.split()[0]}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta), flush=True)
    for name, script, extra in _plan(out, steps, cut, target):
        if only and name not in only:
            continue
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts clean (its records would mix with the last ones)
        probes = run_dir / "probe"
        probes.mkdir(parents=True)
        env = {
            **os.environ,
            "RAY_ADDRESS": "local",  # a cluster of its own
            "VERL_USE_EXTERNAL_MODULES": "hf_rollout,verl_sdpa_critic,verl_launch_probe",
            "ED_VERL_PROBE_DIR": str(probes),
            "VERL_FILE_LOGGER_PATH": str(run_dir / "metrics.jsonl"),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ADAPTER_TESTS), os.environ.get("PYTHONPATH", "")]),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
        }
        if cpu_smoke:
            env.update({
                "ED_VERL_CPU_GLOO": "1", "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda",
                "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 8, "GPU": gpus}),
                "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform," + env["VERL_USE_EXTERNAL_MODULES"],
            })
        extra = [*extra, *(CPU_SMOKE if cpu_smoke else [])]
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *_overrides(script, assets, run_dir, gpus, extra)]
        (run_dir / "command.json").write_text(json.dumps(cmd, indent=1))
        start = time.time()
        with open(run_dir / "train.log", "w") as log:
            rc = subprocess.run(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"{name}: exit {rc} after {time.time() - start:.0f} s; {len(list(probes.iterdir()))} probe records",
              flush=True)
        if rc != 0:
            print((run_dir / "train.log").read_text()[-6000:], flush=True)
            return rc
    return 0


# ------------------------------------------------------------------------------------------------- check


def _records(run_dir: pathlib.Path, kind: str) -> list[dict[str, Any]]:
    files = sorted((run_dir / "probe").glob(f"{kind}-*.pt"), key=lambda p: (p.name.split("-")[1], p.stat().st_mtime_ns))
    return [torch.load(p, weights_only=False) for p in files]


def _metrics(run_dir: pathlib.Path) -> dict[int, dict[str, float]]:
    """verl's file logger: global step -> every metric logged there."""
    out: dict[int, dict[str, float]] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        out.setdefault(int(row["step"]), {}).update(row["data"])
    return out


def _triples(fields: dict[str, torch.Tensor], valid: torch.Tensor | None = None) -> set[tuple[float, float, float]]:
    """The ``(log p, H, E_p[S])`` triples of the positions (``valid``: only those) as exact Python floats."""
    cols = [fields[k].float().reshape(-1) for k in ("logp", "entropy", "s_expected")] if "logp" in fields else \
        [fields[k].float().reshape(-1) for k in FIELDS]
    stacked = torch.stack(cols, dim=1)
    if valid is not None:
        stacked = stacked[valid.reshape(-1)]
    return {tuple(row) for row in stacked.tolist()}


def _worker_share(rec: dict[str, Any], hooks: list[dict[str, Any]]) -> tuple[int, dict[int, int]]:
    """Tokens of the driver's batch whose triple no hook call of the step's old-log-prob pass returned, and per
    rank the number of tokens found among that rank's triples."""
    start, end = rec["window"]
    per_rank: dict[int, set] = {}
    for h in hooks:
        if start <= h["time"] <= end:
            per_rank.setdefault(h["rank"], set()).update(_triples(h["fields"]))
    valid = rec["inputs"]["response_mask"].bool()
    tokens = _triples({k: rec["inputs"][k] for k in FIELDS}, valid)
    tokens_list = torch.stack([rec["inputs"][k].float()[valid] for k in FIELDS], dim=1).tolist()
    found = {rank: sum(tuple(t) in s for t in tokens_list) for rank, s in sorted(per_rank.items())}
    union = set().union(*per_rank.values()) if per_rank else set()
    return len(tokens - union), found


def _recompute(rec: dict[str, Any], dtype: torch.dtype) -> tuple[torch.Tensor, dict | None]:
    """The keep-mask of one process on the whole batch from the recorded fields, with the core library; and the
    controller's state after it (autopilot)."""
    from entropy_discriminator import discriminator_score

    x = rec["inputs"]
    valid = x["response_mask"].bool()
    zero = torch.zeros((), dtype=dtype)
    logp, h = (torch.where(valid, x[k].to(dtype), zero) for k in ("old_log_probs", "entropy"))
    s_star = discriminator_score(logp, h, check=False)
    s_c = torch.where(valid, s_star - x["s_expected"].to(dtype), zero)
    adv = x["advantages"].to(dtype)
    options = rec["options"]
    if options.method != "autopilot":
        return options.compute_mask(advantages=adv, valid=valid, s_star=s_star, s_centered=s_c).keep, None
    ratio = None
    if x.get("rollout_log_probs") is not None:
        ratio = torch.where(valid, (logp - x["rollout_log_probs"].to(dtype)).exp(), zero)
    pilot = options.build_autopilot(vocab_size=rec["vocab_size"])
    pilot.load_state_dict(rec["before"])
    result = pilot.step(adv, s_centered=s_c, entropy=h, valid=valid, lr=rec["eta"], ratio=ratio)
    return result.mask.keep, pilot.state_dict()


def _initial_stats(rec: dict[str, Any], model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    """``log p``, ``H`` and ``E_p[S]`` of every response token of the batch, padded ``[B, T]`` like the driver's
    fields, from a float64 forward of the initial model on prompt + response (one process, whole batch)."""
    from transformers import AutoModelForCausalLM

    from entropy_discriminator import token_stats

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    shape = rec["inputs"]["response_mask"].shape
    out = {k: torch.zeros(shape, dtype=torch.float64) for k in ("logp", "entropy", "s_expected")}
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(rec["prompts"], rec["responses"])):
            ids = torch.tensor([p + r])
            logits = model(input_ids=ids).logits[0, len(p) - 1:len(p) + len(r) - 1] / rec["temperature"]
            stats = token_stats(logits, torch.tensor(r))
            for k in out:
                out[k][i, :len(r)] = getattr(stats, k)
    return out


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def check(out: pathlib.Path, tol: float) -> int:
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    meta = json.loads((out / "meta.json").read_text())
    cut, gpus = meta["cut"], meta["gpus"]
    print(f"devices: {meta['devices']}; {gpus} GPU(s) per run (FSDP, data parallel {gpus}); "
          f"versions {meta['versions']}")
    print(f"{'run':<17}{'step':>5}{'rows':>6}{'valid':>7}{'clipped':>8}{'frac':>8}{'diff':>6}{'diff64':>7}{'state':>7}"
          f"{'unmatched':>10}{'  tokens per rank':<22}{'weights':>8}{'logged frac':>12}")
    present = [name for name in RUNS if (out / name / "probe").is_dir()]
    expect(bool(present), f"{out}: no run's records")
    runs = {}
    for name in present:
        run_dir = out / name
        drivers, hooks = _records(run_dir, "driver"), _records(run_dir, "hook")
        ckpts, logged = _records(run_dir, "ckpt"), _metrics(run_dir)
        runs[name] = (drivers, ckpts, logged)
        first = cut + 1 if name == "gae_pilot_resume" else 1
        last = meta["steps"] if name == "grpo_clip_v" else 2 * cut
        expect([r["step"] for r in drivers] == list(range(first, last + 1)),
               f"{name}: advantage steps {[r['step'] for r in drivers]}, expected {first}..{last}")
        expect(bool(hooks), f"{name}: the engine hook never ran in a worker")
        clipped_total = 0
        for rec in drivers:
            step, valid = rec["step"], rec["inputs"]["response_mask"].bool()
            unmatched, per_rank = _worker_share(rec, hooks)
            expect(unmatched == 0, f"{name} step {step}: {unmatched} tokens' statistics were not computed by a worker")
            expect(sorted(per_rank) == list(range(gpus)) and all(n > 0 for n in per_rank.values()),
                   f"{name} step {step}: tokens per worker rank {per_rank} (expected every one of {gpus} ranks)")
            keep, after = _recompute(rec, torch.float32)
            keep64, _ = _recompute(rec, torch.float64)
            diff, diff64 = int((keep != rec["keep"]).sum()), int((keep64 != rec["keep"]).sum())
            expect(diff == 0, f"{name} step {step}: {diff} mask entries differ from the one-process recomputation")
            clipped = int((~rec["keep"] & valid).sum())
            clipped_total += clipped
            state = "-"
            if after is not None:
                same = _flat(after) == _flat(rec["after"])
                expect(same, f"{name} step {step}: the controller's state differs from the recomputation's")
                state = "equal" if same else "DIFF"
            frac = clipped / max(1, int(valid.sum()))
            logged_frac = logged.get(step, {}).get("entropy_disc/clip/frac", math.nan)
            expect(abs(logged_frac - frac) < 1e-6, f"{name} step {step}: logged entropy_disc/clip/frac {logged_frac} "
                                                   f"is not the recomputed {frac}")
            expect(any(k.startswith("entropy_disc/") for k in logged.get(step, {})),
                   f"{name} step {step}: verl logged no entropy_disc/* metric")
            versions = {t.get(k) for t in rec["tags"] for k in ("min_global_steps", "max_global_steps")}
            expect(versions == {step - 1}, f"{name} step {step}: the rollout used weights of steps {versions}, "
                                           f"expected {step - 1}")
            print(f"{name:<17}{step:>5}{valid.size(0):>6}{int(valid.sum()):>7}{clipped:>8}{frac:>8.4f}{diff:>6}"
                  f"{diff64:>7}{state:>7}{unmatched:>10}  {json.dumps(per_rank):<20}{sorted(versions)[0]!s:>8}"
                  f"{logged_frac:>12.4f}")
            if step == 1:
                ref = _initial_stats(rec, out / "assets" / "model")
                worst = {k: float((ref[k] - rec["inputs"][f].double()).abs()[valid].max())
                         for k, f in zip(("logp", "entropy", "s_expected"), FIELDS)}
                expect(all(v <= tol for v in worst.values()),
                       f"{name} step 1: the workers' statistics differ from the one-process float64 forward {worst}")
                print(f"{'':<17}step 1, whole batch ({valid.size(0)} rows from {gpus} rank(s)) against a float64 "
                      f"forward of the initial model in one process: max |diff| " +
                      ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + f" (tolerance {tol:g})")
        if name == "grpo_clip_v":
            expect(clipped_total > 0, f"{name}: Clip_V clipped no token at any step (the mask check is vacuous)")
    if {"gae_pilot_full", "gae_pilot_resume"} <= set(present):
        _check_resume(out, cut, runs, expect)
    print("entropy_disc/* metrics verl logged (driver, per step):")
    for name in present:
        for step, row in sorted(runs[name][2].items()):
            ed = {k.removeprefix("entropy_disc/"): round(v, 6) if isinstance(v, float) else v
                  for k, v in sorted(row.items()) if k.startswith("entropy_disc/")}
            print(f"  {name} step {step}: {json.dumps(ed)}")
    for f in failures:
        print("FAIL:", f)
    print(f"runs checked: {present}")
    print("ALL CHECKS PASSED" if not failures else f"{len(failures)} CHECK(S) FAILED")
    return 1 if failures else 0


def _check_resume(out: pathlib.Path, cut: int, runs: dict[str, tuple], expect: Any) -> None:
    """The resumed autopilot run continued the uninterrupted run's controller (see the module docstring).

    The state that must cross the checkpoint is the one the uninterrupted run carried into step ``cut + 1``:
    after step ``cut``'s advantage step and the law calibration of its actor update (the adapter saves after both)."""
    full, full_ckpts, _ = runs["gae_pilot_full"]
    resumed, resumed_ckpts, _ = runs["gae_pilot_resume"]
    nxt = next((r for r in full if r["step"] == cut + 1), None)
    carried = None if nxt is None else nxt["before"]
    saved = [c for c in full_ckpts if c["event"] == "save" and c["step"] == cut]
    expect(carried is not None and len(saved) == 1 and saved[0]["state"] == carried,
           f"gae_pilot_full: the checkpoint at step {cut} does not hold the state the run carried into step {cut + 1}")
    file = out / "gae_pilot_full" / "ckpt" / f"global_step_{cut}" / "entropy_disc_autopilot.json"
    on_disk = json.loads(file.read_text()) if file.exists() else {}
    expect(on_disk.get("global_step") == cut and carried is not None and
           _flat(on_disk.get("autopilot", {})) == _flat(json.loads(json.dumps(carried))),
           f"{file}: not the state the run carried into step {cut + 1}")
    loaded = [c for c in resumed_ckpts if c["event"] == "load"]
    loaded_ok = len(loaded) == 1 and loaded[0]["step"] == cut and carried is not None and loaded[0]["state"] == carried
    expect(loaded_ok, "gae_pilot_resume: the resumed run did not load the controller's state of the checkpoint")
    started_ok = bool(resumed) and carried is not None and resumed[0]["step"] == cut + 1 and \
        resumed[0]["before"] == carried
    expect(started_ok, "gae_pilot_resume: its first step did not start from the checkpoint's controller state")
    same_prompts = [sorted(map(tuple, a["prompts"])) == sorted(map(tuple, b["prompts"]))
                    for a, b in zip([r for r in full if r["step"] > cut], resumed)]
    expect(len(same_prompts) == cut and all(same_prompts),
           f"gae_pilot_resume: the resumed steps' prompts differ from the uninterrupted run's ({same_prompts})")
    if carried is not None:
        print(f"resume: global_step_{cut} holds the controller the run carried into step {cut + 1} (its step "
              f"{carried.get('step')}, h_start {carried.get('h_start')}); the resumed run loaded it: {loaded_ok}; "
              f"started step {cut + 1} from it: {started_ok}; steps {cut + 1}-{2 * cut} drew the uninterrupted "
              f"run's prompts: {same_prompts}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("mode", choices=("train", "check"))
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per run (FSDP data parallel)")
    parser.add_argument("--steps", type=int, default=5, help="Clip_V steps")
    parser.add_argument("--cut", type=int, default=3, help="autopilot checkpoint step (its runs take 2 * cut)")
    parser.add_argument("--target", default="5.0", help="the autopilot's target entropy (nats/token, or hold)")
    parser.add_argument("--only", default="", help="comma-separated runs to train (default: all)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: gloo process group, GPUs declared to Ray only (a smoke run of the flow)")
    parser.add_argument("--tol", type=float, default=1e-4, help="step-1 statistics against float64")
    ns = parser.parse_args(argv)
    for name, value in (("--gpus", ns.gpus), ("--steps", ns.steps), ("--cut", ns.cut)):
        if value < 1:
            parser.error(f"{name} must be >= 1 (got {value})")
    only = [r for r in ns.only.split(",") if r]
    unknown = sorted(set(only) - set(RUNS))
    if unknown:
        parser.error(f"--only: unknown runs {unknown}; choose from {list(RUNS)}")
    if ns.mode == "train":
        ns.out.mkdir(parents=True, exist_ok=True)
        return train(ns.out.resolve(), ns.gpus, ns.steps, ns.cut, ns.target, only, ns.cpu_smoke)
    return check(ns.out, ns.tol)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
