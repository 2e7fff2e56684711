"""The hybrid engine (OpenRLHF's colocate_all_models in sync mode): the vLLM engines share the trainer ranks' devices
(trainer_placement_group's bundles, each engine's workers beside the ranks of a node's bundles: rollout/engine.py
hybrid_engine_bundles), and a step hands the devices back
and forth in one order, so that the engines' and the trainer's full states are never held at once:

    generate -> engines sleep -> trainer states reloaded -> train -> states offloaded -> engines wake their weights
    -> the new weights, a bucket at a time -> finish_weight_update(version) -> engines wake their KV cache

(--vllm.enable_sleep: vLLM's sleep, level 1; --ds.enable_sleep: DeepSpeed's offload_states/reload_states.)

The weights go through vLLM's weight-transfer API as in the split layout, from the rank on each engine's devices
rather than over a group, through this project's engine (rollout/weight_transfer.py): on cpu its "shm" transport, a
shared-memory file per such rank that it writes a bucket at a time and its engine maps; on cuda its "ipc" transport,
the rank's CUDA IPC handles per parameter, each bucket's copies dropped once the engines loaded it (not run here: no
GPU in CI; benchmarks/gpu_e2e.py runs it on one). Either way
every rank gathers each bucket (a ZeRO-3 collective), the version moves at finish only, after the last bucket, and
an engine that fails or hangs on the way is dropped (the fleet restarts one in its bundles) with the transfer made
again to the others."""

import time

from openrlhf_async.rollout.engine import submit
from openrlhf_async.rollout.sync_group import bytes_of
from openrlhf_async.trainer.weight_sync import WeightSync, _outcomes
from openrlhf_async.utils.ray_utils import get_all

START_WAIT_S = 1800.0  # a replacement engine's start (loading, profiling, CUDA graphs) awaited before a step trains


