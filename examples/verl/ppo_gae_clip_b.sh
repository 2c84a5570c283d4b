#!/usr/bin/env bash
# GPU only (CUDA GPUs, vLLM and the data; checked before verl starts, see gsm8k_quickstart.sh).
# PPO with GAE on GSM8K (verl's quick-start) with Clip_B (S* outside mean - 2.5 std, negative-advantage tokens).
# Usage: bash ppo_gae_clip_b.sh [extra Hydra overrides]   (env: MODEL, DATA_DIR, N_GPUS; see gsm8k_quickstart.sh)
# Other options: +entropy_disc.mask_mode=drop_token (reference behaviour), +entropy_disc.sides=both.
set -euo pipefail
ESTIMATOR=gae exec bash "$(dirname "$0")/gsm8k_quickstart.sh" +entropy_disc.method=clip_b +entropy_disc.mu_low=2.5 "$@"
