"""``EntropyDiscConfig(method="autopilot")``: its fields, their checks, the refusals across methods,
``from_mapping``'s string parsing, the controller it builds and the step size it chooses."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import entropy_discriminator as ed
from entropy_discriminator import autopilot
from entropy_discriminator.config import AUTOPILOT_ONLY, MASK_ONLY, METHODS

C = ed.EntropyDiscConfig


def test_defaults_and_the_other_methods_unchanged():
    cfg = C()
    assert cfg.method == "none" and METHODS == ("none", "clip_b", "clip_v", "autopilot")
    assert {k: getattr(cfg, k) for k in AUTOPILOT_ONLY} == AUTOPILOT_ONLY
    assert AUTOPILOT_ONLY["gain"] == autopilot.DEFAULT_GAIN and AUTOPILOT_ONLY["max_step"] == autopilot.DEFAULT_MAX_STEP
    assert C(method="clip_b").resolved() == (2.5, None) and C(method="clip_v").needs_expected
    pilot = C(method="autopilot")
    assert pilot.enabled and pilot.needs_expected  # S_c needs E_p[S]
    # The new fields are appended: positional construction of the old ones is unchanged.
    assert [f.name for f in dataclasses.fields(C)][:10] == ["method", "mu_low", "mu_high", "sides", "max_frac",
                                                            "cap_rule", "mask_mode", "chunk_size", "impl", "log_metrics"]


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("target_entropy", "hot", "'hold' or a number"),
    ("target_entropy", -0.1, ">= 0"),
    ("target_entropy", math.nan, "finite"),
    ("target_entropy", math.inf, "finite"),
    ("decay_steps", 0, ">= 1"),
    ("decay_steps", 2.5, "integer"),
    ("decay_steps", True, "integer"),
    ("gain", 0, "> 0"),
    ("gain", 1.5, "<= 1"),
    ("gain", "0.5", "must be"),
    ("max_step", 0, "> 0"),
    ("max_step", math.nan, "must be"),
    ("eta", 0, "> 0"),
    ("eta", math.inf, "finite"),
    ("eta", "1e-3", "must be"),
    ("form", "exact", "one of"),
    ("calibrate_share", 0, "> 0"),
    ("calibrate_share", 1.5, "<= 1"),
    ("calibrate_share", math.nan, "must be"),
    ("calibrate_share", "1/4", "must be"),
])
def test_each_field_is_checked_at_construction_and_on_assignment(field, value, needle):
    base = {"method": "autopilot", "target_entropy": 1.0, field: value}
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field} .*{needle}"):
        C(**base)
    cfg = C(method="autopilot", target_entropy=1.0)
    before = dataclasses.asdict(cfg)
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}"):
        setattr(cfg, field, value)
    assert dataclasses.asdict(cfg) == before


def test_accepted_values_are_stored_as_python_numbers():
    cfg = C(method="autopilot", target_entropy=np.float32(1.25), decay_steps=np.int64(200), gain=torch.tensor(0.25),
            max_step=math.inf, eta=np.float64(3e-4), form="mean", max_frac=None, sides="both", mask_mode="drop_token")
    assert (cfg.target_entropy, cfg.decay_steps, cfg.gain, cfg.max_step, cfg.eta, cfg.form) == (
        1.25, 200, 0.25, math.inf, 3e-4, "mean")
    assert type(cfg.target_entropy) is float and type(cfg.decay_steps) is int and type(cfg.gain) is float
    with pytest.raises(ValueError, match="decay_steps"):  # a ramp needs a number: refused, nothing changed
        cfg.target_entropy = "hold"
    assert cfg.target_entropy == 1.25


@pytest.mark.parametrize(("field", "value"), [("mu_low", 3.0), ("mu_high", 4.0), ("cap_rule", "reference")])
def test_mask_fields_are_refused_with_autopilot(field, value):
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}=.*does not apply to method 'autopilot'"):
        C(method="autopilot", **{field: value})
    cfg = C(method="autopilot")
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}"):
        setattr(cfg, field, value)
    assert getattr(cfg, field) == MASK_ONLY[field]
    switched = C(method="clip_b", **{field: value})  # switching method with the field set is refused too
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}"):
        switched.method = "autopilot"
    assert switched.method == "clip_b"
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}=.*does not apply to method 'none'"):
        C(method="none", **{field: value})  # the switch off would silently ignore it


@pytest.mark.parametrize("method", ["clip_b", "clip_v"])
@pytest.mark.parametrize(("field", "value"), [("target_entropy", 1.0), ("gain", 0.25), ("max_step", 0.1),
                                              ("eta", 1e-3), ("form", "mean")])
def test_autopilot_fields_are_refused_with_the_masks(method, field, value):
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}=.*does not apply to method '{method}'"):
        C(method=method, **{field: value})
    cfg = C(method="autopilot", **{field: value})
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}"):
        cfg.method = method
    assert cfg.method == "autopilot"
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}=.*does not apply to method 'none'"):
        C(method="none", **{field: value})


def test_decay_steps_needs_a_number_target():
    with pytest.raises(ValueError, match="entropy_disc.decay_steps=10 .*target_entropy='hold'"):
        C(method="autopilot", decay_steps=10)
    assert C(method="autopilot", target_entropy=0.5, decay_steps=10).decay_steps == 10


def test_from_mapping_parses_command_line_strings():
    cfg = C.from_mapping({"method": "autopilot", "target_entropy": "0.75", "decay_steps": "300", "gain": "0.4",
                          "max_step": "inf", "eta": "1e-6", "form": "mean", "max_frac": "0.1", "sides": "both"})
    assert cfg == C(method="autopilot", target_entropy=0.75, decay_steps=300, gain=0.4, max_step=math.inf, eta=1e-6,
                    form="mean", max_frac=0.1, sides="both")
    assert C.from_mapping({"method": "autopilot", "target_entropy": "hold"}).target_entropy == "hold"
    for key, text, needle in (("target_entropy", "lots", "number"), ("decay_steps", "1e3", "integer"),
                              ("gain", "half", "number"), ("eta", "lr", "number"), ("max_step", "", "number")):
        with pytest.raises(ValueError, match=rf"entropy_disc\.{key} must be an? {needle}"):
            C.from_mapping({"method": "autopilot", "target_entropy": "1.0", key: text})
    with pytest.raises(ValueError, match="entropy_disc.mu_low"):
        C.from_mapping({"method": "autopilot", "mu_low": "2.5"})
    assert C.from_mapping({"calibrate_share": "0.5"}).calibrate_share == 0.5 and C().calibrate_share == 0.25
    with pytest.raises(ValueError, match=r"entropy_disc\.calibrate_share must be a number"):
        C.from_mapping({"calibrate_share": "quarter"})


def test_build_autopilot_carries_every_setting():
    group = object()  # stored as given; only used when the controller steps
    pilot = C(method="autopilot", target_entropy=0.5, decay_steps=20, gain=0.3, max_step=0.05, sides="both",
              form="mean", max_frac=0.2).build_autopilot(process_group=group)
    assert isinstance(pilot, ed.EntropyAutopilot)
    assert (pilot.target_entropy, pilot.decay_steps, pilot.gain, pilot.max_step, pilot.max_frac, pilot.sides,
            pilot.form, pilot.process_group) == (0.5, 20, 0.3, 0.05, 0.2, "both", "mean", group)
    state = pilot.state_dict()
    assert (state["version"], state["step"], state["h_start"]) == (autopilot.STATE_VERSION, 0, None)
    assert state["settings"] == pilot.settings() and state["settings"]["gain"] == 0.3
    default = C(method="autopilot").build_autopilot()
    assert default.target_entropy is None and default.max_frac == autopilot.DEFAULT_MAX_FRAC == 0.05
    assert C(method="autopilot", max_frac=None).build_autopilot().max_frac is None
    for method in ("none", "clip_b", "clip_v"):
        with pytest.raises(ValueError, match="build_autopilot needs method 'autopilot'"):
            C(method=method).build_autopilot()


def test_the_built_controller_equals_a_hand_built_one():
    g = torch.Generator().manual_seed(0)
    s_c, h = torch.randn(6, 9, generator=g), torch.rand(6, 9, generator=g) * 2
    valid, adv = torch.rand(6, 9, generator=g) > 0.2, torch.randn(6, generator=g)
    stats = ed.TokenStats(logp=-h, entropy=h, s_star=s_c, s_expected=torch.zeros_like(s_c), s_centered=s_c, valid=valid)
    built = C(method="autopilot", target_entropy=0.3, sides="both", max_frac=0.3).build_autopilot()
    hand = ed.EntropyAutopilot(0.3, sides="both", max_frac=0.3)
    for _ in range(3):
        a, b = built.from_stats(stats, adv, lr=0.5), hand.from_stats(stats, adv, lr=0.5)
        assert torch.equal(a.keep, b.keep) and a.metrics() == b.metrics()
    assert built.state_dict() == hand.state_dict()


def test_step_size_default_and_override():
    assert C(method="autopilot").step_size(1e-6) == 1e-6
    assert C(method="autopilot", eta=0.25).step_size(1e-6) == 0.25
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"entropy_disc\.eta is None.*learning rate.*set entropy_disc\.eta"):
            C(method="autopilot").step_size(bad)
    assert C(method="autopilot", eta=0.1).step_size(0.0) == 0.1  # the override needs no learning rate


def test_threshold_api_refuses_autopilot_clearly():
    cfg = C(method="autopilot")
    with pytest.raises(ValueError, match="no threshold"):
        cfg.resolved()
    with pytest.raises(ValueError, match="controller with state.*build_autopilot"):
        cfg.compute_mask(advantages=torch.ones(2), valid=torch.ones(2, 3, dtype=torch.bool),
                         s_centered=torch.zeros(2, 3))
