"""Edges of the public API that once gave a silent or wrong result, or a cryptic error.

Each case here failed on the code before it was fixed: settings nothing reads, positions that
``token_stats`` ignored counted by a mask, signs flipped by a negative step or ratio, command-line
prefixes taken for other options, and errors that did not name the argument.
"""

from __future__ import annotations

import argparse
import ast
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_outlier_keep, reference_token_stats

import entropy_discriminator as ed
from entropy_discriminator.__main__ import build_parser
from entropy_discriminator.config import AUTOPILOT_ONLY, CONTROL_ONLY, MASK_ONLY
from entropy_discriminator.stats import SCORE_SLACK

ROOT = Path(__file__).resolve().parents[1]
C = ed.EntropyDiscConfig
P = "entropy_disc/"


# --- config objects -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "hint"), [("mu_lo", "mu_low"), ("maxfrac", "max_frac"), ("side", "sides"),
                                            ("zzz", None)])
def test_config_refuses_an_unknown_attribute_naming_it_and_the_closest_field(name, hint):
    cfg = C(method="clip_b")
    with pytest.raises(AttributeError, match=f"'{name}'") as err:
        setattr(cfg, name, 1.0)
    assert (f"did you mean '{hint}'" in str(err.value)) if hint else "did you mean" not in str(err.value)
    assert name not in vars(cfg) and cfg == C(method="clip_b")


def test_config_fields_are_still_checked_and_set():
    cfg = C(method="clip_b")
    with pytest.raises(ValueError, match=r"entropy_disc\.mu_low"):
        cfg.mu_low = -1.0
    cfg.mu_low = np.float32(1.5)
    assert cfg.mu_low == 1.5 and cfg.resolved() == (1.5, None)


@pytest.mark.parametrize(("field", "value"), [
    ("mu_low", 1.0), ("mu_high", 3.0), ("cap_rule", "reference"), ("sides", "both"), ("mask_mode", "drop_token"),
    ("max_frac", 0.01), ("target_entropy", 1.0), ("gain", 0.25), ("max_step", 0.1), ("eta", 1e-3), ("form", "mean"),
])
def test_method_none_refuses_a_setting_that_only_a_mask_or_the_autopilot_reads(field, value):
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}=.*does not apply to method 'none'"):
        C(method="none", **{field: value})
    cfg = C()
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field}"):
        setattr(cfg, field, value)
    assert cfg == C()
    method = "autopilot" if field in AUTOPILOT_ONLY else "clip_b"
    cfg.method = method  # method first, then its setting
    setattr(cfg, field, value)
    assert getattr(cfg, field) == value


def test_method_none_keeps_defaults_and_the_no_cap_setting():
    assert set(CONTROL_ONLY) == {*MASK_ONLY, *AUTOPILOT_ONLY, "sides", "mask_mode"}
    assert C(method="none", max_frac=None, chunk_size=64, impl="torch", log_metrics=False).max_frac is None
    assert C(method="none", **CONTROL_ONLY) == C()


@pytest.mark.parametrize(("field", "text", "value"), [
    ("chunk_size", "1024", 1024), ("chunk_size", "none", None), ("decay_steps", " 200", 200),
    ("log_metrics", "false", False), ("log_metrics", "True", True), ("log_metrics", "0", False),
    ("mu_low", "None", None), ("mu_low", "1.5", 1.5), ("mu_high", "inf", math.inf), ("max_frac", "1e-4", 1e-4),
    ("max_frac", "null", None), ("max_frac", "auto", "auto"), ("eta", "null", None), ("eta", "3e-6", 3e-6),
    ("target_entropy", "hold", "hold"), ("target_entropy", "0.5", 0.5), ("gain", "0.25", 0.25),
])
def test_from_mapping_parses_command_line_strings(field, text, value):
    method = "autopilot" if field in AUTOPILOT_ONLY else "none" if field in ("chunk_size", "log_metrics") else "clip_b"
    values = {"method": method, field: text}
    if field == "decay_steps":
        values["target_entropy"] = "1.0"
    cfg = C.from_mapping(values)
    assert getattr(cfg, field) == value and type(getattr(cfg, field)) is type(value)


