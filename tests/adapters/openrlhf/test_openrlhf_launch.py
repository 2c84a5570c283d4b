"""The adapter's launcher (``python -m entropy_discriminator.adapters.openrlhf``) into OpenRLHF's policy actor, on a CPU.

Each launch is an example script's own argument list (``examples/openrlhf/*.sh`` with
``ED_PRINT_ARGS=1``) with the tiny offline inputs of ``launch_assets`` (a random Qwen2, a BPE
tokenizer trained here, GSM8K-style prompts) and the sizes shrunk, run in a subprocess through the
launcher and OpenRLHF's real ``train_ppo_ray``: the driver, OpenRLHF's ``PPOTrainer`` actor and the
``PolicyModelActor`` are separate processes of a private local Ray cluster (``RAY_ADDRESS=local``;
``RAY_OVERRIDE_RESOURCES`` declares one GPU, which Ray only counts).  ``--vllm.num_engines 0``: no
rollout engine (vLLM is GPU-only; nothing is generated before the stop).

``launch_site/sitecustomize.py`` is on ``PYTHONPATH`` of every process: it stands in for
``flash_attn``, ``ring_flash_attn`` and ``vllm`` (not installable on a CPU; only where missing and only
for OpenRLHF's own imports) and probes ``DeepspeedStrategy.setup_distributed``, the first call of
``PolicyModelActor.init_model_from_pretrained``: the probe records, inside the actor's process, that
``ActorPPOTrainer.ppo_train`` and ``Actor.forward`` are the adapter's wrappers and that the settings of
the command line arrived.  Where it stops: ``setup_distributed`` calls ``torch.cuda.set_device(local_rank)``
(and then builds a ``"cuda"`` device mesh); OpenRLHF has no setting for a CPU backend, so that call ends
the launch, and the test checks it did.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.version import Version

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from test_openrlhf import EXAMPLES  # noqa: E402  (skips or fails like it without OpenRLHF)

from launch_assets import write_model, write_prompts_jsonl  # noqa: E402
from ray_local import STALE_ADDRESS, bootstrap_file, plain_init_outcome  # noqa: E402

from entropy_discriminator.adapters.openrlhf import _experience, _launch, _patch  # noqa: E402

#: The example's sizes shrunk to the tiny model, no vLLM engine, no TensorBoard; the examples' own default of
#: one GPU (shared by the colocated models) is kept.
SHRUNK = [
    "--vllm.num_engines", "0", "--data.max_len", "128", "--rollout.max_new_tokens", "16",
    "--data.max_samples", "8", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2",
    "--train.batch_size", "4", "--train.micro_batch_size", "1", "--logger.tensorboard_dir", "",
    "--data.input_key", "prompt", "--data.label_key", "answer",
]
STOP = "torch.cuda.set_device(local_rank)"
#: OpenRLHF 0.10.x's ``train_ppo_ray`` assigns ``max_len`` only inside its vLLM branch, so a launch without a rollout
#: engine (the only kind a CPU can start) ends in ``UnboundLocalError`` in the driver before any worker exists
#: (0.11 assigns it first). On 0.10.x the launch cannot reach the policy actor on a CPU.
REACHES_WORKERS = pytest.mark.skipif(
    Version(version("openrlhf")) < Version("0.11"),
    reason="OpenRLHF 0.10.x: train_ppo_ray without vLLM engines fails on max_len before any worker starts",
)
REWARD = "def reward_func(queries, prompts, labels):\n    return [0.0 for _ in queries]\n"


def launch(tmp: Path, script: str, method: str, settings: dict,
           extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``script``'s launch (shrunk, with ``settings`` as ``--entropy_disc.*`` flags, then ``extra``); returns the
    finished process and the probe's records."""
    argv = subprocess.run(["bash", str(EXAMPLES / script), method], env={**os.environ, "ED_PRINT_ARGS": "1"},
                          capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    model = write_model(tmp / "model")
    (tmp / "reward.py").write_text(REWARD)
    ours = [str(x) for k, v in settings.items() for x in (f"--entropy_disc.{k}", v)]
    argv += [
        *SHRUNK, "--actor.model_name_or_path", str(model),
        "--reward.remote_url", str(tmp / "reward.py"), "--data.prompt_dataset", str(write_prompts_jsonl(tmp / "p.jsonl", 8)),
        "--ckpt.output_dir", str(tmp / "out"), "--ckpt.path", str(tmp / "out" / "ckpt"), *ours,
    ]
    if script == "ppo_gae.sh":  # its critic starts from the policy
        argv += ["--critic.model_name_or_path", str(model)]
    argv += list(extra)
    probes = tmp / "probe"
    probes.mkdir()
    env = {
        **os.environ,
        "RAY_ADDRESS": "local",  # a new cluster of its own, whatever ray_current_cluster or RAY_ADDRESS say
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 4, "GPU": 1}),
        "ED_LAUNCH_PROBE_DIR": str(probes),
        "PYTHONPATH": os.pathsep.join([str(HERE / "launch_site"), os.environ.get("PYTHONPATH", "")]),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run([sys.executable, "-m", "entropy_discriminator.adapters.openrlhf", *argv], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=900)
    return proc, [json.loads(p.read_text()) for p in sorted(probes.glob("worker-*.json"))]


