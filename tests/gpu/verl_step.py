"""One verl 0.9.1 actor step with the entropy-disc adapter, on one GPU (not collected by pytest).

Run by hand (see ``verl_step_README.md``)::

    python tests/gpu/verl_step.py --out DIR [--variants default,dynbsz,fused,dynbsz+fused] [--dry-run]

Variants (run in sequence in one process, each with all the checks below; padding removal, verl's
default, is on in all of them): ``default``; ``dynbsz`` (``actor.use_dynamic_bsz=True`` and
``rollout.log_prob_use_dynamic_bsz=True``, 320 tokens per micro-batch, so verl regroups the
sequences by token count); ``fused`` (``model.use_fused_kernels=True``: no logits exist, the adapter
re-forms verl's torch fused head from the final hidden states and the LM-head weight, and the
reference is float64 arithmetic on ``(hidden @ W.T) / T`` formed as verl forms it, per 512 rows in
verl's autocast dtype, bf16-rounded); joined with ``+`` they combine.  ``--dry-run`` only composes each variant's config and runs the adapter's
``check_config`` on it (works on a CPU machine with verl installed).

What runs, all in this one process (rank 0 of a one-rank NCCL/gloo group, no Ray cluster):

1. A tiny random Llama + a word-level tokenizer are written locally with ``save_pretrained``.
2. verl's ``ppo_trainer`` config is composed by Hydra with the adapter's overrides
   (``trainer.v1.trainer_mode=entropy_disc +entropy_disc.*``); the adapter's start-up decision
   ``check_config`` reads it.
3. The adapter's hook-installing worker ``stats_worker(ActorRolloutRefWorker)`` (role ``actor``) is
   built and ``init_model()`` runs verl's real engine build: ``TrainingWorker`` ->
   ``FSDPEngineWithLMHead`` (HF load from the local directory, FSDP wrap, bf16 mixed precision,
   optimizer, LR scheduler).
4. Old-log-prob pass: ``worker.compute_log_prob`` (-> ``TrainingWorker.infer_batch`` -> engine
   ``infer_batch`` -> ``prepare_model_outputs`` wrapped by the adapter's hook) with the flags the
   adapter's trainer sets.  The logits verl produced (fused: the hidden states and LM-head weight)
   are captured by outer wrappers, put back into the batch's order (dynamic batch regroups the
   sequences), and the hook's ``log p``, ``H`` and ``E_p[S]`` (and verl's entropy / log-probs) are
   compared with float64 arithmetic on them.
5. Driver step: verl's GRPO estimator (``compute_grpo_outcome_advantage``), then the adapter's
   ``EntropyDiscTrainerMixin.entropy_disc_step`` (S*, S_c, Clip_V mask, metrics) on the hook's fields,
   as the adapter's ``_compute_advantage`` does; the mask against the float64 one (0 differences).
6. Update pass: the keep-mask applied exactly as the adapter's ``_update_actor`` does (zero_pg:
   advantages * keep), then ``worker.update_actor`` (-> ``train_mini_batch`` -> engine
   ``train_batch`` with verl's ``ppo_loss`` / vanilla policy loss -> optimizer step).  The first
   mini-batch's ``pg_loss`` (ratio = 1 there) is checked against ``-sum(A*keep)/n_tokens``; verl
   divides each micro-batch's sum by the mini-batch's token count and sums them, so the check is the
   same under dynamic batch.
7. A second ``compute_log_prob`` gives the realised entropy change.

Not run: rollout (no vLLM/SGLang on the device; their wheels were not carried), Ray workers and
TransferQueue (the worker methods are called in-process; with a plain TensorDict verl's ``tqbridge``
calls them directly), the reference model and the critic.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root, for benchmarks/ (last: an installed entropy_discriminator wins)
from benchmarks.verl_inprocess import (
    base_tensors,
    compose_ppo_config,
    nested,
    one_rank_env,
)

N_PROMPTS, N_ROLLOUTS = 8, 4
VOCAB, HIDDEN, LAYERS = 4096, 128, 2
TEMPERATURE = 0.8
MU_LOW = 2.0  # deliberately low Clip_V bound so that a batch of ~1k tokens clips some


def log(msg: str) -> None:
    print(f"[verl_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_model(path: Path) -> None:
    """Random tiny Llama + word-level tokenizer, saved with ``save_pretrained`` (no hub)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({"<pad>": 0, "<s>": 1, "</s>": 2})
    vocab = {k: v for k, v in vocab.items() if k not in ("t0", "t1", "t2")}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # spread the logits so softmax rows are far from uniform
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)


