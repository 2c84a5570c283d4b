"""``EntropyDiscGRPOConfig``: ``GRPOConfig`` plus the ``entropy_disc_*`` settings (CLI flags
through ``TrlParser``).

Building one also installs the adapter's wrappers on ``GRPOTrainer``
(:func:`._patch.ensure_args_patch`): a stock ``GRPOTrainer`` given this config then acts on it
exactly like ``EntropyDiscGRPOTrainer``, instead of silently training without the mask.

TRL turns on ``bf16`` unless told otherwise, and transformers then stops on a machine without a
bf16 GPU ("Your setup doesn't support bf16/gpu"); this config leaves ``bf16`` off there when it
was not given, so ``EntropyDiscGRPOConfig(output_dir="out")`` trains in float32 on a CPU-only
machine (an explicit ``bf16=True`` still gets transformers' error).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available
from trl import GRPOConfig

from entropy_discriminator import EntropyDiscConfig
from entropy_discriminator._checks import did_you_mean
from entropy_discriminator.autopilot import DEFAULT_GAIN, DEFAULT_MAX_STEP, DEFAULT_SMOOTHING
from entropy_discriminator.config import DEFAULT_CALIBRATE_EVERY, DEFAULT_CALIBRATE_SHARE

from ._patch import ensure_args_patch
from ._support import check_trl_version, validate_options


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EntropyDiscGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the entropy-discriminator settings.

    The ``entropy_disc_*`` fields map one-to-one onto :class:`EntropyDiscConfig` (``mask_source``
    is the adapter's own option); ``__post_init__`` validates them, checks the TRL version and
    makes ``GRPOTrainer`` read them (module docstring).  After that, assigning an ``entropy_disc_*``
    field validates it at once (``ValueError`` naming it, the field left as it was), and assigning
    an ``entropy_disc_*`` name that is not a field raises ``AttributeError`` naming the closest one.
    """

    entropy_disc_method: str = field(
        default="none",
        metadata=_help("Token mask: 'none' (monitor only), 'clip_b' (on S*), 'clip_v' (on S_c) or 'autopilot' (drop "
                       "the fewest tokens that keep the entropy at entropy_disc_target_entropy)."),
    )
    entropy_disc_mu_low: float | None = field(
        default=None, metadata=_help("Lower threshold in batch std units (None: 2.5 for clip_b and clip_v).")
    )
    entropy_disc_mu_high: float = field(
        default=math.inf, metadata=_help("Upper threshold in batch std units (inf: no upper clipping).")
    )
    entropy_disc_sides: str = field(
        default="negative", metadata=_help("Which advantage sign may be clipped: negative, positive or both.")
    )
    entropy_disc_max_frac: str | None = field(
        default="auto",
        metadata=_help("Cap on the clipped share of valid tokens: a number in [0, 1], 'none' (no cap) or 'auto' "
                       "(no cap for clip_b and clip_v)."),
    )
    entropy_disc_cap_rule: str = field(
        default="share",
        metadata=_help("How max_frac becomes a token count: 'share' (floor(max_frac * n)) or 'reference' (at least "
                       "one token when over the cap, as Trinity-RFT)."),
    )
    entropy_disc_mask_mode: str = field(
        default="zero_pg",
        metadata=_help("'zero_pg': clipped tokens lose their policy-gradient term; 'drop_token': they leave the "
                       "loss mask (normaliser shrinks)."),
    )
    entropy_disc_mask_source: str = field(
        default="generation",
        metadata=_help("'generation': one mask per generation batch from the generating policy; 'current': "
                       "per micro-batch from the current policy in the training forward."),
    )
    entropy_disc_chunk_size: int | None = field(
        default=None, metadata=_help("Rows per chunk of the statistics on the torch path (None: ~128 MiB slices).")
    )
    entropy_disc_impl: str = field(
        default="auto", metadata=_help("Statistics implementation: auto, torch or triton.")
    )
    entropy_disc_log_metrics: bool = field(
        default=True, metadata=_help("Log the entropy_disc/ metrics (entropy percentiles, S*, clip fractions, ...).")
    )
    entropy_disc_target_entropy: str = field(
        default="hold",
        metadata=_help("autopilot: 'hold' (hold the first batch's entropy) or a target in nats/token (>= 0)."),
    )
    entropy_disc_decay_steps: int | None = field(
        default=None,
        metadata=_help("autopilot: ramp the target from the starting entropy to entropy_disc_target_entropy over "
                       "this many steps (None: the target from the start)."),
    )
    entropy_disc_gain: float = field(
        default=DEFAULT_GAIN, metadata=_help("autopilot: feedback gain in (0, 1].")
    )
    entropy_disc_max_step: float = field(
        default=DEFAULT_MAX_STEP, metadata=_help("autopilot: largest desired entropy change per step, nats/token.")
    )
    entropy_disc_eta: float | None = field(
        default=None,
        metadata=_help("autopilot: step size eta of the law dH ~ -eta Cov(A, r S_c) (None: learning_rate)."),
    )
    entropy_disc_form: str = field(
        default="cov", metadata=_help("autopilot: 'cov' (Corollaries 4 / 4.1) or 'mean' (eq. 23).")
    )

    entropy_disc_smoothing: float = field(
        default=DEFAULT_SMOOTHING,
        metadata=_help("autopilot: weight of the new batch's entropy in the controller's smoothed reading, (0, 1]."),
    )
    entropy_disc_calibrate_every: int = field(
        default=DEFAULT_CALIBRATE_EVERY,
        metadata=_help("Every this many statistics batches, one no-grad pass over that batch after its update measures "
                       "the realised entropy change and calibrates delta_entropy/predicted in nats (0: off)."),
    )
    entropy_disc_calibrate_share: float = field(
        default=DEFAULT_CALIBRATE_SHARE,
        metadata=_help("Share of a calibration batch's sequences (rows spread evenly over it) that the after-update "
                       "pass reads, (0, 1]; 1: the whole batch."),
    )

    def __post_init__(self) -> None:
        if self.bf16 is None and not self.fp16 and not self.use_cpu and not _bf16_accelerator():
            self.bf16 = False  # TRL's default bf16 needs a bf16 GPU (module docstring)
        super().__post_init__()
        validate_options(self.entropy_disc_config(), self.entropy_disc_mask_source)
        check_trl_version()
        ensure_args_patch()
        object.__setattr__(self, _CHECKED, True)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith(_PREFIX) and name not in _ENTROPY_DISC_FIELDS:
            raise AttributeError(f"EntropyDiscGRPOConfig has no setting {name!r}"
                                 f"{did_you_mean(name, _ENTROPY_DISC_FIELDS)}")
        if name not in _ENTROPY_DISC_FIELDS or not self.__dict__.get(_CHECKED, False):
            return super().__setattr__(name, value)
        before = self.__dict__[name]
        super().__setattr__(name, value)
        try:
            validate_options(self.entropy_disc_config(), self.entropy_disc_mask_source)
        except (TypeError, ValueError):
            super().__setattr__(name, before)
            raise

    def entropy_disc_config(self) -> EntropyDiscConfig:
        """The core :class:`EntropyDiscConfig` these fields describe."""
        return EntropyDiscConfig(
            method=self.entropy_disc_method,
            mu_low=self.entropy_disc_mu_low,
            mu_high=self.entropy_disc_mu_high,
            sides=self.entropy_disc_sides,
            max_frac=_max_frac(self.entropy_disc_max_frac),
            cap_rule=self.entropy_disc_cap_rule,
            mask_mode=self.entropy_disc_mask_mode,
            chunk_size=self.entropy_disc_chunk_size,
            impl=self.entropy_disc_impl,
            log_metrics=self.entropy_disc_log_metrics,
            target_entropy=_target_entropy(self.entropy_disc_target_entropy),
            decay_steps=self.entropy_disc_decay_steps,
            gain=self.entropy_disc_gain,
            max_step=self.entropy_disc_max_step,
            eta=self.entropy_disc_eta,
            form=self.entropy_disc_form,
            smoothing=self.entropy_disc_smoothing,
            calibrate_every=self.entropy_disc_calibrate_every,
            calibrate_share=self.entropy_disc_calibrate_share,
        )


