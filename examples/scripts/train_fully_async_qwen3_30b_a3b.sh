#!/usr/bin/env bash
# Fully asynchronous DAPO on Qwen3-30B-A3B, a mixture of experts (48 layers of 128 experts, 8 routed per token:
# 30.5B parameters, 3.3B active), with DAPO-Math-17k, evaluated on AIME 2024 (4096-token context).
# As train_fully_async_qwen25_math_7b.sh: groups stream from the engines, the generator may run half a sync window
# ahead, each optimizer step takes 4 batches, weights sync every 4 steps and episodes in flight at a sync continue on
# the new weights (partial rollout), with token-level TIS against vLLM's log-probs (clip 0..2).
# The experts sync under the checkpoint's per-expert names (experts.{e}.gate_proj/up_proj/down_proj), which vLLM
# loads into its fused expert tensors. Routing replay (on by default): the trainer routes each token to the experts
# vLLM routed it to, recorded by a hook on vLLM's routers that CUDA graphs do not run, hence --vllm.enforce_eager
# (slower decoding; --no-actor.routing_replay instead keeps the graphs and trains on the trainer's own routing).
# Resources: 32 GPUs (4 nodes x 8): 16 DeepSpeed ZeRO-3 trainer ranks (the 30.5B parameters' fp32 Adam states
# split 16 ways: about 23 GB a rank) + 8 vLLM engines of tensor parallel 2 (61 GB of bf16 weights on two GPUs each).
# `--dry_run --plan.device_memory_gb 80` prints the memory plan of one rank and one engine GPU.
# Data: as in train_dapo_qwen3_8b_async.sh. Network and storage: as in train_fully_async_qwen25_math_7b.sh.
# Usage: bash examples/scripts/train_fully_async_qwen3_30b_a3b.sh [--dry_run] [more flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/submit.sh"
submit \
  --run_name fully_async_qwen3_30b_a3b --runs_dir "$RUNS_DIR" --device cuda \
  --train.async_enable --train.partial_rollout_enable --ckpt.output_dir "{run_dir}/final_hf" --ckpt.path "{run_dir}/ckpt" \
  --train.staleness_threshold 0.5 --train.trigger_parameter_sync_step 4 --train.require_batches 4 \
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen3-30B-A3B}" \
  --vllm.num_engines 8 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.85 --vllm.enforce_eager \
  --actor.num_nodes 2 --actor.num_gpus_per_node 8 --ds.zero_stage 3 --ds.param_dtype bf16 \
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