#: Variants one invocation can run (``--variants``), as overrides on top of the common ones.  Padding
#: removal is verl's default (``actor_rollout_ref.model.use_remove_padding: True`` in ``hf_model.yaml``)
#: and stays on in every variant; the script asserts it.
MAX_TOKENS = 320  # per micro-batch under dynamic batch: ~1161 tokens -> several micro-batches per pass
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "dynbsz": [
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={MAX_TOKENS}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={MAX_TOKENS}",
    ],
    "fused": ["actor_rollout_ref.model.use_fused_kernels=True"],
}


def variant_overrides(name: str) -> list[str]:
    """Overrides of a variant name: one of ``VARIANTS`` or several joined by ``+`` (e.g. ``dynbsz+fused``)."""
    parts = name.split("+")
    unknown = [p for p in parts if p not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown variant {unknown} in {name!r}; known: {sorted(VARIANTS)} (join with '+')")
    return [o for p in parts for o in VARIANTS[p]]


def compose_config(model_dir: Path, extra: list[str]):
    mini = N_PROMPTS // 2  # two mini-batches: the second one sees ratio != 1
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.rollout.n={N_ROLLOUTS}",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "algorithm.adv_estimator=grpo",
        "trainer.v1.trainer_mode=entropy_disc",
        "+entropy_disc.method=clip_v",
        f"+entropy_disc.mu_low={MU_LOW}",
        "+entropy_disc.max_frac=null",
        "+entropy_disc.mask_mode=zero_pg",
        *extra,
    ]
    return compose_ppo_config(overrides), overrides


