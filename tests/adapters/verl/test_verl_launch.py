"""verl's real ``main_ppo`` launch, into its Ray workers, on a CPU.

Each launch is the example script's own command line (``examples/verl/*.sh``, recorded as in
test_verl_examples.py) with the tiny offline inputs of ``launch_assets`` (a random Qwen2, a BPE
tokenizer trained here, GSM8K-layout parquet) and the sizes shrunk, run as
``python -m verl.trainer.main_ppo`` in a subprocess: the driver, verl's ``TaskRunnerV1`` actor and
the colocated ``WorkerDict`` actor are separate processes of a private local Ray cluster
(``RAY_ADDRESS=local``; ``RAY_OVERRIDE_RESOURCES`` declares one GPU, which Ray only counts).

What each process did is written by ``launch_probe.py``, which verl itself loads in every process
(``VERL_USE_EXTERNAL_MODULES``): the TaskRunner's trainer is the adapter's with the user's settings,
the workers are the adapter's with the engine hook installed.  The control launch (the same
command with verl's ``sync`` trainer and no ``entropy_disc`` options) gets verl's own workers with
no hook.

Where it stops: the worker's ``init_model`` builds verl's ``TrainingWorker``, whose
``initialize_global_process_group_ray`` calls ``torch.distributed.init_process_group`` with the
backend ``cpu:gloo,cuda:nccl`` that verl takes from its platform (no setting selects another), and
this CPU torch has no NCCL; the probe checks the worker reached that call with the hook live, and
the test checks that error is what ended the launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from launch_assets import write_model, write_verl_parquet  # noqa: E402
from ray_local import STALE_ADDRESS, bootstrap_file, plain_init_outcome  # noqa: E402
from test_verl_examples import overrides_of  # noqa: E402

from entropy_discriminator.adapters.verl import _engine  # noqa: E402

WORKER = "entropy_discriminator.adapters.verl._workers.EntropyDiscActorRolloutRefWorker"
STOCK_WORKER = "verl.workers.engine_workers.ActorRolloutRefWorker"
STOCK_SYNC = "verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync"
#: The example's sizes, shrunk to the tiny model on 2 CPU cores.
SHRUNK = [
    "data.train_batch_size=4", "data.val_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=2", "trainer.total_epochs=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1", "+ray_kwargs.ray_init.include_dashboard=False",
]
#: Where the launch stops on a CPU (see the module doc).
STOP = "Distributed package doesn't have NCCL built in"


def _merged(overrides: list[str], extra: list[str]) -> list[str]:
    """``overrides`` with every key that ``extra`` sets replaced by ``extra``'s value (Hydra takes a key once)."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + extra


def launch(tmp: Path, script: str, extra: list[str] = (), *, control: bool = False):
    """Run ``script``'s ``main_ppo`` command (shrunk, plus ``extra``; ``control``: verl's ``sync`` trainer and no
    ``entropy_disc`` option); returns the finished process and the probe's plan and worker records."""
    model = write_model(tmp / "model")
    write_verl_parquet(tmp / "data" / "train.parquet", 8, "train")
    write_verl_parquet(tmp / "data" / "test.parquet", 4, "test")
    overrides = _merged(overrides_of(script, DATA_DIR=str(tmp / "data"), MODEL=str(model)),
                        [*SHRUNK, f"hydra.run.dir={tmp / 'hydra'}", *extra])
    if control:
        overrides = _merged([o for o in overrides if "entropy_disc." not in o], ["trainer.v1.trainer_mode=sync"])
    probes = tmp / "probe"
    probes.mkdir()
    env = {
        **os.environ,
        "RAY_ADDRESS": "local",  # a new cluster of its own, whatever ray_current_cluster or RAY_ADDRESS say
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 8, "GPU": 1}),
        "VERL_USE_EXTERNAL_MODULES": "launch_probe",
        "ED_LAUNCH_PROBE_DIR": str(probes),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=900)
    records = [json.loads(p.read_text()) | {"file": p.name} for p in sorted(probes.iterdir())]
    return proc, [r for r in records if r["file"].startswith("plan")], [r for r in records if r["file"].startswith("worker")]


