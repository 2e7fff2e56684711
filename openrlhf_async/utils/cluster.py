"""A run on a Ray cluster of several nodes: what every actor must find in its environment, and the trainer ranks
placed before the engines.

A raylet hands its workers the environment of whoever started it (`ray start` on that node), not the driver's: what
the run's actors need from the driver travels in a runtime_env, which Ray sets in the worker process on any node."""

import json
import os
import threading
import time

# Network settings of NCCL, gloo and torch.distributed that a user sets where the driver starts (the interface to use,
# the InfiniBand adapters, debug output): every rank and engine needs the same.
NETWORK_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "UCX_", "NVSHMEM_")
NETWORK_NAMES = ("TP_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG")


def network_env(environ=None) -> dict:
    """The network variables of this process's environment (or of environ)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(NETWORK_PREFIXES) or k in NETWORK_NAMES}


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


class PlacedFirst:
    """start() (PolicyGroup: it creates the trainer ranks' placement group, then waits for the ranks to load) in a
    thread, and nodes() waits only until that placement group is placed. What starts after it (the engines) takes the
    room it left: started together, the engines' groups could take part of a node first and split the ranks."""

    def __init__(self, start):
        import ray

        self.known = set(ray.util.placement_group_table())
        self.value = self.error = None
        self.thread = threading.Thread(target=self._run, args=(start,), daemon=True)
        self.thread.start()

    def _run(self, start) -> None:
        try:
            self.value = start()
        except BaseException as e:  # raised by result()
            self.error = e

    def nodes(self, poll_s: float = 0.2) -> set:
        """The ids of the nodes the placement group start() created was placed on."""
        import ray

        while True:
            for group_id, info in ray.util.placement_group_table().items():
                if group_id not in self.known and info["state"] == "CREATED":
                    return set(info["bundles_to_node_id"].values())
            if not self.thread.is_alive():
                self.result()
                raise RuntimeError("the trainer started without a placement group")
            time.sleep(poll_s)

    def result(self):
        """What start() returned (or raised), once it is done."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


def group_nodes(group) -> set:
    """The ids of the nodes a (ready) placement group's bundles are on."""
    import ray

    return set(ray.util.placement_group_table(group)["bundles_to_node_id"].values())
