#!/usr/bin/env bash
# Run protocol commands of PREREGISTRATION.md section 8 on a lent machine's CPUs, a call at a time.
#
#   bash docs/reproduction/headroom/device.sh '<protocol arguments>' ['<protocol arguments>' ...]
#
# Each argument is one `python -m entropy_lab.protocol` command line (its words split by the shell), run in order
# with OMP_NUM_THREADS=1 and `--jobs $JOBS` (default: the CPU count less 2); a failed command stops the rest.
# State lives in the carried folder .devcarry-headroom/ (tuning/ and the warm cache warm/), which the repository
# ignores; the paths T, R and W below point into it, and CFG is the pre-registered configuration.  After each command the
# whole folder is packed into $OUT/headroom.tgz (when OUT is set), so that the next call can carry it on and a call
# stopped at its time limit still returns every command that finished.  JOBS: count with `nproc --all`, since
# nproc obeys OMP_NUM_THREADS.
set -u -o pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
C=.devcarry-headroom
mkdir -p "$C/tuning" "$C/warm" "$C/logs"
T=$C/tuning R=$C/main W=$C/warm
CFG="n_numbers=7,d_model=64,n_layers=2,warmup_noise=0,targets=uniform,warmup_solution=first,warmup_steps=750"
JOBS=${JOBS:-$(( $(nproc --all) > 3 ? $(nproc --all) - 2 : 1 ))}
PY=${PYTHON:-python3}
# Pack after every command, so that a call stopped at its time limit still returns what finished.
pack() { if [ -n "${OUT:-}" ]; then tar czf "$OUT/.headroom.$$" "$C" && mv "$OUT/.headroom.$$" "$OUT/headroom.tgz"; fi; }
rc=0
for cmd in "$@"; do
    cmd=${cmd//\$T/$T}; cmd=${cmd//\$R/$R}; cmd=${cmd//\$W/$W}
    echo "== $(date -u +%H:%M:%S) protocol $cmd (jobs $JOBS)"
    # shellcheck disable=SC2086  # the command's words are meant to split
    $PY -m entropy_lab.protocol $cmd --config "$CFG" --jobs "$JOBS" --warm-cache "$W" 2>&1 \
        | tee -a "$C/logs/protocol.log" || rc=1
    pack
    [ $rc = 0 ] || break
done
echo "== $(date -u +%H:%M:%S) done, rc $rc"
exit $rc
