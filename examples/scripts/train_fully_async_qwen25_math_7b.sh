#!/usr/bin/env bash
# Fully asynchronous DAPO on Qwen2.5-Math-7B (4096-token context) with DAPO-Math-17k, evaluated on AIME 2024.
# Groups stream from the engines; the generator may run half a sync window ahead (staleness threshold 0.5);
# each optimizer step takes 4 batches, weights sync every 4 steps, and episodes in flight at a sync continue on
# the new weights (partial rollout). Running groups carry over between batches rather than being aborted, so all
# 64 groups (--rollout.vllm_generate_batch_size) stay in flight; more keeps 8 engines' batches fuller (each takes
# 4 x --vllm.max_num_seqs episodes), at the price of older carried groups.
# The loss: one optimizer step per 4 batches (--train.batch_size 2048 = 4 x 32 x 16), so the PPO clip (0.2 / 0.28)
# is idle and the samples' staleness is bounded by token-level TIS against vLLM's log-probs (clip 0..2); a smaller
# --train.batch_size makes several clipped updates per step, --actor.proximal_policy rollout clips against the
# sampler itself.
# Resources: 16 GPUs (2 nodes x 8): 8 vLLM engines (tensor parallel 1) + 8 DeepSpeed ZeRO-3 trainer ranks.
# Data: as in train_dapo_qwen3_8b_async.sh.
# Network: export NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME, NCCL_DEBUG, ... before running it: submit.sh
# hands them to every rank and engine on every node. Checkpoints (--ckpt.path) and the final model must be on storage
# every node mounts at the same path (the run checks it at start).
# Usage: bash examples/scripts/train_fully_async_qwen25_math_7b.sh [--dry_run] [more flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/submit.sh"
submit \
  --run_name fully_async_qwen25_math_7b --runs_dir "$RUNS_DIR" --device cuda \
  --train.async_enable --train.partial_rollout_enable --ckpt.output_dir "{run_dir}/final_hf" --ckpt.path "{run_dir}/ckpt" \
  --train.staleness_threshold 0.5 --train.trigger_parameter_sync_step 4 --train.require_batches 4 \
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen2.5-Math-7B}" \
  --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.85 \
  --actor.num_nodes 1 --actor.num_gpus_per_node 8 --ds.zero_stage 3 --ds.param_dtype bf16 \
  --data.prompt_dataset "$DATA_DIR/dapo-math-17k.jsonl" --eval.dataset "$DATA_DIR/aime24.jsonl" \
  --data.input_key prompt --data.label_key label --data.apply_chat_template \
  --data.max_len 4096 --rollout.max_new_tokens 3072 \
  --rollout.batch_size 32 --rollout.n_samples_per_prompt 16 --rollout.temperature 1.0 --train.batch_size 2048 \
  --rollout.vllm_generate_batch_size 64 --vllm.enable_prefix_caching \
  --algo.advantage.estimator group_norm --algo.dynamic_filtering_enable --algo.kl.init_coef 0 \
  --algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip \
  --algo.advantage.is_correction_threshold 0 2 \
  --actor.eps_clip_low_high 0.2 0.28 --actor.adam.lr 1e-6 --actor.adam.weight_decay 0.1 --actor.lr_scheduler constant \
  --reward.overlong_buffer_len 512 --reward.overlong_penalty_factor 1.0 \
  --actor.gradient_checkpointing_enable --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 \
  --ds.packing_samples --train.max_steps 500 --ckpt.save_steps 20 \
  --eval.steps 10 --eval.n_samples_per_prompt 32 --eval.temperature 1.0 --eval.top_p 0.7 \
  "$@"