@pytest.mark.parametrize(("field", "text", "wanted"), [
    ("chunk_size", "1e3", "an integer or none"), ("chunk_size", "lots", "an integer"), ("log_metrics", "maybe", "true or false"),
    ("decay_steps", "2.5", "an integer"), ("mu_high", "none", "a number"), ("gain", "half", "a number"),
    ("max_frac", "x", "a number or 'auto' or none"), ("target_entropy", "keep", "a number or 'hold'"),
])
def test_from_mapping_names_the_field_of_a_garbage_string(field, text, wanted):
    with pytest.raises(ValueError, match=rf"entropy_disc\.{field} must be {wanted}.*'{text}'"):
        C.from_mapping({"method": "autopilot" if field in AUTOPILOT_ONLY else "clip_b", field: text})


def test_from_mapping_suggests_the_closest_field_for_an_unknown_key():
    with pytest.raises(ValueError, match=r"\['mu_lo'\]; did you mean 'mu_low'\?"):
        C.from_mapping({"mu_lo": 1.0})


@pytest.mark.parametrize("lr", [0.0, -1e-5, math.nan, "1e-6"])
def test_step_size_without_eta_says_what_the_learning_rate_must_be_in_one_sentence(lr):
    with pytest.raises(ValueError) as err:
        C(method="autopilot").step_size(lr)
    assert str(err.value) == (
        f"entropy_disc.eta is None, so the autopilot's step size is the optimizer's learning rate, which must be a "
        f"finite real number > 0, got {lr!r}; set entropy_disc.eta to a finite real > 0 (or give the optimizer such a "
        "learning rate)")


# --- positions that token_stats ignored never count ------------------------------------------------


def _batch(seed: int, dtype: torch.dtype, chunk: int):
    """Logits with peaked and flat rows and -inf entries, labels with ignored positions, and a response
    mask that covers some of the ignored positions (what a caller's padding mask often does)."""
    g = torch.Generator().manual_seed(seed)
    b, t, v = 3, 7, 13
    scale = torch.tensor([0.05, 1.0, 8.0])[torch.randint(0, 3, (b, t, 1), generator=g)]  # flat .. peaked rows
    logits = (torch.randn(b, t, v, generator=g) * scale).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    logits[torch.rand(b, t, v, generator=g) < 0.15] = -math.inf
    logits.scatter_(-1, labels[..., None], 0.5)  # the sampled token stays finite
    labels[torch.rand(b, t, generator=g) < 0.3] = -100
    response = torch.rand(b, t, generator=g) < 0.85
    adv = torch.randn(b, generator=g)
    stats = ed.token_stats(logits, labels, chunk_size=chunk, impl="torch")
    ref = reference_token_stats(logits, labels)
    both = response & (labels != -100)
    return stats, ref, adv, response, both


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       chunk=st.sampled_from([1, 4, 5, 64]), clip_v=st.booleans(), mu=st.floats(0.3, 2.0))
def test_masks_given_the_statistics_count_only_positions_valid_in_both(seed, dtype, chunk, clip_v, mu):
    stats, ref, adv, response, both = _batch(seed, dtype, chunk)
    field = "s_centered" if clip_v else "s_star"
    mask_fn = ed.clip_v_mask if clip_v else ed.clip_b_mask
    res = mask_fn(stats, adv, response, mu_low=mu, sides="both")
    x = ref[field][both].numpy()  # float64 reference over the positions valid in both masks only
    assert res.n_valid == int(both.sum()) < int(response.sum()) or res.n_valid == int(both.sum())
    assert res.std == pytest.approx(x.std(), rel=1e-4, abs=1e-6)
    assert res.center == (pytest.approx(x.mean(), rel=1e-4, abs=1e-6) if not clip_v else 0.0)
    a = adv[:, None].expand_as(both)
    keep = reference_outlier_keep(getattr(stats, field).double().flatten().tolist(), a.flatten().tolist(),
                                  both.flatten().tolist(), recentre=not clip_v, mu_low=mu, mu_high=math.inf,
                                  sides="both", max_frac=None)
    assert res.keep.flatten().tolist() == keep
    same = mask_fn(getattr(stats, field), adv, both, mu_low=mu, sides="both")  # the explicit intersection
    assert torch.equal(res.keep, same.keep) and (res.center, res.std) == (same.center, same.std)
    config = C(method="clip_v" if clip_v else "clip_b", mu_low=mu, sides="both")
    assert torch.equal(config.compute_mask(advantages=adv, valid=response.int(), stats=stats).keep, res.keep)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       chunk=st.sampled_from([2, 3, 64]))