class HybridWeightSync(WeightSync):
    """WeightSync's surface (sync, catch_up, version, members, counters) for the hybrid engine, with to_train before
    a step's training and to_generate after a step that does not sync. `calls` records the order of the calls made,
    one entry each (for the run's record and the tests)."""

    def __init__(self, policy, engines: list, cfg, fleet=None, critic=None):
        """critic: PPO's critic (its CriticGroup), whose training states leave and come back with the policy's."""
        self.critic = critic
        self.cuda = cfg.device == "cuda"
        self.engine_sleep, self.trainer_sleep = cfg.vllm.enable_sleep, cfg.ds.enable_sleep
        self.sleeping = set()  # ids of the engines put to sleep (to_train) that have not woken yet
        self.calls = []
        self.handover_s = 0.0  # seconds spent sleeping, waking, offloading and reloading since the last step's record
        self.bundles = {}  # engine id -> its bundles, the ranks it shares devices with (rank r in bundle r)
        super().__init__(policy, engines, cfg, fleet)  # maps the members' transfer (_connect)
        if self.trainer_sleep:  # generation comes first: the states wait in host memory
            self._ranks("offload_states")

    def to_train(self, newest_version: int = None) -> None:
        """The last sync's check ends whatever the batch holds (the engines' weights leave as they sleep); the engines
        sleep (their running requests were aborted by the controller) and the training states come back. An engine
        starting in its bundles (a replacement) finishes first: vLLM sizes its KV cache from the free memory as it
        starts, which the reloaded states would take; it sleeps with the others, waiting for its weights.

        The states come back only once every sleep returned (or its engine was dropped): vLLM's sleep asserts that
        its device's free memory (cudaMemGetInfo, every process's) did not fall across the call (vLLM 0.26
        v1/worker/gpu_worker.py:192-220, no retry on CUDA), so a rank reloading GBs of states meanwhile would fail
        it, leaving vLLM's executor awake in its own eyes with its weights in host memory (v1/executor/abstract.py
        :318-326): an engine whose sleep failed is dropped and replaced, never woken. Nothing else on the device
        allocates more than a sleep frees (an engine's weights and KV cache)."""
        super().to_train()
        self._await_starting()
        if self.engine_sleep and not self.sleeping:
            sleepers = {**self.members, **self._joining()}
            kept = self._keep(sleepers, self._call(sleepers, "sleep", 1))
            self.members = {i: e for i, e in self.members.items() if i in kept}
            self.sleeping = set(kept)
            self.calls.append("sleep")
        if self.trainer_sleep:
            self._ranks("reload_states")
            self.calls.append("reload")

    def to_generate(self) -> None:
        """After a step that does not sync: the states leave and the engines wake whole, on their old weights (a
        joining one too, which the next sync or catch-up gives the weights)."""
        if self.trainer_sleep:
            self._ranks("offload_states")
            self.calls.append("offload")
        if self.sleeping:
            woken = self._wake({**self.members, **self._joining()}, None, "wake")
            self.members = {i: e for i, e in self.members.items() if i in woken}
            self.sleeping = set()

    # ---- inside --------------------------------------------------------------------------------------------

    def take_handover_s(self) -> float:
        """timing/sleep_s: the seconds the step spent handing the devices over (sleep, wake, offload, reload)."""
        spent, self.handover_s = self.handover_s, 0.0
        return spent

    def _ranks(self, method: str, *args) -> list:
        start = time.perf_counter()
        try:
            if method in ("offload_states", "reload_states"):  # the critic's with the policy's
                return get_all(_states(self.policy, self.critic, method), self.timeout + 60)
            return get_all(self.policy.call(method, *args), self.timeout + 60)
        finally:
            if method in ("offload_states", "reload_states"):
                self.handover_s += time.perf_counter() - start

    def _call(self, members: dict, method: str, *args) -> list:
        start = time.perf_counter()
        try:
            return super()._call(members, method, *args)
        finally:
            if method in ("sleep", "wake_up"):
                self.handover_s += time.perf_counter() - start

    def _before(self, members: dict, pause_mode: str) -> dict:
        """Offload the trainer's states and wake the engines' weights for the transfer (WeightSync._broadcast then
        sends every bucket and finishes with the version; a transfer that did not complete is made again to the
        engines left, which stay asleep, on no version of it, until one does). An engine that started meanwhile
        (it replaced one lost in the step) is awake already."""
        if self.trainer_sleep:
            self._ranks("offload_states")
            self.calls.append("offload")
        return self._wake(members, ["weights"], "wake weights")

    def _after(self, members: dict) -> dict:
        """Every bucket arrived: the engines wake their KV cache."""
        members = self._wake(members, ["kv_cache"], "wake kv_cache")
        self.sleeping = set()  # every sleeper was among the members, or was dropped
        return members

    def _wake(self, members: dict, tags, record: str) -> dict:
        """vLLM's wake_up(tags) (None: whole) on those of members that sleep, recorded in calls as record; returns
        members less the woken ones that failed (dropped)."""
        asleep = {i: e for i, e in members.items() if i in self.sleeping}
        if not asleep:
            return members
        kept = self._keep(asleep, self._call(asleep, "wake_up", tags))
        self.calls.append(record)
        return {i: e for i, e in members.items() if i in kept or i not in asleep}

    def _await_starting(self) -> None:
        """Wait (up to START_WAIT_S) for the engines starting in the fleet's bundles: replacements of engines lost
        in the last step."""
        import ray

        if self.fleet is None:
            return
        starting = ray.get(self.fleet.starting.remote())
        if starting:
            self.calls.append("await starting")
            ray.wait(starting, num_returns=len(starting), timeout=START_WAIT_S)

    def _joining(self) -> dict:
        """The fleet's started engines still waiting for the trainer's weights."""
        import ray

        return {} if self.fleet is None else ray.get(self.fleet.joining.remote())

    def _connect(self, members: dict) -> dict:
        """Set up each engine's transfer: on cpu a new shared-memory file on the rank in its first bundle, mapped by
        the engine and then unlinked (the mappings outlive the name: nothing is left in /dev/shm); on cuda the ipc
        transport (each bucket's handles come with its update). Returns the engines set up."""
        import ray

        if self.fleet is not None:
            self.bundles = ray.get(self.fleet.bundles.remote())
        else:
            self.bundles = {i: tuple(range(i * self.tp, (i + 1) * self.tp)) for i in members}
        ranks = self.policy.actors
        if self.cuda:
            infos = {i: {"transport": "ipc"} for i in members}
        else:
            size = max(bytes_of(b) for b in self.buckets)
            owners = sorted({self.bundles[i][0] for i in members})
            paths = dict(zip(owners, get_all([ranks[r].open_weight_file.remote(size) for r in owners])))
            infos = {i: {"transport": "shm", "path": paths[self.bundles[i][0]], "bucket_bytes": size} for i in members}
        refs = [submit(e, "init_weight_transfer", infos[i]) for i, e in members.items()]
        outcomes = _outcomes(refs, self.timeout + 10)
        if not self.cuda:
            get_all([ranks[r].unlink_weight_file.remote() for r in owners])
        kept = self._keep(members, outcomes, ("died", "hung"))
        errors = [value for kind, value in outcomes if kind == "error"]
        if errors:
            raise RuntimeError(f"the engines' weight transfer could not be set up: {errors[0]}")
        self.grouped = set(kept)
        return kept

    def _send(self, members: dict, version: int) -> tuple:
        """One transfer, bucket by bucket: (the engines that got every bucket, whether all did)."""
        # cuda: each of an engine's tensor-parallel workers takes the handles of the rank on its own GPU (rank r in
        # bundle r: the engine's bundles), every rank here being one of them; cpu: one file per engine, by its first.
        owners = {r for i in members for r in (self.bundles[i] if self.cuda else self.bundles[i][:1])}
        members = self._keep(members, self._call(members, "start_weight_update"), ("died", "hung"))
        self.calls.append("start")
        complete = True
        for bucket in self.buckets:
            info = {"names": [n for n, _, _ in bucket], "dtype_names": [d for _, d, _ in bucket],
                    "shapes": [list(s) for _, _, s in bucket]}
            if self.cuda:
                shared = self._ranks_each("share_bucket", bucket, owners)
                info["ipc_handles"] = [{k: v for rank in shared if rank for k, v in rank[j].items()}
                                       for j in range(len(bucket))]
            else:
                self._ranks("write_bucket", bucket)
            outcomes = self._call(members, "update_weights", info)
            self.calls.append("update")
            if self.cuda:  # loaded by the call (whole layers: vLLM keeps nothing of it), so its copies go now
                self._ranks("release_shared")
                self.calls.append("release")
            members = self._keep(members, outcomes, ("died", "hung"))
            if any(kind == "error" for kind, _ in outcomes) or not members:
                complete = False
                break
        if complete:
            outcomes = self._call(members, "finish_weight_update", version)
            self.calls.append(f"finish {version}")
            members = self._keep(members, outcomes, ("died", "hung"))
            complete = not any(kind == "error" for kind, _ in outcomes)
        if self.cuda:  # before the engines wake their KV cache (_after): what vLLM kept until its finish is free
            self._ranks("release_shared")
            self.calls.append("release")
        if not complete:
            self.broadcasts_failed += 1
            print("weight sync: the hybrid transfer did not complete; made again to the engines left", flush=True)
            self.grouped = None
        return members, complete

    def _ranks_each(self, method: str, bucket: list, owners: set) -> list:
        return get_all([getattr(a, method).remote(bucket, r in owners)
                        for r, a in enumerate(self.policy.actors)], self.timeout + 60)


