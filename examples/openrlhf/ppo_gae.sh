#!/usr/bin/env bash
# GPU only (a Ray cluster of CUDA machines, see below).
# PPO with GAE (actor + critic + reward model) and Clip_B or Clip_V, OpenRLHF 0.11.2, hybrid engine on
# one node of 8 GPUs.  The flags are OpenRLHF's own (python -m openrlhf.cli.train_ppo_ray --help) plus
# --entropy_disc.* (python -m entropy_discriminator.adapters.openrlhf --entropy_disc.help).
#
#   bash examples/openrlhf/ppo_gae.sh clip_b      # Clip_B: clip A<0 tokens with S* < mean - 2.5 std
#   bash examples/openrlhf/ppo_gae.sh clip_v      # Clip_V: clip A<0 tokens with S_c < -2.5 std
#
# Needs a running Ray cluster of CUDA machines (ray start --head --num-gpus 8) whose nodes all have
# this package with OpenRLHF: `pip install -e ".[openrlhf]"` from a clone of this repository, run on
# the CUDA machine (OpenRLHF's flash-attn dependency builds from source; it fails on a CPU-only machine) (the Ray workers import the adapter).
# Environment: MODEL, REWARD_MODEL, DATA, INPUT_KEY, OUT, RAY_DASHBOARD, WANDB_KEY (optional).
# ED_PRINT_ARGS=1 prints the argument list (NUL-separated) instead of launching (used by the tests).
set -euo pipefail

METHOD=${1:-clip_b}
case "$METHOD" in
  clip_b) ED_FLAGS=(--entropy_disc.method clip_b --entropy_disc.mu_low 2.5 --entropy_disc.sides negative) ;;
  clip_v) ED_FLAGS=(--entropy_disc.method clip_v --entropy_disc.mu_low 2.5 --entropy_disc.sides negative) ;;
  *) echo "usage: $0 clip_b|clip_v" >&2; exit 2 ;;
esac

MODEL=${MODEL:-OpenRLHF/Llama-3-8b-sft-mixture}
REWARD_MODEL=${REWARD_MODEL:-OpenRLHF/Llama-3-8b-rm-700k}
DATA=${DATA:-OpenRLHF/prompt-collection-v0.1}
INPUT_KEY=${INPUT_KEY:-context_messages}
OUT=${OUT:-./ckpt/ppo_gae_${METHOD}}

ARGS=(
  --ref.num_nodes 1 --ref.num_gpus_per_node 8
  --reward.num_nodes 1 --reward.num_gpus_per_node 8
  --critic.num_nodes 1 --critic.num_gpus_per_node 8
  --actor.num_nodes 1 --actor.num_gpus_per_node 8
  --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.5
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep --vllm.enforce_eager
  --actor.model_name_or_path "$MODEL"
  --reward.model_name_or_path "$REWARD_MODEL"
  --algo.advantage.estimator gae --algo.advantage.gamma 1.0 --algo.advantage.lambd 0.95
  --algo.kl.init_coef 0.01
  --data.prompt_dataset "$DATA" --data.input_key "$INPUT_KEY" --data.apply_chat_template
  --data.max_len 2048 --rollout.max_new_tokens 1024 --data.max_samples 100000
  --rollout.batch_size 1024 --rollout.n_samples_per_prompt 1 --rollout.temperature 1.0
  --train.batch_size 128 --train.micro_batch_size 4 --train.max_epochs 1 --train.num_episodes 1
  --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
  --actor.adam.lr 5e-7 --critic.adam.lr 9e-6
  --reward.normalize_enable
  --ckpt.output_dir "$OUT" --ckpt.path "$OUT/checkpoints" --ckpt.save_hf
  --logger.tensorboard_dir "$OUT/tensorboard"
  "${ED_FLAGS[@]}"
)
if [[ -n "${WANDB_KEY:-}" ]]; then ARGS+=(--logger.wandb.key "$WANDB_KEY"); fi

if [[ "${ED_PRINT_ARGS:-0}" == 1 ]]; then printf '%s\0' "${ARGS[@]}"; exit 0; fi
command -v ray >/dev/null || { echo "$0: needs Ray (pip install -e \".[openrlhf]\" on a CUDA machine) and a running cluster" >&2; exit 1; }
ray job submit --address="${RAY_DASHBOARD:-http://127.0.0.1:8265}" \
  -- python3 -m entropy_discriminator.adapters.openrlhf "${ARGS[@]}"
