"""Two GPUs, NCCL, megatron-core tensor parallel size 2: the verl adapter's Megatron E_p[S] hook against float64.

Run (a machine with 2 CUDA cards; NVLink multicast stays off)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc_per_node=2 tests/gpu/megatron_tp.py [out_dir]

Needs megatron-core 0.16.1 and verl 0.9.1's import closure (no TransformerEngine, no Megatron-Bridge:
verl's engine is not built, see megatron_README.md).  Without CUDA it dry-runs on CPU with gloo.

What runs, on every rank of one tensor-parallel group of size 2 (``megatron.core.parallel_state``):

1. The output layer is megatron-core's ``ColumnParallelLinear`` over the padded vocabulary
   (32003 real ids padded to 32256 = a multiple of 128 x TP, the rows past 32003 zero, as both of
   verl's bridges pad a checkpoint), so each rank holds 16128 vocabulary columns and only rank 1
   holds padding.  Its vocabulary-parallel logits (bf16 and fp32 parameters) go through verl's real
   ``MegatronEngineWithLMHead._lm_head_logits_processor`` with the adapter's hook installed by
   ``install_engine_hook()`` (verl's own method wrapped, on an engine object built without
   ``__init__``), with per-token temperatures.  The hook's ``E_p[S]``, verl's own ``entropy`` and
   ``log_probs`` of the same call, and ``S* / S_c`` formed from them the way the driver does, are
   compared with float64 over the gathered full-vocabulary logits, scaled exactly as verl scales
   them (the distribution verl samples its statistics from: padding columns included, as verl does).
2. ``token_stats(vocab_parallel_group=...)`` directly: logp, H, S*, E_p[S], S_c with the padding
   columns set to -inf (excluded) against float64 over the 32003 real columns; and
   ``impl="triton"`` with the group refused (the reason for the start-up refusal in
   ``adapters/verl/_megatron.py``).
3. One actor-update-like step through the same layer: Clip_V mask (``clip_v_mask`` on the hook's
   ``S_c``), PPO clipped policy loss on megatron's ``vocab_parallel_cross_entropy`` log-probs,
   token-mean, ``zero_pg`` and ``drop_token`` modes; the clipped tokens' logit gradients (their only
   path into any parameter) and input gradients must be exactly zero on both ranks, and the weight
   gradient must equal the one computed without the clipped tokens at all.

Exit status 0 only if every check passed; a JSON report goes to out_dir (default: current directory).
"""

from __future__ import annotations

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

V = 32003  # real vocabulary, not divisible by 2 x 128
TP = 2
DIVISIBLE_BY = 128  # megatron's make_vocab_size_divisible_by; the padded size is a multiple of it x TP
V_PAD = math.ceil(V / (DIVISIBLE_BY * TP)) * DIVISIBLE_BY * TP
HIDDEN = 256
SEQ_LENS = [150, 230, 97]  # packed ("thd") sequences, like verl's remove-padding layout
TEMPS = [0.7, 1.0, 1.3]  # per-sequence sampling temperatures
#: (parameter dtype, logits dtype handed to verl): bf16 training, where megatron's Float16Module (which verl's
#: and Megatron-Bridge's model builders wrap around the model) upcasts the last stage's output to fp32; fp32
#: training; and bf16 logits as such (no wrapper), where only the hook's own fields are checked.
CASES = {
    "bf16_params_fp32_logits": (torch.bfloat16, torch.float32),
    "fp32_params": (torch.float32, torch.float32),
    "bf16_logits": (torch.bfloat16, torch.bfloat16),
}
#: max |error| / max(1, max |reference|) against float64 on the same scaled logits.
TOL_HOOK = {torch.float32: 2e-6, torch.bfloat16: 2e-5}  # E_p[S], S_c, the core's fields
TOL_VERL = 2e-4  # verl's own entropy / log-probs (its fp32 formulas), and S* formed from them


