"""examples/verl/*.sh: every script's overrides compose with verl 0.9.1's own ppo_trainer config.

Each script is run with ``PYTHON`` pointing at a recorder that prints the arguments verl would
receive; Hydra then composes them exactly as ``python -m verl.trainer.main_ppo`` would (struct
mode: a misspelt or missing verl key fails).  Not run here: the training itself (needs GPUs, the
models and the data sets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from entropy_discriminator.adapters.verl import check_config  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "verl"
CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
RECORDER = "import json, sys; print(json.dumps(sys.argv[3:]))"  # argv: -c, '-m', 'verl...main_ppo', overrides


def overrides_of(script: str, **env: str) -> list[str]:
    rec = Path(os.environ.get("TMPDIR", "/tmp")) / "verl_argv_recorder.sh"
    rec.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{RECORDER}" "$@"\n')
    rec.chmod(0o755)
    out = subprocess.run(
        ["bash", str(EXAMPLES / script)], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHON": str(rec), **env},
    )
    return json.loads(out.stdout)


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.mark.parametrize(
    ("script", "estimator", "method", "mu"),
    [
        ("grpo_clip_b.sh", "grpo", "clip_b", 2.5),
        ("grpo_clip_v.sh", "grpo", "clip_v", 2.5),
        ("ppo_gae_clip_b.sh", "gae", "clip_b", 2.5),
        ("ppo_gae_clip_v.sh", "gae", "clip_v", 2.5),
    ],
)
def test_gsm8k_variants(script, estimator, method, mu):
    cfg = composed(overrides_of(script, DATA_DIR="/data/gsm8k"))
    assert cfg.algorithm.adv_estimator == estimator
    assert cfg.trainer.v1.trainer_mode == "entropy_disc"
    assert cfg.data.train_files == "/data/gsm8k/train.parquet"
    plan = check_config(cfg)  # the start-up decision verl's validate_config runs
    ed = plan.options
    # GRPO quick-start: verl's KL loss acts on every token, so the mask acts as drop_token (logged)
    mode = "drop_token" if estimator == "grpo" else "zero_pg"
    assert (ed.method, ed.mu_low, ed.sides, ed.mask_mode) == (method, mu, "negative", mode)
    assert (plan.mask_mode_reason is not None) == (estimator == "grpo")
    if estimator == "gae":
        assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path
    else:
        assert cfg.actor_rollout_ref.rollout.n == 5


@pytest.mark.parametrize("method", ["clip_b", "clip_v"])
def test_paper_recipe(method):
    cfg = composed(overrides_of("dapo_math_qwen2.5_7b_paper.sh", METHOD=method))
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-7B-Instruct"
    assert cfg.data.train_batch_size == 64 and r.n == 16 and a.optim.lr == 4e-7
    assert r.temperature == 1.0 and r.val_kwargs.temperature == 0.7
    assert list(a.optim.betas) == [0.9, 0.999]
    ed = check_config(cfg).options
    assert ed.method == method and ed.resolved()[0] == {"clip_b": 2.5, "clip_v": 8.5}[method]
    assert ed.mask_mode == "zero_pg"  # no KL loss, no entropy bonus, vanilla loss: zero_pg is exact


@pytest.mark.parametrize(
    "script", ["grpo_clip_b.sh", "grpo_clip_v.sh", "ppo_gae_clip_b.sh", "ppo_gae_clip_v.sh", "dapo_math_qwen2.5_7b_paper.sh"]
)
def test_every_example_runs_on_one_gpu_by_default(script):
    """verl's resource pool asks for trainer.n_gpus_per_node GPUs; the default is one, and vLLM's tensor parallel
    size fits in it (the paper's recipe: 2 on its 8 GPUs, with N_GPUS=8)."""
    cfg = composed(overrides_of(script))
    assert cfg.trainer.n_gpus_per_node == 1 and cfg.trainer.nnodes == 1
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    if script.startswith("dapo"):
        assert cfg.actor_rollout_ref.actor.fsdp_config.param_offload is True
        eight = composed(overrides_of(script, N_GPUS="8"))
        assert eight.trainer.n_gpus_per_node == 8 and eight.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
        assert eight.actor_rollout_ref.actor.fsdp_config.param_offload is False