def _states(policy, critic, method: str) -> list:
    """offload_states / reload_states on the policy's ranks and the critic's: the object refs."""
    return policy.call(method) + (critic.call(method) if critic is not None else [])


def start_hybrid(cfg, model_path: str, group, fleet):
    """The ranks of the hybrid engine, loaded after its engines (vLLM checks the free device memory as it starts, so
    the engines come first, as in OpenRLHF): the engines sleep while the ranks, the critic's and the reward models
    (not running yet) load in the same bundles, the ranks' states are offloaded, then the engines wake for the first
    batch. Returns (the PolicyGroup, PPO's CriticGroup or None)."""
    import ray

    from openrlhf_async.reward.model import start_reward_models
    from openrlhf_async.trainer.critic import start_critic
    from openrlhf_async.trainer.ranks import PolicyGroup

    engines = list(ray.get(fleet.active.remote()).values())
    if cfg.vllm.enable_sleep:
        get_all([e.sleep.remote(1) for e in engines])
    policy = PolicyGroup(cfg, model_path, group)
    critic = start_critic(cfg, model_path, policy)
    if cfg.reward.model_name_or_path:
        start_reward_models(cfg, policy.group)
    if cfg.ds.enable_sleep:
        get_all(_states(policy, critic, "offload_states"))
    if cfg.vllm.enable_sleep:
        get_all([e.wake_up.remote(None) for e in engines])
    return policy, critic