def setup() -> tuple[int, torch.device]:
    for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        if os.environ.get(var) != val:
            raise SystemExit(f"set {var}={val} (NVLink multicast must stay off)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != TP:
        raise SystemExit(f"run with --nproc_per_node={TP}")
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        device = torch.device("cuda", rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=TP)
    return rank, device


def full_weight() -> torch.Tensor:
    """``[V_PAD, HIDDEN]`` fp32, identical on every rank; padding rows zero (what the bridges load)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(V_PAD, HIDDEN, generator=g) * (3.0 / math.sqrt(HIDDEN))
    w[V:] = 0.0
    return w


def batch_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden ``[N, HIDDEN]`` fp32, labels ``[N]`` sampled from the tempered softmax over the V real ids
    (as a rollout samples them), per-token temperature ``[N]`` fp32; identical on every rank."""
    g = torch.Generator().manual_seed(11)
    n = sum(SEQ_LENS)
    hidden = torch.randn(n, HIDDEN, generator=g)
    hidden[::37] *= 6.0  # some very peaked rows
    temps = torch.cat([torch.full((s,), t) for s, t in zip(SEQ_LENS, TEMPS)])
    probs = torch.softmax((hidden.double() @ full_weight()[:V].double().T) / temps[:, None].double(), dim=-1)
    labels = torch.multinomial(probs, 1, generator=g)[:, 0]
    return hidden.to(device), labels.to(device), temps.to(device)


def output_layer(dtype: torch.dtype, device: torch.device):
    """megatron-core ``ColumnParallelLinear`` (no bias, sharded output) holding this rank's slice of :func:`full_weight`."""
    from megatron.core import parallel_state as mpu
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    cfg = ModelParallelConfig(
        tensor_model_parallel_size=TP, params_dtype=dtype, use_cpu_initialization=True, perform_initialization=False
    )
    layer = ColumnParallelLinear(
        HIDDEN, V_PAD, config=cfg, init_method=torch.nn.init.zeros_, bias=False, gather_output=False
    ).to(device)
    rank = mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        layer.weight.copy_(full_weight().chunk(TP, dim=0)[rank].to(device, dtype))
    return layer


def local_logits(layer, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[1, N, V_PAD / TP]`` vocabulary shard in ``dtype``, verl's thd layout (megatron's ``[s, b, v]`` transposed)."""
    out, _ = layer(hidden.to(layer.weight.dtype)[:, None, :])  # [s=N, b=1, V_local]
    return out.transpose(0, 1).contiguous().to(dtype)


def gather_vocab(x: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def reference(full: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 logp, H, S*, E_p[S], S_c of ``softmax(full)`` for rows ``[N, V']`` (the docstring formula of token_stats)."""
    logq = torch.log_softmax(full.double(), dim=-1)
    p = logq.exp()
    h = -(p * torch.where(p > 0, logq, torch.zeros_like(logq))).sum(-1)
    lpk = logq.gather(-1, labels[:, None])[:, 0]
    s_star = lpk.exp() * (h + lpk)
    s_exp = (p * p * (h[:, None] + torch.where(p > 0, logq, torch.zeros_like(logq)))).sum(-1)
    return {"logp": lpk, "entropy": h, "s_star": s_star, "s_expected": s_exp, "s_centered": s_star - s_exp}


def err(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    got, ref = got.double().reshape(-1), ref.double().reshape(-1)
    if not torch.isfinite(got).all():
        return {"max_abs": math.inf, "rel_l2": math.inf, "max_ref": float(ref.abs().max())}
    return {
        "max_abs": float((got - ref).abs().max()),
        "rel_l2": float((got - ref).norm() / ref.norm().clamp_min(1e-300)),
        "max_ref": float(ref.abs().max()),
    }


def hooked_pass(logits: torch.Tensor, labels: torch.Tensor, temps: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's ``_lm_head_logits_processor`` (hook installed) on this rank's shard; returns its dict."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from entropy_discriminator.adapters.verl._engine import SEQ_FIELD, STATS_CHUNK, STATS_FLAG, STATS_IMPL

    engine = object.__new__(MegatronEngineWithLMHead)  # verl's __init__ builds the model through a bridge + TE
    engine.engine_config = SimpleNamespace(entropy_from_logits_with_chunking=False, entropy_from_logits_chunk_size=2048)
    batch = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(batch, **{STATS_FLAG: True, STATS_CHUNK: 97, STATS_IMPL: "auto"})
    with torch.no_grad():
        ret = MegatronEngineWithLMHead._lm_head_logits_processor(
            engine,
            logits.clone(),  # verl divides in place
            labels[None],
            temps[None].clone(),
            calculate_sum_pi_squared=False,
            calculate_entropy=True,
            distillation_use_topk=False,
            distillation_only=False,
            logits_processor_func=None,
            batch=batch,
            data_format="thd",
        )
    if SEQ_FIELD not in ret:
        raise AssertionError(f"the hook did not add {SEQ_FIELD}; keys {sorted(ret)}")
    return {"entropy": ret["entropy"][0], "log_probs": ret["log_probs"][0], "s_expected": ret[SEQ_FIELD][0]}


def check_hook(case: str, device, hidden, labels, temps, checks: dict) -> dict:
    """Item 1: the hooked verl method on megatron's vocabulary-parallel logits vs float64."""
    from entropy_discriminator import discriminator_score

    param_dtype, dtype = CASES[case]
    layer = output_layer(param_dtype, device)
    with torch.no_grad():
        logits = local_logits(layer, hidden, dtype)
    out = hooked_pass(logits, labels, temps)
    # verl's scaling, reproduced on the gathered logits: the same division in the logits' dtype.
    scaled_full = gather_vocab(logits)[0] / temps[:, None].to(dtype)
    ref = reference(scaled_full, labels)
    s_star = discriminator_score(out["log_probs"], out["entropy"], check=False)  # what the driver forms
    got = {
        "hook_s_expected": (out["s_expected"], ref["s_expected"]),
        "verl_entropy": (out["entropy"], ref["entropy"]),
        "verl_log_probs": (out["log_probs"], ref["logp"]),
        "driver_s_star": (s_star, ref["s_star"]),
        "driver_s_centered": (s_star - out["s_expected"].double(), ref["s_centered"]),
    }
    res = {k: err(a, b) for k, a, b in ((k, *v) for k, v in got.items())}
    for k, e in res.items():
        if k.startswith("hook_"):
            checks[f"{case}_{k}"] = e["max_abs"] <= TOL_HOOK[dtype] * max(1.0, e["max_ref"])
        elif dtype == torch.float32:  # verl's own bf16 entropy is not float64-accurate: reported only
            checks[f"{case}_{k}"] = e["max_abs"] <= TOL_VERL * max(1.0, e["max_ref"])
    # Padding columns are part of verl's distribution: their effect, for the record.
    res["padding_effect_on_E_p[S]"] = err(reference(scaled_full[:, :V], labels)["s_expected"], ref["s_expected"])
    return {"layer": layer, "logits": logits, "hook": out, "errors": res}


def check_excluded_padding(logits, labels, temps, checks: dict) -> dict:
    """Item 2: token_stats over NCCL with the padding columns at -inf vs float64 over the 32003 real columns."""
    from megatron.core import parallel_state as mpu

    from entropy_discriminator import token_stats

    group = mpu.get_tensor_model_parallel_group()
    rank = mpu.get_tensor_model_parallel_rank()
    v_local = logits.shape[-1]
    shard = (logits[0] / temps[:, None].to(logits.dtype)).clone()
    real_here = max(0, min(v_local, V - rank * v_local))
    shard[:, real_here:] = -math.inf
    stats = token_stats(shard, labels, vocab_parallel_group=group, vocab_start_index=rank * v_local, chunk_size=113)
    ref = reference(gather_vocab(shard)[:, :V], labels)
    res = {f: err(getattr(stats, f), ref[f]) for f in ("logp", "entropy", "s_star", "s_expected", "s_centered")}
    for f, e in res.items():
        tol = (TOL_VERL if f == "logp" else TOL_HOOK[logits.dtype]) * max(1.0, e["max_ref"])
        checks[f"excluded_padding_{logits.dtype}_{f}".replace("torch.", "")] = e["max_abs"] <= tol
    try:
        token_stats(shard, labels, vocab_parallel_group=group, vocab_start_index=rank * v_local, impl="triton")
        checks["triton_with_group_refused"] = False
    except ValueError:
        checks["triton_with_group_refused"] = True
    return res


def policy_grads(layer, hidden, labels, temps, old_logp, adv, keep, valid, mode: str, rows=None):
    """One PPO-clip token-mean policy loss through ``layer``; returns (d logits, d hidden, d weight).

    ``rows`` restricts the batch to those tokens (normaliser given by ``valid.sum()`` of the full batch).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from entropy_discriminator import apply_keep_mask

    layer.zero_grad(set_to_none=True)
    idx = torch.arange(hidden.shape[0], device=hidden.device) if rows is None else rows
    h = hidden[idx].to(layer.weight.dtype).detach().requires_grad_(True)
    out, _ = layer(h[:, None, :])  # [n, 1, V_local]
    out.retain_grad()
    logits = out.float() / temps[idx, None, None]  # Float16Module's fp32 output, then verl's division
    logp = -vocab_parallel_cross_entropy(logits, labels[idx, None])[:, 0]
    ratio = torch.exp(logp - old_logp[idx])
    pg = torch.maximum(-adv[idx] * ratio, -adv[idx] * ratio.clamp(0.8, 1.2))
    pg, loss_mask = apply_keep_mask(pg, keep[idx], valid[idx].float(), mode=mode)
    denom = (valid.float() * (keep.float() if mode == "drop_token" else 1.0)).sum()
    loss = (pg * loss_mask).sum() / denom
    loss.backward()
    return out.grad[:, 0], h.grad, layer.weight.grad.clone()


def check_update(layer, hidden, labels, temps, hook_out, checks: dict) -> dict:
    """Item 3: Clip_V mask on the hook's S_c, one policy-gradient backward; clipped tokens contribute exactly 0."""
    from entropy_discriminator import clip_v_mask, discriminator_score

    g = torch.Generator().manual_seed(5)
    adv = torch.randn(hidden.shape[0], generator=g).to(hidden.device)  # per token (GAE-like)
    s_c = discriminator_score(hook_out["log_probs"], hook_out["entropy"], check=False) - hook_out["s_expected"]
    valid = torch.ones_like(labels, dtype=torch.bool)
    mask = clip_v_mask(s_c.float(), adv, valid, mu_low=1.0, max_frac=None)
    both = gather_vocab(mask.keep[None].int())[0]  # the same mask on every TP rank?
    n = mask.keep.numel()
    checks["update_mask_identical_across_tp"] = bool((both[:n] == both[n:]).all())
    keep = both[:n].bool()  # rank 0's, so that the ranks' collectives below stay matched either way
    clipped = ~keep
    old_logp = hook_out["log_probs"].float().detach()
    res = {"n_tokens": int(valid.sum()), "n_clipped": int(clipped.sum()), "threshold_low": mask.lower}
    checks["update_some_clipped"] = 0 < res["n_clipped"] < res["n_tokens"]
    for mode in ("zero_pg", "drop_token"):
        d_out, d_h, d_w = policy_grads(layer, hidden, labels, temps, old_logp, adv, keep, valid, mode)
        kept_rows = keep.nonzero()[:, 0]
        _, _, d_w_kept = policy_grads(layer, hidden, labels, temps, old_logp, adv, keep, valid, mode, rows=kept_rows)
        _, _, d_w_nomask = policy_grads(layer, hidden, labels, temps, old_logp, adv, torch.ones_like(keep), valid, mode)
        r = {
            "clipped_logit_grad_max_abs": float(d_out[clipped].abs().max()),
            "clipped_hidden_grad_max_abs": float(d_h[clipped].abs().max()),
            "kept_logit_grad_rows_nonzero": int((d_out[keep].abs().amax(-1) > 0).sum()),
            "weight_grad_vs_kept_only_max_abs": float((d_w - d_w_kept).abs().max()),
            "weight_grad_max_abs": float(d_w.abs().max()),
            "weight_grad_change_by_mask_max_abs": float((d_w - d_w_nomask).abs().max()),
        }
        checks[f"update_{mode}_clipped_logit_grad_zero"] = r["clipped_logit_grad_max_abs"] == 0.0
        checks[f"update_{mode}_clipped_hidden_grad_zero"] = r["clipped_hidden_grad_max_abs"] == 0.0
        checks[f"update_{mode}_kept_rows_have_grad"] = r["kept_logit_grad_rows_nonzero"] > 0.9 * int(keep.sum())
        checks[f"update_{mode}_weight_grad_equals_kept_only"] = (
            r["weight_grad_vs_kept_only_max_abs"] <= 1e-2 * r["weight_grad_max_abs"]
        )
        checks[f"update_{mode}_mask_changes_grad"] = r["weight_grad_change_by_mask_max_abs"] > 1e-3 * r["weight_grad_max_abs"]
        res[mode] = r
    return res


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    rank, device = setup()
    from entropy_discriminator.adapters.verl import _engine

    _engine.install_engine_hook()
    checks: dict[str, bool] = {}
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(),
        "vocab": V,
        "padded_vocab": V_PAD,
        "tokens": sum(SEQ_LENS),
    }
    hidden, labels, temps = batch_inputs(device)
    for case in CASES:
        h = check_hook(case, device, hidden, labels, temps, checks)
        report[case] = h["errors"]
        report[f"excluded_padding_{case}"] = check_excluded_padding(h["logits"], labels, temps, checks)
        for key in (case, f"excluded_padding_{case}"):
            summary = {k: [f"{v['max_abs']:.3g}", f"{v['rel_l2']:.3g}"] for k, v in report[key].items()}
            print(f"rank {rank} {key} [max_abs, rel_l2]:", json.dumps(summary), flush=True)
        if case == "bf16_params_fp32_logits":
            report["update"] = check_update(h["layer"], hidden, labels, temps, h["hook"], checks)
    _engine.remove_engine_hook()
    checks["hook_removed"] = not _engine.engine_hook_installed()
    report["checks"] = checks
    report["passed"] = all(checks.values())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"megatron_tp_rank{rank}.json").write_text(json.dumps(report, indent=1, default=float))
    failed = [k for k, ok in checks.items() if not ok]
    print(f"rank {rank} ({report['device']}, {report['backend']}): {len(checks) - len(failed)}/{len(checks)} checks passed"
          + (f"; FAILED: {failed}" if failed else ""), flush=True)
    print(f"rank {rank} update:", json.dumps(report["update"], default=float), flush=True)
    ok = torch.tensor([0 if failed else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    return 0 if int(ok) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
