"""Check what the verl examples need before verl starts Ray: CUDA GPUs, vLLM, the data files, and the plugin.

Without this, verl on a machine that lacks them starts Ray and waits without a word; and if verl does not
load the adapter's plugin (``VERL_USE_EXTERNAL_PLUGINS``, or an error while loading it, which verl logs
at DEBUG only), it ignores every ``entropy_disc`` setting.  Usage (the example scripts call it with the
interpreter verl will run under, and the Hydra overrides they pass to verl)::

    python examples/verl/_preflight.py N_GPUS DATA_FILE [DATA_FILE ...] HINT [-- OVERRIDE ...]

Exit status 1 with one line per missing need on stderr, else 0.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def asks_for_adapter(overrides: list[str]) -> bool:
    """Whether the Hydra overrides select an entropy_disc trainer mode or set an ``entropy_disc`` option."""
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        if key.startswith("entropy_disc.") or key == "entropy_disc" or (
            key == "trainer.v1.trainer_mode" and value.startswith("entropy_disc")
        ):
            return True
    return False


def plugin_problem() -> str | None:
    """The adapter's answer (``adapters/verl/_startup.plugin_problem``), or why it cannot be asked."""
    try:
        from entropy_discriminator.adapters.verl._startup import plugin_problem as problem
    except Exception as exc:
        return (f"the entropy_disc verl adapter cannot be imported ({type(exc).__name__}: {exc}), so verl cannot "
                "load its plugin: pip install -e '.[verl]' from the clone")
    return problem()


def problems(n_gpus: int, files: list[str], hint: str, overrides: list[str] = ()) -> list[str]:
    """What is missing: GPUs (fewer CUDA devices than ``n_gpus``), vLLM, any of ``files``, or the plugin
    (when ``overrides`` ask for the adapter)."""
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
    if asks_for_adapter(list(overrides)):
        problem = plugin_problem()
        if problem is not None:
            found.append(problem)
    return found


def main(argv: list[str]) -> int:
    head, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    n_gpus, *files, hint = head
    missing = problems(int(n_gpus), files, hint, overrides)
    for line in missing:
        print(f"examples/verl: {line}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
