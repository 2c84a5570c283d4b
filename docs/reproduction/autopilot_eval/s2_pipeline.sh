#!/usr/bin/env bash
# Set-up S2 of the autopilot evaluation: the commands of PREREGISTRATION.md §6, in order, as one resumable pipeline
# on the CPU cores of whatever machine runs it (S2: the device machine for the tuning, the project's CPU machine for
# the main run).
#
#   bash docs/reproduction/autopilot_eval/s2_pipeline.sh wait OUTDIR SECONDS
#
# starts the pipeline in its own process session unless it already runs (so it goes on between device calls while
# the machine stays held), waits up to SECONDS for it to finish, then writes OUTDIR/s2.tgz: every stage folder
# without its per-stage warm starts, the shared warm cache and the logs.  On a fresh machine, a tarball carried in as
# .s2carry/s2.tgz is unpacked first (without one, the tuning stages committed under s2/ stand in, and the warm starts
# are made again); a stage without its ".done" mark is run again from scratch (a run depends only on its seed and
# arm, so a rerun gives the same records).
#
# Order: stage A (tune-a) beside the warm-up of the evaluation seeds into the warm cache; then stage B (Clip_B, Clip_V)
# beside stage C (adaptive bonus), which need LR2 (stage A's chosen GRPO lr) and START2 (the mean step-1 token entropy
# of stage A's GRPO runs at LR2, 2 decimals); then the main run, seeds 0-4 and 5-9.
set -uo pipefail
M="python3 -m entropy_lab.protocol"
CFG2=${CFG2:-"d_model=64,n_layers=2,warmup_noise=0,targets=uniform,warmup_steps=2500"}
TUNE_SEEDS=${TUNE_SEEDS:-100/101/102}
CKPTS=${CKPTS:-0/10/20/30/40/60/80/100/125/150/200}
MAIN_SEEDS=${MAIN_SEEDS:-"0/1/2/3/4 5/6/7/8/9"}
W=${S2_WORK:-/tmp/s2}
CACHE=$W/warm_cache
SELF=$(readlink -f "$0")
DONE_STAGES=$(dirname "$SELF")/s2

stage() {  # stage NAME COMMAND...: run COMMAND --out $W/NAME unless NAME is marked done
  local name=$1; shift
  [ -f "$W/$name.done" ] && return 0
  rm -rf "${W:?}/$name"
  echo "$(date -u +%T) start $name: $*"
  if "$@" --out "$W/$name" > "$W/$name.log" 2>&1; then
    touch "$W/$name.done"; echo "$(date -u +%T) done $name"
  else
    echo "$(date -u +%T) FAILED $name (tail of $W/$name.log:)"; tail -20 "$W/$name.log"; return 1
  fi
}

chosen_lr_and_start() {  # prints "LR2 START2" from stage A
  python3 - "$W/stage_a" <<'EOF'
import json, sys
from pathlib import Path
from entropy_lab.protocol import load_jsonl
from entropy_lab.tuning import stage_a
d = Path(sys.argv[1])
chosen = json.loads((d / "selection.json").read_text())["grpo"]["chosen"]
if not chosen:
    raise SystemExit("stage A chose no GRPO lr")
lr = next(a.lr for a in stage_a() if a.name == chosen)
step1 = [r["records"][0]["entropy"] for r in load_jsonl(d / "runs.jsonl") if r["arm"] == chosen]
print(f"{lr:g} {round(sum(step1) / len(step1), 2):.2f}")
EOF
}

