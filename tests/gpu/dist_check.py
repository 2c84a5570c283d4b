"""Two GPUs, NCCL: the process-group statistics equal one process on the whole batch.

Run (GPU machine with 2 cards; NVLink multicast stays off)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --standalone --nproc_per_node=2 tests/gpu/dist_check.py [out_dir]

Each rank holds an uneven share of the sequences of one bf16 batch (per-token statistics through
the Triton kernel on its own GPU), then computes Clip_B / Clip_V masks, the monitor's metrics and
the predicted batch entropy change over the NCCL group.  Rank 0 recomputes everything in one
process on the whole batch; keep-masks and integer counts must be identical, float metrics equal
to float64 rounding.  Without CUDA it dry-runs on CPU with gloo.  A vocabulary-parallel check (each rank holds half of V) compares against the
full-vocabulary statistics.  Exit status 0 only if every check passed; a JSON report is written to
out_dir (default: the current directory).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import entropy_discriminator as ed

B, T, V = 12, 300, 32000
ROWS = [5, 7]  # sequences per rank (uneven)


def full_batch(device: torch.device):
    g = torch.Generator().manual_seed(2024)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, T), generator=g)
    for b in range(B):  # right padding of varying length
        labels[b, T - 17 * b :] = -100
    seq_adv = torch.randn(B, generator=g)
    tok_adv = torch.randn(B, T, generator=g)
    ratio = 1 + 0.2 * torch.rand(B, T, generator=g)
    return tuple(t.to(device) for t in (logits, labels, seq_adv, tok_adv, ratio))


def compute(logits, labels, seq_adv, tok_adv, ratio, group) -> dict:
    stats = ed.token_stats(logits, labels)  # auto: the Triton kernel on CUDA
    masks = {
        "clip_b": ed.clip_b_mask(stats.s_star, seq_adv, stats.valid, mu_low=1.0, sides="both", process_group=group),
        "clip_v_cap": ed.clip_v_mask(stats.s_centered, seq_adv, stats.valid, mu_low=1.5, max_frac=3e-3, process_group=group),
        "clip_v_tok": ed.clip_v_mask(stats.s_centered, tok_adv, stats.valid, mu_low=2.0, max_frac=None, process_group=group),
    }
    mon = ed.EntropyMonitor(process_group=group)
    metrics = mon.from_stats(stats, advantages=seq_adv, mask=masks["clip_v_cap"], ratio=ratio, lr=0.1)
    dh = ed.batch_entropy_change(tok_adv, stats.s_centered, stats.valid, lr=0.1, ratio=ratio, process_group=group)
    return {
        "s_centered": stats.s_centered.cpu(),
        "keep": {k: m.keep.cpu() for k, m in masks.items()},
        "mask_fields": {
            k: {f: getattr(m, f) for f in ("center", "std", "lower", "upper", "n_valid", "n_clipped", "n_clipped_neg", "n_clipped_pos", "capped")}
            for k, m in masks.items()
        },
        "metrics": metrics,
        "dh": dh,
    }


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        if os.environ.get(var) != val:
            raise SystemExit(f"set {var}={val} (NVLink multicast must stay off)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == len(ROWS), f"run with --nproc_per_node={len(ROWS)}"
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # dry run of the script itself on CPU (gloo, torch path)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    tmp = Path(os.environ.get("DIST_CHECK_TMP", tempfile.gettempdir())) / "ed_dist_check"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        logits, labels, seq_adv, tok_adv, ratio = full_batch(device)
        lo = sum(ROWS[:rank])
        sl = slice(lo, lo + ROWS[rank])
        local = compute(logits[sl], labels[sl], seq_adv[sl], tok_adv[sl], ratio[sl], dist.group.WORLD)
        v_half = V // 2 + 123  # uneven vocabulary shards
        v_sl = slice(0, v_half) if rank == 0 else slice(v_half, V)
        vp = ed.token_stats(logits[..., v_sl], labels, vocab_parallel_group=dist.group.WORLD, vocab_start_index=v_sl.start)
        torch.save({"local": local, "vp_s_centered": vp.s_centered.cpu()}, tmp / f"rank{rank}.pt")
        dist.barrier()
        if rank != 0:
            return 0
        whole = compute(logits, labels, seq_adv, tok_adv, ratio, None)
        parts = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
        checks: dict[str, bool] = {}
        checks["s_centered"] = torch.equal(torch.cat([p["local"]["s_centered"] for p in parts]), whole["s_centered"])
        for k in whole["keep"]:
            checks[f"keep/{k}"] = torch.equal(torch.cat([p["local"]["keep"][k] for p in parts]), whole["keep"][k])
            for f, want in whole["mask_fields"][k].items():
                got = [p["local"]["mask_fields"][k][f] for p in parts]
                checks[f"{k}/{f}"] = all(_close(float(g), float(want)) for g in got)
        for name, want in whole["metrics"].items():
            checks[f"metric/{name}"] = all(_close(p["local"]["metrics"][name], want) for p in parts)
        checks["delta_entropy/predicted"] = all(_close(p["local"]["dh"], whole["dh"]) for p in parts)
        full_sc = ed.token_stats(logits, labels, impl="torch").s_centered.cpu()
        vp_err = max(float((p["vp_s_centered"] - full_sc).abs().max()) for p in parts)
        checks["vocab_parallel/s_centered"] = vp_err <= 1e-5  # fp32 sums split differently
        failed = [k for k, ok in checks.items() if not ok]
        report = {
            "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo dry run)",
            "backend": dist.get_backend(),
            "world": world,
            "rows_per_rank": ROWS,
            "tokens_valid": int((labels != -100).sum()),
            "n_checks": len(checks),
            "failed": failed,
            "vocab_parallel_max_abs_err": vp_err,
            "clip_counts": {k: whole["mask_fields"][k]["n_clipped"] for k in whole["keep"]},
        }
        (out_dir / "dist_check.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        print("DIST CHECK", "PASSED" if not failed else "FAILED")
        return 0 if not failed else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
