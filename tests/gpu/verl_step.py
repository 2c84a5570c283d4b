"""One verl 0.9.1 actor step with the entropy-disc adapter, on one GPU (not collected by pytest).

Run by hand (see ``verl_step_README.md``)::

    python tests/gpu/verl_step.py --out DIR

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
   adapter's trainer sets.  The logits verl produced are captured by an outer wrapper and the hook's
   ``E_p[S]`` (and verl's entropy / log-probs) are compared with float64 arithmetic on them.
5. Driver step: verl's GRPO estimator (``compute_grpo_outcome_advantage``), then the adapter's
   ``EntropyDiscTrainerMixin.entropy_disc_step`` (S*, S_c, Clip_V mask, metrics) on the batch.
6. Update pass: the keep-mask applied exactly as the adapter's ``_update_actor`` does (zero_pg:
   advantages * keep), then ``worker.update_actor`` (-> ``train_mini_batch`` -> engine
   ``train_batch`` with verl's ``ppo_loss`` / vanilla policy loss -> optimizer step).  The first
   mini-batch's ``pg_loss`` (ratio = 1 there) is checked against ``-sum(A*keep)/n_tokens``.
7. A second ``compute_log_prob`` gives the realised entropy change.

Not run: rollout (no vLLM/SGLang on the device; their wheels were not carried), Ray workers and
TransferQueue (the worker methods are called in-process; with a plain TensorDict verl's ``tqbridge``
calls them directly), the reference model and the critic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

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


def compose_config(model_dir: Path):
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
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
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides), overrides


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


def nested(ts):
    import torch

    return torch.nested.as_nested_tensor(ts, layout=torch.jagged)


def base_tensors(seqs, r_lens):
    import torch

    return {
        "prompts": nested([s[: len(s) - r] for s, r in zip(seqs, r_lens)]),
        "responses": nested([s[len(s) - r :] for s, r in zip(seqs, r_lens)]),
        "input_ids": nested(seqs),
        "position_ids": nested([torch.arange(len(s)) for s in seqs]),
        "response_mask": nested([torch.ones(r, dtype=torch.int64) for r in r_lens]),
        "loss_mask": nested([torch.ones(r, dtype=torch.int64) for r in r_lens]),
    }


def reference_stats(captured, temperature):
    """float64 (H, log p of next token, E_p[S]) per packed position from the logits verl produced."""
    import torch
    from verl.workers.engine.fsdp import transformer_impl as impl

    out = []
    for cap in captured:
        logits = cap["logits"]
        z = impl._scale_logits_by_temperature(logits, cap["temperature"].unsqueeze(-1), is_unit_temperature=False)
        z = z[: cap["ids"].numel()].double()
        logq = torch.log_softmax(z, -1)
        p = logq.exp()
        h = -(p * logq).sum(-1)
        e_s = (p * p * (h[:, None] + logq)).sum(-1)
        labels = torch.roll(cap["ids"], -1)
        lp = logq.gather(-1, labels[:, None])[:, 0]
        out.append((h, lp, e_s, cap["ids"], cap["offsets"]))
    return out


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("DIST_INIT_METHOD", "tcp://127.0.0.1:29533")
    results: dict = {"checks": {}}

    import torch
    import transformers
    import verl

    results["versions"] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "verl": verl.__version__,
    }
    if torch.cuda.is_available():
        results["versions"]["gpu"] = torch.cuda.get_device_name(0)
    log(f"versions {results['versions']}")

    model_dir = Path(tempfile.mkdtemp()) / "tiny_llama"
    write_model(model_dir)

    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import response_from_nested as _from_nested, response_to_nested

    from entropy_discriminator import EntropyMonitor, clip_v_mask
    from entropy_discriminator.adapters.verl import _trainer as trainer_mod
    from entropy_discriminator.adapters.verl import check_config
    from entropy_discriminator.adapters.verl._engine import SEQ_FIELD, STATS_CHUNK, STATS_FLAG, STATS_IMPL
    from entropy_discriminator.adapters.verl._workers import stats_worker

    def response_from_nested(values, mask):  # verl's slice to the response, padded [B, T_resp] with 0
        return torch.nested.to_padded_tensor(_from_nested(values, mask), 0.0)

    cfg, overrides = compose_config(model_dir)
    results["overrides"] = overrides
    plan = check_config(cfg)
    ed_cfg = plan.options
    assert plan.expected, "clip_v must ask the old-policy pass for E_p[S]"
    log(f"entropy_disc config {ed_cfg}")

    # --- engine build: the adapter's worker class, verl's init_model ----------------------------
    worker_cls = stats_worker(ActorRolloutRefWorker)
    t0 = time.time()
    worker = worker_cls(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    results["engine"] = {
        "class": type(engine).__name__, "module": type(engine.module).__name__,
        "strategy": cfg.actor_rollout_ref.actor.strategy, "autocast_dtype": str(engine._autocast_dtype),
        "optimizer": type(engine.optimizer).__name__, "build_s": round(time.time() - t0, 2),
    }
    log(f"engine {results['engine']}")
    assert FSDPEngineWithLMHead.prepare_model_outputs.__name__ == "prepare_model_outputs"
    from entropy_discriminator.adapters.verl._engine import engine_hook_installed

    assert engine_hook_installed(), "the adapter's worker must install the engine hook"

    # capture the exact logits verl hands to prepare_model_outputs (outer wrapper, around the hook)
    captured: list[dict] = []
    hooked = FSDPEngineWithLMHead.prepare_model_outputs

    def capturing(self, output, output_args, micro_batch, logits_processor_func):
        if tu.get_non_tensor_data(data=micro_batch, key=STATS_FLAG, default=False):
            captured.append({
                "logits": output.logits.squeeze(0).detach().clone(),  # verl's dtype: it scales in it
                "temperature": output_args["temperature_rmpad"].detach().clone(),
                "ids": micro_batch["input_ids"].values().detach().clone(),
                "offsets": micro_batch["input_ids"].offsets().detach().clone(),
                "logits_dtype": str(output.logits.dtype),
            })
        return hooked(self, output, output_args, micro_batch, logits_processor_func)

    FSDPEngineWithLMHead.prepare_model_outputs = capturing

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
    response_mask = nested([torch.ones(r, dtype=torch.int64) for r in r_lens])
    log(f"old-log-prob pass: keys {sorted(old.keys())}, {len(captured)} micro-batches captured")
    old_lp = response_from_nested(old["log_probs"], response_mask)
    ent = response_from_nested(old["entropy"], response_mask)
    s_exp = response_from_nested(old[SEQ_FIELD], response_mask)

    # float64 reference on verl's own logits, per packed position then response-aligned
    ref = reference_stats(captured, TEMPERATURE)
    ids_cat = torch.cat([r[3] for r in ref])
    assert torch.equal(ids_cat.cpu(), torch.cat(seqs)), "captured micro-batches are the batch, in order"
    h_seq = torch.cat([r[0] for r in ref]).cpu()
    lp_seq = torch.cat([r[1] for r in ref]).cpu()
    es_seq = torch.cat([r[2] for r in ref]).cpu()
    offsets = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(s) for s in seqs]), 0)))
    as_nested = lambda v: torch.nested.nested_tensor_from_jagged(v, offsets)  # noqa: E731
    ref_h = response_from_nested(as_nested(h_seq), response_mask)
    ref_lp = response_from_nested(as_nested(lp_seq), response_mask)
    ref_es = response_from_nested(as_nested(es_seq), response_mask)
    valid = torch.nested.to_padded_tensor(response_mask, 0).bool()
    hook_all = old[SEQ_FIELD].values().cpu().double()
    results["checks"]["old_log_prob"] = {
        "logits_dtype": captured[0]["logits_dtype"],
        "E_p[S] all positions: rel_err vs float64": rel_err(hook_all, es_seq),
        "E_p[S] all positions: max_abs_err": float((hook_all - es_seq).abs().max()),
        "E_p[S] response: rel_err vs float64": rel_err(s_exp[valid], ref_es[valid]),
        "E_p[S] response: max |ref|": float(ref_es[valid].abs().max()),
        "verl entropy: rel_err vs float64": rel_err(ent[valid], ref_h[valid]),
        "verl log_probs: rel_err vs float64": rel_err(old_lp[valid], ref_lp[valid]),
        "n_positions": int(hook_all.numel()), "n_response_tokens": int(valid.sum()),
    }
    log(f"old-log-prob checks {results['checks']['old_log_prob']}")
    assert results["checks"]["old_log_prob"]["E_p[S] all positions: rel_err vs float64"] < 1e-5
    FSDPEngineWithLMHead.prepare_model_outputs = hooked

    # --- driver: verl's GRPO advantages, then the adapter's mask step --------------------------
    token_rewards = torch.zeros(valid.shape)
    for i, r in enumerate(r_lens):
        token_rewards[i, r - 1] = rewards[i]
    import numpy as np

    index = np.array([f"p{i // N_ROLLOUTS}" for i in range(b)], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=token_rewards, response_mask=valid.float(), index=index)
    driver = SimpleNamespace(entropy_disc=ed_cfg, config=cfg, _entropy_disc_monitor=EntropyMonitor())
    mask, metrics = trainer_mod.EntropyDiscTrainerMixin.entropy_disc_step(
        driver, advantages=adv, response_mask=valid.long(), old_log_probs=old_lp, entropy=ent, s_expected=s_exp,
    )
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
    t0 = time.time()
    upd = worker.update_actor(td)
    results["update_s"] = round(time.time() - t0, 3)
    upd_metrics = {k: (v if not isinstance(v, torch.Tensor) else v.tolist()) for k, v in tu.get(upd, "metrics").items()}
    results["update_metrics"] = json.loads(json.dumps(upd_metrics, default=str))
    log(f"update metrics {results['update_metrics']}")

    first = slice(0, mini)  # shuffle off: the first mini-batch is the first `mini` sequences, ratio = 1 there
    n_tok = valid[first].sum()
    expect_masked = float(-(adv * mask.keep)[first][valid[first]].sum() / n_tok)
    expect_unmasked = float(-adv[first][valid[first]].sum() / n_tok)
    pg = upd_metrics.get("actor/pg_loss", upd_metrics.get("pg_loss"))
    pg_first = float(pg[0] if isinstance(pg, list) else pg)
    results["checks"]["update"] = {
        "pg_loss_first_minibatch": pg_first, "expected_with_mask": expect_masked,
        "expected_without_mask": expect_unmasked, "mini_batch_sequences": mini,
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
    assert SEQ_FIELD not in new.keys(), "without the flag the hook must not add E_p[S]"
    realised = EntropyMonitor().realised(ent, new_ent, valid)
    results["after_update"] = {
        **realised,
        "mean_abs_logprob_change": float((new_lp - old_lp)[valid].abs().mean()),
        "predicted_delta_entropy_(first-order, lr)": metrics.get("entropy_disc/delta_entropy/predicted"),
    }
    log(f"after update {results['after_update']}")
    results["ok"] = True
    (out_dir / "verl_step.json").write_text(json.dumps(results, indent=2, default=str))
    log("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
