#!/usr/bin/env bash
# The main run's analysis (§8's report lines, amendment 2's parts): run once, after all 600 runs are in main/.
#
#   bash docs/reproduction/headroom/report.sh [OUT_DIR]      # default docs/reproduction/headroom/main
#
# Every part's runs.jsonl(.xz) under main/ is read (a (seed, arm) must appear once: the script refuses
# duplicates and a count other than 40 seeds x 15 arms before any test), then the five comparison families of §5
# (primary, controller, each peer - GRPO, GRPO's second rate, Clip_B and Clip_V - each peer) with the pre-registered
# margin; tables, the frontier figures of each family's arms ({name}_frontier_T*_pass*.png) and parts.md (each
# part's platform) go to OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
H=docs/reproduction/headroom
OUT=${1:-$H/main}
RUNS=()
for f in "$H"/main/*/runs.jsonl.xz; do RUNS+=(--runs "${f%.xz}"); done
mkdir -p "$OUT"
${PYTHON:-python3} - "$H/main" "$OUT" <<'PY'
import sys
from collections import Counter
from pathlib import Path
from entropy_lab.records import load_jsonl
parts = {p: load_jsonl(p.with_suffix("")) for p in sorted(Path(sys.argv[1]).glob("*/runs.jsonl.xz"))}
runs = [r for part in parts.values() for r in part]
count = Counter((r["seed"], r["arm"]) for r in runs)
twice = sorted(k for k, n in count.items() if n > 1)
if twice or len(count) != 600 or {s for s, _ in count} != set(range(40)):
    sys.exit(f"report: need each of 40 seeds x 15 arms once; got {len(count)} (seed, arm) pairs, twice: {twice[:5]}")
import json
rows = ["| part | platform | torch | seeds | arms | runs |", "|---|---|---|---|---|---|"]
for p, part in parts.items():
    meta = json.loads((p.parent / "meta.json").read_text())
    seeds = sorted({r["seed"] for r in part})
    where = f"GPU ({meta['cuda']})" if meta.get("cuda") else f"CPU ({meta['cpu_count']} cores)"
    rows.append(f"| {p.parent.name} | {where} | {meta['torch']} | {seeds[0]}-{seeds[-1]} | "
                f"{len({r['arm'] for r in part})} | {len(part)} |")
(Path(sys.argv[2]) / "parts.md").write_text("\n".join(rows) + "\n")
PY
# The chosen settings' arm names (tuning/*/selection.json).
GRPO="grpo(lr=0.0001)" PPO="ppo(lr=0.0001)" CLIPB="clip_b(mu=2.5)" CLIPV="clip_v(mu=2.5,cap=None)"
PEERS=("clip_cov(ratio=0.005)" "kl_cov(ratio=0.1,coef=1)" "forking(rho=0.5)" "entropy_bonus(c=0.03)"
       "adaptive_bonus(target=0.23)" "unlikely(pen=0.5)")
VS_GRPO=() CLIPS=()
for p in "${PEERS[@]}"; do
    VS_GRPO+=(--pair "$p|$GRPO")
    CLIPS+=(--pair "$CLIPB|$p")
done
for p in "${PEERS[@]}"; do CLIPS+=(--pair "$CLIPV|$p"); done
M="${PYTHON:-python3} -m entropy_lab.protocol report $OUT ${RUNS[*]} --margin 0.02"
$M --name primary --pair "$CLIPB|$GRPO" --pair "$CLIPV|$GRPO" \
   --pair "ppo+clip_b(mu=2.5)|$PPO" --pair "ppo+clip_v(mu=0.5,cap=0.02)|$PPO"
$M --name controller --pair "autopilot(hold)|fixed_share(0.0209)" --pair "autopilot(hold)|$GRPO"
$M --name peers "${VS_GRPO[@]}"
$M --name grpo_lr --pair "grpo(lr=0.0003)|$GRPO"
$M --name clips_vs_peers "${CLIPS[@]}"
