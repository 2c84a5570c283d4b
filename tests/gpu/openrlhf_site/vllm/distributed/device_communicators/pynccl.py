"""TEST STAND-IN (see ``vllm/__init__.py``): ``PyNcclCommunicator`` with vLLM's ``broadcast(tensor, src, stream)``, here
over a gloo group on the ``StatelessProcessGroup``'s store, the tensor staged through host memory (bit for bit: it
travels as raw bytes). NCCL cannot join two processes on one GPU, which is what OpenRLHF's non-IPC weight sync does
when the policy and the engine share the device."""

from __future__ import annotations

import datetime
from typing import Any


class PyNcclCommunicator:
    def __init__(self, group: Any, device: Any) -> None:
        import torch.distributed as dist

        self.rank, self.world_size, self.device = group.rank, group.world_size, device
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("ed_weight_sync", group.store), group.rank,
                                        group.world_size, datetime.timedelta(seconds=300))

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        """``tensor`` (any device, contiguous) of rank ``src`` into the others' ``tensor``, in place."""
        import torch
        import torch.distributed as dist

        if not tensor.is_contiguous():
            raise ValueError("PyNcclCommunicator.broadcast: the tensor must be contiguous")
        host = tensor.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([host], opts).wait()
        if self.rank != src:
            tensor.copy_(host.view(tensor.dtype).view(tensor.shape))
