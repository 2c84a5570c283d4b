"""TEST STAND-IN (see ``vllm/__init__.py``): ``StatelessProcessGroup``, a TCP store shared by the policy's rank 0
(the store's master) and the rollout engines, outside ``torch.distributed``'s default group."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any


@dataclasses.dataclass
class StatelessProcessGroup:
    store: Any
    rank: int
    world_size: int

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, store_timeout: int = 300) -> "StatelessProcessGroup":
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"StatelessProcessGroup.create: rank {rank} is not in [0, {world_size})")
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=store_timeout))
        return cls(store, rank, world_size)
