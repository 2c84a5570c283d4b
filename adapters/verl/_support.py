"""What the verl adapter supports, decided once at start-up from the run's config.

Read first: the version guard (:func:`check_version`), the trainer names, the policy-loss table
(:data:`LOSS_MODES`) and :func:`check_config`, which either returns the :class:`RunPlan` of a run
that selects the adapter or raises ``ValueError`` naming the setting that rules the request out.
Nothing here imports verl, so the check is cheap enough for verl's config validation (see
``_startup``) in the driver, before Ray or any worker starts.

The rule: a run that asks for the adapter anywhere (a ``trainer.v1.trainer_mode`` of
:data:`TRAINER_MODES`, or an ``entropy_disc`` config group) gets exactly what it asked for or a
start-up error; a clipped token contributes exactly zero gradient to the actor update, and a kept
token exactly the gradient verl gives it (``zero_pg``: as without the mask; ``drop_token``: as if
the clipped tokens were not in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from entropy_discriminator import EntropyDiscConfig

from .._patching import UnsupportedVersionError, require_version
from ._megatron import megatron_layout_refusal

# --- version guard -------------------------------------------------------------------------------

#: verl versions this adapter is written and tested against (PEP 440).
SUPPORTED_VERL = ">=0.9.0,<0.9.2"

_WHY = (
    "the adapter overrides private methods of verl's V1 PPOTrainer (_compute_old_log_prob, _compute_advantage, "
    "_update_actor, _init_resource_pool_mgr) and of its FSDP/Megatron engines (prepare_model_outputs, forward_step, "
    "_lm_head_logits_processor), and relies on the policy-loss registry of that release; their signatures, data "
    "layout and loss modes change between releases"
)


def check_version(installed: str | None = None) -> str:
    """Return the installed verl version; raise ``UnsupportedVersionError`` (a ``RuntimeError``) saying why if unsupported."""
    return require_version("verl", SUPPORTED_VERL, why=_WHY, installed=installed)


def unsupported_reason(installed: str | None = None) -> str | None:
    """The :func:`check_version` message, or None when the verl release is supported."""
    try:
        check_version(installed)
    except UnsupportedVersionError as exc:
        return str(exc)
    return None


# --- trainer names -------------------------------------------------------------------------------

#: Registered trainer name (``trainer.v1.trainer_mode=<name>``) -> the verl V1 mode it extends.
BASE_MODES = {
    "entropy_disc": "sync",
    "entropy_disc_colocate_async": "colocate_async",
    "entropy_disc_separate_async": "separate_async",
}
TRAINER_MODES = tuple(BASE_MODES)

# --- policy losses -------------------------------------------------------------------------------

#: Every policy-loss mode registered in verl 0.9.x (``core_algos.POLICY_LOSS_REGISTRY``) -> how the
#: mask can act.  ``"both"``: zeroing a clipped token's advantage removes its whole loss term and
#: leaves every kept token's gradient unchanged, so ``zero_pg`` and ``drop_token`` are exact.
#: ``"drop_token"``: ``zero_pg`` is not exact (the reason is given), the token must leave
#: ``response_mask``.  ``"refused"``: the adapter cannot run with it (reason given).
LOSS_MODES: dict[str, tuple[str, str]] = {
    "vanilla": ("both", "per-token PPO clip term, proportional to the token's advantage"),
    "dppo_tv": ("both", "per-token term -A * sg(ratio) * log p * valid, proportional to the advantage"),
    "dppo_kl": ("both", "per-token term -A * sg(ratio) * log p * valid, proportional to the advantage"),
    "gspo": ("both", "per-token term -A * s_i with a stop-gradient sequence ratio that does not involve advantages"),
    "sapo": ("both", "per-token gated term -gate(ratio) * A"),
    "gpg": ("both", "per-token term -A * log p"),
    "cispo": ("both", "per-token term -sg(clip(ratio)) * A * log p"),
    "clip_cov": (
        "drop_token",
        "its covariance selection uses the batch mean of the advantages and a budget over all valid tokens, so a "
        "token kept with advantage 0 changes which kept tokens lose their gradient",
    ),
    "kl_cov": (
        "drop_token",
        "its |log ratio| penalty acts on top-covariance tokens whatever their advantage, so a clipped token with "
        "advantage 0 can still get gradient, and it changes the covariance ranking of the kept tokens",
    ),
    "dro": ("drop_token", "its quadratic log-ratio penalty gives every token in response_mask gradient, advantage 0 or not"),
    "geo_mean": (
        "drop_token",
        "its sequence ratio and sequence advantage average over every token in response_mask, so a token kept with "
        "advantage 0 still gets gradient and shrinks the update of the kept tokens",
    ),
    "bypass_mode": (
        "refused",
        "it replaces the old policy by the rollout policy, and the adapter needs verl's old-policy pass "
        "(log-probs and entropy of the training policy)",
    ),
}

#: verl's ``actor.loss_agg_mode`` values (``core_algos.agg_loss``): all exact in both mask modes.
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")

#: Engine strategies whose old-policy pass the statistics hook covers.
HOOKED_STRATEGIES = ("fsdp", "fsdp2", "megatron")


# --- the start-up check --------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """What a run that selects the adapter does, fixed at start-up by :func:`check_config`.

    Attributes:
        options: the ``entropy_disc`` settings, ``mask_mode`` the one that acts.
        base_mode: the verl V1 mode the selected trainer extends (sync, colocate_async, separate_async).
        expected: the old-policy pass's hook computes ``log p_k``, ``H`` and ``E_p[S]`` of verl's own logits
            (FSDP in every arm; Megatron without fused kernels); otherwise ``S*`` comes from verl's
            ``old_log_probs`` and ``entropy`` and Clip_V is refused.
        from_hidden: the hook re-forms verl's fused LM head from the hidden states (``use_fused_kernels=True``).
        mask_mode_reason: why ``mask_mode`` is ``drop_token`` although none was given, else None.
        eta: method ``autopilot``: the step size of its law, ``options.step_size(actor_rollout_ref.actor.optim.lr)``
            (``entropy_disc.eta`` when set, else the actor's configured learning rate); None for the other methods.
    """

    options: EntropyDiscConfig
    base_mode: str
    expected: bool
    from_hidden: bool
    mask_mode_reason: str | None = None
    eta: float | None = None


def read_config(config: DictConfig) -> EntropyDiscConfig:
    """``EntropyDiscConfig`` from the top-level ``entropy_disc`` group (absent -> method "none")."""
    node = config.get("entropy_disc", None)
    values = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    if not isinstance(values, dict):
        raise ValueError(f"entropy_disc must be a mapping of options, got {values!r}")
    return EntropyDiscConfig.from_mapping(values)


def _select(config: DictConfig, key: str, default: Any) -> Any:
    return OmegaConf.select(config, key, default=default)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def check_config(config: DictConfig) -> RunPlan | None:
    """The adapter's start-up decision for a verl PPO config.

    Returns None when the run does not ask for the adapter (no adapter trainer mode, no
    ``entropy_disc`` group), the :class:`RunPlan` when it selects it in a supported setting.

    Raises:
        ValueError: the run asks for the adapter where it cannot act exactly; the message names the
            setting (legacy trainer, adapter options without an adapter trainer, policy-loss mode,
            ``mask_mode=zero_pg`` where it is not exact, rollout-correction bypass, E_p[S] unavailable, the
            autopilot without a step size: ``entropy_disc.eta`` None and ``actor.optim.lr`` not > 0).
        UnsupportedVersionError: verl outside :data:`SUPPORTED_VERL`.
    """
    mode = _select(config, "trainer.v1.trainer_mode", "sync")
    group = config.get("entropy_disc", None)
    ours = mode in BASE_MODES
    if not _select(config, "trainer.use_v1", True):
        if ours or group is not None:
            raise ValueError(
                f"entropy_disc runs in verl's V1 trainer only, but trainer.use_v1=false selects the legacy trainer "
                f"(main_ppo_v0), which would train without any mask or metric: set trainer.use_v1=true "
                f"(with trainer.v1.trainer_mode={mode if ours else 'entropy_disc'})"
            )
        return None
    if not ours:
        if group is not None:
            raise ValueError(
                f"entropy_disc options are set but trainer.v1.trainer_mode={mode!r} is not an entropy_disc trainer, "
                f"so they would do nothing: set trainer.v1.trainer_mode to one of {list(TRAINER_MODES)}"
            )
        return None
    check_version()
    options = read_config(config)
    eta = None
    if options.method == "autopilot":  # entropy_disc.eta, else the actor's lr; a missing one is refused here
        eta = options.step_size(_select(config, "actor_rollout_ref.actor.optim.lr", None))
    v1 = _select(config, "trainer.v1", {}) or {}
    if mode in v1 and _plain(v1[mode]) != _plain(v1.get(BASE_MODES[mode], None)):  # the trainer's own alias is equal
        raise ValueError(
            f"trainer.v1.{mode} is set, but the {mode} trainer takes its options from trainer.v1.{BASE_MODES[mode]}: "
            f"move them there"
        )
    if _select(config, "algorithm.rollout_correction.bypass_mode", False):
        raise ValueError(
            "entropy_disc needs verl's old-policy pass (entropy and log-probs of the training policy), which "
            "algorithm.rollout_correction.bypass_mode=True skips: set it to False"
        )
    if _select(config, "distillation.enabled", False):
        raise ValueError(
            "entropy_disc cannot run with distillation.enabled=True: the actor then trains on verl's "
            "distillation_ppo_loss, whose terms the adapter has not checked for exact masking"
        )
    options, reason = _mask_mode_for_loss(config, options)
    expected, from_hidden = _statistics_source(config, options)
    return RunPlan(options, BASE_MODES[mode], expected, from_hidden, reason, eta)


def _mask_mode_for_loss(config: DictConfig, options: EntropyDiscConfig) -> tuple[EntropyDiscConfig, str | None]:
    """The mask mode that is exact for the actor's loss: the given one, ``drop_token`` in its place, or an error."""
    actor = "actor_rollout_ref.actor"
    loss_mode = _select(config, f"{actor}.policy_loss.loss_mode", "vanilla")
    agg = _select(config, f"{actor}.loss_agg_mode", "token-mean")
    if loss_mode not in LOSS_MODES:
        raise ValueError(
            f"{actor}.policy_loss.loss_mode={loss_mode!r} is not one of verl's policy losses the adapter has checked "
            f"({sorted(LOSS_MODES)}); the adapter cannot tell whether its mask gives clipped tokens zero gradient there"
        )
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"{actor}.loss_agg_mode={agg!r} is not one of {list(LOSS_AGG_MODES)}")
    kind, why = LOSS_MODES[loss_mode]
    if kind == "refused":
        raise ValueError(f"entropy_disc cannot run with {actor}.policy_loss.loss_mode={loss_mode}: {why}")
    if not options.enabled or options.mask_mode == "drop_token":
        return options, None
    reasons = []
    if kind == "drop_token":
        reasons.append(f"{actor}.policy_loss.loss_mode={loss_mode}: {why}")
    if _select(config, f"{actor}.use_kl_loss", False):
        reasons.append(f"{actor}.use_kl_loss=True: the KL loss acts on every token in response_mask")
    if float(_select(config, f"{actor}.entropy_coeff", 0.0) or 0.0) != 0.0:
        reasons.append(f"{actor}.entropy_coeff != 0: the entropy bonus acts on every token in response_mask")
    if not reasons:
        return options, None
    given = (config.get("entropy_disc", None) or {}).get("mask_mode", None)
    if given is not None:
        raise ValueError(
            "entropy_disc.mask_mode=zero_pg would leave clipped tokens with gradient ("
            + "; ".join(reasons)
            + "): set +entropy_disc.mask_mode=drop_token (or leave it unset, which picks drop_token here)"
        )
    return replace(options, mask_mode="drop_token"), "; ".join(reasons)


