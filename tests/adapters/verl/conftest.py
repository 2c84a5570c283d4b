"""Shared by the verl tests: a one-process gloo group (its helper module: verl_cpu_engine.py), Ray with
TransferQueue for the tests that drive verl's V1 trainer, and, for the whole session, a stale Ray bootstrap
file (``../ray_local.py``): every test that starts Ray starts a private local cluster."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ray_local import LOCAL, stale_bootstrap  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def stale_ray_bootstrap():
    """The session runs as on a machine where ``ray start --head`` ran: its bootstrap file points at a dead cluster."""
    with stale_bootstrap() as path:
        yield path


@pytest.fixture(scope="module")
def gloo():
    """A one-rank gloo process group for the module's tests (verl's engine all-reduces through it)."""
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def queue():
    """Ray and TransferQueue for the module's tests (verl's V1 trainer moves its batches through TransferQueue)."""
    import ray
    import transfer_queue as tq

    ray.init(num_cpus=8, **LOCAL)  # TQ's actors ask for more CPUs than 2
    tq.init()
    yield
    tq.close()
    ray.shutdown()
