"""Compile a fused head's Gluon (or Triton) kernel for sm_90a on any machine and report what its PTX and ptxas say
(:func:`ptxas_report`); as a script, the library's ``entropy_discriminator.kernels.gluon_fused.ws_kernel``,
printed as JSON: ``python tests/gluon_compile.py ROUND T_ROUND LAG``.

The script is run in a process of its own by tests/test_kernels.py: with ``TRITON_INTERPRET=1`` (the kernels
session) Triton's functions are interpreted objects that the Gluon compiler cannot take.
``benchmarks/gluon_pingpong_probe.py --compile-only`` and ``benchmarks/fused_compile.py`` report their kernels through
:func:`ptxas_report` too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

# the fp32 scalar arguments of the fused heads' kernels (the others are i32 unless ``types`` names them)
_FLOAT_ARGS = ("cst", "clo", "c", "c_lo", "inv_t")


def ptxas_report(kernel, consts: dict, types: dict[str, str], options: dict, source=GluonASTSource) -> dict:
    """``kernel`` (a fused head's Gluon kernel, or with ``source=triton.compiler.ASTSource`` a Triton one) compiled
    for sm_90a with the constexprs ``consts``, the argument types ``types`` (descriptors, pointers; the fp32 scalars
    of :data:`_FLOAT_ARGS` and i32 otherwise) and the compile ``options``: its wgmma and ex2 counts, the
    ``wgmma.wait_group`` depths, the setmaxnreg instructions, shared bytes, ptxas's registers a thread and
    spill-store bytes, and the fp32 -> bf16 conversions, one value (``cvt_bf16``) or two (``cvt_bf16x2``) each."""
    names = kernel.arg_names  # in the kernel's order: the constexprs are named by position
    sig = {k: "constexpr" if k in consts else types.get(k, "fp32" if k in _FLOAT_ARGS else "i32") for k in names}
    src = source(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        text = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True).stderr  # fmt: skip
    return {"wgmma": ptx.count("wgmma.mma_async"), "ex2": ptx.count("ex2.approx"),
            "waits": sorted({int(w) for w in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)}),
            "setmaxnreg": sorted({line.strip() for line in ptx.splitlines() if "setmaxnreg" in line}),
            "cvt_bf16": ptx.count("cvt.rn.bf16.f32"), "cvt_bf16x2": ptx.count("cvt.rn.bf16x2.f32"),
            "shared": compiled.metadata.shared, "registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", text).group(1))}  # fmt: skip


def descriptor_types(a_desc, w_desc) -> dict[str, str]:
    """:func:`ptxas_report`'s ``types`` of a fused head's Gluon kernel: its two descriptors and the partials."""
    return {"a_desc": mangle_type(a_desc), "w_desc": mangle_type(w_desc), "part_ptr": "*fp32"}


def report(round_code: int, t_round: bool, lag: int) -> dict:
    """:func:`ptxas_report` of the library's ``ws_kernel`` (H 896 bf16 descriptors) for one variant."""
    from entropy_discriminator.kernels import gluon_fused

    ws = gluon_fused.WS_CONFIG
    a_desc, w_desc = gluon_fused.ws_descriptors(torch.empty(256, 896, dtype=torch.bfloat16),
                                                torch.empty(512, 896, dtype=torch.bfloat16))  # fmt: skip
    consts = {"ROUND": round_code, "T_ROUND": t_round, "BMW": ws["bmw"], "BN": ws["bn"],
              "BK": ws["bk"], "STAGES": ws["stages"], "LAG": lag, "CONSUMER_REGS": ws["consumer_regs"],
              "PRODUCER_REGS": ws["producer_regs"]}  # fmt: skip
    return ptxas_report(gluon_fused.ws_kernel, consts, descriptor_types(a_desc, w_desc),
                        {"num_warps": 4, "maxnreg": ws["maxnreg"]})


if __name__ == "__main__":
    rnd, t_round, lag = (int(a) for a in sys.argv[1:4])
    print(json.dumps(report(rnd, bool(t_round), lag)))
