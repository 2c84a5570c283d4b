"""verl 0.9.x's engine driven in this one process (rank 0 of a one-rank group, no Ray, no rollout).

Shared by ``benchmarks/verl_step.py`` and ``tests/gpu/verl_step.py``: the environment of a one-rank
process group, verl's ``ppo_trainer`` config composed by Hydra with overrides, and the jagged
tensors of a batch laid out as verl's agent loop hands them to the actor worker.
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def checkout_adapters() -> None:
    """Make ``entropy_discriminator.adapters`` importable where ``entropy_discriminator`` is this checkout's.

    ``python -m benchmarks...`` from the repository root imports ``entropy_discriminator`` from the
    checkout, whose adapters live in ``adapters/`` (pyproject's ``package-dir`` maps them into the
    package only in an install); the repository root is then added to the package's search path.
    Call it before ``import verl``, which loads the adapter's verl plugin.  No-op in an install.
    """
    import entropy_discriminator

    if find_spec("entropy_discriminator.adapters") is None:
        entropy_discriminator.__path__.append(str(ROOT))


def one_rank_env(port: int = 29533) -> None:
    """Environment variables verl's worker reads for rank 0 of a one-rank group (kept where already set)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("DIST_INIT_METHOD", f"tcp://127.0.0.1:{port}")


def compose_ppo_config(overrides: list[str]):
    """verl's ``ppo_trainer`` config (the installed release's own YAML) with Hydra ``overrides``."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def nested(ts: list[torch.Tensor]) -> torch.Tensor:
    """A jagged nested tensor of 1-D tensors ``ts`` (verl's layout for variable-length fields)."""
    return torch.nested.as_nested_tensor(ts, layout=torch.jagged)


def base_tensors(seqs: list[torch.Tensor], r_lens: list[int]) -> dict[str, torch.Tensor]:
    """The actor worker's input fields of sequences ``seqs`` (prompt + response ids), responses ``r_lens`` long.

    Jagged ``prompts``, ``responses``, ``input_ids``, ``position_ids`` (0.. per sequence) and all-ones
    int64 ``response_mask`` / ``loss_mask`` over the response tokens.
    """
    return {
        "prompts": nested([s[: len(s) - r] for s, r in zip(seqs, r_lens)]),
        "responses": nested([s[len(s) - r :] for s, r in zip(seqs, r_lens)]),
        "input_ids": nested(seqs),
        "position_ids": nested([torch.arange(len(s)) for s in seqs]),
        "response_mask": nested([torch.ones(r, dtype=torch.int64) for r in r_lens]),
        "loss_mask": nested([torch.ones(r, dtype=torch.int64) for r in r_lens]),
    }


def use_cpu_platform() -> None:
    """Make verl treat the CPU as its device (a CPU-only torch; verl falls back to CUDA otherwise).

    Installs a ``verl.plugin.platform`` platform named ``cpu`` whose device module is ``torch.cpu`` (memory queries read 0),
    collectives on gloo, and has verl's engine registry pick its CUDA engine classes (the FSDP
    engine is registered for cuda and npu only); call it before verl first asks for its platform.  For smoke runs of the
    real engine code on a machine without an accelerator; nothing about it is timed.
    """
    import contextlib

    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import set_platform

    class CPUDevice:  # torch.cpu plus the memory queries verl makes of its device module (all 0 here)
        def __getattr__(self, name: str):
            if "mem" in name:
                return lambda *args, **kwargs: (0, 0) if name == "mem_get_info" else 0
            return getattr(torch.cpu, name)

        def empty_cache(self) -> None:
            pass

        def get_device_name(self, *args: object) -> str:
            return "CPU"

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CPUDevice()

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # verl passes it to FSDP as device_id
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str):
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    set_platform(PlatformCPU())
    os.environ["VERL_ENGINE_DEVICE"], os.environ["VERL_ENGINE_VENDOR"] = "cuda", "nvidia"
