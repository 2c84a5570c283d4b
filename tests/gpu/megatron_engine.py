"""verl 0.9.1's Megatron engine pass with the adapter's hook, on two GPUs: TP=2 or PP=2, against float64.

Run (2 CUDA cards; NVLink multicast stays off)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc_per_node=2 tests/gpu/megatron_engine.py --tp 2 --pp 1 [out_dir]
    (... --tp 1 --pp 2 for pipeline parallelism)

verl's ``MegatronEngine.__init__`` / ``initialize`` build the model through Megatron-Bridge or
mbridge with TransformerEngine layers, which cannot be installed on the device (see
megatron_README.md).  Here the model is a megatron-core ``GPTModel`` built directly with the local
layer spec (no TransformerEngine), wrapped in ``Float16Module`` for bf16 as verl's ``get_model`` does,
and given to a ``MegatronEngineWithLMHead`` made without ``__init__`` (its ``engine_config`` is
verl's real ``McoreEngineConfig``).  What runs is verl's own
``forward_backward_batch(forward_only=True)``: micro-batch split, megatron's schedule (pipelined for
PP=2), verl's ``forward_step`` and ``gptmodel_forward_model_engine`` (bshd layout: packed "thd"
sequences need TransformerEngine attention), ``_lm_head_logits_processor`` with the hook
(installed by ``install_engine_hook``), verl's per-key post-processing and batch collection.

Checks on the ranks that hold outputs (the last pipeline stage): the returned ``E_p[S]`` field and
verl's ``entropy``/``log_probs`` against float64 statistics of the logits the hook saw (captured by
an outer wrapper, gathered over the tensor-parallel group), aligned position by position through
verl's post-processing; ``S_c`` formed the driver's way.  Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

V = 32003
DIVISIBLE_BY = 128
HIDDEN, LAYERS, HEADS = 128, 2, 4
SEQ_LENS = [37, 64, 23, 50]  # prompt+response lengths of 4 sequences
MICRO_BATCH = 2  # -> 2 micro-batches (pipelined with PP=2)
TEMPERATURE = 0.8
TOL_HOOK = 2e-6  # max |E_p[S] error| / max(1, max |ref|), fp32 logits (Float16Module's output)
TOL_VERL = 2e-4  # verl's own fp32 entropy / log-probs, and S*, S_c formed from them
CHECKED = ("hook_s_expected", "verl_entropy", "verl_log_probs", "driver_s_centered")


def setup(tp: int, pp: int) -> tuple[int, torch.device]:
    for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        if os.environ.get(var) != val:
            raise SystemExit(f"set {var}={val} (NVLink multicast must stay off)")
    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        device = torch.device("cuda", rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(1234)
    return rank, device


class PaddingMaskToLocal(torch.nn.Module):
    """verl's bshd ``attention_mask [b, s]`` (True = token) -> the local attention's ``[b, 1, s, s]`` (True = masked).

    TransformerEngine takes verl's padding mask itself; megatron-core's local ``DotProductAttention``
    wants the full causal-and-padding mask.  Everything else passes through to the ``GPTModel``.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.config, self.pre_process, self.post_process = module.config, module.pre_process, module.post_process

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        if attention_mask is not None:
            s = attention_mask.shape[-1]
            causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).triu(1)
            attention_mask = causal[None, None] | ~attention_mask[:, None, None, :]
        return self.module(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def build_model(tp: int, pp: int, device: torch.device):
    """megatron-core GPTModel (local spec, bf16 params, padded vocabulary) in Float16Module, like verl's get_model."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16, use_cpu_initialization=True,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True, variable_seq_lengths=True,
        init_method_std=0.3, hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=False,
        moe_token_dispatcher_type="alltoall",  # megatron refuses variable_seq_lengths with its default (unused: dense)
    )
    torch.manual_seed(1234)  # use_cpu_initialization: every rank draws the same master weights
    v_pad = math.ceil(V / (DIVISIBLE_BY * tp)) * DIVISIBLE_BY * tp
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=v_pad,
        max_sequence_length=256, pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=False, position_embedding_type="rope",
    )
    if model.post_process:  # the bridges load zero rows past the real vocabulary
        with torch.no_grad():
            w = model.output_layer.weight
            start = mpu.get_tensor_model_parallel_rank() * w.shape[0]
            w[max(0, V - start):] = 0.0
    model = PaddingMaskToLocal(model.to(device))
    return [Float16Module(cfg, model)], cfg, v_pad


def make_engine(module, tf_config):
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine = object.__new__(MegatronEngineWithLMHead)  # __init__/initialize need a bridge + TransformerEngine
    engine.engine_config = McoreEngineConfig(
        use_remove_padding=False, forward_only=True, tensor_model_parallel_size=tf_config.tensor_model_parallel_size,
        pipeline_model_parallel_size=tf_config.pipeline_model_parallel_size, sequence_parallel=False,
    )
    engine.model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
        mtp=SimpleNamespace(enable=False, enable_train=False),
        tokenizer=SimpleNamespace(pad_token_id=0),
    )
    engine.tf_config = tf_config
    engine.module = module
    engine.enable_routing_replay = False
    return engine


def make_data():
    from verl.utils import tensordict_utils as tu

    from entropy_discriminator.adapters.verl._engine import STATS_CHUNK, STATS_FLAG, STATS_IMPL

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, V, (n,), generator=g) for n in SEQ_LENS]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    return tu.get_tensordict(
        tensor_dict={
            "input_ids": nested(seqs),
            "loss_mask": nested([torch.ones(n, dtype=torch.int64) for n in SEQ_LENS]),
            "temperature": torch.full((len(SEQ_LENS),), TEMPERATURE),
        },
        non_tensor_dict={
            "calculate_entropy": True, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": MICRO_BATCH,
            STATS_FLAG: True, STATS_CHUNK: None, STATS_IMPL: "auto",
        },
    )


def reference(full: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 logp, H, E_p[S] of softmax rows ``full [n, V']``; ``labels [n]``."""
    logq = torch.log_softmax(full.double(), dim=-1)
    p = logq.exp()
    plogq = torch.where(p > 0, p * logq, torch.zeros_like(p))
    h = -plogq.sum(-1)
    return {
        "logp": logq.gather(-1, labels[:, None])[:, 0],
        "entropy": h,
        "s_expected": (p * p * h[:, None] + p * plogq).sum(-1),
    }


def _cpu_dry_run_patches() -> None:
    """CPU dry run only: verl, megatron's layers and its schedules ask CUDA for devices and RNG states."""
    import contextlib

    from megatron.core import tensor_parallel
    from verl.workers.engine.megatron import transformer_impl

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    transformer_impl.get_forward_backward_func = lambda: _sequential_schedule


def _sequential_schedule(forward_step_func, data_iterator, model, num_microbatches, forward_only, **_):
    """CPU dry run only: megatron's no-pipelining schedule, forward_only, without its CUDA tensors."""
    assert forward_only
    store = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model[0])
        store.append(loss_func(output)[1])
    return store


