"""verl's Megatron engine hook on CPU: two gloo ranks, megatron-core tensor parallel size 2.

Runs the dry runs of the two-GPU scripts in ``tests/gpu/`` (see ``tests/gpu/megatron_README.md``)
under ``torch.distributed.run`` with real verl and real megatron-core (``nox -s verl`` installs
megatron-core 0.16.1; no TransformerEngine, no bridge):

* ``megatron_tp.py``: verl's ``MegatronEngineWithLMHead._lm_head_logits_processor`` with the
  adapter's hook on ``ColumnParallelLinear`` vocabulary shards (vocabulary 32003 padded to 32256),
  ``E_p[S]``, verl's entropy / log-probs and the driver's ``S_c`` against float64, the padding
  columns excluded through ``token_stats(vocab_parallel_group=...)``, and a Clip_V policy-gradient
  step whose clipped tokens get exactly zero gradient;
* ``megatron_engine.py --tp 2 --pp 1``: verl's ``forward_backward_batch`` (forward only) with the
  hook on a megatron-core ``GPTModel``.  On CPU, megatron's CUDA-only schedule is replaced by a
  sequential loop and ``torch.cuda.current_device`` / the CUDA RNG tracker by CPU stand-ins (the
  script says which); everything verl does in between runs as is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
pytest.importorskip("megatron.core", reason="needs megatron-core: nox -s verl installs it")
import verl  # noqa: E402

GPU_DIR = Path(__file__).resolve().parents[2] / "gpu"

pytestmark = pytest.mark.skipif(
    verl.__version__ != "0.9.1", reason="the Megatron scripts drive verl 0.9.1's engine internals"
)


def _torchrun(script: str, *args: str, out: Path) -> None:
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(GPU_DIR / script)]
    proc = subprocess.run([*cmd, *args, str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def test_hook_on_column_parallel_shards(tmp_path: Path) -> None:
    _torchrun("megatron_tp.py", out=tmp_path)
    reports = [json.loads((tmp_path / f"megatron_tp_rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert report["backend"] == "gloo" and report["padded_vocab"] == 32256
        assert report["passed"] and all(report["checks"].values()), report["checks"]
        assert report["update"]["n_clipped"] > 0
        for mode in ("zero_pg", "drop_token"):
            assert report["update"][mode]["clipped_logit_grad_max_abs"] == 0.0
    assert reports[0]["bf16_params_fp32_logits"] == reports[1]["bf16_params_fp32_logits"]


def test_engine_forward_with_hook_tp2(tmp_path: Path) -> None:
    _torchrun("megatron_engine.py", "--tp", "2", "--pp", "1", out=tmp_path)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"megatron_engine_tp2_pp1_rank{rank}.json").read_text())
        assert report["checks"]["hook_field_returned"] and all(report["checks"].values()), report["checks"]
        assert report["hook_s_expected"]["n"] == 174
