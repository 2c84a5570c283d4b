"""Run ``tests/gpu/openrlhf_step.py`` on a CPU, for checking the script without a GPU (not a GPU result).

CUDA calls are redirected to the CPU (``torch.cuda.*``, ``.cuda()``, ``cuda:N`` tensor moves, the
device mesh); DeepSpeed picks its CPU accelerator and a gloo group. Everything else, OpenRLHF's
``DeepspeedStrategy``, ``deepspeed.initialize`` (ZeRO-2, bf16), ``ActorPPOTrainer`` and the
adapter, runs as on the GPU; the statistics use the torch path instead of the Triton kernel.

    python tests/gpu/openrlhf_step_on_cpu.py [--fallback]   # in the nox openrlhf (0.11.2) environment
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch
import torch.distributed.device_mesh as device_mesh


def _cpu(device):
    is_index = isinstance(device, int) and not isinstance(device, bool)
    return "cpu" if is_index or (isinstance(device, (str, torch.device)) and str(device).startswith("cuda")) else device


def redirect_cuda_to_cpu() -> None:
    tensor_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        args = tuple(_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return tensor_to(self, *args, **kwargs)

    init_mesh = device_mesh.init_device_mesh
    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.get_device_name = lambda *a: "cpu (CUDA calls redirected)"
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.set_device = lambda *a: None
    device_mesh.init_device_mesh = lambda device_type, *a, **k: init_mesh("cpu", *a, **k)
    skip_deepspeed_shm_op()


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from JIT-building its shared-memory collective op on its first
    ``init_distributed``: a C++ build of minutes on a small CPU machine, for one or two gloo ranks that
    do not need it, and one whose lock file a killed build leaves behind (every later build then waits
    on it forever).  DeepSpeed skips the op when its compatibility table says no."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


if __name__ == "__main__":
    redirect_cuda_to_cpu()
    script = Path(__file__).with_name("openrlhf_step.py")
    sys.argv = [str(script), *sys.argv[1:]]  # e.g. --fallback
    runpy.run_path(str(script), run_name="__main__")
