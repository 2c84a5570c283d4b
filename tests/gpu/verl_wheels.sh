#!/usr/bin/env bash
# The wheels that verl 0.9.1's main_ppo launch (tests/gpu/launch_verl.py) needs and the device image lacks, packed
# for the device tool's carry limit. Run here (a machine with pip and the package mirror), from the repository root:
#
#     bash tests/gpu/verl_wheels.sh            # -> .devcarry-verl/p1, .devcarry-verl/p2, ... (git-ignored)
#
# The closure: what the `nox -s "verl(release='0.9.1')"` environment holds (the versions the CPU tests and the CPU
# smoke run of launch_verl.py used) minus the device image's packages (the device README's package list), less
# what the launch never imports (megatron-core, wandb, torchcodec, av, qwen-vl-utils, mathruler, pylatexenc,
# py-spy, virtualenv, pytest plug-ins, cryptography; lazy-importer stays: importlib_metadata 10.2, which tensordict
# requires, imports it on Python < 3.15). transformers: the image's 5.17 by default (verl 0.9.1 asks
# for <5.11, but its launch ran on 5.17 in the CPU smoke run and its FSDP engine on the device); TRANSFORMERS=5.10.4
# carries 5.10.4 with the tokenizers 0.22.2 it accepts (the image's 0.23.2 fails its import-time version check),
# 13.4 MiB more. antlr4-python3-runtime 4.9.3 (hydra's parser) exists only as an sdist; pip builds
# its wheel here. The project's own wheel is built here too, from this checkout (verl finds the adapter through
# its installed verl.plugins entry point): rerun this script after changing the library or the adapters.
#
# All wheels go into one tar, split into parts of at most 50 MiB (a call carries 64 MiB with the ~10 MB tree);
# each part is its own carry folder. tests/gpu/launch_verl_README.md has the device calls.
#
# CLOSURE=step (in the environment): the closure of benchmarks/verl_step.py instead, which drives verl's engine in
# one process and never starts a Ray cluster, as plain wheels in ONE carry folder, .devcarry-verl-step/ (DEST
# overrides it), no tar: the same wheels, with ray's wheel less what only a Ray cluster runs (ray/jars/, the Java
# workers' runtime; ray/core/src/ray/gcs/ and ray/core/src/ray/raylet/, the GCS server and raylet executables that
# ray.init starts: 52 of its 76 MiB; zip -d, pip installs the rest as usual) and without the project's wheel (the
# benchmark imports entropy_discriminator and its adapters from the checkout; the wheel's verl.plugins entry point
# adds only verl's start-up check and the trainers' registration, which the benchmark does not use).
# tests/gpu/verl_step_README.md has the device call.
set -euo pipefail

CLOSURE=${CLOSURE:-launch}
case "$CLOSURE" in
    launch) DEST=${DEST:-.devcarry-verl} ;;
    step) DEST=${DEST:-.devcarry-verl-step} ;;
    *) echo "$0: CLOSURE must be launch or step, got $CLOSURE" >&2; exit 2 ;;
esac
PART_BYTES=${PART_BYTES:-50M}
WHEELS=(
    ray==2.60.0 tensordict==0.10.0 TransferQueue==0.1.11 verl==0.9.1 torchdata==0.11.0
    omegaconf==2.3.1 hydra-core==1.3.8 codetiming==1.4.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    msgspec==0.22.0 orjson==3.13.0 nvtx==0.2.17 pyvers==0.1.0 pyzmq==27.3.0
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 sniffio==1.3.1 cachetools==8.0.2 colorful==0.5.8
    google-api-core==2.44.0 google-auth==2.63.0 googleapis-common-protos==1.76.0 proto-plus==1.29.0
    pyasn1==0.6.5 pyasn1_modules==0.4.2 importlib_metadata==10.2.0 lazy-importer==0.1.0
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2
    opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2
    aiohttp-cors==0.8.1 opencensus==0.11.4 opencensus-context==0.1.3 smart_open==9.0.2
)
SDISTS=(antlr4-python3-runtime==4.9.3)
if [[ -n "${TRANSFORMERS:-}" ]]; then
    [[ "$TRANSFORMERS" == 5.10.4 ]] || { echo "TRANSFORMERS: only 5.10.4 is prepared (got $TRANSFORMERS)" >&2; exit 2; }
    WHEELS+=(transformers==5.10.4 tokenizers==0.22.2)
fi

if [[ "$CLOSURE" == step ]]; then
    rm -rf "$DEST"
    mkdir -p "$DEST"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "${WHEELS[@]}"
    python3 -m pip wheel -q --no-deps -w "$DEST" "${SDISTS[@]}"
    zip -q -d "$DEST"/ray-2.60.0-*.whl 'ray/jars/*' 'ray/core/src/ray/gcs/*' 'ray/core/src/ray/raylet/*'
    count=$(ls "$DEST"/*.whl | wc -l)
    if [[ "$count" -ne $(( ${#WHEELS[@]} + ${#SDISTS[@]} )) ]]; then
        echo "expected $(( ${#WHEELS[@]} + ${#SDISTS[@]} )) wheels in $DEST, found $count" >&2
        exit 1
    fi
    (cd "$DEST" && ls -l --block-size=1 *.whl | awk '{printf "%10.2f MiB  %s\n", $5 / 1048576, $9}' | sort -rn) \
        > "$DEST/CLOSURE.txt"
    total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    cat "$DEST/CLOSURE.txt"
    printf 'closure (%d wheels): %.1f MiB; with the tracked tree (%.1f MiB): %.1f MiB of the 64 MiB a call carries\n' \
        "$count" "$(echo "$total / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" \
        "$(echo "($total + $tree) / 1048576" | bc -l)"
    (( total + tree < 64 * 1048576 )) || { echo "$0: over the 64 MiB a call carries" >&2; exit 1; }
    exit 0
fi

rm -rf "$DEST"
mkdir -p "$DEST/whl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST/whl" "${WHEELS[@]}"
python3 -m pip wheel -q --no-deps -w "$DEST/whl" "${SDISTS[@]}" .

count=$(ls "$DEST/whl" | wc -l)
if [[ "$count" -ne $(( ${#WHEELS[@]} + ${#SDISTS[@]} + 1 )) ]]; then
    echo "expected $(( ${#WHEELS[@]} + ${#SDISTS[@]} + 1 )) wheels in $DEST/whl, found $count" >&2
    exit 1
fi
(cd "$DEST/whl" && ls -l --block-size=1 *.whl | awk '{printf "%10.2f MiB  %s\n", $5 / 1048576, $9}' | sort -rn) \
    > "$DEST/CLOSURE.txt"
tar cf "$DEST/wheels.tar" -C "$DEST/whl" .
(cd "$DEST" && sha256sum wheels.tar > wheels.tar.sha256)
split -b "$PART_BYTES" -d -a 1 "$DEST/wheels.tar" "$DEST/wheels.tar.part"
n=0
for part in "$DEST"/wheels.tar.part*; do
    n=$((n + 1))
    mkdir -p "$DEST/p$n"
    mv "$part" "$DEST/p$n/"
done
cp "$DEST/wheels.tar.sha256" "$DEST/p$n/"
rm -rf "$DEST/whl" "$DEST/wheels.tar"

echo "closure ($count wheels, $(du -cb "$DEST"/p*/wheels.tar.part* | tail -1 | awk '{printf "%.1f MiB", $1 / 1048576}')):"
cat "$DEST/CLOSURE.txt"
echo
echo "carry folders (one per device call, in this order; the last one installs):"
du -sh "$DEST"/p*
