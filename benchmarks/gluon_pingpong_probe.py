"""Probe: warp-specialised fused heads written in Gluon (Hopper), against the public kernel and cuBLAS.

Why: the public fused kernel (``kernels/triton_fused._fused_stream_kernel``) runs each tile's epilogue (an exp2 and
four sums per logit) in the warps that issue the tensor-core loop, so the tensor cores idle during it.  Two kernels
here, each behind a one-warp TMA producer:

- ping-pong (``_pingpong_kernel``, the default): two consumer warp groups take alternate [BM, BN] tiles of one
  program's rows and vocabulary chunk from one ring of shared-memory slots, taking turns (CUTLASS's ping-pong):
  while one runs its tensor-core loop, the other folds its finished tile.  Each consumer writes its own partial
  column (P = 2 S).
- cooperative (``coop=1``): the library's ``kernels/gluon_fused.ws_kernel``, whose two consumer warp groups of BM
  rows share each [BN, BK] weight slice (a [2 BM, BN] tile, the public kernel's 128 x 256 with BM 64) with a deeper
  ring, the second ``lag`` K steps behind (0: in step); one partial column per chunk; every moment (no floor).

The ring, its producer warp and the K loop are the library kernel's (``_ring``, ``_producer``, ``_k_steps``).

``kernels/_reduce.merge_kernel`` merges the partials as it merges the streaming kernel's.  Scope: no bias, T = 1,
no rounding of the logits, labels' logits formed on the host; what it measures is the matmul with the full
epilogue, against the public call (``token_stats_fused_triton``) and cuBLAS's matmul alone on the same inputs.
Results: benchmarks/RESULTS.md, results/h200/gluon_2026-11-29/.

    python -m benchmarks.gluon_pingpong_probe --compile-only --cfg coop:coop=1   # sm_90a compile anywhere: ptxas's
                                                                                 # registers, spills
    python -m benchmarks.gluon_pingpong_probe --out probe.csv        # on a Hopper GPU: float64 check, then times
    python -m benchmarks.gluon_pingpong_probe --cublas-kernels       # the kernels cuBLAS picks for these shapes
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait

from entropy_discriminator.kernels import gluon_fused, triton_fused
from entropy_discriminator.kernels.gluon_fused import _k_steps, _producer, _ring

# The public kernels' Triton-language helpers, compiled as Gluon (their builtins take either language's semantics).
_fold_tile = gluon.jit(triton_fused._fold_tile.fn)
_store_partials = gluon.jit(triton_fused._store_partials.fn)
_stream_coords = gluon.jit(triton_fused._stream_coords.fn)

LOG2E = 1.4426950408889634


@gluon.constexpr_function
def _instr_n(bn):
    return min(bn, 256)


@gluon.jit
def _zero_stats(ROWS: gl.constexpr, rows_l: gl.constexpr):
    """Running statistics of ROWS rows before any tile: m = -inf, s0..s3 = 0."""
    zero = gl.zeros([ROWS], gl.float32, rows_l)
    return gl.full([ROWS], float("-inf"), gl.float32, rows_l), zero, zero, zero, zero


@gluon.jit
def _consumer(c, a_bufs, b_bufs, ready, empty, turn, part_ptr, row0, t0, n_tiles, k_tiles, N, V, n_cols, col, cst, clo,
              BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, MOMENTS: gl.constexpr):
    """One warp group: tiles c, c + 2, ... of the chunk; per tile the K loop on the ring (one wgmma in flight, the
    slot before it released), then the fold of the fp32 [BM, BN] tile into running base-2 statistics (as
    ``_fold_tile``); at the end its partials at column ``col`` of part_ptr, fp32 [6, N, n_cols]."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, _instr_n(BN), 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    m, s0, s1, s2, s3 = _zero_stats(BM, rows_l)
    for i in range(c, n_tiles, 2):
        # The consumers take turns: this one waits on the ring only once the other has issued the tile before
        # (waits on a slot then come in the order of its fills, so a parity names one fill).
        n = i // 2
        mbarrier.wait(turn.index(c), (n - 1 + c) & 1, pred=i > 0)
        base = i * k_tiles
        acc = _k_steps(a_bufs, b_bufs, ready, empty, base, k_tiles, gl.zeros([BM, BN], gl.float32, mma), 0,
                       turn.index(c), -1, 1, STAGES)
        mbarrier.arrive(turn.index(1 - c))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES))
        m, s0, s1, s2, s3 = _fold(acc, (t0 + i) * BN, V, m, s0, s1, s2, s3, cst, clo, BN, MOMENTS, cols_l)
    rm = row0 + gl.arange(0, BM, layout=rows_l)
    _store_partials(part_ptr, rm, rm < N, N, n_cols, col, m, s0, s1, s2, s3)


