"""Clip_B / Clip_V, the entropy autopilot and the entropy monitor in TRL's ``GRPOTrainer`` (TRL 1.14.0 - 1.16.x).

Three ways in, same behaviour:

* ``EntropyDiscGRPOTrainer(model, reward_funcs, args=EntropyDiscGRPOConfig(...), ...)``;
  ``EntropyDiscGRPOConfig`` is ``GRPOConfig`` plus ``entropy_disc_*`` fields (CLI flags through
  ``TrlParser``).
* A stock ``GRPOTrainer`` given an ``EntropyDiscGRPOConfig`` (e.g. the ``trl grpo`` CLI): building
  the config installs the wrappers, so the settings are never silently ignored.
* ``patch(config=EntropyDiscConfig(method="clip_b"))`` on every ``GRPOTrainer``, or
  ``patch(trainer, config)`` on one; ``patch()`` with no config takes the args' settings.
  ``unpatch()`` restores the original methods exactly; ``is_patched()`` tells.

The package reads top to bottom: ``_support`` (release range, seams, which configurations are
served and how, refusals), ``_config`` (the config dataclass), ``_patch`` (the wrappers, patch,
unpatch), ``_stats`` (statistics from the hidden states of a pass TRL runs), ``_mask`` (the mask
and how it reaches the loss), ``_autopilot`` (``method="autopilot"``: one controller step per
training batch, its state in every checkpoint), ``_metrics``.  docs/adapters/trl.md has the
support table.

``RLOOTrainer`` is not served: its loss clips a sequence-level ratio of summed log-probs against
an ``old_logps`` stored already summed, so dropping a token would change both sums and the
clipping itself; the same seam (per-token advantages or loss mask) does not exist there.
"""

from __future__ import annotations

try:
    import trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without TRL
    raise ImportError(
        "entropy_discriminator.adapters.trl needs TRL 1.14-1.16: from the clone: pip install -e '.[trl]'"
    ) from exc

from ._config import EntropyDiscGRPOConfig
from ._mask import KEEP_KEY
from ._patch import EntropyDiscGRPOTrainer, is_patched, patch, unpatch
from ._support import HOOKED_METHODS, LOSS_TYPES, SUPPORTED_TRL, UnsupportedVersionError, check_trl_version

__all__ = [
    "HOOKED_METHODS",
    "KEEP_KEY",
    "LOSS_TYPES",
    "SUPPORTED_TRL",
    "EntropyDiscGRPOConfig",
    "EntropyDiscGRPOTrainer",
    "UnsupportedVersionError",
    "check_trl_version",
    "is_patched",
    "patch",
    "unpatch",
]
