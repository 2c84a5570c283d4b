"""One OpenRLHF actor update with packed samples, real DeepSpeed and the adapter, on one GPU.

Not collected by pytest; run by hand (see ``openrlhf_step_README.md``)::

    python tests/gpu/openrlhf_step.py               # normal path: statistics from the old-log-prob forward
    python tests/gpu/openrlhf_step.py --fallback    # the adapter's fallback no-grad pass in ppo_train

What runs, in this one process (rank 0 of a one-rank NCCL group, no Ray cluster):

1. A random Llama is written locally with ``save_pretrained`` and loaded by OpenRLHF's own
   ``Actor`` (bf16, sdpa attention, ``packing_samples=True``, temperature 0.7).
2. OpenRLHF's real ``DeepspeedStrategy``: ``setup_distributed`` (device mesh) and ``prepare``
   (``deepspeed.initialize``: ZeRO-2, bf16, gradient clipping, LR scheduler). One deviation:
   the optimizer config gets ``torch_adam: true`` (torch's AdamW instead of DeepSpeed's FusedAdam,
   whose CUDA op would have to be compiled; the DeepSpeed wheel was built with no ops).
3. OpenRLHF's real ``ActorPPOTrainer.__init__`` (PolicyLoss, NaiveReplayBuffer with packing), a
   rollout batch of 4 prompts x 4 samples (sampled from the policy with HF ``generate``, not vLLM)
   appended to its replay buffer, advantages from OpenRLHF's own
   ``group_norm`` estimator, old log-probs from the actor itself (``make_experience``'s call:
   ``actor.eval()``, no grad, ``actor(sequences, action_mask, attention_mask)``).
4. The adapter (Clip_B, ``zero_pg``, two-sided ``mu_low=mu_high=1.0`` so that a small batch has
   clipped tokens, both advantage signs) and the real ``ppo_train``: the mask, then one DeepSpeed
   forward/backward/step.

   * Default (the normal path, as ``benchmarks/openrlhf_step.py`` and a Ray worker): the adapter is
     patched before ``ActorPPOTrainer.__init__`` (which registers the policy) and so before the
     old-log-prob forward; its ``Actor.forward`` wrapper scores the tokens from that forward's packed
     fp32 logits (Triton kernel on a GPU), and ``ppo_train``'s round takes them from there
     (``entropy_disc/stats/from_forward`` 1, no forward of its own).
   * ``--fallback``: the trainer is built and the old log-probs taken before the patch, so the round
     finds no statistics from the forward and runs the adapter's fallback no-grad pass of the policy
     over the buffer (``entropy_disc/stats/from_forward`` 0).

Checks (exit 1 on failure): where the statistics came from (``from_forward`` 1 by default, 0 with
``--fallback``; exactly one no-grad LM-head forward, in the old-log-prob call or in ``ppo_train``
respectively); the statistics against float64 arithmetic on the very packed logits they were taken
from; their log-probs against OpenRLHF's own packed ``action_log_probs``; the keep-mask against the
plain-Python rule (``tests/reference.py``) on the float64 S*; the gradient at every clipped token's
LM-head position exactly zero (some kept ones nonzero); the parameters changed; the
``entropy_disc/*`` metrics in the returned status.

Stand-ins (modules not on the device, see the README): ``flash_attn`` (OpenRLHF's packing helpers:
transformers' pure-torch versions, as in the CPU tests), ``vllm`` (empty; not called), ``ray``
(empty; its wheel is larger than the 64 MiB the device accepts, and the update runs in-process).
Generation is not run: it needs vLLM, which is not on the device.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

ROOT = Path(__file__).resolve().parents[2]
N_PROMPTS, N_PER_PROMPT, VOCAB, HIDDEN, LAYERS = 4, 4, 32000, 256, 2
TEMPERATURE = 0.7
FAILURES: list[str] = []


def log(msg: str) -> None:
    print(f"[openrlhf_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def check(ok: bool, what: str) -> None:
    log(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def install_stand_ins() -> None:
    for name in ("ray", "ray.util", "ray.util.placement_group", "ray.util.scheduling_strategies"):
        if name not in sys.modules:
            module = MagicMock(name=name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = module
    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "openrlhf"))
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ.setdefault("ED_REQUIRE_OPENRLHF", "1")
    import test_openrlhf  # noqa: F401  (installs the flash_attn / vllm stand-ins of the CPU tests)


def training_args(micro: int, total: int, n_per_prompt: int = N_PER_PROMPT, packing: bool = True) -> SimpleNamespace:
    """OpenRLHF 0.11's hierarchical arguments as ``DeepspeedStrategy``, ``ActorPPOTrainer`` and the
    experience maker read them: ZeRO-2, bf16, ``micro`` / ``total`` samples per micro-batch / step."""
    ns = SimpleNamespace
    return ns(
        local_rank=-1,
        train=ns(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False,
                 batch_size=total, micro_batch_size=micro),
        ds=ns(param_dtype="bf16", zero_stage=2, adam_offload=False, zpg=1, use_universal_ckpt=False,
              grad_accum_dtype=None, overlap_comm=False, deepcompile=False, tensor_parallel_size=1,
              ring_attn_size=1, packing_samples=packing),
        actor=ns(eps_clip_low_high=(0.2, 0.2), dual_clip=None, loss_agg_mode="token-mean", policy_loss_type="ppo",
                 aux_loss_coef=0.0, entropy_coef=None),
        algo=ns(kl=ns(use_loss=False, init_coef=0.0, estimator="k1", unbiased_gradient=False),
                advantage=ns(estimator="group_norm", gamma=1.0, lambd=1.0, no_std_norm=False,
                             is_correction_level="off", is_correction_enable=False, is_correction_mode="mask",
                             is_correction_gating="ratio", is_correction_type="tis",
                             is_correction_threshold=[0.5, 5.0])),
        vllm=ns(sync_backend="nccl"),
        rollout=ns(n_samples_per_prompt=n_per_prompt, max_new_tokens=512),
        reward=ns(clip_range=(-10.0, 10.0), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        data=ns(max_len=1024),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--fallback", action="store_true",
                        help="patch the adapter only after the old-log-prob forward (trainer built before the "
                             "patch): its round runs the fallback no-grad pass; default: patched before, statistics "
                             "from the forward")
    ns = parser.parse_args(argv)
    fallback = ns.fallback
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    install_stand_ins()
    import torch
    from reference import reference_outlier_keep, reference_token_stats
    from transformers import LlamaConfig, LlamaForCausalLM

    import openrlhf
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    from entropy_discriminator import EntropyDiscConfig
    from entropy_discriminator.adapters import openrlhf as adapter
    from entropy_discriminator.adapters.openrlhf import _round

    import deepspeed

    log(f"torch {torch.__version__}, openrlhf {openrlhf.__file__}, deepspeed {deepspeed.__version__}, "
        f"GPU {torch.cuda.get_device_name(0)}")
    log("path: " + ("FALLBACK (adapter patched after the old-log-prob forward: its own no-grad pass in ppo_train)"
                    if fallback else "normal (adapter patched before the old-log-prob forward: statistics from it)"))
    started = time.perf_counter()
    n = N_PROMPTS * N_PER_PROMPT
    args = training_args(micro=n, total=n)
    strategy = DeepspeedStrategy(seed=0, max_norm=1.0, micro_train_batch_size=n, train_batch_size=n, zero_stage=2,
                                 args=args)
    strategy.setup_distributed()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)  # rows far from uniform
        model.save_pretrained(tmp)
        actor = Actor(tmp, attn_implementation="sdpa", param_dtype="bf16", packing_samples=True,
                      temperature=TEMPERATURE, ds_config=strategy.get_ds_train_config())
    original_config = strategy.get_ds_train_config

    def with_torch_adam(*a, **k):
        config = original_config(*a, **k)
        if "optimizer" in config:
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    strategy.get_ds_train_config = with_torch_adam
    actor_cfg = dict(optim="adam", adam=dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
                     lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0, scheduler_steps=10)
    actor.cuda()
    actor, optim, scheduler = strategy.prepare((actor, actor_cfg))
    rounds = []
    original_begin = _round.begin_round

    def recording_begin(*a, **k):
        state = original_begin(*a, **k)
        rounds.append(state)
        return state

    _round.begin_round = recording_begin
    config = EntropyDiscConfig(method="clip_b", mu_low=1.0, mu_high=1.0, sides="both", max_frac=None,
                               mask_mode="zero_pg")
    if not fallback:  # as a Ray worker: patched before ActorPPOTrainer.__init__ (registers the policy)
        adapter.patch(config)
    trainer = ActorPPOTrainer(strategy, actor, None, optim, scheduler, micro_train_batch_size=n,
                              dataloader_pin_memory=False)
    log(f"DeepSpeed engine {type(actor.model).__name__}, ZeRO stage {actor.model.zero_optimization_stage()}, "
        f"optimizer {type(actor.model.optimizer).__name__} ({time.perf_counter() - started:.1f} s)")

    # rollout batch: responses sampled from the policy itself (HF generate, temperature 0.7, cut to
    # random lengths), unpadded prompt + response, action_mask over positions 1..T-1 (OpenRLHF's layout)
    g = torch.Generator().manual_seed(1)
    engine_module = actor.model.module
    seqs, masks = [], []
    for _ in range(N_PROMPTS):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(16, 64, (1,), generator=g)),), generator=g)
        with torch.no_grad():
            out = engine_module.generate(prompt[None].cuda(), do_sample=True, temperature=TEMPERATURE, top_k=0,
                                         max_new_tokens=256, min_new_tokens=256, num_return_sequences=N_PER_PROMPT,
                                         pad_token_id=0).cpu()
        for row in out:
            resp = row[len(prompt) : len(prompt) + int(torch.randint(64, 257, (1,), generator=g))]
            seqs.append(torch.cat([prompt, resp]))
            masks.append(torch.cat([torch.zeros(len(prompt) - 1), torch.ones(len(resp))]).bool())
    width = max(len(x) for x in seqs)
    sequences = torch.zeros(n, width, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    action_mask = torch.zeros(n, width - 1, dtype=torch.bool)
    for i, (x, m) in enumerate(zip(seqs, masks)):
        sequences[i, : len(x)], attention_mask[i, : len(x)], action_mask[i, : len(m)] = x, 1, m

    # hooks: the no-grad logits of each phase (the old-log-prob forward; the fallback pass in ppo_train),
    # the LM-head input gradient of the update and its batch
    seen: dict[str, Any] = {"phase": "old_log_prob", "no_grad_logits": {"old_log_prob": [], "ppo_train": []},
                            "head_grad": [], "batch": []}

    def on_head_out(module, inputs, output):
        if not torch.is_grad_enabled():
            seen["no_grad_logits"][seen["phase"]].append(output.detach().float().cpu())

    def on_head_in(module, inputs):
        if inputs[0].requires_grad:
            inputs[0].register_hook(lambda grad: seen["head_grad"].append(grad.detach().float().cpu()))

    def on_actor(module, a, k):
        if torch.is_grad_enabled():
            seen["batch"].append((a[0].detach().cpu(), k["attention_mask"].detach().cpu()))

    hooks = [engine_module.lm_head.register_forward_hook(on_head_out),
             engine_module.lm_head.register_forward_pre_hook(on_head_in),
             actor.register_forward_pre_hook(on_actor, with_kwargs=True)]

    # make_experience's old-policy forward (PolicyModelActor.forward: eval, no grad, one micro-batch)
    actor.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        own_logp = actor(sequences.cuda(), action_mask.cuda(), attention_mask.cuda()).float().cpu()
    torch.cuda.synchronize()
    old_s = time.perf_counter() - t0
    actor.train()
    rewards = torch.randn(n, generator=g)
    exp = Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                     action_log_probs=own_logp * action_mask, kl=torch.zeros(action_mask.shape), rewards=rewards,
                     response_length=action_mask.sum(-1).float(), total_length=attention_mask.sum(-1).float(),
                     index=list(range(n)), info={"reward": rewards.clone()})
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.advantage_estimator = SimpleNamespace(args=args), args, "group_norm"
    maker.kl_ctl = SimpleNamespace(value=0.0)
    maker.compute_advantages_and_returns([exp])
    trainer.replay_buffer.append(exp)
    items = trainer.replay_buffer.items
    mask0 = [it.action_mask.clone() for it in items]
    adv0 = torch.cat([it.advantages.clone() for it in items]).double()
    log(f"buffer: {len(items)} samples, {int(torch.cat(mask0).sum())} action tokens, "
        f"{int(attention_mask.sum())} tokens")

    if fallback:  # patched only now: the trainer and the old-log-prob forward above knew nothing of it
        adapter.patch(config)
    seen["phase"] = "ppo_train"
    params_before = [p.detach().float().clone() for p in engine_module.parameters()]
    try:
        t0 = time.perf_counter()
        status = trainer.ppo_train(0.0)
        torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
        adapter.unpatch()
        _round.begin_round = original_begin
    state = rounds[0]
    log(f"old-log-prob forward {old_s:.2f} s (of which statistics in the forward "
        f"{status.get('entropy_disc/timing/stats_in_forward', float('nan')):.3f} s); ppo_train with the adapter "
        f"{step_s:.2f} s (of which round start {status['entropy_disc/timing/stats_pass']:.3f} s"
        f"{': the fallback pass included' if state.source == 'pass' else ''})")
    log("status: " + json.dumps({k: round(float(v), 6) for k, v in sorted(status.items())
                                 if isinstance(v, (int, float))}))

    # 0. where the statistics came from
    from_forward = float(status.get("entropy_disc/stats/from_forward", float("nan")))
    n_old, n_train = (len(seen["no_grad_logits"][k]) for k in ("old_log_prob", "ppo_train"))
    log(f"entropy_disc/stats/from_forward = {from_forward:g} (round's source {state.source!r}); no-grad LM-head "
        f"forwards: {n_old} in the old-log-prob call, {n_train} in ppo_train")
    if fallback:
        check(from_forward == 0.0 and state.source == "pass", "statistics from the fallback pass (from_forward == 0)")
        check(n_old == 1 and n_train == 1,
              "one no-grad forward in the old-log-prob call, one fallback pass in ppo_train")
        stats_logits = seen["no_grad_logits"]["ppo_train"]
    else:
        check(from_forward == 1.0 and state.source == "forward",
              "statistics from the old-log-prob forward (from_forward == 1)")
        check(float(status.get("entropy_disc/timing/stats_in_forward", 0.0)) > 0.0,
              "statistics timed inside the old-log-prob forward")
        check(n_old == 1 and n_train == 0, "one no-grad forward (the old-log-prob call), no pass of the adapter's own")
        stats_logits = seen["no_grad_logits"]["old_log_prob"]

    # 1. statistics vs float64 on the logits they were taken from (one packed micro-batch of all samples)
    check(len(stats_logits) == 1 and stats_logits[0].shape[0] == 1, "statistics from one packed forward")
    z = stats_logits[0][0].double()  # [L, V], packed order
    positions = attention_mask.reshape(-1).nonzero().squeeze(-1)
    labels = torch.full(sequences.shape, -100, dtype=torch.long)
    labels[:, :-1] = torch.where(action_mask, sequences[:, 1:], torch.full_like(sequences[:, 1:], -100))
    ref_packed = reference_token_stats(z, labels.reshape(-1)[positions], temperature=TEMPERATURE)
    order = {tuple(it.sequences.tolist()): i for i, it in enumerate(items)}
    ref: dict[str, list] = {k: [None] * n for k in ref_packed}
    offsets = torch.cumsum(attention_mask.sum(-1), 0) - attention_mask.sum(-1)
    for r in range(n):
        i = order[tuple(sequences[r][attention_mask[r].bool()].tolist())]
        a = mask0[i].numel()
        for k, v in ref_packed.items():
            ref[k][i] = v[int(offsets[r]) : int(offsets[r]) + a]
    ref = {k: torch.cat(v) for k, v in ref.items()}
    valid = torch.cat(mask0).bool()
    got = state.stats
    for name in ("logp", "entropy", "s_star", "s_expected", "s_centered"):
        err = (getattr(got, name).double().cpu()[valid] - ref[name][valid]).abs()
        scale = ref[name][valid].abs().max()
        log(f"{name}: max abs error vs float64 {float(err.max()):.3g} (max |value| {float(scale):.3g})")
        check(float(err.max()) <= 2e-5 * max(1.0, float(scale)), f"{name} within 2e-5 of float64")
    own_by_item = [None] * n
    for r in range(n):
        i = order[tuple(sequences[r][attention_mask[r].bool()].tolist())]
        own_by_item[i] = own_logp[r, : mask0[i].numel()]
    own = torch.cat(own_by_item)
    err = (got.logp.cpu()[valid] - own[valid]).abs().max()
    log(f"logp vs OpenRLHF's own packed action_log_probs ({'another bf16 forward' if fallback else 'the same forward'}): "
        f"max abs difference {float(err):.3g}")
    check(float(err) < 5e-2, "logp matches OpenRLHF's own action_log_probs (bf16 forwards)")

    # 2. mask vs the plain-Python rule on the float64 S*
    keep_ref = torch.tensor(reference_outlier_keep(ref["s_star"].tolist(), adv0.tolist(), valid.tolist(), recentre=True,
                                                   mu_low=1.0, mu_high=1.0, sides="both", max_frac=None))
    keep = state.mask.keep.cpu()
    log(f"clipped {int((valid & ~keep).sum())} of {int(valid.sum())} tokens; "
        f"{int((keep != keep_ref).sum())} differences from the float64 rule")
    check(int((keep != keep_ref).sum()) == 0 and bool((valid & ~keep).any()), "keep-mask equals the float64 rule")

    # 3. clipped tokens get exactly zero gradient at their LM-head position; the update happened
    check(len(seen["head_grad"]) == 1 and len(seen["batch"]) == 1, "one training forward/backward")
    grad = seen["head_grad"][0][0]  # [L, H] packed
    seq_b, am_b = seen["batch"][0]
    full = torch.zeros(am_b.numel(), grad.shape[-1])
    full[am_b.reshape(-1).nonzero().squeeze(-1)] = grad
    full = full.reshape(*am_b.shape, -1)
    clipped_total = zero_ok = kept_nonzero = 0
    keeps = keep.split([m.numel() for m in mask0])
    for r in range(seq_b.shape[0]):
        i = order[tuple(seq_b[r][am_b[r].bool()].tolist())]
        a = mask0[i].numel()
        rows = full[r, :a]
        clipped = mask0[i].bool() & ~keeps[i]
        clipped_total += int(clipped.sum())
        zero_ok += int((rows[clipped] == 0).all(-1).sum())
        kept_nonzero += int((rows[mask0[i].bool() & keeps[i]].abs().sum(-1) > 0).sum())
    log(f"clipped positions with exactly zero gradient: {zero_ok} of {clipped_total}; kept with nonzero: {kept_nonzero}")
    check(zero_ok == clipped_total > 0 and kept_nonzero > 0, "clipped tokens get exactly zero gradient")
    changed = sum(int(not torch.equal(b, p.detach().float())) for b, p in zip(params_before, engine_module.parameters()))
    check(changed > 0, f"DeepSpeed step changed {changed} parameter tensors")
    check("entropy_disc/clip/frac" in status and "policy_loss" in status, "metrics in ppo_train's status")
    log(f"total {time.perf_counter() - started:.1f} s; {'all checks passed' if not FAILURES else FAILURES}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
