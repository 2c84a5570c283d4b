"""verl 0.9.1 adapter: entry point, version guard, patch()/unpatch(), Hydra config, trainer selection.

Real verl (``verl[verl-core]==0.9.1``, installed by ``nox -s verl``); nothing is stubbed here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402

import entropy_discriminator.adapters.verl as ed_verl  # noqa: E402
from entropy_discriminator import EntropyDiscConfig  # noqa: E402
from entropy_discriminator.adapters._patching import UnsupportedVersionError  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
#: What verl's GSM8K quick-start sets besides the defaults (micro-batch sizes are required).
QUICKSTART = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
]
SELECT = ["trainer.v1.trainer_mode=entropy_disc", "+entropy_disc.method=clip_v", "+entropy_disc.mu_low=8.5"]


def compose_ppo(overrides: list[str]):
    """verl's own ``ppo_trainer`` config (the one ``verl.trainer.main_ppo`` uses) with ``overrides``."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=QUICKSTART + overrides)


def _fresh_python(code: str, **env: str) -> dict:
    """Run ``code`` in a new interpreter (so ``import verl`` really loads the plugins); it prints JSON."""
    full_env = {**os.environ, **env}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _probe(**env: str) -> dict:
    return _fresh_python(
        """
        import json, sys
        import verl
        state = {
            "v1_imported": "verl.trainer.ppo.v1" in sys.modules,
            "plugin_loaded": "entropy_discriminator.adapters.verl._plugin" in sys.modules,
        }
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
        state["trainers"] = {k: v.__module__ + "." + v.__qualname__ for k, v in TRAINER_REGISTRY.items()}
        state["losses"] = sorted(POLICY_LOSS_REGISTRY)
        state["prepare_model_outputs"] = FSDPEngineWithLMHead.prepare_model_outputs.__module__
        print(json.dumps(state))
        """,
        **env,
    )


def test_entry_point_registers_the_trainers_on_import_verl():
    on = _probe()
    off = _probe(VERL_USE_EXTERNAL_PLUGINS="none")
    assert on["plugin_loaded"] and not off["plugin_loaded"]
    assert not on["v1_imported"]  # the plugin does not pull verl's trainer stack into every process
    added = set(on["trainers"]) - set(off["trainers"])
    assert added == set(ed_verl.TRAINER_MODES)
    assert on["trainers"]["entropy_disc"].endswith("EntropyDiscTrainerSync")
    # installed but not selected: verl's own trainers, losses and engine code are untouched
    assert {k: on["trainers"][k] for k in off["trainers"]} == off["trainers"]
    assert on["losses"] == off["losses"]
    assert on["prepare_model_outputs"] == off["prepare_model_outputs"] == "verl.workers.engine.fsdp.transformer_impl"


def test_version_guard_says_why():
    assert ed_verl.check_version() == verl.__version__ == os.environ.get("ED_VERL_RELEASE", verl.__version__)
    for good in ("0.9.0", "0.9.1", "0.9.1.post1"):
        assert ed_verl.unsupported_reason(good) is None
    for bad in ("0.8.0", "0.9.2", "0.10.0", "1.0.0", "0.9.0rc1", "0.9.0.dev0", "0.9.2rc1"):
        with pytest.raises(UnsupportedVersionError, match=r"verl>=0\.9\.0,<0\.9\.2 because .*_compute_advantage"):
            ed_verl.check_version(bad)
        assert "prepare_model_outputs" in ed_verl.unsupported_reason(bad)


def test_patch_is_idempotent_and_reversible():
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    before_fn = FSDPEngineWithLMHead.__dict__["prepare_model_outputs"]
    before_registry = dict(TRAINER_REGISTRY)
    ed_verl.unpatch()  # nothing to undo: a no-op
    assert not ed_verl.is_patched()
    ed_verl.patch()
    wrapped = FSDPEngineWithLMHead.__dict__["prepare_model_outputs"]
    ed_verl.patch()
    assert ed_verl.is_patched()
    assert FSDPEngineWithLMHead.__dict__["prepare_model_outputs"] is wrapped is not before_fn
    assert wrapped.__wrapped__ is before_fn
    assert set(ed_verl.TRAINER_MODES) <= set(TRAINER_REGISTRY)
    ed_verl.unpatch()
    ed_verl.unpatch()
    assert not ed_verl.is_patched()
    assert FSDPEngineWithLMHead.__dict__["prepare_model_outputs"] is before_fn
    assert dict(TRAINER_REGISTRY) == before_registry


