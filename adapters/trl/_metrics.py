"""The ``entropy_disc/`` metrics in TRL's logs (``trainer._metrics``, averaged per logging step)."""

from __future__ import annotations

from typing import Any

import torch

from entropy_discriminator import EntropyMonitor, MaskResult, TokenStats


def log_metrics(trainer: Any, stats: TokenStats, advantages: torch.Tensor, mask: MaskResult | None,
                group: Any, law: dict[str, float] | None = None) -> None:
    """The monitor's metrics of one batch (global over ``group``) and the law scale's ``law`` (``delta_entropy/cheap``,
    ``/predicted``, ``/scale``; :mod:`entropy_discriminator.law_scale`) appended to ``trainer._metrics["train"]``."""
    metrics = EntropyMonitor(process_group=group).from_stats(stats, advantages=advantages, mask=mask)
    metrics.update(law or {})
    for key, value in metrics.items():
        trainer._metrics["train"][key].append(float(value))