_PREFIX = "entropy_disc_"
#: The ``entropy_disc_*`` fields (every other name is TRL's / transformers').
_ENTROPY_DISC_FIELDS = frozenset(f.name for f in dataclasses.fields(EntropyDiscGRPOConfig) if f.name.startswith(_PREFIX))
#: Instance flag set at the end of ``__post_init__``: from then on every ``entropy_disc_*`` assignment is validated.
_CHECKED = "_entropy_disc_checked"


def _bf16_accelerator() -> bool:
    """Whether transformers accepts ``bf16=True`` without ``use_cpu`` here (its own test: a bf16 GPU or XLA)."""
    return is_torch_bf16_gpu_available() or is_torch_xla_available()


def _max_frac(value: Any) -> float | str | None:
    """CLI text of ``--entropy_disc_max_frac`` -> the core's value ('auto', None or a float)."""
    if value is None or value == "auto" or isinstance(value, (int, float)):
        return value
    if str(value).lower() in ("none", "null"):
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"entropy_disc_max_frac must be 'auto', 'none' or a number in [0, 1], got {value!r}") from None


def _target_entropy(value: Any) -> float | str:
    """CLI text of ``--entropy_disc_target_entropy`` -> the core's value ('hold' or a float)."""
    if not isinstance(value, str) or value == "hold":
        return value
    try:
        return float(value)
    except ValueError:
        raise ValueError(
            f"entropy_disc_target_entropy must be 'hold' or a number of nats/token, got {value!r}") from None
