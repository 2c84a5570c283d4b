"""Ray in the adapter tests: always a private local cluster, never the machine's.

``ray start --head`` leaves a bootstrap file, ``<ray temp dir>/ray_current_cluster`` (the temp dir
is ``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else ``/tmp/ray``: ``ray._common.utils.
get_ray_address_file``), holding the cluster's address; a plain ``ray.init()`` connects there, and
with ``num_cpus`` given refuses ("When connecting to an existing cluster, num_cpus and num_gpus must
not be provided").  The tests therefore start Ray with ``address="local"`` (in a subprocess:
``RAY_ADDRESS=local``, which the frameworks' own ``ray.init()`` reads), and they run with a stale
bootstrap file planted in a private Ray temp dir (:func:`stale_bootstrap`), so that a test that
forgets fails instead of passing only on a clean machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: What the planted bootstrap file holds: a GCS address nobody listens on (the cluster is gone).
STALE_ADDRESS = "127.0.0.1:9"
#: ``ray.init`` arguments of every in-process test cluster (the dashboard is not needed).
LOCAL = {"address": "local", "include_dashboard": False, "log_to_driver": False}


def bootstrap_file(ray_tmpdir: str) -> Path:
    """Where ``ray start --head`` writes its address when ``RAY_TMPDIR=ray_tmpdir``."""
    return Path(ray_tmpdir) / "ray" / "ray_current_cluster"


@contextlib.contextmanager
def stale_bootstrap() -> Iterator[str]:
    """Within the block, ``RAY_TMPDIR`` is a fresh short directory whose Ray temp dir holds a stale
    bootstrap file (:data:`STALE_ADDRESS`), as a machine where ``ray start --head`` ran; yields it.
    Short: Ray's socket paths under it must stay below the 107-byte limit of a Unix socket path."""
    previous = os.environ.get("RAY_TMPDIR")
    path = tempfile.mkdtemp(prefix="edray", dir="/tmp")
    target = bootstrap_file(path)
    target.parent.mkdir(parents=True)
    target.write_text(STALE_ADDRESS)
    os.environ["RAY_TMPDIR"] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(path, ignore_errors=True)


def plain_init_outcome() -> str:
    """What a plain ``ray.init(num_cpus=1)`` (no address) does here, in a subprocess: ``"started"`` or the error.

    Under :func:`stale_bootstrap` it follows the bootstrap file and refuses, which shows that the file is live
    and that the tests pass because they ask for ``address="local"``, not because nothing is there."""
    code = (
        "import ray\n"
        "try:\n"
        "    ray.init(num_cpus=1, include_dashboard=False)\n"
        "    print('started')\n"
        "except Exception as exc:\n"
        "    print(f'{type(exc).__name__}: {exc}')\n"
        "finally:\n"
        "    ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
