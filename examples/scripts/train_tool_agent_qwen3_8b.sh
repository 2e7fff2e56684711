#!/usr/bin/env bash
# Multi-turn tool agent: the model may run Python (sandboxed: no network, bounded time and memory) before it
# answers; agents/python_tool_multi_turn.py runs each code block and returns its output as the next observation,
# then scores the final boxed answer. Observation tokens are masked out of the loss.
# The loss: one optimizer step per batch of 32 prompts x 8 samples (so the PPO clip is idle: add a smaller
# --train.batch_size for several clipped updates), token-level TIS against vLLM's log-probs on the model's tokens.
# Resources: 8 GPUs (1 node): 4 vLLM engines (tensor parallel 1) + 4 DeepSpeed ZeRO-3 trainer ranks.
# Data: prepare_data --dataset dapo-math-17k --instruction "Use Python when it helps (write a \`\`\`python block);
#       put your final answer within \\boxed{}." and aime24 likewise, into a folder of their own (the DAPO scripts'
#       files have the same names without the instruction), given as DATA_DIR: docs/DATA.md.
# Network: export NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME, NCCL_DEBUG, ... before running it: submit.sh
# hands them to every rank and engine on every node. Checkpoints (--ckpt.path) and the final model must be on storage
# every node mounts at the same path (the run checks it at start).
# Usage: bash examples/scripts/train_tool_agent_qwen3_8b.sh [--dry_run] [more flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/submit.sh"
submit \
  --run_name tool_agent_qwen3_8b --runs_dir "$RUNS_DIR" --device cuda --train.async_enable \
  --ckpt.output_dir "{run_dir}/final_hf" --ckpt.path "{run_dir}/ckpt" \
  --actor.model_name_or_path "${MODEL:-Qwen/Qwen3-8B}" \
  --train.agent_func_path agents/python_tool_multi_turn.py --agent.max_steps 4 --agent.step_timeout 30 \
  --vllm.num_engines 4 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.85 \
  --actor.num_nodes 1 --actor.num_gpus_per_node 4 --ds.zero_stage 3 --ds.param_dtype bf16 \
  --data.prompt_dataset "$DATA_DIR/dapo-math-17k.jsonl" --eval.dataset "$DATA_DIR/aime24.jsonl" \
  --data.input_key prompt --data.label_key label --data.apply_chat_template \
  --data.max_len 10240 --rollout.max_new_tokens 8192 \
  --rollout.batch_size 32 --rollout.n_samples_per_prompt 8 --rollout.temperature 1.0 --train.batch_size 256 \
  --rollout.vllm_generate_batch_size 64 --vllm.enable_prefix_caching \
  --algo.advantage.estimator group_norm --algo.dynamic_filtering_enable --algo.kl.init_coef 0 \
  --algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip \
  --algo.advantage.is_correction_threshold 0 2 \
  --actor.eps_clip_low_high 0.2 0.28 --actor.adam.lr 1e-6 --actor.lr_scheduler constant \
  --actor.gradient_checkpointing_enable --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 \
  --ds.packing_samples --train.max_steps 500 --ckpt.save_steps 20 \
  --eval.steps 10 --eval.n_samples_per_prompt 16 --eval.temperature 1.0 --eval.top_p 0.7 \
  "$@"