def make_batch(seed: int = 1):
    """Synthetic rollout: ``N_PROMPTS`` prompts x ``N_ROLLOUTS`` responses, jagged like verl's agent loop."""
    import torch

    g = torch.Generator().manual_seed(seed)
    b = N_PROMPTS * N_ROLLOUTS
    p_lens = [int(x) for x in torch.randint(6, 17, (N_PROMPTS,), generator=g)]
    seqs, r_lens = [], []
    for i in range(b):
        same_prompt = torch.Generator().manual_seed(100 + i // N_ROLLOUTS)  # the group's rollouts share it
        prompt = torch.randint(3, VOCAB, (p_lens[i // N_ROLLOUTS],), generator=same_prompt)
        r = int(torch.randint(8, 49, (1,), generator=g))
        seqs.append(torch.cat([prompt, torch.randint(3, VOCAB, (r,), generator=g)]))
        r_lens.append(r)
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    return seqs, [p_lens[i // N_ROLLOUTS] for i in range(b)], r_lens, rewards


def _stats64(z, ids):
    """float64 (H, log p of the next token, E_p[S]) of the rows of scaled logits ``z`` ``[N, V]``."""
    import torch

    logq = torch.log_softmax(z.double(), -1)
    p = logq.exp()
    h = -(p * logq).sum(-1)
    e_s = (p * p * (h[:, None] + logq)).sum(-1)
    lp = logq.gather(-1, torch.roll(ids, -1).to(z.device)[:, None])[:, 0]  # fused captures: ids still on CPU
    return h, lp, e_s


def reference_stats(cap):
    """float64 references per packed position of one captured micro-batch: ``(H, log p, E_p[S], H_v)``.

    The distribution is verl's own: logits path, verl's logits scaled by its per-token temperatures
    exactly as verl scales them; fused path (no logits exist), ``(hidden @ W.T) / T`` formed as verl's
    torch fused head forms it (``_fused_linear_for_ppo_fwd``: per 512 flattened rows, in the autocast
    dtype, the product and the division rounded to it) from the captured hidden states and LM-head
    weight.  ``H, log p, E_p[S]`` are float64 on those rounded logits: what the adapter's fields are
    checked against.  ``H_v`` is what verl returns as entropy: ``H`` on the logits path, ``H`` rounded
    to the autocast dtype on the fused path (verl's fused head returns its entropy in that dtype).
    """
    import torch
    from verl.workers.engine.fsdp import transformer_impl as impl

    n = cap["ids"].numel()
    if "logits" in cap:
        z = impl._scale_logits_by_temperature(cap["logits"], cap["temperature"].unsqueeze(-1), is_unit_temperature=False)
        h, lp, e_s = _stats64(z[:n].double(), cap["ids"])
        return h, lp, e_s, h
    hid, w = cap["hidden"].to(cap["dtype"]), cap["weight"].to(cap["dtype"])
    z = torch.cat([(hid[i : i + 512] @ w.T) / cap["temperature"] for i in range(0, hid.shape[0], 512)])
    h, lp, e_s = _stats64(z[:n].double(), cap["ids"])
    return h, lp, e_s, h.to(cap["dtype"]).double()


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def in_batch_order(captured, seqs):
    """Per-position float64 references (``reference_stats``) of the captured micro-batches, reordered to the batch's sequence order.

    Under dynamic batch verl regroups sequences into micro-batches by token count; every sequence of
    the batch must be captured exactly once.
    """
    import torch

    index = {tuple(s.tolist()): i for i, s in enumerate(seqs)}
    assert len(index) == len(seqs), "synthetic sequences must be distinct"
    per_seq: list = [None] * len(seqs)
    for cap in captured:
        refs = [t.cpu() for t in reference_stats(cap)]
        ids, offsets = cap["ids"].cpu(), cap["offsets"].cpu().tolist()
        for a, b in itertools.pairwise(offsets):
            i = index[tuple(ids[a:b].tolist())]
            assert per_seq[i] is None, f"sequence {i} captured twice"
            per_seq[i] = tuple(t[a:b] for t in refs)
    assert all(x is not None for x in per_seq), "a sequence of the batch was not captured"
    return [torch.cat([x[k] for x in per_seq]) for k in range(len(per_seq[0]))]


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--variants", default="default",
        help=f"comma-separated, run in this order in one process; each one of {sorted(VARIANTS)} or several joined "
        "by '+' (e.g. dynbsz+fused). Put fused variants last: verl's fused-kernel patch replaces the model "
        "class's forward for the rest of the process.",
    )
    parser.add_argument("--dry-run", action="store_true", help="compose and check each variant's config only (CPU)")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        variant_overrides(v)
    seen_fused = False
    for v in variants:
        fused = "fused" in v.split("+")
        if seen_fused and not fused:
            raise SystemExit(f"--variants: {v!r} after a fused variant; put fused variants last")
        seen_fused |= fused
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    one_rank_env()

    import torch
    import transformers
    import verl

    versions = {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "verl": verl.__version__,
    }
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name(0)
    log(f"versions {versions}")
    model_dir = Path(tempfile.mkdtemp()) / "tiny_llama"
    write_model(model_dir)
    summary: dict = {"versions": versions, "variants": {}}
    for name in variants:  # a failing variant is recorded and the next one still runs; the exit status is 1
        t0 = time.time()
        res: dict = {"checks": {}}  # filled as the variant goes, so a failure keeps what ran before it
        try:
            run_variant(name, model_dir, res, dry_run=args.dry_run)
        except Exception as exc:  # noqa: BLE001 (recorded with its traceback, and the run fails at the end)
            res.update(ok=False, error=repr(exc), traceback=traceback.format_exc())
            log(f"variant {name}: FAILED\n{res['traceback']}")
        res["wall_s"] = round(time.time() - t0, 2)
        summary["variants"][name] = res
        (out_dir / "verl_step.json").write_text(json.dumps(summary, indent=2, default=str))
        log(f"variant {name}: {'OK' if res.get('ok', args.dry_run) else 'FAILED'} in {res['wall_s']} s")
    summary["ok"] = all(r.get("ok", args.dry_run) for r in summary["variants"].values())
    (out_dir / "verl_step.json").write_text(json.dumps(summary, indent=2, default=str))
    log("OK" if summary["ok"] else "FAILED")
    return 0 if summary["ok"] else 1


def run_variant(name: str, model_dir: Path, results: dict, *, dry_run: bool = False) -> dict:
    """One actor step (old-log-prob pass, driver mask, update, log-prob pass) under variant ``name``.

    Its settings, measurements and checks go into ``results`` as they are made; a failed check raises.
    """
    import torch
    from entropy_discriminator.adapters.verl import check_config
    from entropy_discriminator.adapters.verl._engine import (
        STATS_FLAG,
        _causal_lm,
        engine_hook_installed,
    )
    from entropy_discriminator.adapters.verl._workers import stats_worker
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import ActorRolloutRefWorker

    log(f"=== variant {name} ===")
    cfg, overrides = compose_config(model_dir, variant_overrides(name))
    results["overrides"] = overrides
    m, a = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor
    fused = bool(m.use_fused_kernels)
    dynamic = bool(a.use_dynamic_bsz)
    results["settings"] = {
        "use_remove_padding": bool(m.use_remove_padding), "use_dynamic_bsz": dynamic,
        "log_prob_use_dynamic_bsz": bool(cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz),
        "ppo_max_token_len_per_gpu": a.ppo_max_token_len_per_gpu,
        "log_prob_max_token_len_per_gpu": cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu,
        "use_fused_kernels": fused, "fused_kernels_backend": m.fused_kernel_options.impl_backend,
    }
    assert results["settings"]["use_remove_padding"], "padding removal is verl's default and stays on here"
    plan = check_config(cfg)
    ed_cfg = plan.options
    assert plan.expected, "clip_v must ask the old-policy pass for E_p[S]"
    assert plan.from_hidden == fused, "with fused kernels E_p[S] must come from the hidden states"
    results["plan"] = {"expected": plan.expected, "from_hidden": plan.from_hidden, "mask_mode": ed_cfg.mask_mode}
    log(f"settings {results['settings']} plan {results['plan']}")
    if dry_run:
        return results

    # --- engine build: the adapter's worker class, verl's init_model ----------------------------
    worker_cls = stats_worker(ActorRolloutRefWorker)
    t0 = time.time()
    worker = worker_cls(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    results["engine"] = {
        "class": type(engine).__name__, "module": type(engine.module).__name__,
        "strategy": a.strategy, "autocast_dtype": str(engine._autocast_dtype),
        "optimizer": type(engine.optimizer).__name__, "build_s": round(time.time() - t0, 2),
    }
    log(f"engine {results['engine']}")
    assert engine_hook_installed(), "the adapter's worker must install the engine hook"

    # Outer wrappers around the hooked engine methods: they copy what verl computed (the logits, or with
    # fused kernels the final hidden states and the LM-head weight) and count micro-batches; they
    # change nothing verl returns.
    captured: list[dict] = []
    micro_batches: list[dict] = []
    hooked_outputs = FSDPEngineWithLMHead.prepare_model_outputs
    hooked_forward = FSDPEngineWithLMHead.forward_step

    def capturing_outputs(self, output, output_args, micro_batch, logits_processor_func):
        if tu.get_non_tensor_data(data=micro_batch, key=STATS_FLAG, default=False) and not fused:
            captured.append({
                "logits": output.logits.squeeze(0).detach().clone(),  # verl's dtype: it scales in it
                "temperature": output_args["temperature_rmpad"].detach().clone(),
                "ids": micro_batch["input_ids"].values().detach().clone(),
                "offsets": micro_batch["input_ids"].offsets().detach().clone(),
                "logits_dtype": str(output.logits.dtype),
            })
        return hooked_outputs(self, output, output_args, micro_batch, logits_processor_func)

    def capturing_forward(self, micro_batch, loss_function, forward_only):
        ids = micro_batch["input_ids"]
        micro_batches.append({"forward_only": bool(forward_only), "sequences": int(ids.shape[0]),
                              "tokens": int(ids.values().numel())})
        if not (fused and tu.get_non_tensor_data(data=micro_batch, key=STATS_FLAG, default=False)):
            return hooked_forward(self, micro_batch, loss_function, forward_only)
        causal_lm = _causal_lm(self.module)

        def grab(module, args, out):  # runs inside verl's autocast, while the LM head is gathered
            hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
            on = torch.is_autocast_enabled(hidden.device.type)
            captured.append({
                "hidden": hidden.detach().squeeze(0).clone(),
                "weight": causal_lm.get_output_embeddings().weight.detach().clone(),
                "dtype": torch.get_autocast_dtype(hidden.device.type) if on else hidden.dtype,
                "temperature": float(tu.get_non_tensor_data(data=micro_batch, key="temperature", default=1.0)),
                "ids": ids.values().detach().clone(), "offsets": ids.offsets().detach().clone(),
                "logits_dtype": "none (fused kernels)",
            })

        handle = causal_lm.base_model.register_forward_hook(grab)
        try:
            return hooked_forward(self, micro_batch, loss_function, forward_only)
        finally:
            handle.remove()

    FSDPEngineWithLMHead.prepare_model_outputs = capturing_outputs
    FSDPEngineWithLMHead.forward_step = capturing_forward
    try:
        return _passes(results, cfg, ed_cfg, worker, captured, micro_batches, fused, dynamic)
    finally:
        FSDPEngineWithLMHead.prepare_model_outputs = hooked_outputs
        FSDPEngineWithLMHead.forward_step = hooked_forward


def _passes(results, cfg, ed_cfg, worker, captured, micro_batches, fused, dynamic) -> dict:
    """Steps 4-7 of the module docstring on a built worker; fills and returns ``results``."""
    import numpy as np
    import torch
    from entropy_discriminator.adapters.verl import _trainer as trainer_mod
    from entropy_discriminator.adapters.verl._engine import (
        SEQ_FIELD,
        SEQ_FIELDS,
        STATS_CHUNK,
        STATS_FLAG,
        STATS_IMPL,
    )
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import response_from_nested as _from_nested
    from verl.workers.utils.padding import response_to_nested

    from entropy_discriminator import EntropyMonitor, clip_v_mask

    def response_from_nested(values, mask):  # verl's slice to the response, padded [B, T_resp] with 0
        return torch.nested.to_padded_tensor(_from_nested(values, mask), 0.0)

    # --- old-log-prob pass ---------------------------------------------------------------------
    seqs, p_lens, r_lens, rewards = make_batch()
    b = len(seqs)
    results["batch"] = {"sequences": b, "prompt_lens": sorted(set(p_lens)), "response_tokens": sum(r_lens),
                        "total_tokens": sum(len(s) for s in seqs), "vocab": VOCAB, "temperature": TEMPERATURE}
    td = tu.get_tensordict(
        tensor_dict=base_tensors(seqs, r_lens),
        non_tensor_dict={
            "calculate_entropy": True, "compute_loss": False, "temperature": TEMPERATURE,
            STATS_FLAG: True, STATS_CHUNK: ed_cfg.chunk_size, STATS_IMPL: ed_cfg.impl,
        },
    )
    t0 = time.time()
    old = worker.compute_log_prob(td)
    results["old_log_prob_s"] = round(time.time() - t0, 3)
    old_mbs = [mb for mb in micro_batches if mb["forward_only"]]
    results["old_log_prob_micro_batches"] = {"count": len(old_mbs), "tokens": [mb["tokens"] for mb in old_mbs],
                                             "sequences": [mb["sequences"] for mb in old_mbs]}
    log(f"old-log-prob pass: keys {sorted(old.keys())}, micro-batches {results['old_log_prob_micro_batches']}")
    assert len(captured) == len(old_mbs), "one capture per micro-batch of the flagged pass"
    if dynamic:
        max_tok = cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
        assert len(old_mbs) > 1 and max(mb["tokens"] for mb in old_mbs) <= max_tok, "dynamic batch must split by tokens"
    response_mask = nested([torch.ones(r, dtype=torch.int64) for r in r_lens])
    old_lp = response_from_nested(old["log_probs"], response_mask)
    ent = response_from_nested(old["entropy"], response_mask)
    hook = {name: response_from_nested(old[field], response_mask) for name, field in SEQ_FIELDS.items()}

    # float64 reference per captured micro-batch, back in the batch's order, then response-aligned
    h_seq, lp_seq, es_seq, hv_seq = in_batch_order(captured, seqs)
    offsets = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(s) for s in seqs]), 0)))
    as_nested = lambda v: torch.nested.nested_tensor_from_jagged(v, offsets)
    ref_h = response_from_nested(as_nested(h_seq), response_mask)
    ref_lp = response_from_nested(as_nested(lp_seq), response_mask)
    ref_es = response_from_nested(as_nested(es_seq), response_mask)
    ref_hv = response_from_nested(as_nested(hv_seq), response_mask)
    valid = torch.nested.to_padded_tensor(response_mask, 0).bool()
    hook_all = old[SEQ_FIELD].values().cpu().double()
    reference = "float64 on verl's fused-head logits (bf16 (hidden @ W.T) / T per 512 rows)" if fused else \
        "float64 on verl's logits"
    checks = {
        "reference": reference,
        "logits_dtype": captured[0]["logits_dtype"],
        "E_p[S] all positions: rel_err vs float64": rel_err(hook_all, es_seq),
        "E_p[S] all positions: max_abs_err": float((hook_all - es_seq).abs().max()),
        "E_p[S] response: max |ref|": float(ref_es[valid].abs().max()),
        "verl entropy: rel_err vs float64": rel_err(ent[valid], ref_hv[valid]),
        "verl log_probs: rel_err vs float64": rel_err(old_lp[valid], ref_lp[valid]),
        "n_positions": int(hook_all.numel()), "n_response_tokens": int(valid.sum()),
    }
    for name, want in (("logp", ref_lp), ("entropy", ref_h), ("s_expected", ref_es)):
        checks[f"hook {name} response: rel_err vs float64"] = rel_err(hook[name][valid], want[valid])
    results["checks"]["old_log_prob"] = checks
    log(f"old-log-prob checks {checks}")
    assert checks["E_p[S] all positions: rel_err vs float64"] < 1e-5
    for name in ("logp", "entropy", "s_expected"):  # the hook's three fields: one distribution, verl's
        assert checks[f"hook {name} response: rel_err vs float64"] < 1e-5, name
    # the captures are what verl computed from: its own outputs agree with the reference (log-probs fp32 with
    # flash-attn's cross-entropy or the fused head; entropy returned in bf16 by the fused head, 2^-9 per value)
    assert checks["verl log_probs: rel_err vs float64"] < 5e-4
    assert checks["verl entropy: rel_err vs float64"] < 4e-3

    # --- driver: verl's GRPO advantages, then the adapter's mask step --------------------------
    token_rewards = torch.zeros(valid.shape)
    for i, r in enumerate(r_lens):
        token_rewards[i, r - 1] = rewards[i]
    index = np.array([f"p{i // N_ROLLOUTS}" for i in range(b)], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=token_rewards, response_mask=valid.float(), index=index)
    driver = SimpleNamespace(entropy_disc=ed_cfg, config=cfg, _entropy_disc_monitor=EntropyMonitor())
    mask, metrics = trainer_mod.EntropyDiscTrainerMixin.entropy_disc_step(
        driver, advantages=adv, response_mask=valid.long(), old_log_probs=hook["logp"], entropy=hook["entropy"],
        s_expected=hook["s_expected"],
    )
    # S*, S_c of the float64 reference: verl's own (rounded) distribution
    ref_s_star = torch.where(valid, ref_lp.exp() * (ref_h + ref_lp), 0.0)
    ref_mask = clip_v_mask(torch.where(valid, ref_s_star - ref_es, 0.0), adv.double(), valid, mu_low=MU_LOW,
                           max_frac=None)
    results["checks"]["driver_mask"] = {
        "method": mask.method, "n_valid": mask.n_valid, "n_clipped": mask.n_clipped,
        "n_clipped_neg": mask.n_clipped_neg, "clip_frac": mask.clip_frac,
        "threshold_low": mask.lower, "threshold_high": mask.upper,
        "keep_disagreements_vs_float64_mask": int((mask.keep != ref_mask.keep)[valid].sum()),
    }
    results["entropy_disc_metrics"] = metrics
    log(f"driver mask {results['checks']['driver_mask']}")
    assert mask.n_clipped > 0, "lower mu_low: the update check needs clipped tokens"
    assert results["checks"]["driver_mask"]["keep_disagreements_vs_float64_mask"] == 0, "mask != float64 mask"

    # --- update pass: the mask as _update_actor applies it (zero_pg), then verl's update ---------
    adv_nested = response_to_nested(adv, response_mask)
    masked_adv = response_to_nested(adv * mask.keep.to(adv.dtype), adv_nested)
    train = base_tensors(seqs, r_lens)
    train.update(old_log_probs=response_to_nested(old_lp, response_mask), advantages=masked_adv)
    a = cfg.actor_rollout_ref.actor
    mini = a.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    td = tu.get_tensordict(
        tensor_dict=train,
        non_tensor_dict={
            "calculate_entropy": True, "distillation_use_topk": False, "distillation_only": False,
            "global_batch_size": mini, "mini_batch_size": mini, "epochs": a.ppo_epochs,
            "seed": a.data_loader_seed, "dataloader_kwargs": {"shuffle": False}, "temperature": TEMPERATURE,
        },
    )
    n_before = len(micro_batches)
    t0 = time.time()
    upd = worker.update_actor(td)
    results["update_s"] = round(time.time() - t0, 3)
    upd_mbs = micro_batches[n_before:]
    results["update_micro_batches"] = {"count": len(upd_mbs), "tokens": [mb["tokens"] for mb in upd_mbs],
                                       "sequences": [mb["sequences"] for mb in upd_mbs]}
    if dynamic:
        assert max(mb["tokens"] for mb in upd_mbs) <= a.ppo_max_token_len_per_gpu
    upd_metrics = {k: (v if not isinstance(v, torch.Tensor) else v.tolist()) for k, v in tu.get(upd, "metrics").items()}
    results["update_metrics"] = json.loads(json.dumps(upd_metrics, default=str))
    log(f"update micro-batches {results['update_micro_batches']} metrics {results['update_metrics']}")

    # shuffle off: the first mini-batch is the first `mini` sequences, ratio = 1 there.  verl's token-mean
    # divides every micro-batch's sum by the mini-batch's token count and sums the micro-batches' pg_loss
    # (also under dynamic batch), so the mini-batch's pg_loss is -sum(A*keep)/n_tokens of that mini-batch.
    first = slice(0, mini)
    n_tok = valid[first].sum()
    expect_masked = float(-(adv * mask.keep)[first][valid[first]].sum() / n_tok)
    expect_unmasked = float(-adv[first][valid[first]].sum() / n_tok)
    pg = upd_metrics.get("actor/pg_loss", upd_metrics.get("pg_loss"))
    n_mini = b // mini * a.ppo_epochs
    assert isinstance(pg, list) and len(pg) == n_mini, f"expected one pg_loss per mini-batch ({n_mini}), got {pg}"
    pg_first = float(pg[0])
    results["checks"]["update"] = {
        "pg_loss_first_minibatch": pg_first, "expected_with_mask": expect_masked,
        "expected_without_mask": expect_unmasked, "abs_diff": abs(pg_first - expect_masked),
        "mini_batch_sequences": mini,
    }
    log(f"update checks {results['checks']['update']}")
    assert abs(pg_first - expect_masked) < 0.05 * abs(expect_masked - expect_unmasked), "mask did not reach verl's loss"

    # --- after the step: entropy again -----------------------------------------------------------
    td = tu.get_tensordict(
        tensor_dict=base_tensors(seqs, r_lens),
        non_tensor_dict={"calculate_entropy": True, "compute_loss": False, "temperature": TEMPERATURE},
    )
    new = worker.compute_log_prob(td)
    new_lp = response_from_nested(new["log_probs"], response_mask)
    new_ent = response_from_nested(new["entropy"], response_mask)
    assert SEQ_FIELD not in new.keys(), "without the flag the hook must not add E_p[S]"  # noqa: SIM118 (TensorDict)
    realised = EntropyMonitor().realised(ent, new_ent, valid)
    results["after_update"] = {
        **realised,
        "mean_abs_logprob_change": float((new_lp - old_lp)[valid].abs().mean()),
        "predicted_delta_entropy_(first-order, lr)": metrics.get("entropy_disc/delta_entropy/predicted"),
    }
    log(f"after update {results['after_update']}")
    results["ok"] = True
    return results


if __name__ == "__main__":
    sys.exit(main())