def test_monitor_and_entropy_change_given_the_statistics_count_only_positions_valid_in_both(seed, dtype, chunk):
    stats, ref, adv, response, both = _batch(seed, dtype, chunk)
    lr = 0.3
    a = adv[:, None].expand_as(both).double()[both].numpy()
    h, s_c = ref["entropy"][both].numpy(), ref["s_centered"][both].numpy()
    cov = float(np.mean(a * s_c) - a.mean() * s_c.mean()) if both.any() else math.nan
    m = ed.EntropyMonitor().from_stats(stats, adv, lr=lr, valid=response)
    assert m[P + "tokens/valid"] == int(both.sum())
    if both.any():
        assert m[P + "entropy/mean"] == pytest.approx(h.mean(), rel=1e-4, abs=1e-6)
        assert m[P + "s_star/std"] == pytest.approx(ref["s_star"][both].numpy().std(), rel=1e-4, abs=1e-6)
        assert m[P + "cov/adv_s_centered"] == pytest.approx(cov, rel=1e-3, abs=1e-6)
        assert m[P + "delta_entropy/predicted"] == pytest.approx(-lr * cov, rel=1e-3, abs=1e-6)
    assert ed.batch_entropy_change(adv, stats, response, lr=lr) == pytest.approx(
        -lr * cov if both.any() else 0.0, rel=1e-3, abs=1e-6)
    after = ed.token_stats(stats.logp.new_zeros(*stats.logp.shape, 5), torch.where(stats.valid, 0, -100))
    realised = ed.EntropyMonitor().realised(stats, after, response)[P + "delta_entropy/realised"]
    expected = math.log(5) - h.mean() if both.any() else math.nan
    assert realised == pytest.approx(expected, rel=1e-4, abs=1e-6, nan_ok=True)


def test_realised_counts_only_positions_valid_before_and_after():
    g = torch.Generator().manual_seed(7)
    logits, labels = torch.randn(2, 6, 9, generator=g), torch.randint(0, 9, (2, 6), generator=g)
    before_labels, after_labels = labels.clone(), labels.clone()
    before_labels[0, :2] = -100
    after_labels[1, 3:] = -100
    before, after = ed.token_stats(logits, before_labels), ed.token_stats(logits * 0.5, after_labels)
    response = torch.ones(2, 6, dtype=torch.bool)
    response[1, 0] = False
    counted = response & (before_labels != -100) & (after_labels != -100)
    h0 = reference_token_stats(logits, labels)["entropy"]
    h1 = reference_token_stats(logits * 0.5, labels)["entropy"]
    expected = float((h1 - h0)[counted].mean())
    got = ed.EntropyMonitor().realised(before, after, response)[P + "delta_entropy/realised"]
    assert got == pytest.approx(expected, rel=1e-5)
    assert ed.EntropyMonitor().realised(before.entropy, after.entropy, counted)[P + "delta_entropy/realised"] == got


def test_a_numeric_response_mask_is_checked_only_where_it_counts():
    stats, _, adv, response, both = _batch(3, torch.float32, 64)
    numeric = response.to(torch.int64)
    numeric[~stats.valid] = 7  # not 0/1, but at positions token_stats ignored: they never count
    assert ed.clip_b_mask(stats, adv, numeric).n_valid == int(both.sum())
    numeric[tuple(stats.valid.nonzero()[0].tolist())] = 7
    with pytest.raises(ValueError, match="valid must hold only 0 and 1"):
        ed.clip_b_mask(stats, adv, numeric)
    with pytest.raises(ValueError, match=r"valid must have stats.valid's shape"):
        ed.clip_v_mask(stats, adv, response[:, :-1])


