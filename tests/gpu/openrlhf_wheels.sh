#!/usr/bin/env bash
# The wheels tests/gpu/launch_openrlhf.py needs on the device machine (Python 3.12, torch 2.11, transformers 5.17,
# no network) and does not find there, in .devcarry-openrlhf/ (git-ignored; carried by the device call, see
# tests/gpu/launch_openrlhf_README.md).  Run from the repository root on a machine with pip access:
#
#   bash tests/gpu/openrlhf_wheels.sh [PYTHON]
#
# PYTHON (default: the openrlhf(release='0.11.2') nox environment's python) builds DeepSpeed's wheel: DeepSpeed
# 0.19.6 is published as source only; it is built here without compiled ops (DS_BUILD_OPS=0; FusedAdam is compiled
# just in time on the device, where nvcc and ninja are) into a py3-none-any wheel.
#
# The closure is what OpenRLHF 0.11.2's train_ppo_ray imports on the path the launch takes (not its full metadata,
# whose wandb, bitsandbytes, vllm, flash-attn, tensorboard, ... the launch never imports), minus what the device has
# (/work/.library/device/KINDS.md's package list): ray and its jsonschema family, DeepSpeed and its hjson and
# pydantic family, datasets' dill and multiprocess, torchdata, pylatexenc.  transformers stays the device's 5.17
# (OpenRLHF pins 5.15; carrying 5.15 would also need tokenizers < 0.23).
#
# ray 2.55.0's wheel (70 MiB) alone is over what one call carries besides the tree (~54 MiB); 31 MiB of it is
# ray/jars/ray_dist.jar, the Java workers' runtime, which a Python-only job never loads.  The wheel is copied here
# without ray/jars/ (zip -d; pip installs it as usual), so the whole closure fits one call (the sizes are printed).
#
# CLOSURE=step (bash tests/gpu/openrlhf_wheels.sh with CLOSURE=step in the environment): the closure of
# benchmarks/openrlhf_step.py instead, in .devcarry-openrlhf-step/: the same wheels less ray and its jsonschema family
# (the benchmark drives OpenRLHF's trainer in one process and puts an empty stand-in in ray's place,
# tests/gpu/openrlhf_step.py's install_stand_ins); tests/gpu/openrlhf_step_README.md has the device call.
set -euo pipefail

PY=${1:-.nox/openrlhf-release-0-11-2/bin/python}
CLOSURE=${CLOSURE:-launch}
RAY=(ray==2.55.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1)
case "$CLOSURE" in
  launch) DIR=.devcarry-openrlhf ;;
  step) DIR=.devcarry-openrlhf-step; RAY=() ;;
  *) echo "$0: CLOSURE must be launch or step, got $CLOSURE" >&2; exit 2 ;;
esac
BINARY=(
  openrlhf==0.11.2
  "${RAY[@]}"
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  torchdata==0.11.0 pylatexenc==2.11
)
PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

[[ -x "$PY" ]] || { echo "$0: $PY not found: create it with nox -s \"openrlhf(release='0.11.2')\" --install-only, or pass a python with torch" >&2; exit 2; }
rm -rf "$DIR" && mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$DIR" "${BINARY[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" deepspeed==0.19.6

if [[ "$CLOSURE" == launch ]]; then
  ray_whl=$(ls "$DIR"/ray-2.55.0-*.whl)
  zip -q -d "$ray_whl" 'ray/jars/*'
fi

count=$(ls "$DIR"/*.whl | wc -l)
expected=$(( ${#BINARY[@]} + 1 ))
[[ "$count" == "$expected" ]] || { echo "$0: $count wheels in $DIR, expected $expected" >&2; exit 1; }
echo "closure in $DIR ($count wheels):"
ls -l "$DIR"/*.whl | awk '{printf "  %8.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
printf 'total %.2f MiB; with the tracked tree (%.2f MiB): %.2f MiB of the 64 MiB a call carries\n' \
  "$(echo "$total / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" "$(echo "($total + $tree) / 1048576" | bc -l)"
(( total + tree < 64 * 1048576 )) || { echo "$0: over the 64 MiB a call carries" >&2; exit 1; }
