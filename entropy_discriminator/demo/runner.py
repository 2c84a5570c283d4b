"""``entropy-discriminator demo``: warm up once, GRPO in three arms (vanilla, + Clip_B, + Clip_V) with the
same seed, then a table, a CSV of every step and a PNG of the curves."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import torch

from .model import TinyGPT
from .report import PLOT_HINT, TextProgress, format_table, have_matplotlib, plot_demo, prepare_output_folder, write_csv
from .theory import Agreement, tabular_check, tabular_start
from .train import ArmResult, ArmSpec, TrainConfig, evaluate, run_arm, warm_up

#: The demo's sizes: ``full`` fits 5 minutes on a 2-core CPU, ``quick`` one minute (CI).
PRESETS = {
    "full": TrainConfig(),
    "quick": TrainConfig(d_model=48, warmup_batch=64, grpo_steps=30, prompts_per_step=8, eval_prompts=64, eval_k=4),
}

#: The warm-up continues (up to twice its steps) until held-out Avg@k reaches this, so RL starts from a policy
#: that passes some problems whatever the seed.
WARMUP_TARGET = 0.3


def summary_columns(k: int) -> list[tuple[str, str]]:
    """``(key, header)`` pairs of the summary table; ``k`` (samples per held-out prompt) names the accuracy columns."""
    return [
        ("arm", "arm"), ("entropy_final", "final entropy"), ("reward_final", "reward"), ("avg_at_k", f"Avg@{k}"),
        ("pass_at_k", f"Pass@{k}"), ("clip_frac", "clip frac"), ("dH_corr", "dH corr"), ("dH_sign", "dH sign agree"),
    ]


@dataclass(frozen=True)
class DemoOptions:
    """What ``entropy-discriminator demo`` runs (see ``entropy-discriminator demo --help``)."""

    out: Path = Path("demo_out")
    quick: bool = False
    device: str = "auto"
    seed: int = 0
    steps: int | None = None
    threads: int | None = None
    mu_b: float = 2.5
    mu_v: float = 2.5
    max_frac_v: float | None = None
    autopilot: str | float | None = None


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available else cpu; ``cpu``, ``cuda`` and ``cuda:N`` are checked against this machine
    (``ValueError`` naming the device for anything else, CUDA without a GPU or a GPU index it does not have)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {name!r} is not a torch device: {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine (use cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``torch.set_num_threads(n)`` (None: unchanged), restoring the old value afterwards.  One thread is
    the demo's default on CPU: its matrices are tiny (on a busy 2-core machine one thread ran 5x faster than two)."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def demo_arms(opts: DemoOptions) -> list[ArmSpec]:
    """Vanilla GRPO, + Clip_B (``mu_b``) and + Clip_V (``mu_v``, ``max_frac_v``) and, with ``autopilot`` (``"hold"``
    or a target entropy in nats/token), + Autopilot with its defaults otherwise (docs/demo.md)."""
    arms = [ArmSpec("GRPO"), ArmSpec("GRPO+Clip_B", method="clip_b", mu_low=opts.mu_b),
            ArmSpec("GRPO+Clip_V", method="clip_v", mu_low=opts.mu_v, max_frac=opts.max_frac_v)]
    if opts.autopilot is not None:
        arms.append(ArmSpec("GRPO+Autopilot", method="autopilot", target_entropy=opts.autopilot))
    return arms


def summarise(result: ArmResult) -> dict[str, object]:
    """One table row: final entropy and reward (means over the last 10% of steps), Avg@k, Pass@k, mean clip fraction,
    and the agreement of the Corollary 4 prediction with the realised per-batch ``dH``."""
    recs = result.records
    tail = recs[-max(1, len(recs) // 10) :]
    dh = Agreement([r["pred_dH"] for r in recs], [r["real_dH"] for r in recs])
    return {"arm": result.arm, "seed": result.seed, "entropy_final": sum(r["entropy"] for r in tail) / len(tail),
            "reward_final": sum(r["reward"] for r in tail) / len(tail), "avg_at_k": result.final["avg_at_k"],
            "pass_at_k": result.final["pass_at_k"], "clip_frac": sum(r["clip_frac"] for r in recs) / len(recs),
            "dH_corr": dh.corr, "dH_sign": dh.sign, "seconds": result.final["seconds"]}


def run_demo(opts: DemoOptions, *, stream: TextIO | None = None) -> dict[str, object]:
    """Run the demo; write ``demo_steps.csv``, ``demo_summary.csv``, ``demo_table.md`` and (with matplotlib)
    ``demo.png`` under ``opts.out``.  Returns ``{"rows", "tabular", "files"}``.  Every option is checked before any
    work (``ValueError`` naming it): ``steps >= 3``, ``threads >= 1``, the mask settings, the device, and that ``out``
    can be written.  ``threads=None``: one thread on CPU, torch's default on CUDA."""
    stream = stream if stream is not None else sys.stdout
    cfg = PRESETS["quick" if opts.quick else "full"]
    if opts.steps is not None:
        if opts.steps < 3:
            raise ValueError(f"--steps must be >= 3, got {opts.steps}")
        cfg = replace(cfg, grpo_steps=opts.steps)
    if opts.threads is not None and opts.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {opts.threads}")
    arms = demo_arms(opts)
    device = resolve_device(opts.device)
    out = prepare_output_folder(opts.out)
    threads = opts.threads if opts.threads is not None else (1 if device.type == "cpu" else None)
    t_start = time.perf_counter()
    print(f"entropy-discriminator demo ({'quick' if opts.quick else 'full'}): {cfg.n_digits}-digit addition, "
          f"TinyGPT d={cfg.d_model} x{cfg.n_layers}, {cfg.grpo_steps} GRPO steps x {cfg.prompts_per_step} prompts x "
          f"{cfg.group_size} samples, device {device}", file=stream, flush=True)
    with torch_threads(threads):
        torch.manual_seed(opts.seed)
        model = TinyGPT(cfg.model_config()).to(device)
        warm = warm_up(model, cfg, seed=opts.seed, device=device, progress=TextProgress("warm-up (supervised)"),
                       target_avg=WARMUP_TARGET, max_steps=2 * cfg.warmup_steps)
        base_eval = evaluate(model, cfg, seed=opts.seed, device=device)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        results = [run_arm(state, cfg, arm, seed=opts.seed, device=device, progress=TextProgress(arm.name))
                   for arm in arms]
        task = cfg.task()
        init, a, b = tabular_start(model, task, 16, seed=opts.seed, device=device)
        tab = tabular_check(task, init_logits=init, a=a, b=b, group_size=cfg.group_size, steps=30, step_size=0.02,
                            seed=opts.seed)

    first = results[0].records[0]
    warm_row = {"arm": "warm-up (no RL)", "seed": opts.seed, "entropy_final": first["entropy"],
                "reward_final": first["reward"], "avg_at_k": base_eval["avg_at_k"], "pass_at_k": base_eval["pass_at_k"],
                "clip_frac": math.nan, "dH_corr": math.nan, "dH_sign": math.nan}
    table_rows = [warm_row, *(summarise(r) for r in results)]
    table = format_table(table_rows, summary_columns(cfg.eval_k))
    notes = (
        f"Warm-up: {warm['steps']:.0f} supervised steps. "
        f"k = {cfg.eval_k} samples per held-out prompt at temperature {cfg.eval_temperature}, {cfg.eval_prompts} prompts; "
        "final entropy / reward: mean over the last 10% of steps; dH corr / sign agree: Pearson correlation and sign "
        "agreement, over steps, of Corollary 4's -Cov_B(A*keep, S_c) with the realised change of the batch-mean entropy.\n"
        f"Theory check, tabular case (logits as parameters, step 0.02, {len(tab.predicted)} steps): "
        f"corr {tab.corr:.5f}, slope {tab.slope:.4f} (1 = exact), sign agreement {tab.sign:.2f}."
    )
    print("\n" + table + "\n\n" + notes, file=stream)

    files = {"steps_csv": out / "demo_steps.csv", "summary_csv": out / "demo_summary.csv", "table": out / "demo_table.md"}
    write_csv(files["steps_csv"], [{"arm": r.arm, "seed": r.seed, **rec} for r in results for rec in r.records])
    write_csv(files["summary_csv"], table_rows)
    files["table"].write_text(table + "\n\n" + notes + "\n")
    if have_matplotlib():
        files["png"] = out / "demo.png"
        plot_demo(files["png"], {r.arm: r.records for r in results}, window=max(1, cfg.grpo_steps // 15))
    else:
        print(PLOT_HINT, file=stream)
    print(f"\nwrote {', '.join(str(p) for p in files.values())} in {time.perf_counter() - t_start:.0f}s", file=stream)
    return {"rows": table_rows, "tabular": tab, "files": files}