def test_monitor_refuses_a_mask_built_over_other_tokens():
    stats, _, adv, response, both = _batch(5, torch.float32, 64)
    assert int(response.sum()) != int(both.sum())
    loose = ed.clip_b_mask(stats.s_star, adv, response)  # the ignored zeros counted
    assert loose.n_valid == int(response.sum())
    monitor = ed.EntropyMonitor()
    with pytest.raises(ValueError, match=rf"mask was computed over {loose.n_valid} valid token\(s\), these "
                                         rf"statistics count {int(stats.valid.sum())}"):
        monitor.from_stats(stats, adv, mask=loose)
    fine = ed.clip_b_mask(stats, adv, response)
    assert monitor.from_stats(stats, adv, mask=fine, valid=response)[P + "clip/n_clipped"] == fine.n_clipped


# --- signs: step size and importance ratio ----------------------------------------------------------


def _small():
    stats, _, adv, response, _ = _batch(11, torch.float32, 64)
    return stats, adv


@pytest.mark.parametrize("lr", [-1.0, -1e-9, math.nan, math.inf, torch.tensor(-0.5)])
def test_a_negative_or_non_finite_lr_is_refused_by_name(lr):
    stats, adv = _small()
    with pytest.raises(ValueError, match=r"lr must be a finite real number >= 0"):
        ed.EntropyMonitor().from_stats(stats, adv, lr=lr)
    with pytest.raises(ValueError, match=r"lr must be a finite real number >= 0"):
        ed.batch_entropy_change(adv, stats.s_centered, stats.valid, lr=lr)


def test_lr_zero_predicts_no_change():
    stats, adv = _small()
    assert ed.EntropyMonitor().from_stats(stats, adv, lr=0.0)[P + "delta_entropy/predicted"] == 0.0
    assert ed.batch_entropy_change(adv, stats.s_centered, stats.valid, lr=0) == 0.0


def test_a_negative_ratio_is_refused_where_it_counts():
    stats, adv = _small()
    ratio = torch.ones_like(stats.entropy)
    ratio[~stats.valid] = -3.0  # ignored positions: never read
    base = ed.batch_entropy_change(adv, stats.s_centered, stats.valid, lr=1.0)
    assert ed.batch_entropy_change(adv, stats.s_centered, stats.valid, lr=1.0, ratio=ratio) == pytest.approx(base)
    monitor = ed.EntropyMonitor()
    assert monitor.from_stats(stats, adv, ratio=ratio, lr=1.0)[P + "delta_entropy/predicted"] == pytest.approx(base)
    ratio[tuple(stats.valid.nonzero()[0].tolist())] = -0.5
    with pytest.raises(ValueError, match=r"ratio must be >= 0 .* negative at 1 valid position"):
        monitor.from_stats(stats, adv, ratio=ratio, lr=1.0)
    with pytest.raises(ValueError, match=r"ratio must be >= 0 .* negative at 1 valid position"):
        ed.batch_entropy_change(adv, stats.s_centered, stats.valid, lr=1.0, ratio=ratio)


# --- discriminator_score's domain -----------------------------------------------------------------


def test_discriminator_score_refuses_negative_entropy_and_positive_logp_beyond_rounding():
    lp, h = torch.tensor([-0.5, -1.0, 0.0]), torch.tensor([0.7, 0.0, 0.2])
    within = ed.discriminator_score(lp + torch.tensor([0, 0, SCORE_SLACK]), h - torch.tensor([0, SCORE_SLACK, 0]))
    assert torch.isfinite(within).all()  # rounding slack accepted
    with pytest.raises(ValueError, match=r"entropy must be >= -0\.125.*1 entry is outside"):
        ed.discriminator_score(lp, h - torch.tensor([0.0, 0.2, 0.0]))
    with pytest.raises(ValueError, match=r"logp must be <= 0\.125.*2 entries are outside"):
        ed.discriminator_score(-lp, h)  # negated log-probs (e.g. an NLL)
    nan = ed.discriminator_score(torch.tensor([math.nan, -math.inf]), torch.tensor([1.0, 1.0]))
    assert math.isnan(nan[0]) and nan[1] == 0.0  # NaN still propagates to the masks; p = 0 gives 0
    # check=False (a framework's own entropies, whose rounding may exceed the slack): the formula, in float64
    h_low = h - torch.tensor([0.0, 0.2, 0.0])
    unchecked = ed.discriminator_score(lp, h_low, check=False)
    want = lp.double().exp() * (h_low.double() + lp.double())
    torch.testing.assert_close(unchecked.double(), want, rtol=1e-6, atol=1e-7)