pipeline() {
  mkdir -p "$W"
  stage stage_a $M tune-a --config "$CFG2" --seeds "$TUNE_SEEDS" --checkpoints "$CKPTS" --warm-cache "$CACHE" &
  local a=$!
  $M warm --config "$CFG2" --seeds "${MAIN_SEEDS// //}" --jobs 10 --warm-cache "$CACHE" > "$W/warm_eval.log" 2>&1 &
  local e=$!
  wait $a || return 1
  wait $e || { echo "warm-up of the evaluation seeds failed"; tail "$W/warm_eval.log"; return 1; }
  read -r LR2 START2 < <(chosen_lr_and_start) || return 1
  [ -n "${START2:-}" ] || { echo "no LR2/START2 from stage A"; return 1; }
  echo "LR2=$LR2 START2=$START2" | tee "$W/lr2_start2.txt"
  stage stage_b $M tune-b --config "$CFG2" --seeds "$TUNE_SEEDS" --checkpoints "$CKPTS" --grpo-lr "$LR2" \
    --ppo-lr "$LR2" --families clip_b,clip_v --warm-cache "$CACHE" &
  local b=$!
  stage stage_c $M tune-c --config "$CFG2" --seeds "$TUNE_SEEDS" --checkpoints "$CKPTS" --grpo-lr "$LR2" \
    --start-entropy "$START2" --warm-cache "$CACHE" &
  local c=$!
  wait $b || return 1
  wait $c || return 1
  for seeds in $MAIN_SEEDS; do
    stage "main_${seeds//\//_}" $M main --config "$CFG2" --selection "$W/stage_a/selection.json" \
      --selection "$W/stage_b/selection.json" --selection "$W/stage_c/selection.json" --start-entropy "$START2" \
      --grpo-lr "$LR2" --ppo-lr "$LR2" --families grpo,grpo_second_lr,clip_b,clip_v,autopilot,adaptive_bonus \
      --seeds "$seeds" --checkpoints "$CKPTS" --warm-cache "$CACHE" || return 1
  done
  touch "$W/ALL.done"
}

wait_and_pack() {  # wait_and_pack OUTDIR SECONDS
  local out=$1 secs=$2
  if [ ! -d "$W" ] && [ -f .s2carry/s2.tgz ]; then
    mkdir -p "$W" && tar xzf .s2carry/s2.tgz -C "$W" && echo "restored $(ls "$W" | tr '\n' ' ')"
  elif [ ! -d "$W" ] && [ -z "${S2_WORK:-}" ] && [ -f "$DONE_STAGES/stage_c/selection.json" ]; then
    # no tarball: the tuning stages committed to the repository stand in (the warm starts are made again)
    mkdir -p "$W"
    for st in stage_a stage_b stage_c; do cp -r "$DONE_STAGES/$st" "$W/$st" && touch "$W/$st.done"; done
    echo "tuning stages taken from $DONE_STAGES (no warm cache: it is filled again)"
  fi
  mkdir -p "$W"
  if [ -f "$W/ALL.done" ]; then
    echo "pipeline already finished"
  elif [ -f "$W/pid" ] && kill -0 "$(cat "$W/pid")" 2>/dev/null; then
    echo "pipeline already running (pid $(cat "$W/pid"))"
  else
    rm -f "$W/FAILED"
    setsid nohup bash -c "bash '$SELF' pipeline >> '$W/pipeline.log' 2>&1 || touch '$W/FAILED'" < /dev/null > /dev/null 2>&1 &
    echo $! > "$W/pid"
    echo "pipeline started (pid $!)"
  fi
  local end=$((SECONDS + secs))
  while [ $SECONDS -lt $end ] && [ ! -f "$W/ALL.done" ] && [ ! -f "$W/FAILED" ]; do sleep 5; done
  echo "--- pipeline.log"; cat "$W/pipeline.log" 2>/dev/null
  for f in "$W"/*.log; do [ "$f" = "$W/pipeline.log" ] || { echo "--- $(basename "$f") (tail)"; tail -2 "$f"; }; done
  mkdir -p "$out"
  tar czf "$out/s2.tgz" -C "$W" --exclude='./*/warm' --exclude='./pid' --exclude='*.partial' .
  ls -la "$out"
  [ -f "$W/FAILED" ] && return 1
  return 0
}

case "${1:-}" in
  pipeline) pipeline ;;
  wait) wait_and_pack "$2" "$3" ;;
  *) echo "usage: $0 wait OUTDIR SECONDS | pipeline" >&2; exit 2 ;;
esac
