#!/usr/bin/env bash
# Async DAPO on Qwen3-8B-Base with DAPO-Math-17k, evaluated on AIME 2024 (mean@32, pass@32).
# Resources: 16 GPUs (2 nodes x 8): 8 vLLM engines (tensor parallel 1) + 8 DeepSpeed ZeRO-3 trainer ranks.
# Data: python -m openrlhf_async.cli.prepare_data --dataset dapo-math-17k --input <DAPO-Math-17k> --output $DATA_DIR
#       python -m openrlhf_async.cli.prepare_data --dataset aime24 --input <AIME-2024> --output $DATA_DIR
# DAPO's settings: 16 samples per prompt, clip 0.2 / 0.28, token-level loss, dynamic sampling, overlong buffer 4096
# within a 20480-token response budget (penalty 1.0), lr 1e-6 (constant), and DAPO's shape of a step: a rollout
# batch of 512 kept prompts (8192 samples) trained in 16 mini batches of 512 samples, 16 optimizer steps each
# clipped at 0.2 / 0.28 against the policy before the first (--actor.proximal_policy recompute), the ratio weighted
# by token-level TIS against vLLM's log-probs (clip 0..2), which also bounds the one batch of staleness of async.
# Every setting is an OpenRLHF 0.11.2 flag or one of this project's.
# Network: export NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME, NCCL_DEBUG, ... before running it: submit.sh
# hands them to every rank and engine on every node. Checkpoints (--ckpt.path) and the final model must be on storage
# every node mounts at the same path (the run checks it at start).
# Usage: bash examples/scripts/train_dapo_qwen3_8b_async.sh [--dry_run] [more flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/submit.sh"
submit \
  --run_name dapo_qwen3_8b_async --runs_dir "$RUNS_DIR" --device cuda --train.async_enable --train.async_queue_size 1 \
  --ckpt.output_dir "{run_dir}/final_hf" --ckpt.path "{run_dir}/ckpt" \
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen3-8B-Base}" \
  --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.85 \
  --actor.num_nodes 1 --actor.num_gpus_per_node 8 --ds.zero_stage 3 --ds.param_dtype bf16 \
  --data.prompt_dataset "$DATA_DIR/dapo-math-17k.jsonl" --eval.dataset "$DATA_DIR/aime24.jsonl" \
  --data.input_key prompt --data.label_key label --data.apply_chat_template \
  --data.max_len 22528 --rollout.max_new_tokens 20480 \
  --rollout.batch_size 512 --rollout.n_samples_per_prompt 16 --rollout.temperature 1.0 --train.batch_size 512 \
  --rollout.vllm_generate_batch_size 64 --vllm.enable_prefix_caching \
  --algo.advantage.estimator group_norm --algo.dynamic_filtering_enable --algo.kl.init_coef 0 \
  --algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip \
  --algo.advantage.is_correction_threshold 0 2 \
  --actor.eps_clip_low_high 0.2 0.28 --actor.adam.lr 1e-6 --actor.adam.weight_decay 0.1 --actor.lr_scheduler constant \
  --reward.overlong_buffer_len 4096 --reward.overlong_penalty_factor 1.0 \
  --actor.gradient_checkpointing_enable --train.dynamic_batch_enable --train.max_tokens_per_gpu 24576 \
  --ds.packing_samples --train.max_steps 2000 --ckpt.save_steps 20 \
  --eval.steps 10 --eval.n_samples_per_prompt 32 --eval.temperature 1.0 --eval.top_p 0.7 \
  "$@"