@gluon.jit
def _fold(x, col0, V, m, s0, s1, s2, s3, cst, clo, BN: gl.constexpr, MOMENTS: gl.constexpr, cols_l: gl.constexpr):
    """Fold one fp32 [rows, BN] logits tile (columns col0 ...; those >= V set to -inf) into running base-2
    statistics: the streaming kernel's ``_fold_tile``."""
    if col0 + BN > V:  # the last, partial vocabulary tile
        rn = col0 + gl.arange(0, BN, layout=cols_l)
        x = gl.where(gl.expand_dims(rn < V, 0), x, float("-inf"))
    return _fold_tile(x, cst, clo, m, s0, s1, s2, s3, MOMENTS, True)


@gluon.jit
def _program(N, V, H, tiles_per_chunk, group_rows, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """(first row, chunk, chunks, first tile, tiles, K steps) of this program, in ``_fused_stream_kernel``'s order
    (its ``_stream_coords``)."""
    rb, chunk, n_chunks = _stream_coords(N, group_rows, BM)
    t0 = chunk * tiles_per_chunk
    return rb * BM, chunk, n_chunks, t0, gl.minimum(tiles_per_chunk, gl.cdiv(V, BN) - t0), gl.cdiv(H, BK)


@gluon.jit
def _pingpong_kernel(a_desc, w_desc, part_ptr, N, V, H, tiles_per_chunk, group_rows, cst, clo, BM: gl.constexpr,
                     BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, MOMENTS: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Program order as ``_fused_stream_kernel`` (:func:`_program`); consumer c of chunk ``chunk`` writes partial
    column 2 chunk + c."""
    row0, chunk, n_chunks, t0, n_tiles, k_tiles = _program(N, V, H, tiles_per_chunk, group_rows, BM, BN, BK)
    n_cols = 2 * n_chunks

    a_bufs, b_bufs, ready, empty = _ring(a_desc, w_desc, STAGES, 1, 1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(turn.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (0, a_bufs, b_bufs, ready, empty, turn, part_ptr, row0, t0, n_tiles, k_tiles, N, V, n_cols,
                     2 * chunk, cst, clo, BM, BN, STAGES, MOMENTS)),
        (_consumer, (1, a_bufs, b_bufs, ready, empty, turn, part_ptr, row0, t0, n_tiles, k_tiles, N, V, n_cols,
                     2 * chunk + 1, cst, clo, BM, BN, STAGES, MOMENTS)),
        (_producer, (a_desc, w_desc, a_bufs, b_bufs, ready, empty, row0, 1, t0, n_tiles, k_tiles, BM, BN, BK, STAGES,
                     1)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


DEFAULTS = {"bm": 128, "bn": 128, "bk": 64, "stages": 6, "moments": 4, "consumer_regs": 232, "producer_regs": 24,
            "maxnreg": 168, "coop": 0}
# coop 1: the two-consumer kernel sharing W slices, bm rows per consumer (2 bm per program)
COOP = {"coop": 1, "bm": 64, "bn": 256, "bk": 64, "stages": 4, "consumer_regs": 232, "producer_regs": 24,
        "maxnreg": 168, "lag": 0}


def _descriptors(hidden: torch.Tensor, weight: torch.Tensor, cfg: dict):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dt = gl.bfloat16 if hidden.dtype == torch.bfloat16 else gl.float16
    a_lay = gl.NVMMASharedLayout.get_default_for([cfg["bm"], cfg["bk"]], dt)
    w_lay = gl.NVMMASharedLayout.get_default_for([cfg["bn"], cfg["bk"]], dt)
    return (TensorDescriptor.from_tensor(hidden, [cfg["bm"], cfg["bk"]], a_lay),
            TensorDescriptor.from_tensor(weight, [cfg["bn"], cfg["bk"]], w_lay))


def plan(n: int, vocab: int, hdim: int, elt: int, cfg: dict, wave: int) -> tuple[int, int, int]:
    """(tiles per chunk, chunks, row blocks per group): the streaming kernel's rule for these tiles."""
    from entropy_discriminator.kernels.triton_fused import stream_plan

    return stream_plan(n, vocab, hdim, elt, cfg["bm"] * (2 if cfg["coop"] else 1), cfg["bn"], wave)


def _kernel_and_consts(cfg: dict):
    common = {"BN": cfg["bn"], "BK": cfg["bk"], "STAGES": cfg["stages"], "CONSUMER_REGS": cfg["consumer_regs"],
              "PRODUCER_REGS": cfg["producer_regs"]}
    if cfg["coop"]:
        if cfg["moments"] != 4:
            raise ValueError("the cooperative kernel is the library's, which computes every moment (moments=4)")
        return gluon_fused.ws_kernel, {"ROUND": 0, "T_ROUND": False, "BMW": cfg["bm"], **common, "LAG": cfg["lag"]}
    return _pingpong_kernel, {"BM": cfg["bm"], **common, "MOMENTS": cfg["moments"]}


def pingpong_stats(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, yk: torch.Tensor,
                   cfg: dict | None = None):
    """KernelStats of z = hidden @ weight.T through the ping-pong kernel and the public merge; ``yk`` fp32 [N] is the
    labels' base-2 logits (formed by the caller)."""
    from entropy_discriminator.kernels._reduce import ERR_WORDS, merge_block, merge_kernel
    from entropy_discriminator.kernels.triton_stats import KernelStats

    cfg = {**DEFAULTS, **(cfg or {})}
    n, hdim = hidden.shape
    vocab = weight.shape[0]
    tpc, s, g = plan(n, vocab, hdim, hidden.element_size(), cfg,
                     torch.cuda.get_device_properties(hidden.device).multi_processor_count)
    a_desc, w_desc = _descriptors(hidden, weight, cfg)
    n_cols = s if cfg["coop"] else 2 * s
    part = torch.empty((6, n, n_cols), device=hidden.device, dtype=torch.float32)
    cst = LOG2E
    clo = cst - float(torch.tensor(cst, dtype=torch.float32))
    kernel, consts = _kernel_and_consts(cfg)
    args = (a_desc, w_desc, part, n, vocab, hdim, tpc, g, 0, cst, clo, 1.0) if cfg["coop"] else (
        a_desc, w_desc, part, n, vocab, hdim, tpc, g, cst, clo)
    kernel[(triton.cdiv(n, cfg["bm"] * (2 if cfg["coop"] else 1)) * s,)](*args, **consts, num_warps=4,
                                                                        maxnreg=cfg["maxnreg"])  # fmt: skip
    out = torch.empty((5, n), device=hidden.device, dtype=torch.float32)
    valid = torch.empty(n, device=hidden.device, dtype=torch.bool)
    errors = torch.zeros(ERR_WORDS, device=hidden.device, dtype=torch.int32)
    merge_kernel[(n,)](part, yk, labels, out, valid, errors, n, n, n_cols, vocab, -100, PB=merge_block(n_cols),
                       num_warps=4 if n_cols >= 128 else 1)
    return KernelStats(*out.unbind(0), valid, errors)


def compile_only(cfg: dict, hdim: int = 896) -> None:
    """Compile for sm_90 without a GPU and print registers, spills and shared memory (ptxas's report, through the
    tests' ``gluon_compile.ptxas_report``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gluon_compile import descriptor_types, ptxas_report

    a_desc, w_desc = _descriptors(torch.empty(256, hdim, dtype=torch.bfloat16),
                                  torch.empty(512, hdim, dtype=torch.bfloat16), cfg)  # fmt: skip
    kernel, consts = _kernel_and_consts(cfg)
    t = time.time()
    r = ptxas_report(kernel, consts, descriptor_types(a_desc, w_desc), {"num_warps": 4, "maxnreg": cfg["maxnreg"]})
    print(f"compiled in {time.time() - t:.1f} s; shared {r['shared']} B; cfg {cfg}")
    print("setmaxnreg:", r["setmaxnreg"])
    print("wgmma:", r["wgmma"], "ex2:", r["ex2"])
    print(f"registers {r['registers']}, spill stores {r['spill_stores']} B")


def _reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor):
    z = hidden[rows].double() @ weight.double().T
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    ent = -(p * logp_all).sum(-1)
    lk = logp_all.gather(1, labels[rows, None])[:, 0]
    s_star = lk.exp() * (ent + lk)
    s_exp = (p * p * (ent[:, None] + logp_all)).sum(-1)
    return torch.stack([lk, ent, s_star, s_exp])


def run(shapes, dtypes, cfgs, out_csv: str | None, min_ms: float, rounds: int = 2) -> None:
    from entropy_discriminator.kernels.triton_fused import token_stats_fused_triton

    rows_out = []
    dev = torch.device("cuda")
    card = torch.cuda.get_device_name(dev)
    for dtype in dtypes:
        for hdim, vocab, n in shapes:
            g = torch.Generator(device=dev).manual_seed(hdim * 7 + n)
            hidden = (torch.randn(n, hdim, device=dev, generator=g) / math.sqrt(hdim) * 4).to(dtype)
            weight = torch.randn(vocab, hdim, device=dev, generator=g).to(dtype)
            labels = torch.randint(0, vocab, (n,), device=dev, generator=g)
            yk = ((hidden.float() * weight[labels].float()).sum(-1) * LOG2E).contiguous()
            rows = torch.linspace(0, n - 1, 8, device=dev).long()
            ref = _reference(hidden, weight, labels, rows)

            def public():
                return token_stats_fused_triton(hidden, weight, labels, None, 1.0, -100)

            def cublas():
                return hidden @ weight.T

            fns = {"cublas": cublas, "public": public}
            for name, cfg in cfgs.items():
                fns[name] = (lambda cfg=cfg: pingpong_stats(hidden, weight, labels, yk, cfg))
            errs = {}
            for name, fn in fns.items():
                if name == "cublas":
                    continue
                try:
                    o = fn()
                    got = torch.stack([o.logp[rows], o.entropy[rows], o.s_star[rows], o.s_expected[rows]]).double()
                    errs[name] = float((got - ref).abs().max())
                except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
                    errs[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            torch.cuda.synchronize()
            base = triton.testing.do_bench(cublas, rep=min_ms)
            rep = max(min_ms, 8 * base)
            times = {}
            for _ in range(rounds):  # interleaved rounds, same order each: each method's median, then their mean
                for name, fn in fns.items():
                    if isinstance(errs.get(name), str):
                        continue
                    times.setdefault(name, []).append(triton.testing.do_bench(fn, rep=rep))
            t = {k: sum(v) / len(v) for k, v in times.items()}
            line = f"{card} H {hdim} N {n} {str(dtype)[6:]}: cublas {t['cublas']:.3f} ms"
            for name in fns:
                if name == "cublas":
                    continue
                if name in t:
                    line += f" | {name} {t[name] / t['cublas']:.3f}x err {errs[name]:.1e}"
                else:
                    line += f" | {name} {errs[name]}"
                rows_out.append({"card": card, "H": hdim, "V": vocab, "N": n, "dtype": str(dtype)[6:], "method": name,
                                 "ms": t.get(name, float("nan")), "cublas_ms": t["cublas"],
                                 "max_err": errs[name] if not isinstance(errs[name], str) else errs[name][:80]})
            print(line, flush=True)
    if out_csv:
        with open(out_csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows_out[0]))
            w.writeheader()
            w.writerows(rows_out)


def cublas_kernels(shapes, dtypes) -> None:
    """Print the kernels cuBLAS launches for ``hidden @ weight.T`` on each shape (torch's profiler): their names give
    the tile, the pipeline depth and the cluster shape cuBLAS chose."""
    from torch.profiler import ProfilerActivity, profile

    for dtype in dtypes:
        for hdim, vocab, n in shapes:
            a = torch.randn(n, hdim, device="cuda", dtype=dtype)
            w = torch.randn(vocab, hdim, device="cuda", dtype=dtype)
            a @ w.T
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                a @ w.T
                torch.cuda.synchronize()
            names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"} - {"Memset (Device)"})
            print(f"H {hdim} N {n} {str(dtype)[6:]}: {names}", flush=True)


def _parse_cfg(text: str) -> dict:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--cublas-kernels", action="store_true", help="list the kernels cuBLAS runs, then exit")
    ap.add_argument("--cfg", action="append", default=[], help="name:key=v,key=v (over DEFAULTS); repeatable")
    ap.add_argument("--h", type=int, nargs="+", default=[896, 1536, 2048, 3584, 5120])
    ap.add_argument("--n", type=int, nargs="+", default=[16384])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"])
    ap.add_argument("--min-ms", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of medians per method (same order)")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfgs = {"pingpong": dict(DEFAULTS)}
    for spec in args.cfg:
        name, _, kv = spec.partition(":")
        kv = _parse_cfg(kv)
        cfgs[name] = {**DEFAULTS, **(COOP if kv.get("coop") else {}), **kv}
    if args.compile_only:
        for h in args.h:
            for cfg in cfgs.values():
                compile_only(cfg, h)
        return
    vocab = {896: 151936, 1536: 151936, 2048: 151936, 3584: 152064, 5120: 152064}
    shapes = [(h, vocab.get(h, 151936), n) for h in args.h for n in args.n]
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.dtypes]
    if args.cublas_kernels:
        cublas_kernels(shapes, dtypes)
        return
    run(shapes, dtypes, cfgs, args.out, args.min_ms, args.rounds)


if __name__ == "__main__":
    main()