#: The user's settings of each launch (non-default values, so that a launch that lost them would show it).
GRPO = {"method": "clip_v", "mu_low": 1.75, "mu_high": math.inf, "sides": "both", "mask_mode": "drop_token"}
GAE = {"method": "clip_b", "mu_low": 3.0, "mu_high": 4.0, "sides": "negative", "mask_mode": "drop_token"}


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("grpo"), "grpo.sh", "clip_v", {k: v for k, v in GRPO.items() if k != "mu_high"})


@pytest.fixture(scope="module")
def gae(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("gae"), "ppo_gae.sh", "clip_b", GAE)


@REACHES_WORKERS
@pytest.mark.parametrize("name", ["grpo", "gae"])
def test_launch_reaches_the_policy_actor_with_the_patch_and_settings(name, request):
    proc, records = request.getfixturevalue(name)
    assert proc.returncode != 0 and STOP in proc.stderr, (proc.stdout[-3000:], proc.stderr[-5000:])
    policy = [r for r in records if any(s.endswith("ppo_actor.PolicyModelActor") for s in r["selves"])]
    assert len(policy) == 1, records
    actor = policy[0]
    assert actor["pid"] != os.getpid() and actor["patched"]
    assert actor["ppo_train"] == _patch.__file__  # ActorPPOTrainer.ppo_train is the adapter's wrapper
    assert actor["forward"] == _experience.__file__  # Actor.forward too
    assert actor["settings"] == {"grpo": GRPO, "gae": GAE}[name] and actor["realised"] is False
    assert "_cuda_setDevice" in actor["error"]  # the CPU torch has no CUDA runtime: torch.cuda.set_device fails
    # both examples use the KL loss: the reference actor's process never imports the trainer module, so stays stock
    reference = [r for r in records if any(s.endswith("ReferenceModelActor") for s in r["selves"])]
    assert len(reference) == 1 and not reference[0]["patched"] and reference[0]["pid"] != actor["pid"]


def test_launch_ignores_a_stale_ray_bootstrap_file(stale_ray_bootstrap, grpo):
    """The session's stale ``ray start`` bootstrap file is live (a plain ``ray.init`` follows it and refuses), and
    the launch above still started its own cluster."""
    assert bootstrap_file(stale_ray_bootstrap).read_text() == STALE_ADDRESS
    assert "When connecting to an existing cluster" in plain_init_outcome()
    assert "Started a local Ray instance" in grpo[0].stdout + grpo[0].stderr


def test_a_model_group_larger_than_the_machine_stops_the_launch_after_ray_init(tmp_path):
    """OpenRLHF's ``--*.num_gpus_per_node`` default to 8: a group that asks for more GPUs than the Ray instance
    the launch started would wait for them forever. The launch stops right after ``ray.init``, naming the
    setting, before any placement group or worker (OpenRLHF 0.10.x too: its ``max_len`` error comes later)."""
    proc, records = launch(tmp_path, "grpo.sh", "clip_v", {"mu_low": 1.75}, extra=("--ref.num_gpus_per_node", "8"))
    assert proc.returncode != 0 and records == [], (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "error: --ref.num_nodes 1 x --ref.num_gpus_per_node 8 asks for 8 GPU(s)" in proc.stderr, proc.stderr[-3000:]
    assert "Ray sees 1 GPU(s)" in proc.stderr and "--actor.num_nodes" not in proc.stderr  # the actor's 1 fits
    assert "Traceback" not in proc.stderr


def _args(kl: float = 0.0, critic: str | None = None, remote: str | None = "r.py", engines: int | None = 0):
    """The fields of OpenRLHF's hierarchical arguments that ``gpu_demands`` reads."""

    def group(nodes: int, gpus: int, **more) -> SimpleNamespace:
        return SimpleNamespace(num_nodes=nodes, num_gpus_per_node=gpus, **more)

    return SimpleNamespace(
        actor=group(1, 2), ref=group(1, 8), critic=group(2, 4, model_name_or_path=critic),
        reward=group(1, 3, remote_url=remote), algo=SimpleNamespace(kl=SimpleNamespace(init_coef=kl)),
        vllm=SimpleNamespace(num_engines=engines, tensor_parallel_size=2),
    )


def test_gpu_demands_follow_the_groups_train_ppo_ray_creates():
    needs = lambda args: [n for _, n in _launch.gpu_demands(args)]  # noqa: E731
    assert needs(_args()) == [2]  # the actor only: no KL, no critic, a remote reward, no vLLM
    assert needs(_args(kl=0.01)) == [2, 8]  # + the reference model
    assert needs(_args(critic="m")) == [2, 8]  # + the critic: 2 nodes x 4
    assert needs(_args(remote=None)) == [2, 3]  # + the reward model
    assert needs(_args(engines=3)) == [2, 6]  # + 3 vLLM engines of tensor parallel size 2
    assert needs(_args(engines=None)) == [2]  # OpenRLHF's default: no engines
    settings = [s for s, _ in _launch.gpu_demands(_args(kl=0.01, engines=3))]
    assert settings[1] == "--ref.num_nodes 1 x --ref.num_gpus_per_node 8"
    assert settings[2] == "--vllm.num_engines 3 x --vllm.tensor_parallel_size 2"
