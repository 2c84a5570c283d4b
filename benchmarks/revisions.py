"""``python -m benchmarks.revisions REV [REV ...]``: the public call of git revisions, side by side (CUDA).

Each revision's ``entropy_discriminator`` core (``git archive``, or a folder holding an unpacked
``entropy_discriminator`` where the machine has no git history; adapters and demo left out: the core
imports itself only relatively) is unpacked under a temporary folder as the package ``ed_<i>`` and
imported next to the working tree's, so that every version is timed in one process, on one card,
in interleaved rounds: ``torch.sum``, ``torch.sum`` + ``stream.synchronize()`` and, per version,
``token_stats`` (default, ``check=False``, and the default with its result kept referenced, as a
caller that uses it keeps it: do_bench otherwise frees the result before its end event).  bf16
logits [N, 151936].  Per line: the do_bench median (L2 flushed) of each round, the median over
rounds with the median of the per-round ratios to ``torch.sum``, and (``--hidden``) the median time
with a ~0.3 ms GPU sleep before the start event, which hides the host's work before the launch;
(``--host``) the median host time per ``check=False`` call while a GPU sleep keeps the stream busy.
The versions' outputs are first checked to agree to fp32 rounding (a kernel change may reorder sums).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

FIELDS = ("logp", "entropy", "s_star", "s_expected", "s_centered", "valid")


def stage(revs: list[str], root: Path) -> dict:
    """``{label: module}``: the working tree's package and each revision's core as ``ed_<i>``."""
    import entropy_discriminator

    versions = {"tree": entropy_discriminator}
    for i, rev in enumerate(revs):
        if (Path(rev) / "entropy_discriminator").is_dir():  # a folder holding an unpacked revision
            shutil.copytree(Path(rev) / "entropy_discriminator", root / f"ed_{i}")
        else:
            archive = subprocess.run(["git", "archive", rev, "entropy_discriminator"], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
            (root / "entropy_discriminator").rename(root / f"ed_{i}")
        for extra in ("adapters", "demo"):
            shutil.rmtree(root / f"ed_{i}" / extra, ignore_errors=True)
        versions[rev] = importlib.import_module(f"ed_{i}")
    return versions


def time_shape(n: int, versions: dict, rounds: int, hidden_too: bool, flush: torch.Tensor, host_too: bool = False) -> None:
    """Print the interleaved rounds of every case at bf16 [n, 151936] (see the module docstring)."""
    import triton.testing

    from .common import kept, synced
    from .host_path import host_hidden_us, host_only_us

    v = 151936
    x = (torch.randn(n, v, device="cuda") * 3).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda")
    want = versions["tree"].token_stats(x, y)
    for label, ed in versions.items():  # kernels may sum in another order: equal to fp32 rounding
        got = ed.token_stats(x, y)
        for f in FIELDS:
            torch.testing.assert_close(getattr(got, f), getattr(want, f), rtol=1e-4, atol=1e-5, msg=f"{label}: {f}")
    results: list = []
    sum_synced = synced(lambda: torch.sum(x))
    cases = {"torch.sum": lambda: torch.sum(x), "torch.sum+sync": sum_synced, "torch.sum+sync, kept": kept(sum_synced, results)}
    for label, ed in versions.items():
        cases[f"{label}: token_stats"] = lambda ed=ed: ed.token_stats(x, y)
        cases[f"{label}: check=False"] = lambda ed=ed: ed.token_stats(x, y, check=False)
        cases[f"{label}: token_stats, kept"] = kept(lambda ed=ed: ed.token_stats(x, y), results)
    times: dict = {k: [] for k in cases}
    hidden: dict = {k: [] for k in cases}
    host: dict = {k: [] for k in cases if k.endswith("check=False")}
    for _ in range(rounds):
        for k, fn in cases.items():
            times[k].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
            if hidden_too:
                hidden[k].append(host_hidden_us(fn, flush))
            if host_too and k in host:
                host[k].append(host_only_us(fn))
            results.clear()
    print(f"bf16 [{n}, {v}]: do_bench median per round (us) | median of rounds, median ratio to torch.sum"
          + (", hidden median" if hidden_too else ""))  # fmt: skip
    for k in cases:
        ratio = statistics.median(t / s for t, s in zip(times[k], times["torch.sum"]))
        tail = f"  hidden {statistics.median(hidden[k]):7.1f}" if hidden_too else ""
        tail += f"  host only {statistics.median(host[k]):6.1f} us/call" if host.get(k) else ""
        per_round = " ".join(f"{t:7.1f}" for t in times[k])
        print(f"  {k:34s} {per_round} | {statistics.median(times[k]):7.1f}  x{ratio:.3f}{tail}", flush=True)


def main() -> None:
    import triton

    from .common import card_name

    parser = argparse.ArgumentParser(prog="python -m benchmarks.revisions", allow_abbrev=False)
    parser.add_argument("revs", nargs="*", help="git revisions (or folders holding an unpacked one) to time beside the working tree")
    parser.add_argument("--n", type=int, nargs="+", default=[256, 16384], help="rows of the [N, 151936] bf16 logits")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--hidden", action="store_true", help="also the host-hidden median of each line")
    parser.add_argument("--host", action="store_true", help="also the host time per check=False call (GPU kept busy)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        versions = stage(args.revs, Path(tmp))
        print(f"card {card_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        for n in args.n:
            time_shape(n, versions, args.rounds, args.hidden, flush, args.host)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
