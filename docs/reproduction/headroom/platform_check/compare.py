"""Print how the GPU runs of seed 0 compare with the CPU's main-run records of the same (seed, arm).

    PYTHONPATH=lab python docs/reproduction/headroom/platform_check/compare.py
"""
from __future__ import annotations

from pathlib import Path

from entropy_lab.records import load_jsonl

HERE = Path(__file__).parent
CPU = {r["arm"]: r for r in load_jsonl(HERE.parent / "main/seeds_0-4/runs.jsonl") if r["seed"] == 0}
CPU.update({r["arm"]: r for r in load_jsonl(HERE.parent / "main/late_arms_seeds_0-2/runs.jsonl") if r["seed"] == 0})


def differing(a: list[dict], b: list[dict]) -> tuple[int, dict[str, float]]:
    """(entries that differ, {field: largest relative difference}) of two equally long lists of records."""
    n, worst = 0, {}
    for x, y in zip(a, b, strict=True):
        n += x != y
        for k, v in x.items():
            if v != y.get(k) and isinstance(v, float):
                worst[k] = max(worst.get(k, 0.0), abs(v - y[k]) / max(abs(y[k]), abs(v)))
    return n, worst


print("| folder | arm | checkpoints differing | steps differing | fields differing (largest relative difference) |")
print("|---|---|---|---|---|")
for folder in ("gpu_probe_a", "gpu_probe_b", "gpu_probe_8", "gpu_batched_eval"):
    for run in load_jsonl(HERE / folder / "runs.jsonl"):
        cpu = CPU[run["arm"]]
        n_cp, _ = differing(run["checkpoints"], cpu["checkpoints"])
        n_st, worst = differing(run["records"], cpu["records"])
        fields = ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())) or "none"
        print(f"| {folder} | {run['arm']} | {n_cp}/{len(cpu['checkpoints'])} | {n_st}/{len(cpu['records'])} "
              f"| {fields} |")
