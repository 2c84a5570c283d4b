#!/usr/bin/env bash
# The S2 report of PREREGISTRATION.md §6, from a finished s2_pipeline.sh tarball:
#
#   bash docs/reproduction/autopilot_eval/s2_report.sh S2_TGZ [DEST]
#
# unpacks S2_TGZ, checks that the pipeline finished (ALL.done), copies the main run's folders (without warm starts)
# to DEST (default docs/reproduction/autopilot_eval/s2), their runs compressed (DEST/main_*/runs.jsonl.xz, xz -9e), and
# runs `protocol report` on those runs read in order (as their concatenation) with the pre-registered pairs, the arm
# names read from the selection files:
#   primary:  autopilot(hold) - {chosen Clip_B, chosen Clip_V, chosen adaptive bonus, chosen GRPO}
#   adaptive: chosen adaptive bonus - chosen GRPO
# and `protocol autopilot-gain` on the autopilot's runs (DEST/report/autopilot_gain.json).
set -euo pipefail
TGZ=$1
DEST=${2:-docs/reproduction/autopilot_eval/s2}
M="python3 -m entropy_lab.protocol"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
tar xzf "$TGZ" -C "$TMP"
[ -f "$TMP/ALL.done" ] || { echo "s2_report: $TGZ holds an unfinished pipeline (no ALL.done)" >&2; exit 1; }
mkdir -p "$DEST/report"
RUNS=()
for d in "$TMP"/main_*/; do
  name=$(basename "$d")
  mkdir -p "$DEST/$name"
  cp "$d"/{meta.json,starts.jsonl} "$DEST/$name/"
  xz -9e -T1 -c "$d/runs.jsonl" > "$DEST/$name/runs.jsonl.xz"
  cp "$TMP/$name.log" "$DEST/$name/log.txt"
  RUNS+=("$DEST/$name/runs.jsonl.xz")
done
cp "$TMP/pipeline.log" "$DEST/pipeline.log"
chosen() {  # chosen STAGE FAMILY
  python3 -c 'import json,sys; c=json.load(open(sys.argv[1]))[sys.argv[2]]["chosen"]; print(c) if c else sys.exit(f"no chosen {sys.argv[2]}")' \
    "$TMP/$1/selection.json" "$2"
}
GRPO=$(chosen stage_a grpo)
CLIP_B=$(chosen stage_b clip_b)
CLIP_V=$(chosen stage_b clip_v)
BONUS=$(chosen stage_c adaptive_bonus)
RUNS_OPTS=()
for f in "${RUNS[@]}"; do RUNS_OPTS+=(--runs "$f"); done
$M report "$DEST/report" "${RUNS_OPTS[@]}" --name primary --pair "autopilot(hold)|$CLIP_B" \
  --pair "autopilot(hold)|$CLIP_V" --pair "autopilot(hold)|$BONUS" --pair "autopilot(hold)|$GRPO"
$M report "$DEST/report" "${RUNS_OPTS[@]}" --name adaptive --pair "$BONUS|$GRPO"
$M autopilot-gain "${RUNS[@]}" --arm "autopilot(hold)" | tee "$DEST/report/autopilot_gain.json"
