"""Run ``grpo_entropy_disc.py --tiny`` once per method in one process and print a comparison table.

No hub access needed (a locally built random Llama; see ``tiny.py``); runs on CPU (float32 there) or a GPU.
Each ``--tiny`` run is 12 steps at lr 1e-2; the masks use mu 1.0, what ``entropy-discriminator suggest-mu`` gave
on the tiny run's first batch.  The two methods below took 4.4 and 5.5 minutes on a busy 2-core CPU::

    python examples/trl/compare_tiny.py --out_dir out/cmp --methods none,clip_v

Everything after ``--`` is passed to every run (e.g. ``-- --max_steps 20 --tiny_hidden 128``).  Per method: mean
over the logged steps of ``reward``, TRL's ``entropy`` and ``entropy_disc/entropy/mean``,
``entropy_disc/clip/frac`` and clipped tokens per generation batch, plus the last step's entropy; then each
method's clipped share and last entropy against ``none``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

RUNS = {
    "none": [],
    "clip_b": ["--entropy_disc_method", "clip_b"],  # --tiny's mu_low (grpo_entropy_disc.TINY_MU), no cap
    "clip_v": ["--entropy_disc_method", "clip_v"],
}


def _example():
    spec = importlib.util.spec_from_file_location(
        "ed_trl_example", pathlib.Path(__file__).with_name("grpo_entropy_disc.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--methods", default=",".join(RUNS))
    own, common = parser.parse_args(argv[:split]), argv[split + 1:]
    example = _example()
    out = pathlib.Path(own.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = {}
    for name in own.methods.split(","):
        summary = example.main(["--tiny", "--output_dir", str(out / name), "--summary_json", str(out / f"{name}.json"),
                                *RUNS[name], *common])
        table[name] = summary
    keys = ("reward", "entropy", "entropy_disc/entropy/mean", "entropy_disc/clip/frac", "entropy_disc/clip/n_clipped")
    print("method      " + "  ".join(f"{k.split('/')[-1] if k != 'entropy' else 'trl_entropy':>12}" for k in keys)
          + "  last_entropy")
    for name, summary in table.items():
        mean, last = summary["mean"], summary["last"]
        print(f"{name:11} " + "  ".join(f"{mean.get(k, float('nan')):12.5f}" for k in keys)
              + f"  {last.get('entropy_disc/entropy/mean', float('nan')):12.5f}")
    if "none" in table:
        base = table["none"]["last"].get("entropy_disc/entropy/mean", float("nan"))
        for name, summary in table.items():
            if name != "none":
                last = summary["last"].get("entropy_disc/entropy/mean", float("nan"))
                print(f"{name}: clipped {summary['mean'].get('entropy_disc/clip/frac', 0.0):.2%} of the tokens; "
                      f"last entropy {last - base:+.3f} nats/token against none")
    (out / "table.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