def compare(mo: dict, seen: list[dict], v_local: int, checks: dict, report: dict) -> None:
    """The engine's ``model_output`` (last stage) against float64 on the logits the hook saw, position by position."""
    from megatron.core import parallel_state as mpu

    from entropy_discriminator import discriminator_score
    from entropy_discriminator.adapters.verl._engine import SEQ_FIELD

    checks["hook_field_returned"] = SEQ_FIELD in mo
    checks["hook_called_per_micro_batch"] = len(seen) == math.ceil(len(SEQ_LENS) / MICRO_BATCH)
    report["logits_seen"] = [f"{tuple(s['logits'].shape)} {s['logits'].dtype}" for s in seen]
    checks["hook_saw_fp32_vocab_shards"] = all(
        s["logits"].dtype == torch.float32 and s["logits"].shape[-1] == v_local for s in seen
    )
    group = mpu.get_tensor_model_parallel_group()
    refs: dict[str, list[torch.Tensor]] = {"logp": [], "entropy": [], "s_expected": []}
    for s in seen:  # [b, s_pad, V_local] logits, [b, s_pad] rolled labels and temperatures
        parts = [torch.empty_like(s["logits"]) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, s["logits"].contiguous(), group=group)
        t = s["temperature"].clone()
        t[t <= 0] = 1e-8
        full = torch.cat(parts, -1) / t.unsqueeze(-1).to(s["logits"].dtype)
        r = reference(full.reshape(-1, full.shape[-1]), s["label"].reshape(-1))
        for k in refs:
            refs[k].append(r[k].reshape(s["label"].shape))

    def ref_seq(k):  # verl's bshd post-processing keeps each sequence's first len positions, in batch order
        rows = [row for chunk in refs[k] for row in chunk]
        return torch.cat([row[:n] for row, n in zip(rows, SEQ_LENS)])

    got = {
        "hook_s_expected": (mo[SEQ_FIELD].values(), ref_seq("s_expected"), TOL_HOOK),
        "verl_entropy": (mo["entropy"].values(), ref_seq("entropy"), TOL_VERL),
        "verl_log_probs": (mo["log_probs"].values(), ref_seq("logp"), TOL_VERL),
    }
    s_star_ref = ref_seq("logp").exp() * (ref_seq("entropy") + ref_seq("logp"))
    s_star = discriminator_score(mo["log_probs"].values(), mo["entropy"].values(), check=False)
    got["driver_s_centered"] = (s_star.double() - mo[SEQ_FIELD].values().double(),
                                s_star_ref - ref_seq("s_expected"), TOL_VERL)
    for k, (a, b, tol) in got.items():
        a, b = a.double().reshape(-1), b.double().reshape(-1)
        e = {"max_abs": float((a - b).abs().max()), "rel_l2": float((a - b).norm() / b.norm()),
             "max_ref": float(b.abs().max()), "n": a.numel()}
        report[k] = e
        checks[k] = a.numel() == sum(SEQ_LENS) and e["max_abs"] <= tol * max(1.0, e["max_ref"])


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("out", nargs="?", default=".")
    args = ap.parse_args()
    rank, device = setup(args.tp, args.pp)
    from megatron.core import parallel_state as mpu
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from entropy_discriminator.adapters.verl import _engine

    _engine.install_engine_hook()
    hooked = MegatronEngineWithLMHead._lm_head_logits_processor
    seen: list[dict] = []

    def capturing(self, logits, label, temperature, **kwargs):  # outer wrapper: what the hook sees
        seen.append({"logits": logits.detach().clone(), "label": label.clone(), "temperature": temperature.clone()})
        return hooked(self, logits, label, temperature, **kwargs)

    MegatronEngineWithLMHead._lm_head_logits_processor = capturing
    if device.type == "cpu":
        if args.pp != 1:
            raise SystemExit("the CPU dry run covers --pp 1 only")
        _cpu_dry_run_patches()
    module, tf_config, v_pad = build_model(args.tp, args.pp, device)
    engine = make_engine(module, tf_config)
    data = make_data()
    with torch.no_grad():
        out = engine.forward_backward_batch(data, loss_function=None, forward_only=True)
    MegatronEngineWithLMHead._lm_head_logits_processor = hooked
    _engine.remove_engine_hook()

    checks: dict[str, bool] = {}
    report: dict = {"tp": args.tp, "pp": args.pp, "padded_vocab": v_pad, "backend": dist.get_backend(),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "micro_batches_seen_by_hook": len(seen)}
    if mpu.is_pipeline_last_stage():
        compare(out["model_output"], seen, v_pad // args.tp, checks, report)
    else:
        checks["no_hook_call_before_last_stage"] = not seen and not out
    report["checks"] = checks
    failed = [k for k, ok in checks.items() if not ok]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"megatron_engine_tp{args.tp}_pp{args.pp}_rank{rank}.json").write_text(json.dumps(report, indent=1))
    errors = {k: [f"{v['max_abs']:.3g}", f"{v['rel_l2']:.3g}"] for k, v in report.items() if k in CHECKED}
    verdict = f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; FAILED {failed}" if failed else "")
    print(f"rank {rank} tp={args.tp} pp={args.pp} ({report['device']}): {verdict} {json.dumps(errors)}", flush=True)
    ok = torch.tensor([0 if failed else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    return 0 if int(ok) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
