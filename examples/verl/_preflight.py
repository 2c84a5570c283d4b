"""Check what the verl examples need before verl starts Ray: CUDA GPUs, vLLM and the data files.

Without this, verl on a machine that lacks them starts Ray and waits without a word.  Usage (the example
scripts call it with the interpreter verl will run under)::

    python examples/verl/_preflight.py N_GPUS DATA_FILE [DATA_FILE ...] HINT

Exit status 1 with one line per missing need on stderr, else 0.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def problems(n_gpus: int, files: list[str], hint: str) -> list[str]:
    """What is missing: GPUs (fewer CUDA devices than ``n_gpus``), vLLM, or any of ``files``."""
    found = []
    try:
        import torch

        have = torch.cuda.device_count()
    except ImportError:
        have = 0
    if have < n_gpus:
        found.append(f"needs {n_gpus} CUDA GPU(s) (N_GPUS), this machine has {have}: the verl examples are GPU-only")
    if importlib.util.find_spec("vllm") is None:
        found.append("needs vLLM, verl's rollout engine here (pip install vllm, on the GPU machine)")
    for path in files:
        if not os.path.isfile(path):
            found.append(f"no data file {path}: {hint}")
    return found


def main(argv: list[str]) -> int:
    n_gpus, *files, hint = argv
    missing = problems(int(n_gpus), files, hint)
    for line in missing:
        print(f"examples/verl: {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
