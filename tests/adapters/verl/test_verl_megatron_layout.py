"""verl 0.9.1 Megatron runs: the start-up refusal ``megatron_layout_refusal`` on verl's own composed configs.

Real verl (``verl[verl-core]==0.9.1``, installed by ``nox -s verl``): the configs are verl's
``ppo_megatron_trainer`` and ``ppo_trainer`` composed by Hydra.  megatron-core is not installed on
CPU; the Megatron hook itself runs in ``tests/gpu/megatron_tp.py`` (two GPUs, NCCL).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from entropy_discriminator.adapters.verl._megatron import megatron_layout_refusal  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")


def compose_config(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=name, overrides=overrides)


LAYOUTS = [
    [],
    ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
    ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"],
    ["actor_rollout_ref.actor.megatron.context_parallel_size=2"],
    ["actor_rollout_ref.actor.megatron.sequence_parallel=False"],
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", [None, "auto", "torch"])
def test_megatron_layouts_accepted(layout: list[str], impl: str | None) -> None:
    overrides = ["+entropy_disc.method=clip_v", *layout] + ([f"+entropy_disc.impl={impl}"] if impl else [])
    config = compose_config("ppo_megatron_trainer", overrides)
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    assert megatron_layout_refusal(config) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_triton_refused(layout: list[str]) -> None:
    config = compose_config("ppo_megatron_trainer", ["+entropy_disc.method=clip_v", "+entropy_disc.impl=triton", *layout])
    reason = megatron_layout_refusal(config)
    assert reason is not None
    assert "entropy_disc.impl=triton" in reason and "strategy=megatron" in reason


def test_other_strategies_untouched() -> None:
    config = compose_config("ppo_trainer", ["+entropy_disc.method=clip_v", "+entropy_disc.impl=triton"])
    assert config.actor_rollout_ref.actor.strategy != "megatron"
    assert megatron_layout_refusal(config) is None


def test_plain_mapping() -> None:
    config = {"actor_rollout_ref": {"actor": {"strategy": "megatron"}}, "entropy_disc": {"impl": "triton"}}
    assert megatron_layout_refusal(config) is not None
    assert megatron_layout_refusal({"actor_rollout_ref": {"actor": {"strategy": "megatron"}}}) is None
