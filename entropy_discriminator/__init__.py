"""entropy-discriminator: principled entropy control for RL fine-tuning of LLMs.

Per-token statistics (``token_stats``: logp, H, S*, E_p[S], S_c), the Clip_B / Clip_V keep-masks,
the paper's first-order entropy-change predictions (``law``: for the optimizer actually used) and a monitor with stable metric names.
Pure torch + numpy; training frameworks are reached through ``entropy_discriminator.adapters``.
"""

from .autopilot import AutopilotResult, EntropyAutopilot, autopilot_mask, fixed_share_mask
from .config import EntropyDiscConfig
from .deferred import raise_deferred
from .dynamics import batch_entropy_change, entropy_change_logit, entropy_change_step
from .hidden import token_stats_from_hidden
from . import law
from .law import Calibration, step_entropy_change, token_terms
from .masks import MaskResult, apply_keep_mask, clip_b_mask, clip_v_mask
from .monitor import EntropyMonitor
from .recipe import MuSuggestion, mu_for_share, save_batch
from .stats import TokenStats, discriminator_score, token_stats

from ._version import __version__

__all__ = ["AutopilotResult", "Calibration", "EntropyAutopilot", "EntropyDiscConfig", "EntropyMonitor", "MaskResult",
           "MuSuggestion", "TokenStats", "apply_keep_mask", "autopilot_mask", "fixed_share_mask",
           "batch_entropy_change", "clip_b_mask", "clip_v_mask", "discriminator_score", "entropy_change_logit",
           "entropy_change_step", "law", "mu_for_share", "raise_deferred", "save_batch", "step_entropy_change", "token_stats",
           "token_stats_from_hidden", "token_terms"]
