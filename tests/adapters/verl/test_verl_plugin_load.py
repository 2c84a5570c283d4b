"""When verl does not load the adapter's plugin: what stays silent, what is logged, what the preflight refuses.

verl loads ``verl.plugins`` entry points on ``import verl`` as ``VERL_USE_EXTERNAL_PLUGINS`` says (``auto``,
``none``, or a list of names) and logs a plugin's import error at DEBUG only.  Real verl in fresh
interpreters (``import verl`` must really run), nothing stubbed; a failing plugin is made by replacing
``_startup.install_startup_check`` before ``import verl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import verl  # noqa: E402

from entropy_discriminator.adapters.verl._plugin import LOAD_FAILED  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch_assets import write_model  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
PREFLIGHT = Path(__file__).resolve().parents[3] / "examples" / "verl" / "_preflight.py"
MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
]
#: Run verl's real ``main_ppo.main`` on a composed config, with ``run_ppo`` (which would start Ray and the
#: trainer) replaced by a recorder: "launched" means verl accepted the config and would train.
MAIN = """
import json, sys
from hydra import compose, initialize_config_dir
from verl.trainer import main_ppo

launched = {}
main_ppo.run_ppo = lambda config, task_runner_class: launched.update(
    runner=task_runner_class.__ray_metadata__.class_name, mode=config.trainer.v1.trainer_mode,
    method=config.entropy_disc.method)
with initialize_config_dir(config_dir=%r, version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=%r)
try:
    main_ppo.main(cfg)
except ValueError as exc:
    launched["refused"] = str(exc)
print(json.dumps(launched))
"""
FAILING_PLUGIN = """
from entropy_discriminator.adapters.verl import _startup
def install_startup_check():
    raise RuntimeError("plugin load failure made by the test")
_startup.install_startup_check = install_startup_check
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          timeout=300)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """verl's ``validate_config`` reads the model's config and tokenizer: the tiny offline ones."""
    return str(write_model(tmp_path_factory.mktemp("model")))


def _main(model: str, prelude: str = "", **env: str) -> dict:
    overrides = [*MICRO, "algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={model}",
                 "+entropy_disc.method=clip_v"]
    out = _python(prelude + MAIN % (CONFIG_DIR, overrides), **env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_the_plugin_verl_trains_stock_without_a_word(model):
    """The path that stays silent (docs/adapters/verl.md): ``+entropy_disc.method=clip_v`` with verl's default
    trainer mode.  With the plugin, verl's own ``main`` refuses it; with ``VERL_USE_EXTERNAL_PLUGINS=none`` (or a
    list without ``entropy_disc``) verl accepts it and would launch its stock trainer."""
    with_plugin = _main(model)
    assert "trainer.v1.trainer_mode='sync' is not an entropy_disc trainer" in with_plugin["refused"]
    silent = _main(model, VERL_USE_EXTERNAL_PLUGINS="none")
    assert silent == {"runner": "TaskRunnerV1", "mode": "sync", "method": "clip_v"}


def test_a_plugin_that_fails_to_load_says_so_at_error(model):
    """verl swallows the exception (DEBUG); the plugin logs it at ERROR with what it means, before re-raising."""
    out = _python(FAILING_PLUGIN + """
import verl
from entropy_discriminator.adapters.verl._startup import startup_check_installed
print(startup_check_installed())
""")
    assert out.returncode == 0 and out.stdout.split()[-1] == "False", out.stderr[-3000:]
    assert LOAD_FAILED in out.stderr and "plugin load failure made by the test" in out.stderr
    assert "ERROR" in out.stderr
    # and the launch it would have let through is what the test above shows: verl trains stock
    assert _main(model, FAILING_PLUGIN)["mode"] == "sync"


def _preflight(overrides: list[str], prelude: str = "", **env: str) -> list[str]:
    """The preflight's complaints about the plugin (GPU, vLLM and data lines are left out)."""
    code = prelude + (
        f"import sys; sys.path.insert(0, {str(PREFLIGHT.parent)!r}); import _preflight; "
        f"sys.exit(_preflight.main(['0', 'hint', '--', *{overrides!r}]))"
    )
    out = _python(code, **env)
    lines = [line for line in out.stderr.splitlines() if line.startswith("examples/verl: ")]
    return [line for line in lines if "CUDA GPU" not in line and "vLLM" not in line]


@pytest.mark.parametrize(
    ("policy", "refused"),
    [("none", True), ("trl,other", True), ("auto", False), ("Other, ENTROPY_DISC", False)],
)
def test_preflight_refuses_a_launch_whose_plugin_verl_would_not_load(policy, refused):
    complaints = _preflight(["+entropy_disc.method=clip_v"], VERL_USE_EXTERNAL_PLUGINS=policy)
    if refused:
        assert len(complaints) == 1 and f"VERL_USE_EXTERNAL_PLUGINS={policy!r}" in complaints[0]
        assert "add entropy_disc to its comma-separated list" in complaints[0]
    else:
        assert complaints == []


def test_preflight_reports_the_plugins_load_error():
    complaints = _preflight(["trainer.v1.trainer_mode=entropy_disc"], FAILING_PLUGIN)
    assert len(complaints) == 1 and "did not load the entropy_disc plugin" in complaints[0]
    assert "plugin load failure made by the test" in complaints[0]


def test_preflight_leaves_a_launch_without_the_adapter_alone():
    assert _preflight(["algorithm.adv_estimator=grpo"], VERL_USE_EXTERNAL_PLUGINS="none") == []
