"""Compile the warp-specialised Gluon kernel (``entropy_discriminator.kernels.gluon_fused.ws_kernel``) for sm_90a on
any machine and print, as JSON, what ptxas reports: ``python tests/gluon_compile.py HAS_BIAS ROUND T_ROUND LAG``.

Run in a process of its own by tests/test_kernels.py: with ``TRITON_INTERPRET=1`` (the kernels session) Triton's
functions are interpreted objects that the Gluon compiler cannot take."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from entropy_discriminator.kernels import gluon_fused


def report(has_bias: bool, round_code: int, t_round: bool, lag: int) -> dict:
    """wgmma count, setmaxnreg present, shared bytes, registers a thread and spill-store bytes of one variant."""
    ws = gluon_fused.WS_CONFIG
    a_desc, w_desc = gluon_fused.ws_descriptors(torch.empty(256, 896, dtype=torch.bfloat16),
                                                torch.empty(512, 896, dtype=torch.bfloat16))  # fmt: skip
    sig = {"a_desc": mangle_type(a_desc), "w_desc": mangle_type(w_desc), "b_ptr": "*bf16", "part_ptr": "*fp32",
           "N": "i32", "V": "i32", "H": "i32", "tiles_per_chunk": "i32", "group_rows": "i32", "c": "fp32",
           "c_lo": "fp32", "inv_t": "fp32"}  # fmt: skip
    consts = {"HAS_BIAS": has_bias, "ROUND": round_code, "T_ROUND": t_round, "BMW": ws["bmw"], "BN": ws["bn"],
              "BK": ws["bk"], "STAGES": ws["stages"], "LAG": lag, "CONSUMER_REGS": ws["consumer_regs"],
              "PRODUCER_REGS": ws["producer_regs"]}  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = GluonASTSource(gluon_fused.ws_kernel, sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": ws["maxnreg"]})  # fmt: skip
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    path = os.path.join(triton.knobs.cache.dir or "/tmp", f"ws_{os.getpid()}.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    try:
        text = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True, text=True,
                              check=True).stderr  # fmt: skip
    finally:
        os.remove(path)
    return {"wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": "setmaxnreg" in ptx,
            "shared": compiled.metadata.shared, "registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", text).group(1))}  # fmt: skip


if __name__ == "__main__":
    bias, rnd, t_round, lag = (int(a) for a in sys.argv[1:5])
    print(json.dumps(report(bool(bias), rnd, bool(t_round), lag)))
