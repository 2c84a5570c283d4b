"""Checkpoint and resume of the autopilot through OpenRLHF's own actor checkpoint path, on the CPU.

Run by ``test_openrlhf_autopilot.py`` in a subprocess (not collected by pytest): CUDA calls are
redirected to the CPU process-wide (``tests/gpu/openrlhf_step_on_cpu.py``), which a shared pytest
process cannot take. Everything on the actor's side is OpenRLHF's real code, called on a real
``PolicyModelActor`` instance (the class under its ``@ray.remote`` wrapper, no Ray cluster):
``init_model_from_pretrained`` (``Actor`` from a saved tiny Llama + tokenizer, ``DeepspeedStrategy``
with ``deepspeed.initialize`` ZeRO-2 bf16, ``--ckpt.load_enable`` -> ``strategy.load_ckpt``, then
``ActorPPOTrainer``), ``forward`` (the old-log-prob pass ``make_experience`` dispatches), ``append``,
``fit`` (``ppo_train``) and ``save_checkpoint(tag, client_states)`` (``strategy.save_ckpt`` ->
DeepSpeed ``save_checkpoint``), ``get_checkpoint_states``. Deviations: the optimizer config gets
``torch_adam: true`` (DeepSpeed's FusedAdam needs a compiled CUDA op), as in the GPU script; torch's
global generator is seeded before each step, because OpenRLHF's checkpoint does not hold the RNG
state that ``ppo_train``'s shuffle of the replay buffer draws from (without it a resumed OpenRLHF run
shuffles differently from the uninterrupted one, with or without the adapter).

    python tests/adapters/openrlhf/openrlhf_autopilot_resume.py OUT.json PORT

Writes JSON: ``full`` (4 rounds, checkpoint ``global_step2`` saved after round 2), ``resumed`` (a
fresh worker loading that checkpoint, rounds 3-4), ``states`` (the loaded client states' keys and
the controller entry), ``refusal`` (the message of loading a checkpoint saved by a Clip_B run into an
autopilot run) and ``fresh_without_checkpoint`` (load enabled, no checkpoint saved there: a fresh controller).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
ROUNDS, SAVE_AFTER, N, MICRO, LR = 4, 2, 8, 4, 5e-3
#: calibrate_every=3: rounds 1 and 4 calibrate; a resume at round 3 that lost the schedule would calibrate there
CONFIG = dict(method="autopilot", sides="both", max_frac=0.3, mask_mode="zero_pg", calibrate_every=3)


def training_args(ckpt_path: str, load: bool) -> SimpleNamespace:
    """OpenRLHF's hierarchical arguments as ``init_model_from_pretrained``, ``DeepspeedStrategy``,
    ``ActorPPOTrainer`` and ``save_checkpoint`` read them (0.10.2 and 0.11.2 names)."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from openrlhf_step import training_args as gpu_args

    ns = SimpleNamespace
    args = gpu_args(micro=MICRO, total=N, n_per_prompt=4, packing=False)
    args.ds.__dict__.update(attn_implementation="eager", experts_implementation=None, load_in_4bit=False,
                            lora=ns(rank=0, alpha=16, target_modules=None, dropout=0.0), use_liger_kernel=False,
                            enable_sleep=False)
    args.actor.__dict__.update(
        optim="adam", muon=ns(lr=0.02, momentum=0.95), adam=ns(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
        lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1, max_norm=1.0, eps_clip=0.2,
        gradient_checkpointing_enable=False, gradient_checkpointing_reentrant=False, freeze_visual_encoder=False)
    args.train.__dict__.update(enable_ema=False, ema_beta=0.992)
    args.rollout.temperature = 0.7
    args.data.disable_fast_tokenizer = False
    args.vllm.sync_backend = "gloo"  # "nccl" would import vLLM (a stand-in here) for its version
    args.ckpt = ns(save_hf=False, disable_ds=False, path=ckpt_path, load_enable=load, max_num=3, max_mem=1000)
    return args


def write_model(path: Path, vocab: int) -> None:
    """A random 2-layer Llama and a word-level tokenizer of the same vocabulary, saved for ``Actor``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # rows far from uniform: S_c spread, the controller has work
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1").save_pretrained(path)


def new_worker(model_dir: Path, ckpt_path: str, load: bool):
    """A real ``PolicyModelActor`` after OpenRLHF's own ``init_model_from_pretrained``."""
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    args = training_args(ckpt_path, load)
    strategy = DeepspeedStrategy(seed=0, max_norm=1.0, micro_train_batch_size=MICRO, train_batch_size=N,
                                 zero_stage=2, args=args)
    original = strategy.get_ds_train_config

    def with_torch_adam(*a, **k):
        config = original(*a, **k)
        if "optimizer" in config:
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    strategy.get_ds_train_config = with_torch_adam
    cls = PolicyModelActor.__ray_actor_class__
    worker = cls.__new__(cls)
    worker.init_model_from_pretrained(strategy, str(model_dir), max_steps=100)
    return worker


def run_round(worker, step: int) -> dict:
    """One step of the actor: old log-probs through ``PolicyModelActor.forward``, ``append``, ``fit``."""
    import torch
    from test_openrlhf import rollout_batch
    from openrlhf.trainer.ppo_utils.experience import (
        make_experience_batch, remove_padding_in_sequences, split_experience_batch)

    from entropy_discriminator.adapters.openrlhf import _round

    # OpenRLHF's checkpoint holds no RNG state, and ppo_train shuffles the buffer with torch's global
    # generator: seeded per step here, so the uninterrupted and the resumed run shuffle alike
    torch.manual_seed(1000 + step)
    exp = rollout_batch(100 + step, n=N)
    items = remove_padding_in_sequences(split_experience_batch(exp))
    seen = {}
    for i in range(0, N, MICRO):
        batch = make_experience_batch(items[i : i + MICRO])
        batch.action_log_probs = worker.forward(batch.sequences, batch.action_mask, batch.attention_mask)
        worker.append(batch)
    original = _round.apply_keep

    def recording(items_, keep, mode):
        seen["keep"] = keep.to(torch.int8).tolist()
        return original(items_, keep, mode)

    _round.apply_keep = recording
    try:
        status = worker.fit(0.0)
    finally:
        _round.apply_keep = original
    from entropy_discriminator.adapters.openrlhf._autopilot import state_of

    params = [p.detach().float() for p in worker.actor.model.module.parameters()]
    return {
        "keep": seen.get("keep"),
        "status": {k: float(v) for k, v in status.items() if k.startswith("entropy_disc/") and "timing" not in k},
        "policy_loss": float(status["policy_loss"]),
        "state": state_of(worker.actor.model),
        "weights": [float(p.double().sum()) for p in params] + [float((p.double() ** 2).sum()) for p in params],
    }


def main(out: str, port: str) -> None:
    from openrlhf_step_on_cpu import redirect_cuda_to_cpu

    redirect_cuda_to_cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import ray  # noqa: F401  (the real one: PolicyModelActor keeps its class under @ray.remote)

    sys.path.insert(0, str(ROOT / "tests" / "adapters" / "openrlhf"))
    import test_openrlhf  # noqa: F401  (flash_attn / vllm stand-ins of the CPU tests)

    from entropy_discriminator import EntropyDiscConfig
    from entropy_discriminator.adapters import openrlhf as adapter

    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, ckpt, other = Path(tmp) / "model", str(Path(tmp) / "ckpt"), str(Path(tmp) / "ckpt_clip_b")
        write_model(model_dir, test_openrlhf.VOCAB)
        adapter.patch(EntropyDiscConfig(**CONFIG))
        worker = new_worker(model_dir, ckpt, load=False)
        result["full"] = []
        for step in range(1, ROUNDS + 1):
            result["full"].append(run_round(worker, step))
            if step == SAVE_AFTER:
                worker.save_checkpoint(f"global_step{step}", {"global_step": step, "episode": 0})
        adapter.unpatch()

        adapter.patch(EntropyDiscConfig(**CONFIG))  # a new job: fresh process state, as a restarted worker
        worker = new_worker(model_dir, ckpt, load=True)
        states = worker.get_checkpoint_states()
        result["states"] = {"keys": sorted(states), "entry": states.get("entropy_disc_autopilot"),
                            "law": states.get("entropy_disc_law")}
        result["resumed"] = [run_round(worker, step) for step in range(SAVE_AFTER + 1, ROUNDS + 1)]
        adapter.unpatch()

        adapter.patch(EntropyDiscConfig(**CONFIG))  # load enabled but nothing saved there: a fresh start
        worker = new_worker(model_dir, other, load=True)
        result["fresh_without_checkpoint"] = run_round(worker, 1)
        adapter.unpatch()

        adapter.patch(EntropyDiscConfig(method="clip_b", mu_low=1.0, sides="both"))  # a run without the autopilot
        worker = new_worker(model_dir, other, load=False)
        run_round(worker, 1)
        worker.save_checkpoint("global_step1", {"global_step": 1, "episode": 0})
        adapter.patch(EntropyDiscConfig(**CONFIG))
        try:
            new_worker(model_dir, other, load=True)
            result["refusal"] = None
        except ValueError as exc:
            result["refusal"] = str(exc)
        adapter.unpatch()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    main(sys.argv[1], sys.argv[2])
