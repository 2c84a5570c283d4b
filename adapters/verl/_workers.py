"""verl worker classes that install the statistics hook in their own (Ray worker) process.

The adapter's trainer puts these in place of verl's actor workers, so the engine hook exists only
in runs that select the adapter.  They are module-level classes (Ray pickles them by reference).
"""

from __future__ import annotations

from typing import Any

from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.workers.engine_workers import ActorRolloutRefWorker

from ._engine import install_engine_hook


class EntropyDiscActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` with the entropy-disc engine hook installed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        install_engine_hook()
        super().__init__(*args, **kwargs)


class EntropyDiscDetachActorWorker(DetachActorWorker):
    """verl's ``DetachActorWorker`` (separate-async mode) with the entropy-disc engine hook installed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        install_engine_hook()
        super().__init__(*args, **kwargs)


#: verl worker class -> the same worker with the hook; the most derived match wins.
STATS_WORKERS: dict[type, type] = {
    DetachActorWorker: EntropyDiscDetachActorWorker,
    ActorRolloutRefWorker: EntropyDiscActorRolloutRefWorker,
}


def stats_worker(cls: type) -> type:
    """The hook-installing counterpart of verl worker class ``cls``.

    Raises ``TypeError`` for worker classes the adapter does not know (a custom worker must call
    :func:`entropy_discriminator.adapters.verl.patch` in its own ``__init__``).
    """
    if cls in STATS_WORKERS.values():
        return cls
    if cls in STATS_WORKERS:
        return STATS_WORKERS[cls]
    raise TypeError(
        f"entropy_disc: unknown actor worker class {cls.__module__}.{cls.__qualname__}; the adapter replaces "
        f"only {[c.__name__ for c in STATS_WORKERS]}. Call entropy_discriminator.adapters.verl.patch() in your "
        "worker's __init__ so its engine computes E_p[S]."
    )
