#!/usr/bin/env bash
# Kernel-configuration sweeps behind the defaults of kernels/triton_stats.choose_config and
# kernels/triton_fused.DEFAULT_CONFIG (kernels and the torch.sum / cuBLAS floors only).
# Usage on a GPU machine: bash benchmarks/sweep.sh [stats|packed|proxy|fused|all]
set -euo pipefail
what=${1:-all}

# configs KEYS VALUES...: cfgs=(--kernel-config k1=v1,k2=v2,... per comma list of VALUES, keys from KEYS)
configs() {
  local keys values spec i c
  IFS=, read -r -a keys <<<"$1"; shift
  cfgs=()
  for c in "$@"; do
    IFS=, read -r -a values <<<"$c"; spec=""
    for i in "${!keys[@]}"; do spec+="${spec:+,}${keys[$i]}=${values[$i]}"; done
    cfgs+=(--kernel-config "$spec")
  done
}
if [[ $what == stats || $what == all ]]; then
  configs block,num_warps,stages 2048,4,3 2048,4,4 1024,4,4 1024,2,4 2048,8,3 4096,4,3 2048,4,5 1024,4,3
  python3 -m benchmarks stats --kernel-only --n 16384 --v 151936 --dtypes bf16 fp32 "${cfgs[@]}" --rep-ms 100 --csv sweep_stats
  cfgs=()
  for sp in 4 8 12 16 24 32; do cfgs+=(--kernel-config "block=2048,num_warps=4,stages=3,split=$sp"); done
  cfgs+=(--kernel-config "block=1024,num_warps=4,stages=4,split=32" --kernel-config "block=1024,num_warps=4,stages=4,split=16")
  python3 -m benchmarks stats --kernel-only --n 256 --v 151936 --dtypes bf16 "${cfgs[@]}" --rep-ms 100 --csv sweep_stats
fi
if [[ $what == packed || $what == all ]]; then
  # bf16 loops with and without PACKED (two logits per int32 word, PTX block max), both batch shapes
  loops=()
  for c in 1024,2,4 512,1,4 1024,1,4 2048,2,4 1024,1,3 2048,2,3 512,1,8; do loops+=("$c,0" "$c,2"); done
  configs block,num_warps,stages,packed "${loops[@]}"
  python3 -m benchmarks stats --kernel-only --n 16384 256 --v 151936 --dtypes bf16 "${cfgs[@]}" --rep-ms 100 --csv sweep_packed
fi
if [[ $what == proxy || $what == all ]]; then
  # the bf16 loop candidates on fewer multiprocessors (--sms: more bandwidth per SM; an H100 on ~92
  # SMs has an H200's bandwidth per SM): which loop stays at the read floor as compute gets scarcer
  configs block,num_warps,stages,packed 2048,2,3,2 1024,1,4,2 512,1,4,2 1024,2,4,2 1024,1,8,2 512,1,8,2 512,1,4,0 1024,2,4,0
  for sms in ${SWEEP_SMS:-132 112 96 88 80 72}; do
    python3 -m benchmarks stats --kernel-only --n 16384 --v 151936 --dtypes bf16 "${cfgs[@]}" --rep-ms 100 --sms "$sms" --csv sweep_proxy
  done
  # fp16 (unpacked loop) on the whole card and at the H200's bandwidth per SM, and N = 256
  configs block,num_warps,stages 1024,2,4 512,1,4 512,1,8 1024,1,4 1024,1,8 2048,4,3
  for sms in 132 96 88; do
    python3 -m benchmarks stats --kernel-only --n 16384 --v 151936 --dtypes fp16 "${cfgs[@]}" --rep-ms 100 --sms "$sms" --csv sweep_fp16
  done
  python3 -m benchmarks stats --kernel-only --n 256 --v 151936 --dtypes fp16 "${cfgs[@]}" --rep-ms 100 --csv sweep_fp16
fi
if [[ $what == fused || $what == all ]]; then
  python3 -m benchmarks fused --kernel-only --n 16384 --h 3584 --rep-ms 300 --csv sweep_fused \
    --kernel-config group_m=4 --kernel-config group_m=16 --kernel-config group_m=32 \
    --kernel-config bk=128,stages=2 --kernel-config bn=256,bm=128,bk=32,stages=5
fi
