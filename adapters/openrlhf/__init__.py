"""Clip_B / Clip_V, the entropy autopilot and the entropy monitor in OpenRLHF 0.10.2-0.11.x (``openrlhf.cli.train_ppo_ray``).

Launch (every stock flag goes to OpenRLHF unchanged; ``--entropy_disc.help`` lists the others)::

    python -m entropy_discriminator.adapters.openrlhf <train_ppo_ray flags> \\
        --entropy_disc.method clip_b --entropy_disc.mu_low 2.5

For a custom launch: ``ray.init(runtime_env=runtime_env(EntropyDiscConfig(method="clip_v")))``
patches every Ray worker; ``patch(config)`` / ``unpatch()`` / ``is_patched()`` act on the current
process (e.g. a test or a single-process trainer).

``logp, H, S*, E_p[S], S_c`` per response token are taken in the old-policy forward that
``make_experience`` already runs (``PolicyModelActor.forward`` -> the patched ``Actor.forward``, from
the fp32 temperature-scaled logits OpenRLHF takes its old log-probs from; ``_experience.py``) and
matched to the replay buffer's samples by their token ids, so a round runs no forward of its own
(a no-grad pass over the buffer remains as the fallback for samples that forward did not score,
e.g. a trainer built before the patch). Once per round of updates (``ActorPPOTrainer.ppo_train``,
i.e. per rollout batch), before the first epoch, the keep-mask is computed over the whole
data-parallel batch and written into the buffered samples, so every epoch and micro-batch uses it. Any advantage estimator that fills
``Experience.advantages`` per token works the same way (``gae``, ``group_norm``, ``rloo``,
``reinforce_baseline``, ``dr_grpo``). Metrics ``entropy_disc/*`` join the actor's status dict, which
OpenRLHF logs (console, wandb, TensorBoard). Details: ``_round.py``.

``method="autopilot"`` steps the policy's ``EntropyAutopilot`` once per round instead, on the same
statistics and OpenRLHF's per-token advantages, ``eta = entropy_disc.eta`` or ``--actor.adam.lr``,
``r = 1``: ``keep = pilot.from_stats(stats [N], advantages [N], lr=eta).mask.keep`` reaches the loss
like the masks, ``entropy_disc/autopilot/*`` join the status dict. Its state (``state_dict()``, version 2)
rides in the client state of the actor's DeepSpeed checkpoints (``DeepspeedStrategy.save_ckpt``
/ ``load_ckpt``, key ``entropy_disc_autopilot``) and is restored when ``ActorPPOTrainer`` is built after
``--ckpt.load_enable`` loaded one; a loaded checkpoint without it is refused there (``_autopilot.py``).

Every method: ``entropy_disc/delta_entropy/cheap`` is the round's ``-eta Cov_B(A, S_c)``; every
``calibrate_every``-th round (default 10) the after-update pass measures the realised change of the tokens of
the ``calibrate_share`` of the round's samples (default 0.25) that ``law_scale.calibration_rows`` picks on each
rank, and feeds ``kappa`` (``entropy_disc/delta_entropy/predicted = kappa * cheap``, ``/scale``), whose state
rides in the same client state under ``entropy_disc_law`` (``entropy_discriminator/law_scale.py``,
docs/adapters/law-and-autopilot.md).

Packed samples and ring attention are served from the actor's own packed / per-rank logits (see
``_round.stats_in_batch_layout``). Combinations a mask mode cannot serve exactly (``zero_pg`` with the
KL loss, an entropy bonus or GSPO; AutoTP) are refused before training starts (``_checks.py``).

Supported: OpenRLHF ``>=0.10.2,<0.12``; others are refused with the reason.
"""

from __future__ import annotations

from ._checks import UnsupportedConfigurationError, check_training_args, refusals
from ._launch import build_parser, main, parse, split_argv
from ._patch import (
    CONFIG_ENV,
    SETUP_HOOK,
    SUPPORTED_OPENRLHF,
    UnsupportedVersionError,
    check_openrlhf_version,
    is_patched,
    patch,
    patch_on_import,
    runtime_env,
    unpatch,
    worker_setup_hook,
)

__all__ = [
    "CONFIG_ENV",
    "SETUP_HOOK",
    "SUPPORTED_OPENRLHF",
    "UnsupportedConfigurationError",
    "UnsupportedVersionError",
    "build_parser",
    "check_openrlhf_version",
    "check_training_args",
    "is_patched",
    "main",
    "parse",
    "patch",
    "patch_on_import",
    "refusals",
    "runtime_env",
    "split_argv",
    "unpatch",
    "worker_setup_hook",
]