def test_hydra_composition_of_verls_ppo_config():
    cfg = compose_ppo(
        SELECT
        + [
            "+entropy_disc.mask_mode=drop_token",
            "+entropy_disc.sides=both",
            "+entropy_disc.max_frac=null",
            "+entropy_disc.mu_high=inf",
            "algorithm.adv_estimator=grpo",
        ]
    )
    assert cfg.trainer.use_v1 is True and cfg.trainer.v1.trainer_mode == "entropy_disc"
    from entropy_discriminator.adapters.verl._support import read_config

    got = read_config(cfg)
    assert got == EntropyDiscConfig(method="clip_v", mu_low=8.5, mu_high=math.inf, sides="both", max_frac=None, mask_mode="drop_token")
    assert got.resolved() == (8.5, None)
    # verl's own validation of the composed config still passes with the extra group
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    # no group -> metrics only; a bad value names the field
    assert read_config(compose_ppo(["trainer.v1.trainer_mode=entropy_disc"])).method == "none"
    with pytest.raises(ValueError, match=r"entropy_disc\.mask_mode"):
        read_config(compose_ppo(["+entropy_disc.method=clip_b", "+entropy_disc.mask_mode=zero"]))
    with pytest.raises(ValueError, match=r"unknown entropy_disc option"):
        read_config(compose_ppo(["+entropy_disc.methd=clip_b"]))


def _trainer(overrides: list[str]):
    from verl.trainer.ppo.v1 import get_trainer_cls

    ed_verl.register_trainers()
    cfg = compose_ppo(overrides)
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = "unused"
    return get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)


def test_selected_trainer_behaves_as_its_base_mode():
    from verl.trainer.ppo.v1 import PPOTrainerSync
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    trainer = _trainer(SELECT)
    assert isinstance(trainer, PPOTrainerSync)
    assert trainer.trainer_mode == "sync" and trainer.parameter_sync_step == 1
    assert type(trainer.replay_buffer) is ReplayBuffer  # verl's sync choice, not the async buffer
    assert trainer.entropy_disc.method == "clip_v" and trainer._entropy_disc_expected


def test_settings_that_rule_out_the_statistics_are_refused():
    with pytest.raises(ValueError, match=r"algorithm\.rollout_correction\.bypass_mode=True"):
        _trainer(SELECT + ["algorithm.rollout_correction.bypass_mode=true"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.strategy='veomni'"):
        ed_verl.check_config(compose_ppo(SELECT + ["actor_rollout_ref.actor.strategy=veomni"]))
    # fused kernels: every arm re-forms verl's torch fused head from the hidden states (one distribution for
    # logp, H and E_p[S]); a backend whose rounding the adapter cannot re-form is refused, naming it
    for method in ("clip_v", "clip_b", "none"):
        fused = _trainer(
            ["trainer.v1.trainer_mode=entropy_disc", f"+entropy_disc.method={method}", "actor_rollout_ref.model.use_fused_kernels=true"]
        )
        assert fused._entropy_disc_expected and fused.entropy_disc_plan.from_hidden, method
    for backend in ("triton", "liger"):
        with pytest.raises(ValueError, match=rf"fused_kernel_options\.impl_backend='{backend}'"):
            _trainer(
                SELECT
                + ["actor_rollout_ref.model.use_fused_kernels=true", f"actor_rollout_ref.model.fused_kernel_options.impl_backend={backend}"]
            )
    plan = ed_verl.check_config(compose_ppo(["trainer.v1.trainer_mode=entropy_disc", "+entropy_disc.method=clip_b", "actor_rollout_ref.actor.strategy=veomni"]))
    assert not plan.expected  # no hook there: Clip_B from verl's own log-probs and entropy


def test_actor_workers_are_swapped_only_when_the_statistic_is_needed():
    from verl.trainer.ppo.utils import Role
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from entropy_discriminator.adapters.verl._workers import EntropyDiscActorRolloutRefWorker

    trainer = _trainer(SELECT)
    trainer._init_resource_pool_mgr()
    actor = trainer.role_worker_mapping[Role.ActorRollout].__ray_actor_class__
    assert actor is EntropyDiscActorRolloutRefWorker and issubclass(actor, ActorRolloutRefWorker)
    from verl.workers.engine_workers import TrainingWorker

    assert trainer.role_worker_mapping[Role.Critic].__ray_actor_class__ is TrainingWorker  # critic untouched
    fused = _trainer(
        ["trainer.v1.trainer_mode=entropy_disc", "+entropy_disc.method=clip_b", "actor_rollout_ref.model.use_fused_kernels=true"]
    )
    fused._init_resource_pool_mgr()  # the hook runs in every FSDP arm, fused kernels included
    assert fused.role_worker_mapping[Role.ActorRollout].__ray_actor_class__ is EntropyDiscActorRolloutRefWorker
