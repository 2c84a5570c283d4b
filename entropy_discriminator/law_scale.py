"""The cheap entropy prediction in nats, for the adapters and any training loop: a scale ``kappa`` of a
:class:`~entropy_discriminator.law.Calibration` fed ``(cheap, realised)`` pairs of the same batch every
``calibrate_every``-th statistics batch (docs/adapters/law-and-autopilot.md).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch

from entropy_discriminator import EntropyAutopilot, batch_entropy_change
from entropy_discriminator._checks import integer, real_number
from entropy_discriminator.law import Calibration

#: Metric names (after the ``entropy_disc/`` prefix).
CHEAP_KEY = "delta_entropy/cheap"
PREDICTED_KEY = "delta_entropy/predicted"
REALISED_KEY = "delta_entropy/realised"
SCALE_KEY = "delta_entropy/scale"
SKIPPED_KEY = "delta_entropy/scale_skipped"
#: Version of :meth:`LawScale.state_dict`'s layout.
STATE_VERSION = 1


class LawScale:
    """The calibration schedule and ``kappa`` of one trainer (module docstring); ``every``: ``calibrate_every``
    (int >= 0, 0 off).  Every rank holds the same state (its pairs are global over the data-parallel group)."""

    def __init__(self, every: int) -> None:
        self.every = integer("calibrate_every", every, minimum=0)
        self.batches = 0
        self._own = Calibration()
        self._pilot: EntropyAutopilot | None = None

    @property
    def calibration(self) -> Calibration:
        """The bound controller's calibration, else this object's own."""
        return self._own if self._pilot is None else self._pilot.calibration

    @property
    def scale(self) -> float:
        """``kappa`` (1.0 before the first informative calibration batch)."""
        return self.calibration.scale

    def bind(self, pilot: EntropyAutopilot | None) -> None:
        """Use ``pilot``'s calibration (the autopilot's selection reads it); None: this object's own."""
        self._pilot = pilot

    def tick(self) -> bool:
        """Count one statistics batch; True when it is a calibration batch (the 1st, the ``every+1``-th, ...)."""
        due = self.every > 0 and self.batches % self.every == 0
        self.batches += 1
        return due

    def feed(self, cheap: float, realised: float) -> bool:
        """Add one same-batch pair; False when it was left out: either is NaN (no valid token), or, bound to a
        controller, the fit with it would have ``kappa <= 0``."""
        if not (math.isfinite(cheap) and math.isfinite(realised)):
            return False
        calibration = self.calibration
        if self._pilot is not None and copy.copy(calibration).update(cheap, realised) <= 0:  # tried on a copy
            return False
        calibration.update(cheap, realised)
        return True

    def metrics(self, cheap: float | None, prefix: str = "entropy_disc/") -> dict[str, float]:
        """``delta_entropy/cheap``, and with the calibration on ``delta_entropy/predicted = kappa * cheap`` and
        ``delta_entropy/scale``; nothing when ``cheap`` is None (no step size known)."""
        if cheap is None:
            return {}
        out = {prefix + CHEAP_KEY: float(cheap)}
        if self.every > 0:
            out[prefix + PREDICTED_KEY] = self.scale * float(cheap)
            out[prefix + SCALE_KEY] = self.scale
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "batches", "calibration"}`` (plain values; ``calibration`` None when bound to a controller,
        whose own state carries it)."""
        return {"version": STATE_VERSION, "batches": self.batches,
                "calibration": None if self._pilot is not None else self._own.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` naming a bad entry."""
        if not isinstance(state, Mapping) or set(state) != {"version", "batches", "calibration"}:
            raise ValueError(f"law-scale state must have the keys ['batches', 'calibration', 'version'], got {state!r}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"law-scale state['version'] must be {STATE_VERSION}, got {state['version']!r}")
        batches = integer("law-scale state['batches']", state["batches"], minimum=0)
        if state["calibration"] is not None:
            self._own.load_state_dict(state["calibration"])  # checks everything before it changes anything
        self.batches = batches


def calibration_rows(rows: int, share: float, multiple: int = 1) -> torch.Tensor:
    """Indices (int64, sorted, on the CPU) of the ``m`` sequences of a calibration batch that the after-update pass
    reads, ``floor(i * rows / m)`` for ``i < m`` (spread evenly from row 0), with ``m = ceil(share * rows)`` rounded
    up to a multiple of ``multiple`` (int >= 1: splits evenly over a framework's ranks and micro-batches) and capped
    at ``rows``.  ``share`` in (0, 1] (1: every row); ``rows = 0`` gives no index.
    """
    rows = integer("rows", rows, minimum=0)
    share = real_number("calibrate_share", share, above=0, maximum=1)
    multiple = integer("multiple", multiple, minimum=1)
    m = math.ceil(share * rows - 1e-9)  # 0.1 * 30 is 3.0000000000000004
    m = min(rows, -(-m // multiple) * multiple)
    return torch.arange(m, dtype=torch.int64) * rows // max(m, 1)


def cheap_change(advantages: torch.Tensor, s_centered: torch.Tensor, valid: torch.Tensor, *, eta: float | None,
                 ratio: torch.Tensor | None = None, form: str = "cov", process_group: Any = None) -> float | None:
    """``-eta Cov_B(A, r S_c)`` (``form="cov"``) or ``-eta E_B[A r S_c]`` over the valid tokens of the group
    (:func:`~entropy_discriminator.batch_entropy_change`); None when ``eta`` is None; 0 for no valid token."""
    if eta is None:
        return None
    return batch_entropy_change(advantages, s_centered, valid, lr=eta, ratio=ratio, form=form,
                                process_group=process_group)
