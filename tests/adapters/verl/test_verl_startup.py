"""Start-up decisions on verl's real entry points: legacy trainer, stray options, the three V1 trainer modes.

Real verl, nothing stubbed.  ``verl.trainer.main_ppo.main`` is called with a composed config
(Hydra's config pass-through); a refused config fails inside verl's ``validate_config``, before
``run_ppo`` would start Ray, so no cluster is needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402

import entropy_discriminator.adapters.verl as ed_verl  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


def compose_ppo(overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=MICRO + overrides)


def test_both_entry_points_run_the_check():
    """main_ppo.main and the legacy main_ppo_v0.TaskRunner call the wrapped validate_config."""
    from verl.trainer import main_ppo, main_ppo_v0
    from verl.utils import config as verl_config

    from entropy_discriminator.adapters.verl._startup import startup_check_installed

    assert startup_check_installed()  # loaded through the verl.plugins entry point on `import verl`
    for module in (main_ppo, main_ppo_v0, verl_config):
        assert module.validate_config.__module__ == verl_config.validate_config.__wrapped__.__module__
        assert hasattr(module.validate_config, "__wrapped__")


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.use_v1=false", "trainer.v1.trainer_mode=entropy_disc", "+entropy_disc.method=clip_v"],
        ["trainer.use_v1=false", "trainer.v1.trainer_mode=entropy_disc"],
        ["trainer.use_v1=false", "+entropy_disc.method=clip_b"],
    ],
)
def test_legacy_trainer_is_refused_by_verls_main(overrides):
    from verl.trainer.main_ppo import main

    with pytest.raises(ValueError, match=r"trainer\.use_v1=false selects the legacy trainer .* set trainer\.use_v1=true"):
        main(compose_ppo(overrides))


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_adapter_options_without_an_adapter_trainer_are_refused(mode):
    from verl.trainer.main_ppo import main

    with pytest.raises(ValueError, match=rf"trainer\.v1\.trainer_mode='{mode}' is not an entropy_disc trainer"):
        main(compose_ppo([f"trainer.v1.trainer_mode={mode}", "+entropy_disc.method=clip_b"]))


def test_configs_without_the_adapter_pass_unchanged():
    assert ed_verl.check_config(compose_ppo([])) is None
    assert ed_verl.check_config(compose_ppo(["trainer.use_v1=false"])) is None
    assert ed_verl.check_config(compose_ppo(["trainer.v1.trainer_mode=colocate_async"])) is None


def _trainer(mode: str, extra: list[str]):
    from verl.trainer.ppo.v1 import get_trainer_cls

    ed_verl.register_trainers()
    cfg = compose_ppo([f"trainer.v1.trainer_mode={mode}", "+entropy_disc.method=clip_b", *extra])
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = "unused"
    return get_trainer_cls(mode)(cfg), cfg


SEPARATE = [
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.v1.separate_async.parameter_sync_step=4",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
]


@pytest.mark.parametrize(
    ("mode", "base", "extra", "sync_step"),
    [
        ("entropy_disc", "sync", [], 1),
        ("entropy_disc_colocate_async", "colocate_async", [], 1),
        ("entropy_disc_separate_async", "separate_async", SEPARATE, 4),
    ],
)
def test_the_three_trainer_modes_read_their_base_modes_options(mode, base, extra, sync_step, tmp_path):
    from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync
    from verl.utils.skip.rollout_skip import RolloutTqSkip

    trainer, cfg = _trainer(mode, extra)
    bases = {"sync": PPOTrainerSync, "colocate_async": PPOTrainerColocateAsync, "separate_async": PPOTrainerSeparateAsync}
    assert isinstance(trainer, bases[base]) and trainer.trainer_mode == base
    assert trainer.parameter_sync_step == sync_step
    # verl code that looks options up under the configured name (the rollout-skip cache) sees the base mode's
    local = OmegaConf.merge(cfg.skip.rollout_tq, {"enable": True, "dump_dir": str(tmp_path)})
    skip = RolloutTqSkip(local, cfg)
    assert skip.parameter_sync_step == sync_step
    assert ed_verl.check_config(cfg).base_mode == base  # the alias does not trip the check on a second look


def test_adapter_mode_options_under_the_adapter_name_are_refused():
    cfg = compose_ppo(
        ["trainer.v1.trainer_mode=entropy_disc_separate_async", "+entropy_disc.method=clip_b",
         "+trainer.v1.entropy_disc_separate_async.parameter_sync_step=2"]
    )
    with pytest.raises(ValueError, match=r"trainer\.v1\.entropy_disc_separate_async is set, .* trainer\.v1\.separate_async"):
        ed_verl.check_config(cfg)


def test_distillation_is_refused():
    cfg = compose_ppo(["trainer.v1.trainer_mode=entropy_disc", "+entropy_disc.method=clip_b", "distillation.enabled=true"])
    with pytest.raises(ValueError, match=r"distillation\.enabled=True"):
        ed_verl.check_config(cfg)
