#!/usr/bin/env bash
# GRPO on GSM8K (verl's quick-start) with Clip_V (S_c below -8.5 std, negative-advantage tokens, at most 1e-4 of the tokens).
# Usage: bash grpo_clip_v.sh [extra Hydra overrides]   (env: MODEL, DATA_DIR, N_GPUS; see gsm8k_quickstart.sh)
# The quick-start's KL loss (use_kl_loss=True) acts on every token, so the mask acts as drop_token
# (clipped tokens leave every loss term; logged at start-up). Other options: +entropy_disc.sides=both.
set -euo pipefail
ESTIMATOR=grpo exec bash "$(dirname "$0")/gsm8k_quickstart.sh" +entropy_disc.method=clip_v +entropy_disc.mu_low=8.5 +entropy_disc.max_frac=1e-4 "$@"
