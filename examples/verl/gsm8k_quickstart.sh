#!/usr/bin/env bash
# GPU only (CUDA GPUs, vLLM and the data; checked before verl starts, details below).
# verl's GSM8K quick-start (docs: "Quickstart: PPO training on GSM8K"), parameterised so that the
# variant scripts beside this file only add their own overrides. Not meant to be run by itself.
#
# GPU only: needs N_GPUS CUDA GPUs, vLLM and the GSM8K parquet files, checked before verl starts
# (it stops at once with what is missing). Prepare the data once, from a clone of verl 0.9.1:
#     python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k
#
#   ESTIMATOR=grpo|gae   advantage estimator (GAE also trains verl's critic)
#   MODEL                HF id or local path (default Qwen/Qwen2.5-0.5B-Instruct)
#   DATA_DIR             where verl's examples/data_preprocess/gsm8k.py wrote train/test.parquet
#   N_GPUS               GPUs on this node (default 1)
#   PYTHON               interpreter (default python3)
# Extra arguments are passed on to verl as Hydra overrides.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
N_GPUS=${N_GPUS:-1}
ESTIMATOR=${ESTIMATOR:-grpo}

ARGS=(
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length=512
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.logger=console
    trainer.val_before_train=False
    trainer.n_gpus_per_node="$N_GPUS"
    trainer.nnodes=1
    trainer.save_freq=10
    trainer.test_freq=10
    trainer.total_epochs=15
    # the adapter: verl's sync trainer with Clip_B / Clip_V (needs `pip install -e ".[verl]"` from this repository)
    trainer.v1.trainer_mode=entropy_disc
)
if [[ "$ESTIMATOR" == grpo ]]; then
    ARGS+=(
        algorithm.adv_estimator=grpo
        actor_rollout_ref.rollout.n=5
        actor_rollout_ref.actor.use_kl_loss=True
        actor_rollout_ref.actor.kl_loss_coef=0.001
    )
else
    ARGS+=(
        algorithm.adv_estimator=gae
        critic.optim.lr=1e-5
        critic.model.path="$MODEL"
        critic.ppo_micro_batch_size_per_gpu=4
    )
fi

"${PYTHON:-python3}" "$(dirname "$0")/_preflight.py" "$N_GPUS" "$DATA_DIR/train.parquet" "$DATA_DIR/test.parquet" \
    "prepare GSM8K with verl's examples/data_preprocess/gsm8k.py --local_dir $DATA_DIR (or set DATA_DIR)" -- "${ARGS[@]}" "$@" >&2
PYTHONUNBUFFERED=1 exec "${PYTHON:-python3}" -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
