#!/usr/bin/env bash
# GPU only (CUDA GPUs, vLLM and the data; checked before verl starts, see gsm8k_quickstart.sh).
# GRPO on GSM8K (verl's quick-start) with Clip_V (S_c below -2.5 std, negative-advantage tokens; the library's default).
# Usage: bash grpo_clip_v.sh [extra Hydra overrides]   (env: MODEL, DATA_DIR, N_GPUS; see gsm8k_quickstart.sh)
# The quick-start's KL loss (use_kl_loss=True) acts on every token, so the mask acts as drop_token
# (clipped tokens leave every loss term; logged at start-up). Other options: +entropy_disc.sides=both.
set -euo pipefail
ESTIMATOR=grpo exec bash "$(dirname "$0")/gsm8k_quickstart.sh" +entropy_disc.method=clip_v +entropy_disc.mu_low=2.5 "$@"
