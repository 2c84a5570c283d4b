"""``EntropyDiscGRPOConfig`` (real TRL): settings that a run would silently ignore are refused by name.

A mask setting without a method (``--entropy_disc_mu_low`` alone trains metrics-only), a misspelt
``entropy_disc_*`` attribute, and a bad value assigned after construction.
"""

from __future__ import annotations

import pytest
from trl import TrlParser

from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, unpatch

BASE = ["--output_dir", "/tmp/ed_trl_edges", "--report_to", "none", "--use_cpu"]


@pytest.fixture(autouse=True)
def _no_leftover_patch():
    yield
    unpatch()  # building the config installs the adapter's wrappers on GRPOTrainer


@pytest.mark.parametrize(("flag", "value"), [("--entropy_disc_mu_low", "1.0"), ("--entropy_disc_sides", "both"),
                                             ("--entropy_disc_max_frac", "0.01"), ("--entropy_disc_gain", "0.25")])
def test_a_mask_or_autopilot_flag_without_a_method_is_refused(flag, value):
    name = flag.removeprefix("--entropy_disc_")
    with pytest.raises(ValueError, match=rf"entropy_disc\.{name}=.*does not apply to method 'none'"):
        TrlParser((EntropyDiscGRPOConfig,)).parse_args_and_config(args=[*BASE, flag, value])
    (args,) = TrlParser((EntropyDiscGRPOConfig,)).parse_args_and_config(
        args=[*BASE, "--entropy_disc_method", "autopilot" if name == "gain" else "clip_b", flag, value])
    assert str(getattr(args.entropy_disc_config(), name)) == value


def test_attributes_are_checked_when_set():
    args = EntropyDiscGRPOConfig(output_dir="/tmp/ed_trl_edges", report_to="none", use_cpu=True,
                                 entropy_disc_method="clip_b")
    with pytest.raises(AttributeError, match=r"'entropy_disc_mu_lo'; did you mean 'entropy_disc_mu_low'\?"):
        args.entropy_disc_mu_lo = 1.0
    assert not hasattr(args, "entropy_disc_mu_lo")
    with pytest.raises(ValueError, match=r"entropy_disc\.method"):
        args.entropy_disc_method = "clip_x"
    assert args.entropy_disc_method == "clip_b"  # a refused assignment leaves the field as it was
    with pytest.raises(ValueError, match=r"entropy_disc\.mu_low"):
        args.entropy_disc_mu_low = -1.0
    assert args.entropy_disc_mu_low is None
    args.entropy_disc_mu_low = 1.5
    assert args.entropy_disc_config().mu_low == 1.5
    args.learning_rate = 3e-3  # TRL's own fields are TRL's business
    assert args.learning_rate == 3e-3
