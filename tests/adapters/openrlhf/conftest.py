"""Shared by the OpenRLHF tests: for the whole session, a stale Ray bootstrap file (``../ray_local.py``), so that
every test that starts Ray must start a private local cluster."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ray_local import stale_bootstrap  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def stale_ray_bootstrap():
    """The session runs as on a machine where ``ray start --head`` ran: its bootstrap file points at a dead cluster."""
    with stale_bootstrap() as path:
        yield path
