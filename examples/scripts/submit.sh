# Sourced by the launch scripts beside it: `submit FLAGS... "$@"` submits the run as a Ray job, or with --dry_run
# among the flags resolves and validates the whole configuration here and prints it, starting nothing.
#   RAY_ADDRESS   the cluster's dashboard (default http://127.0.0.1:8265)
#   PYTHON        the interpreter for --dry_run and for the job's runtime_env (default: the project's environment,
#                 .venv/bin/python, where `make install` made one; else python3)
#   NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME, NCCL_DEBUG, ... (NCCL_*, GLOO_*, TORCH_NCCL_*, UCX_*,
#                 TP_SOCKET_IFNAME): exported here, they reach every rank and engine on every node
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA_DIR="${DATA_DIR:-$REPO/data}"   # where prepare_data wrote the datasets
RUNS_DIR="${RUNS_DIR:-$REPO/runs}"   # run folders (metrics, checkpoints): an absolute path the head node can write
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

submit() {
  cd "$REPO"
  for arg in "$@"; do
    if [[ "$arg" == "--dry_run" ]]; then
      exec "$PYTHON" -m openrlhf_async.cli.train_async "$@"
    fi
  done
  # The repo is the job's working directory on every node, so relative agent paths resolve there too; the network
  # variables exported here (NCCL_*, GLOO_SOCKET_IFNAME, ...) go to every actor on every node.
  local runtime_env
  runtime_env="$("$PYTHON" -c 'import sys; from openrlhf_async.utils.cluster import submit_runtime_env
print(submit_runtime_env(sys.argv[1]))' "$REPO")"
  exec ray job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" --runtime-env-json "$runtime_env" \
    -- python3 -m openrlhf_async.cli.train_async "$@"
}
