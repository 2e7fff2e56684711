#!/usr/bin/env bash
# The CPU demo as a Ray job: the embedded tiny model on the built-in arithmetic task, fully asynchronous with
# partial rollout (what `make demo` runs, minus the job submission).
# Resources: CPU only: 1 vLLM-CPU engine + 2 DeepSpeed ZeRO-3 ranks (gloo), on a cluster started with
#   RAY_process_group_cleanup_enabled=1 ray start --head --dashboard-host 127.0.0.1
# Usage: bash examples/scripts/train_cpu_demo.sh [--dry_run] [more flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/submit.sh"
# The settings are the tiny CPU preset's (openrlhf_async/presets/tiny_cpu.args); later flags override them.
submit @openrlhf_async/presets/tiny_cpu.args --run_name cpu_demo --runs_dir "$RUNS_DIR" --device cpu \
  --train.async_enable --train.partial_rollout_enable --no-progress "$@"
