"""Which OpenRLHF training settings the keep-mask can serve exactly, checked before training starts.

A clipped token must contribute exactly zero gradient. The two mask modes reach the loss through
the two per-token fields of OpenRLHF's ``Experience``:

* ``zero_pg`` multiplies ``advantages`` by ``keep``. Every term of the PPO loss that OpenRLHF
  multiplies by the token's own advantage vanishes (``-min(rA, clip(r)A)``, dual clip, the
  detached IS-correction factors, token- or sequence-mean aggregation), so a clipped token gets no
  gradient there. Terms that do not carry the advantage keep theirs: the KL loss
  (``--algo.kl.use_loss`` with ``--algo.kl.init_coef > 0``), the entropy bonus
  (``--actor.entropy_coef`` other than 0), and GSPO (``--actor.policy_loss_type gspo``), whose
  sequence ratio averages the log-probs of every token of the sample, clipped ones included.
  These combinations are refused with the setting named and ``drop_token`` suggested.
* ``drop_token`` multiplies ``action_mask`` by ``keep``. Every term OpenRLHF aggregates over
  ``action_mask`` (PPO, KL, entropy, GSPO's sequence ratio, the normalisers) then leaves the token
  out, so every loss variant is exact.

``--ds.tensor_parallel_size > 1`` (DeepSpeed AutoTP) is refused whenever clipping is on: the
statistics need full-vocabulary logits per rank, which has not been verified under AutoTP.

``method="autopilot"`` masks through the same two modes, so the same combinations are refused; in
addition it needs its law's step size: ``entropy_disc.eta``, else ``--actor.adam.lr`` (> 0) with
``--actor.optim adam``; ``--actor.optim muon`` without ``entropy_disc.eta`` is refused (``_autopilot.step_size``).

What changed between the supported releases, as far as the mask is concerned
(:data:`SEQUENCE_MEAN_SKIPS_EMPTY`): before 0.10.3 the sequence-mean aggregation (which GSPO
forces) divides by each sample's action count without guarding samples with none, so a sample
whose tokens are all clipped by ``drop_token`` turns the loss into NaN; GSPO is refused there in
both modes.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from packaging.version import Version

from entropy_discriminator import EntropyDiscConfig

#: First OpenRLHF release whose sequence-mean loss skips samples with no action token (``aggregate_loss``).
SEQUENCE_MEAN_SKIPS_EMPTY = Version("0.10.3")

_MISSING = object()


class UnsupportedConfigurationError(ValueError):
    """A combination of OpenRLHF settings and entropy_disc settings that cannot be served exactly."""


def _setting(args: Any, dotted: str) -> Any:
    node = args
    for part in dotted.split("."):
        node = getattr(node, part, _MISSING)
        if node is _MISSING:
            raise UnsupportedConfigurationError(
                f"OpenRLHF's arguments have no --{dotted}; the adapter reads the hierarchical arguments of "
                "OpenRLHF >= 0.10.2"
            )
    return node


def refusals(args: Any, config: EntropyDiscConfig, *, openrlhf_version: str | None = None) -> list[str]:
    """One message per OpenRLHF setting (``args``: OpenRLHF's parsed, hierarchical arguments) that
    the configured clipping cannot serve exactly; empty when everything is exact or nothing is clipped.
    ``openrlhf_version`` defaults to the installed release."""
    if not config.enabled:
        return []
    version = Version(openrlhf_version or importlib.metadata.version("openrlhf"))
    problems = []
    if int(_setting(args, "ds.tensor_parallel_size")) > 1:
        problems.append(
            "--ds.tensor_parallel_size > 1 (DeepSpeed AutoTP) is not supported with clipping: the statistics "
            "need full-vocabulary logits on every rank, which is not verified under AutoTP"
        )
    if config.method == "autopilot":
        from ._autopilot import step_size

        try:
            step_size(args, config)
        except ValueError as exc:
            problems.append(f"autopilot step size: {exc}")
    if _setting(args, "actor.policy_loss_type") == "gspo" and version < SEQUENCE_MEAN_SKIPS_EMPTY:
        problems.append(
            f"--actor.policy_loss_type gspo on OpenRLHF {version} (< {SEQUENCE_MEAN_SKIPS_EMPTY}): its sequence-mean "
            "loss divides by each sample's action count unguarded, so a sample whose tokens are all clipped makes "
            f"the loss NaN with drop_token, and zero_pg leaves clipped tokens gradient; use OpenRLHF >= "
            f"{SEQUENCE_MEAN_SKIPS_EMPTY}"
        )
        return problems
    if config.mask_mode != "zero_pg":
        return problems
    hint = "; use --entropy_disc.mask_mode drop_token (the clipped token leaves action_mask, so every term drops it)"
    if _setting(args, "actor.policy_loss_type") == "gspo":
        problems.append(
            "--actor.policy_loss_type gspo with --entropy_disc.mask_mode zero_pg: GSPO's sequence ratio averages the "
            "log-probs of every token of a sample, so a clipped token with zeroed advantage still gets gradient "
            "through its neighbours' terms" + hint
        )
    if _setting(args, "algo.kl.use_loss") and float(_setting(args, "algo.kl.init_coef")) > 0:
        problems.append(
            "--algo.kl.use_loss with --algo.kl.init_coef > 0 and --entropy_disc.mask_mode zero_pg: the KL loss is "
            "not multiplied by the advantage, so a clipped token keeps its KL gradient" + hint
        )
    entropy_coef = _setting(args, "actor.entropy_coef")
    if entropy_coef is not None and float(entropy_coef) != 0:
        problems.append(
            "--actor.entropy_coef != 0 with --entropy_disc.mask_mode zero_pg: the entropy term is not multiplied "
            "by the advantage, so a clipped token keeps its entropy gradient" + hint
        )
    return problems


def check_training_args(args: Any, config: EntropyDiscConfig, *, openrlhf_version: str | None = None) -> None:
    """Raise :class:`UnsupportedConfigurationError` listing :func:`refusals`, if any."""
    problems = refusals(args, config, openrlhf_version=openrlhf_version)
    if problems:
        raise UnsupportedConfigurationError(
            f"entropy_disc.method={config.method!r} cannot be applied exactly with these OpenRLHF settings:\n  - "
            + "\n  - ".join(problems)
        )