#: The user's settings of each launch, on top of the example's (non-default values, so that a launch that
#: lost them would show it): GRPO with Clip_V, PPO-GAE with Clip_B.
GRPO = {"method": "clip_v", "mu_low": 1.75, "mu_high": float("inf"), "sides": "both", "mask_mode": "drop_token"}
GAE = {"method": "clip_b", "mu_low": 3.0, "mu_high": 4.0, "sides": "negative", "mask_mode": "drop_token"}


def _ed(settings: dict) -> list[str]:
    return [f"+entropy_disc.{k}={v}" for k, v in settings.items() if k != "mu_high" or v != float("inf")]


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("grpo"), "grpo_clip_v.sh", _ed(GRPO))


@pytest.fixture(scope="module")
def gae(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("gae"), "ppo_gae_clip_b.sh", _ed(GAE))


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("sync"), "grpo_clip_v.sh", control=True)


def _actor_worker(record: dict) -> list[str]:
    """The class hierarchy of the actor worker the colocated ``WorkerDict`` holds (its role key depends on the config)."""
    found = [mro for key, mro in record["workers"].items() if key != "_self" and STOCK_WORKER in mro]
    assert len(found) == 1, record["workers"]
    return found[0]


def _stopped_at_the_process_group(proc) -> None:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert STOP in proc.stderr, proc.stderr[-4000:]  # and nothing before it failed


@pytest.mark.parametrize("name", ["grpo", "gae"])
def test_launch_reaches_the_workers_with_the_users_settings(name, request):
    """The driver's start-up check and the TaskRunner's trainer hold the user's settings; the worker process
    runs the adapter's worker with the engine hook installed when it reaches the process group."""
    proc, plans, workers = request.getfixturevalue(name)
    settings = {"grpo": GRPO, "gae": GAE}[name]
    _stopped_at_the_process_group(proc)
    driver = [p for p in plans if p["function"] == "validate_config"]
    runner = [p for p in plans if p["caller"] and p["caller"][0].endswith("_trainer.EntropyDiscTrainerSync")]
    assert len(driver) == 1 and len(runner) == 1, plans
    assert driver[0]["options"] == settings and runner[0]["options"] == settings
    assert runner[0]["base_mode"] == "sync" and runner[0]["sync"] == STOCK_SYNC  # verl's own sync trainer, untouched
    assert len(workers) == 1, workers
    worker = workers[0]
    assert len({driver[0]["pid"], runner[0]["pid"], worker["pid"]}) == 3  # three processes
    assert _actor_worker(worker)[:2] == [WORKER, STOCK_WORKER]
    assert worker["hook"] and worker["prepare_model_outputs"] == _engine.__file__
    assert worker["backend"] == "cpu:gloo,cuda:nccl" and worker["error"].endswith(STOP)


def test_sync_control_is_stock(control):
    """The same launch with verl's ``sync`` trainer and no entropy_disc option: verl's own worker, no hook."""
    proc, plans, workers = control
    _stopped_at_the_process_group(proc)
    assert [p["options"] for p in plans] == [None]  # only the driver's check ran, and it chose nothing
    assert len(workers) == 1
    worker = workers[0]
    assert _actor_worker(worker)[0] == STOCK_WORKER
    assert not worker["hook"]
    assert worker["prepare_model_outputs"].endswith("verl/workers/engine/fsdp/transformer_impl.py")


def test_launches_ignore_a_stale_ray_bootstrap_file(stale_ray_bootstrap, grpo):
    """The session's stale ``ray start`` bootstrap file is live (a plain ``ray.init`` follows it and refuses), and
    the launch above still started its own cluster."""
    assert bootstrap_file(stale_ray_bootstrap).read_text() == STALE_ADDRESS
    assert "When connecting to an existing cluster" in plain_init_outcome()
    assert "Started a local Ray instance" in grpo[0].stdout + grpo[0].stderr
