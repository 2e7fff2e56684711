"""Weight sync: trainer rank 0 broadcasts the policy, bucket by bucket, to every vLLM worker over one
stateless process group (NCCL on GPU, gloo on CPU); the engines then tag new tokens with the new version."""

import math
import time

import torch

from openrlhf_async.utils.ray_utils import get_all


def plan_buckets(named_shapes: list, bucket_bytes: int) -> list:
    """Group [(name, dtype, shape)] into buckets of at most bucket_bytes (one dtype per bucket), in order."""
    buckets, current, size = [], [], 0
    for name, dtype, shape in named_shapes:
        nbytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size() * math.prod(shape)
        if current and (size + nbytes > bucket_bytes or current[0][1] != dtype):
            buckets.append(current)
            current, size = [], 0
        current.append((name, dtype, tuple(shape)))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class WeightSync:
    def __init__(self, policy, engines: list, cfg):
        import ray

        self.policy, self.engines = policy, list(engines)  # engines: the live ones, those in the group
        self.tp, self.backend = cfg.vllm.tensor_parallel_size, cfg.backend
        self.buckets = plan_buckets(ray.get(policy.actors[0].named_shapes.remote()),
                                    cfg.train.weight_sync_bucket_mb << 20)
        self._connect()
        self.version = 0
        self.engine_version = 0  # the oldest version any engine reported loading

    def _connect(self) -> None:
        """Form the group of trainer rank 0 and every worker of self.engines."""
        import ray

        rank0 = self.policy.actors[0]
        host, port = ray.get(rank0.weight_sync_address.remote())
        world = 1 + len(self.engines) * self.tp
        # Every member must join at once: the rendezvous blocks until the whole group is there.
        get_all([rank0.init_weight_sync_group.remote(host, port, world, self.backend)] + [
            e.init_weight_sync_group.remote(host, port, 1 + i * self.tp, world, self.backend)
            for i, e in enumerate(self.engines)
        ])

    def drop_dead_engines(self) -> int:
        """Leave out engines whose actor died (the rollout reroutes their groups): a new group is formed with the
        live ones, since a collective with a dead member fails. Returns how many were dropped."""
        from openrlhf_async.rollout.engine import live_versions

        alive = live_versions(self.engines)
        dropped = len(self.engines) - len(alive)
        if dropped:
            self.engines = [self.engines[i] for i in sorted(alive)]
            self._connect()
        return dropped

    def sync(self, pause_mode: str = "wait", version: int = None) -> float:
        """Broadcast the current policy to every engine as the next version (or the given one: a resumed run's);
        returns the seconds it took. The engines pause meanwhile: "wait" lets running requests finish on the old
        weights first, "keep" freezes them (partial rollout)."""
        start = time.perf_counter()
        self.drop_dead_engines()
        self.version = self.version + 1 if version is None else version
        results = get_all(self.policy.call("broadcast_weights", self.buckets)
                          + [e.receive_weights.remote(self.buckets, self.version, pause_mode) for e in self.engines])
        self.engine_version = min(results[len(self.policy.actors):])
        return time.perf_counter() - start
