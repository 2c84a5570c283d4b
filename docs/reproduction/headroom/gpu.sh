#!/usr/bin/env bash
# Run the main run's remaining seeds on a lent machine's GPU (amendment 3 of PREREGISTRATION.md), a call at a time.
#
#   bash docs/reproduction/headroom/gpu.sh SEEDS JOBS PART      # e.g. 25/26/27 13 gpu_seeds_25-27
#   FAM=autopilot,fixed_share bash docs/reproduction/headroom/gpu.sh 23 2 gpu_seed_23_rest
#
# §10's `protocol main` command with `--device cuda`, every arm (or the families in FAM) of the '/'-separated SEEDS,
# JOBS processes sharing the one GPU (14 keep an H200 busy), records in $R/PART.  State lives in the carried,
# ignored folder .devcarry-headroom/ as for device.sh: tuning/ (a copy of ../tuning/: the selections and the
# autopilot's tuning records) and warm/ (the warm starts; a missing one is warmed up on the CPU first).  When OUT is
# set, $R and the logs (without the copied warm starts) are packed into $OUT/main.tgz every 30 s and at the end, so
# that a call stopped at its time limit still returns every run that finished.
set -u -o pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
C=.devcarry-headroom
T=$C/tuning R=$C/main W=$C/warm
mkdir -p "$C/logs" "$R" "$W"
[ -f "$T/stage_a/selection.json" ] || cp -r docs/reproduction/headroom/tuning "$T"
CFG="n_numbers=7,d_model=64,n_layers=2,warmup_noise=0,targets=uniform,warmup_solution=first,warmup_steps=750"
FAM=${FAM:-grpo,ppo,clip_b,clip_v,ppo+clip_b,ppo+clip_v,clip_cov,kl_cov,forking_tokens,entropy_bonus,unlikely,adaptive_bonus,grpo_second_lr,autopilot,fixed_share}
SEL=()
for d in stage_a stage_b_clip_b stage_b_clip_v stage_b_ppo_clip_b stage_b_ppo_clip_v stage_b_peers stage_c; do
    SEL+=(--selection "$T/$d/selection.json")
done
pack() { if [ -n "${OUT:-}" ]; then tar czf "$OUT/.main.$$" --exclude='*/warm' "$R" "$C/logs" && mv "$OUT/.main.$$" "$OUT/main.tgz"; fi; }
( while sleep 30; do pack; done ) &
packer=$!
echo "== $(date -u +%H:%M:%S) $3: seeds $1, $2 processes"
${PYTHON:-python3} -m entropy_lab.protocol main --config "$CFG" "${SEL[@]}" --families "$FAM" \
    --fixed-share-from "$T/autopilot/runs.jsonl" --autopilot-calibrate-every 10 --grpo-lr 0.0001 --ppo-lr 0.0001 \
    --start-entropy 0.43 --seeds "$1" --jobs "$2" --warm-cache "$W" --device cuda --out "$R/$3" 2>&1 \
    | tee -a "$C/logs/$3.log" | grep -v '^ *[0-9]*/[0-9]* done'
rc=$?
kill $packer 2>/dev/null
pack
echo "== $(date -u +%H:%M:%S) done, rc $rc"
exit $rc