def _statistics_source(config: DictConfig, options: EntropyDiscConfig) -> tuple[bool, bool]:
    """``(expected, from_hidden)``: whether the old-policy pass's hook computes the statistics, and from what."""
    strategy = _select(config, "actor_rollout_ref.actor.strategy", "fsdp")
    fused = bool(_select(config, "actor_rollout_ref.model.use_fused_kernels", False))
    if strategy not in HOOKED_STRATEGIES:
        if options.needs_expected:
            raise ValueError(
                f"entropy_disc.method={options.method} needs E_p[S], which the adapter computes in the {HOOKED_STRATEGIES} "
                f"engines only; actor_rollout_ref.actor.strategy={strategy!r}"
            )
        return False, False
    if strategy == "megatron":
        if fused:
            if options.needs_expected:
                raise ValueError(
                    f"entropy_disc.method={options.method} with actor_rollout_ref.actor.strategy=megatron needs the "
                    "vocabulary-parallel logits of the old-policy pass, which actor_rollout_ref.model.use_fused_kernels=True "
                    "never forms: set it to False (Clip_B works with fused kernels)"
                )
            return False, False
        refusal = megatron_layout_refusal(config)
        if refusal is not None:
            raise ValueError(refusal)
        return True, False
    if fused:  # FSDP: verl's torch fused head re-formed from the final hidden states, in every arm
        backend = _select(config, "actor_rollout_ref.model.fused_kernel_options.impl_backend", "torch") or "torch"
        if backend != "torch":
            raise ValueError(
                f"entropy_disc with actor_rollout_ref.model.use_fused_kernels=True follows verl's torch fused head "
                f"(bf16 logits (hidden @ W.T) / T per 512 rows); actor_rollout_ref.model.fused_kernel_options."
                f"impl_backend={backend!r} forms and rounds its logits inside its own kernel, so the statistics would "
                "not be those of verl's log-probs: set impl_backend=torch (or use_fused_kernels=False)"
            )
        return True, True
    return True, False
