#!/usr/bin/env bash
# GPU only (a Ray cluster of CUDA machines, see below).
# GRPO (group_norm advantages, no critic) with a rule-based reward function and Clip_B or Clip_V,
# OpenRLHF 0.11.2, hybrid engine (actor, reference and vLLM colocated) on N_GPUS GPUs of one node
# (default 1, with Qwen2.5-0.5B-Instruct; the 8-GPU setting: N_GPUS=8 MODEL=Qwen/Qwen2.5-7B-Instruct).  The flags are OpenRLHF's own
# (python -m openrlhf.cli.train_ppo_ray --help) plus --entropy_disc.*
# (python -m entropy_discriminator.adapters.openrlhf --entropy_disc.help).
#
#   bash examples/openrlhf/grpo.sh clip_b      # Clip_B: clip A<0 tokens with S* < mean - 2.5 std
#   bash examples/openrlhf/grpo.sh clip_v      # Clip_V: clip A<0 tokens with S_c < -2.5 std
#
# Needs a running Ray cluster of CUDA machines (ray start --head --num-gpus N_GPUS) whose nodes all have
# this package with OpenRLHF: `pip install -e ".[openrlhf]"` from a clone of this repository, run on
# the CUDA machine (OpenRLHF's flash-attn dependency builds from source; it fails on a CPU-only machine), and REWARD_FN: a Python file defining OpenRLHF's
# reward_func(queries, prompts, labels) (see OpenRLHF's README, "reward function").
# Environment: N_GPUS, MODEL, REWARD_FN, DATA, INPUT_KEY, LABEL_KEY, OUT, RAY_DASHBOARD, WANDB_KEY (optional).
# ED_PRINT_ARGS=1 prints the argument list (NUL-separated) instead of launching (used by the tests).
set -euo pipefail

METHOD=${1:-clip_b}
case "$METHOD" in
  clip_b) ED_FLAGS=(--entropy_disc.method clip_b --entropy_disc.mu_low 2.5 --entropy_disc.sides negative) ;;
  clip_v) ED_FLAGS=(--entropy_disc.method clip_v --entropy_disc.mu_low 2.5 --entropy_disc.sides negative) ;;
  *) echo "usage: $0 clip_b|clip_v" >&2; exit 2 ;;
esac
# The KL loss below (--algo.kl.use_loss) is not multiplied by the advantage, so zeroing a clipped
# token's advantage (mask_mode zero_pg) would leave it KL gradient: drop_token removes it from
# action_mask, and so from every term (the launcher refuses zero_pg here).
ED_FLAGS+=(--entropy_disc.mask_mode drop_token)

N_GPUS=${N_GPUS:-1}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
REWARD_FN=${REWARD_FN:-./reward_func.py}
DATA=${DATA:-your/math-prompts}
INPUT_KEY=${INPUT_KEY:-prompt}
LABEL_KEY=${LABEL_KEY:-answer}
OUT=${OUT:-./ckpt/grpo_${METHOD}}

ARGS=(
  --ref.num_nodes 1 --ref.num_gpus_per_node "$N_GPUS"
  --actor.num_nodes 1 --actor.num_gpus_per_node "$N_GPUS"
  --vllm.num_engines "$N_GPUS" --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.6
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep --vllm.enforce_eager
  --actor.model_name_or_path "$MODEL"
  --reward.remote_url "$REWARD_FN"
  --algo.advantage.estimator group_norm
  --algo.kl.use_loss --algo.kl.init_coef 0.001 --algo.kl.estimator k3
  --data.prompt_dataset "$DATA" --data.input_key "$INPUT_KEY" --data.label_key "$LABEL_KEY"
  --data.apply_chat_template
  --data.max_len 4096 --rollout.max_new_tokens 3072 --data.max_samples 100000
  --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --rollout.temperature 1.0
  --train.batch_size 1024 --train.micro_batch_size 4 --train.max_epochs 1 --train.num_episodes 1
  --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
  --actor.adam.lr 1e-6 --actor.entropy_coef 0
  --ckpt.output_dir "$OUT" --ckpt.path "$OUT/checkpoints" --ckpt.save_hf
  --logger.tensorboard_dir "$OUT/tensorboard"
  "${ED_FLAGS[@]}"
)
if [[ -n "${WANDB_KEY:-}" ]]; then ARGS+=(--logger.wandb.key "$WANDB_KEY"); fi

if [[ "${ED_PRINT_ARGS:-0}" == 1 ]]; then printf '%s\0' "${ARGS[@]}"; exit 0; fi
command -v ray >/dev/null || { echo "$0: needs Ray (pip install -e \".[openrlhf]\" on a CUDA machine) and a running cluster" >&2; exit 1; }
ray job submit --address="${RAY_DASHBOARD:-http://127.0.0.1:8265}" \
  -- python3 -m entropy_discriminator.adapters.openrlhf "${ARGS[@]}"