# --- errors that name the argument ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [50, 50.0, "50", None])
def test_percentiles_not_a_sequence_is_refused_by_name(bad):
    with pytest.raises(TypeError, match=r"percentiles must be a sequence of numbers in \(0, 100\]"):
        ed.EntropyMonitor(percentiles=bad)


def test_percentiles_set_later_are_checked_and_used():
    stats, _ = _small()
    monitor = ed.EntropyMonitor()
    monitor.percentiles = (25, 75)
    m = monitor.from_stats(stats)
    h = np.sort(stats.entropy[stats.valid].double().numpy())
    for q in (25, 75):
        assert m[f"{P}entropy/p{q}"] == pytest.approx(h[math.ceil(q / 100 * len(h)) - 1])
    assert f"{P}entropy/p50" not in m
    with pytest.raises(ValueError, match="percentiles"):
        monitor.percentiles = (0,)
    assert monitor.percentiles == (25.0, 75.0)


def test_prefix_set_later_is_checked():
    monitor = ed.EntropyMonitor()
    with pytest.raises(TypeError, match="prefix must be a str, got int"):
        monitor.prefix = 5
    monitor.prefix = "x/"
    assert set(monitor.from_stats(_small()[0])) >= {"x/entropy/mean", "x/tokens/valid"}


@pytest.mark.parametrize("bad", [{"entropy": torch.zeros(2)}, torch.zeros(2, 3), None])
def test_from_stats_refuses_what_is_not_a_token_stats(bad):
    with pytest.raises(TypeError, match=r"stats must be a TokenStats .*got"):
        ed.EntropyMonitor().from_stats(bad)
    if bad is not None:
        with pytest.raises(TypeError, match=r"stats must be a TokenStats"):
            C(method="clip_b").compute_mask(advantages=torch.zeros(2), valid=torch.ones(2, 3), stats=bad)


def test_compute_mask_takes_the_statistics_or_the_scores_not_both():
    stats, adv = _small()
    with pytest.raises(ValueError, match="either stats or s_star"):
        C(method="clip_b").compute_mask(advantages=adv, valid=stats.valid, stats=stats, s_star=stats.s_star)


def test_openrlhf_launcher_without_openrlhf_says_so_in_one_line():
    """The launcher run as a user would (``python -m ...``), in a process where the ``openrlhf``
    distribution is not found (the core session does not install it; the lookup is also forced to
    miss here so that the test means the same wherever it runs)."""
    code = ("import importlib.metadata as md, runpy, sys\n"
            "real = md.version\n"
            "def version(name):\n"
            "    if name == 'openrlhf': raise md.PackageNotFoundError(name)\n"
            "    return real(name)\n"
            "md.version = version\n"
            "sys.argv = ['x', '--help']\n"
            "runpy.run_module('entropy_discriminator.adapters.openrlhf', run_name='__main__', alter_sys=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "openrlhf is not installed" in lines[0] and ">=0.10.2,<0.12" in lines[0], out.stderr


# --- command lines: options are matched whole -----------------------------------------------------

_PARSER_CALLS = ("ArgumentParser", "TrlParser", "HfArgumentParser", "add_parser")


def _parser_calls_without_allow_abbrev_false() -> list[str]:
    """``file:line`` of every parser construction in the project's code that does not pass ``allow_abbrev=False``.

    A command's parser made through ``entropy-discriminator``'s subparsers (``parser_class=CommandParser``)
    is checked on the built parser instead (:func:`test_cli_parsers_match_options_whole`)."""
    missing = []
    for folder in ("entropy_discriminator", "adapters", "examples", "benchmarks", "tests/gpu"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "entropy_discriminator" / "__main__.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in _PARSER_CALLS and not any(
                    k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords
                ):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return missing


def test_every_parser_in_the_project_matches_options_whole():
    assert _parser_calls_without_allow_abbrev_false() == []


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_cli_parsers_match_options_whole():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) >= 3 and all(p.allow_abbrev is False for p in parsers)


def test_demo_max_frac_is_not_taken_for_max_frac_v(capsys):
    from entropy_discriminator.__main__ import main

    assert main(["demo", "--max-frac", "0.1"]) == 2
    assert "unrecognized arguments: --max-frac 0.1" in capsys.readouterr().err
