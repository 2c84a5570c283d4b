"""A CPU platform for verl 0.9.1, for ``launch_verl.py train --cpu-smoke`` only (a smoke run of the flow, no GPU).

verl registers the NVIDIA, Ascend and ROCm platforms and falls back to NVIDIA without an accelerator;
this module registers ``cpu`` through verl's ``PlatformRegistry`` (selected with ``VERL_PLATFORM=cpu``): device
``cpu``, process group ``gloo``, Ray resource ``GPU`` (declared through ``RAY_OVERRIDE_RESOURCES``, so that verl's
GPU placement still places one worker per declared GPU), and a device module that is ``torch.cpu`` plus
no-op memory and RNG calls; ``Tensor.pin_memory`` returns the tensor itself (FSDP2's CPU offload of verl's
reference model pins its shards, which needs an accelerator).  Loaded (``VERL_USE_EXTERNAL_MODULES``) before verl
asks for its platform.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


#: ``torch.cuda``-like calls verl makes on its device module, for the CPU.
CPU_MODULE = SimpleNamespace(
    is_available=lambda: True, device_count=lambda: 1, current_device=torch.cpu.current_device, set_device=_none,
    synchronize=_none,
    empty_cache=_none, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
    memory_allocated=_zero, memory_reserved=_zero, max_memory_allocated=_zero, max_memory_reserved=_zero,
    reset_peak_memory_stats=_none, mem_get_info=lambda *a: (1 << 40, 1 << 40), memory=SimpleNamespace(
        _set_allocator_settings=_none), is_initialized=lambda: True, get_device_name=lambda *a: "cpu",
    Stream=torch.cpu.Stream, stream=torch.cpu.stream, current_stream=torch.cpu.current_stream, Event=torch.cpu.Event,
)


torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU (smoke runs)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return CPU_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> str:
        return torch.cpu.current_device()

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {}

    def get_collective_module(self) -> Any:
        return None

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None
