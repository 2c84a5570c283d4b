"""``python -m benchmarks.fused_compile``: the fused kernel's sweep variants compiled for Hopper, no GPU needed.

For each variant of :data:`benchmarks.fused_vs_cublas.SWEEP` that runs the streaming TMA kernel,
compile it for sm_90 (Triton's own ``ptxas``, ``--arch`` sm_90a) exactly as the public call would
launch it with bf16 inputs, no bias and unrounded logits, and print what costs no device time to
read: registers per thread, spill bytes, shared memory, the ``wgmma`` count per K step and the
``wgmma.wait_group`` depths.  A variant that spills, or
needs more shared memory than the 227 KiB a Hopper block may have, is worth dropping before a
device run.  Runs on any machine with Triton 3.6.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90


def compile_variant(cfg: dict) -> dict:
    """Compile the streaming kernel of ``cfg`` (a full configuration) for sm_90; returns registers,
    spill stores (bytes), shared memory (bytes), wgmma instructions in the PTX and wait depths
    (the tests' ``gluon_compile.ptxas_report``)."""
    from triton.compiler import ASTSource

    from entropy_discriminator.kernels.triton_fused import stream_spec

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gluon_compile import ptxas_report

    kernel, consts = stream_spec(cfg, False, 0, False, True)
    types = {"a_desc": f"tensordesc<bf16[{cfg['bm']},{cfg['bk']}]>",
             "w_desc": f"tensordesc<bf16[{cfg['bn']},{cfg['bk']}]>", "b_ptr": "*bf16", "part_ptr": "*fp32"}
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["stages"],
            **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {})}
    r = ptxas_report(kernel, consts, types, opts, source=ASTSource)
    return {"regs": r["registers"], "spill": r["spill_stores"], "smem": int(r["shared"]), "wgmma": r["wgmma"],
            "waits": r["waits"]}


def main(argv: list[str] | None = None) -> int:
    from entropy_discriminator.kernels.triton_fused import DEFAULT_CONFIG

    from .fused_vs_cublas import SWEEP

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fused_compile", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument("--configs", nargs="*", default=None, help="only these SWEEP names")
    args = p.parse_args(argv)
    print(f"{'variant':30s} {'regs':>4s} {'spill B':>7s} {'smem B':>7s} {'wgmma':>5s}  waits")
    for name, over in SWEEP.items():
        if args.configs and name not in args.configs:
            continue
        cfg = {**DEFAULT_CONFIG, **(over or {})}
        if not cfg["stream"]:
            print(f"{name:30s} (a per-tile kernel: not compiled here)")
            continue
        try:
            r = compile_variant(cfg)
        except Exception as exc:  # a variant that does not compile is reported, not fatal
            print(f"{name:30s} does not compile: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        flag = " SPILLS" if r["spill"] else ""
        flag += " SMEM>227KiB" if r["smem"] > SMEM_LIMIT else ""
        print(f"{name:30s} {r['regs']:4d} {r['spill']:7d} {r['smem']:7d} {r['wgmma']:5d}  {r['waits']}{flag}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
