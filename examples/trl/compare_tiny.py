"""Run ``grpo_entropy_disc.py --tiny`` once per method in one process and print a comparison table.

No hub access needed (a locally built random Llama; see ``tiny.py``); runs on CPU (float32 there) or a GPU.
Example::

    python examples/trl/compare_tiny.py --out_dir /tmp/cmp -- --max_steps 15 --tiny_hidden 256

Everything after ``--`` is passed to every run.  Per method: mean over the logged steps of
``reward``, TRL's ``entropy`` and ``entropy_disc/entropy/mean``, ``entropy_disc/clip/frac`` and
clipped tokens per generation batch, plus the last step's entropy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

RUNS = {
    "none": [],
    "clip_b": ["--entropy_disc_method", "clip_b"],  # the defaults: mu_low 2.5, no cap
    "clip_v": ["--entropy_disc_method", "clip_v"],
    "clip_b_mu1": ["--entropy_disc_method", "clip_b", "--entropy_disc_mu_low", "1.0"],
    "clip_v_mu1": ["--entropy_disc_method", "clip_v", "--entropy_disc_mu_low", "1.0"],
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
    (out / "table.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
