"""A run on a Ray cluster of several nodes: what every actor must find in its environment, the trainer ranks placed
before the engines, and the folders the ranks write checked to be the driver's own.

A raylet hands its workers the environment of whoever started it (`ray start` on that node), not the driver's: what
the run's actors need from the driver travels in a runtime_env, which Ray sets in the worker process on any node."""

import json
import os
import uuid

# Of a GPU, per model sharing it (an engine worker, a trainer or critic rank, a reward model: as OpenRLHF asks Ray).
HYBRID_GPU_SHARE = 0.2

# Network settings of NCCL, gloo and torch.distributed that a user sets where the driver starts (the interface to use,
# the InfiniBand adapters, debug output): every rank and engine needs the same.
NETWORK_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "UCX_", "NVSHMEM_")
NETWORK_NAMES = ("TP_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG")


def network_env(environ=None) -> dict:
    """The network variables of this process's environment (or of environ)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(NETWORK_PREFIXES) or k in NETWORK_NAMES}


def submit_runtime_env(repo: str) -> str:
    """The runtime_env (JSON) of `ray job submit` in examples/scripts/submit.sh: the repo as every node's working
    directory (relative agent paths resolve there too), and the network variables of the submitting shell, which the
    job's actors would otherwise never see."""
    env, network = {"working_dir": repo, "excludes": [".git", ".venv", "runs", "data"]}, network_env()
    if network:
        env["env_vars"] = network
    return json.dumps(env)


def connect() -> None:
    """Join the Ray cluster at RAY_ADDRESS (or start one here) with the driver's network variables in the job's
    runtime_env, so every actor of the run gets them, on any node. Variables a `ray job submit` runtime_env sets
    already reach every actor (and Ray refuses to merge one twice)."""
    import ray

    if ray.is_initialized():
        return
    submitted = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env") or {}
    env = {k: v for k, v in network_env().items() if k not in (submitted.get("env_vars") or {})}
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env} if env else None)


def group_nodes(group) -> set:
    """The ids of the nodes a (ready) placement group's bundles are on."""
    import ray

    return set(ray.util.placement_group_table(group)["bundles_to_node_id"].values())


def folders_ranks_write(cfg) -> list:
    """(flag, folder, what the ranks write there) for the folders the trainer ranks write and the driver reads."""
    found = [("--ckpt.output_dir", cfg.output_dir, "rank 0 writes the final model there on its own node")]
    if cfg.ckpt.save_steps > 0 or cfg.ckpt.load_enable:
        found.append(("--ckpt.path", cfg.ckpt_path, "each rank writes its DeepSpeed shards there on its own node, "
                                                    "so a resume would find no DeepSpeed state"))
    return found


def check_shared_folders(cfg, nodes: set) -> None:
    """Ranks on a node other than the driver's must see the folders they write as the driver sees them (one shared
    file system): the driver writes a file with a random token in each and a task on each such node reads it back.
    ConfigError naming the flag otherwise."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from openrlhf_async.errors import ConfigError
    from openrlhf_async.utils.ray_utils import get_all

    others = sorted(set(nodes) - {ray.get_runtime_context().get_node_id()})
    if not others:
        return
    token = uuid.uuid4().hex
    markers, created = [], []
    try:
        for flag, folder, why in folders_ranks_write(cfg):
            created += _make_folder(folder)
            marker = os.path.join(folder, f".shared_check_{token}")
            with open(marker, "w") as f:
                f.write(token)
            markers.append((flag, folder, why, marker))
        read = ray.remote(_reads_token)
        seen = get_all([read.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                        .remote([m[3] for m in markers], token) for node in others], timeout_s=300)
    finally:
        for *_, marker in markers:
            try:
                os.remove(marker)
            except OSError:
                pass
        for folder in reversed(created):  # the run creates its folders when it writes them
            try:
                os.rmdir(folder)
            except OSError:
                pass
    for ip, visible in seen:
        for (flag, folder, why, _), ok in zip(markers, visible):
            if not ok:
                raise ConfigError(f"{flag} {folder}: trainer ranks run on node {ip}, which does not see this folder "
                                  f"as the driver does ({why}); give a folder on storage every node mounts at the same "
                                  "path (NFS, a cluster file system)")


def _make_folder(folder: str) -> list:
    """Create folder with its missing parents; returns those it created, outermost first."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    return missing[::-1]


def _reads_token(paths: list, token: str) -> tuple:
    """(this node's IP, for each path whether it holds token): run on a node by check_shared_folders."""
    import ray

    def holds(path):
        try:
            with open(path) as f:
                return f.read() == token
        except OSError:
            return False

    return ray.util.get_node_ip_address(), [holds(p) for p in paths]
