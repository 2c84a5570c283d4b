#!/usr/bin/env bash
# Device side of tests/gpu/launch_verl.py (see tests/gpu/launch_verl_README.md). Run from the repository root on the
# device machine; everything it keeps lives in /tmp (kept while the machine stays warm between calls): the wheels in
# $SITE (default /tmp/site), a launch's runs in $RUN (default /tmp/lv).
#
#   bash tests/gpu/verl_device.sh stash DIR        copy the wheel parts in carry folder DIR to /tmp/verl_parts
#   bash tests/gpu/verl_device.sh install DIR      stash DIR, join the parts, check their sha256, install the wheels
#                                                  (the project's among them) into /tmp/site
#   bash tests/gpu/verl_device.sh launch ARGS...   launch_verl.py train ARGS (output /tmp/lv), then check; logs and
#                                                  records (no checkpoints) to $OUT
#   bash tests/gpu/verl_device.sh check [ARGS...]  launch_verl.py check on /tmp/lv again; logs to $OUT
set -euo pipefail

PARTS=/tmp/verl_parts
SITE=${SITE:-/tmp/site}
RUN=${RUN:-/tmp/lv}   # RUN=/tmp/lv2 keeps a second launch (e.g. 2 GPUs beside 1) apart

use_site() {
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
}

check() {
    use_site
    local tag
    tag=$(python3 -c "import json; m = json.load(open('$RUN/meta.json')); print(m['gpus'])")gpu
    set +e
    python3 tests/gpu/launch_verl.py check --out "$RUN" "$@" 2>&1 | tee "$OUT/launch_verl_${tag}_check.log"
    local rc=${PIPESTATUS[0]}
    set -e
    tar czf "$OUT/launch_verl_${tag}_records.tgz" --exclude=ckpt --exclude=hydra --exclude=assets -C "$(dirname "$RUN")" \
        "$(basename "$RUN")"
    return "$rc"
}

case "${1:-}" in
    stash)
        mkdir -p "$PARTS"
        cp "$2"/* "$PARTS"/
        ls -l "$PARTS"
        ;;
    install)
        mkdir -p "$PARTS"
        cp "$2"/* "$PARTS"/
        cat "$PARTS"/wheels.tar.part* > "$PARTS/wheels.tar"
        (cd "$PARTS" && sha256sum -c wheels.tar.sha256)
        mkdir -p "$PARTS/whl"
        tar xf "$PARTS/wheels.tar" -C "$PARTS/whl"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$PARTS"/whl/*.whl
        use_site
        python3 -c "import verl, ray, transformers, torch, entropy_discriminator as e; print('verl', verl.__version__, \
'ray', ray.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, 'entropy_discriminator', \
e.__file__, 'GPUs', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
        ;;
    launch)
        shift
        use_site
        mkdir -p "$RUN"
        gpus=1
        args=("$@")
        for i in "${!args[@]}"; do [[ "${args[$i]}" == --gpus ]] && gpus=${args[$((i + 1))]}; done
        tag=${gpus}gpu
        set +e
        python3 tests/gpu/launch_verl.py train --out "$RUN" "$@" 2>&1 | tee -a "$OUT/launch_verl_${tag}_train.log"
        rc=${PIPESTATUS[0]}
        set -e
        for log in "$RUN"/*/train.log; do
            if [[ -f "$log" ]]; then
                tail -c 200000 "$log" > "$OUT/launch_verl_${tag}_$(basename "$(dirname "$log")").log"
            fi
        done
        [[ "$rc" -eq 0 ]] || exit "$rc"
        check
        ;;
    check)
        shift
        check "$@"
        ;;
    *)
        echo "usage: bash tests/gpu/verl_device.sh stash DIR | install DIR | launch ARGS... | check [ARGS...]" >&2
        exit 2
        ;;
esac
