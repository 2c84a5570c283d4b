#!/usr/bin/env bash
# GPU only (CUDA GPUs, vLLM and the data; checked before verl starts, see gsm8k_quickstart.sh).
# The paper's setting (Sec. 5, App.): GRPO on DAPO-Math-17k with Qwen2.5-7B-Instruct, train batch 64,
# 16 rollouts, Adam lr 4e-7, sampling temperature 1.0 (0.7 for evaluation), Clip_B or Clip_V on the
# negative-advantage tokens.  GPU only (N_GPUS GPUs, vLLM, the data below; checked before verl starts).
# The paper ran it on 8 GPUs (N_GPUS=8: vLLM tensor parallel 2). The default, one GPU, runs vLLM
# without tensor parallelism and offloads the actor's parameters and optimizer state to the CPU
# (not run at this scale).
# Clip_V runs at the paper's setting for this scale, mu 8.5 with the reference's cap (max_frac 1e-4,
# cap_rule reference), not at the library's default (mu 2.5, no cap; README "Defaults").
#
#   METHOD=clip_b|clip_v (default clip_v), MU (default: 2.5 for clip_b, 8.5 for clip_v)
#   MODEL    default Qwen/Qwen2.5-7B-Instruct
#   TRAIN    DAPO-Math-17k as verl parquet (e.g. verl's recipe/dapo data prep), minus 500 validation questions
#   VAL      the 500 held-out questions (DAPO500) as parquet
#   N_GPUS   default 1
# Extra arguments are passed on to verl as Hydra overrides.
set -euo pipefail

METHOD=${METHOD:-clip_v}
if [[ "$METHOD" == clip_b ]]; then MU=${MU:-2.5}; else MU=${MU:-8.5}; fi
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
TRAIN=${TRAIN:-$HOME/data/dapo-math-17k/train.parquet}
VAL=${VAL:-$HOME/data/dapo-math-17k/dapo500.parquet}
N_GPUS=${N_GPUS:-1}
if (( N_GPUS >= 2 )); then TP=2; OFFLOAD=False; else TP=1; OFFLOAD=True; fi

ARGS=(
    algorithm.adv_estimator=grpo
    data.train_files="$TRAIN"
    data.val_files="$VAL"
    data.train_batch_size=64
    data.max_prompt_length=2048
    data.max_response_length=8192
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.optim.lr=4e-7
    actor_rollout_ref.actor.optim.betas=[0.9,0.999]
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.fsdp_config.param_offload="$OFFLOAD"
    actor_rollout_ref.actor.fsdp_config.optimizer_offload="$OFFLOAD"
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=16
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.temperature=0.7
    actor_rollout_ref.rollout.val_kwargs.n=8
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.tensor_model_parallel_size="$TP"
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768
    algorithm.use_kl_in_reward=False
    trainer.logger=[console]
    trainer.project_name=entropy-discriminator
    trainer.experiment_name="qwen2.5-7b-dapo-$METHOD-mu$MU"
    trainer.n_gpus_per_node="$N_GPUS"
    trainer.nnodes=1
    trainer.save_freq=50
    trainer.test_freq=10
    trainer.total_epochs=1
    # the adapter (needs `pip install -e ".[verl]"` from this repository)
    trainer.v1.trainer_mode=entropy_disc
    +entropy_disc.method="$METHOD"
    +entropy_disc.mu_low="$MU"
    +entropy_disc.sides=negative
)
if [[ "$METHOD" == clip_v ]]; then ARGS+=(+entropy_disc.max_frac=1e-4 +entropy_disc.cap_rule=reference); fi

"${PYTHON:-python3}" "$(dirname "$0")/_preflight.py" "$N_GPUS" "$TRAIN" "$VAL" \
    "convert DAPO-Math-17k to verl parquet (e.g. verl's recipe/dapo data preparation) and set TRAIN / VAL" -- "${ARGS[@]}" "$@" >&2

PYTHONUNBUFFERED=1 exec "${PYTHON:-python3}" -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
