"""EngineFleet: the run's vLLM engines as one Ray actor that keeps them alive and lets them grow.

Each engine lives in a placement group of its own (its tensor-parallel workers in its bundles, on one node). An engine
found dead (its actor or node gone, or hung in a weight sync and killed) is removed with its group, and another is
started in its place, on any node with room, up to --vllm.max_engine_restarts a run. Up to --vllm.max_num_engines,
the fleet keeps one placement group waiting for room: when the cluster gains a node (or Ray's autoscaler adds one
for that waiting group) it becomes ready and an engine starts in it.

A started engine holds the model's initial weights, so it takes no work until it has joined the weight-sync group
and received the trainer's current weights and version ("joining", then "active"): the trainer syncs joining
engines as soon as it is between steps with the last sync's weights (WeightSync.catch_up), else with everyone at its
next sync. The controller
routes work to active engines only."""

import time
from dataclasses import dataclass, field

from openrlhf_async.rollout.engine import engine_placement_group, hybrid_engine_bundles, start_engine


@dataclass
class Slot:
    handle: object
    group: object  # its placement group
    state: str  # "starting" (loading), "joining" (ready, waiting for the trainer's weights), "active"
    ready: object = None  # the ready() call of a starting engine
    since: float = field(default_factory=time.time)  # when the engine it replaces died, or it was asked for
    reason: str = "initial"  # "initial", "replacement" or "growth"
    bundles: tuple = None  # its bundles in the hybrid engine's group (its workers', one node's); None: its own group


class EngineFleet:
    def __init__(self, cfg, model_path: str, shared_group=None, placed: list = None):
        """shared_group: the hybrid engine's placement group, the trainer ranks' too, with placed, each engine's
        bundles there (hybrid_engine_bundles: its workers beside the ranks they share devices with, on one node); a
        replacement in the bundles of the engine it replaces; the group outlives the engines. None: a group per
        engine."""
        self.cfg, self.model_path, self.shared_group = cfg, model_path, shared_group
        self.slots: dict = {}  # engine id -> Slot; ids are never reused
        self.next_id = 0
        self.version = 0  # the weight version every active engine holds
        self.restarts_left = cfg.vllm.max_engine_restarts
        self.max_engines = cfg.vllm.max_num_engines or cfg.num_engines
        self.waiting_group = self.waiting_ready = None  # a placement group waiting for room to grow onto
        self.counts = {"engines/replaced": 0, "engines/added": 0, "engines/died": 0}
        self.replace_s = []  # seconds from an engine's death to its replacement taking work
        for k in range(cfg.num_engines):
            if shared_group is not None:
                self._start(shared_group, "initial", time.time(), placed[k])
            else:
                self._start(engine_placement_group(cfg), "initial", time.time())

    # ---- what the trainer and the generator ask --------------------------------------------------------------

    def wait_ready(self, timeout_s: float = 1800.0) -> int:
        """Block until the initial engines are up (they hold the initial weights: active at once)."""
        from openrlhf_async.utils.ray_utils import get_all

        starting = {i: s for i, s in self.slots.items() if s.state == "starting"}
        get_all([s.ready for s in starting.values()], timeout_s)
        for slot in starting.values():
            slot.state, slot.ready = "active", None
        return len(self.slots)

    def active(self) -> dict:
        """{engine id: handle} of the engines taking work."""
        self._tick()
        return {i: s.handle for i, s in self.slots.items() if s.state == "active"}

    def joining(self) -> dict:
        """{engine id: handle} of the started engines waiting for the trainer's weights."""
        self._tick()
        return {i: s.handle for i, s in self.slots.items() if s.state == "joining"}

    def starting(self) -> list:
        """The ready() calls of the engines loading to replace or add to the initial ones (the hybrid engine awaits
        them before its ranks take the devices back: trainer/hybrid.py)."""
        self._tick()
        return [s.ready for s in self.slots.values() if s.state == "starting" and s.reason != "initial"]

    def coming(self) -> int:
        """Engines started or waiting for weights: work may wait for them rather than fail when none is active."""
        self._tick()
        return sum(s.state != "active" for s in self.slots.values())

    def joined(self, ids: list, version: int) -> None:
        """These engines received the trainer's weights of this version (the newest sync): they take work from now
        on."""
        now, self.version = time.time(), version
        for i in ids:
            slot = self.slots.get(i)
            if slot is not None and slot.state == "joining":
                slot.state = "active"
                if slot.reason == "replacement":
                    self.replace_s.append(now - slot.since)

    def died(self, ids: list) -> None:
        """These engines are gone or hung: kill what is left of them, free their placement, start replacements."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for i in ids:
            slot = self.slots.pop(i, None)
            if slot is None:  # reported already
                continue
            self.counts["engines/died"] += 1
            _quietly(lambda: ray.kill(slot.handle, no_restart=True))
            if self.shared_group is None:
                _quietly(lambda: remove_placement_group(slot.group))
            if self.restarts_left > 0 and self.shared_group is not None:
                self.restarts_left -= 1
                self.counts["engines/replaced"] += 1
                self._start(self.shared_group, "replacement", time.time(), slot.bundles)
            elif self.restarts_left > 0:  # before growth: a group waiting for room to grow onto goes to it
                self.restarts_left -= 1
                self.counts["engines/replaced"] += 1
                group, self.waiting_group = self.waiting_group or engine_placement_group(self.cfg), None
                self._start(group, "replacement", time.time())

    def bundles(self) -> dict:
        """{engine id: its bundles} (the hybrid engine: the trainer ranks sharing its devices, the first on its
        actor's)."""
        return {i: s.bundles for i, s in self.slots.items()}

    def weight_version(self) -> int:
        """The version of the trainer's newest sync: every active engine holds it."""
        return self.version

    def metrics(self) -> dict:
        self._tick()
        states = [s.state for s in self.slots.values()]
        return {"engines/alive": states.count("active"), "engines/starting": len(states) - states.count("active"),
                **self.counts, "engines/replace_s": self.replace_s[-1] if self.replace_s else None,
                "engines/restarts_left": self.restarts_left}

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for slot in self.slots.values():
            _quietly(lambda: ray.kill(slot.handle, no_restart=True))
            if self.shared_group is None:
                _quietly(lambda: remove_placement_group(slot.group))
        self.slots = {}
        if self.waiting_group is not None:
            _quietly(lambda: remove_placement_group(self.waiting_group))
            self.waiting_group = None

    # ---- inside --------------------------------------------------------------------------------------------

    def _start(self, group, reason: str, since: float, bundles: tuple = None) -> None:
        engine_id, self.next_id = self.next_id, self.next_id + 1
        handle = start_engine(self.cfg, self.model_path, engine_id, group, bundles)
        self.slots[engine_id] = Slot(handle, group, "starting", handle.ready.remote(), since, reason, bundles)

    def _tick(self) -> None:
        """Promote engines that finished loading; a replacement or growth engine that died while loading counts as
        dead. Grow into the waiting placement group once it has room."""
        import ray

        for engine_id, slot in list(self.slots.items()):
            if slot.state != "starting" or slot.reason == "initial":
                continue
            done, _ = ray.wait([slot.ready], timeout=0)
            if done:
                try:
                    ray.get(done[0])
                    slot.state, slot.ready = "joining", None
                except Exception:
                    self.died([engine_id])
        # Growth adds max_engines - num_engines engines at most: a dead engine past the restarts is not refilled.
        grown = self.counts["engines/added"]
        if grown >= self.max_engines - self.cfg.num_engines or len(self.slots) >= self.max_engines:
            return
        if self.waiting_group is None:
            self.waiting_group = engine_placement_group(self.cfg)
            self.waiting_ready = self.waiting_group.ready()
        if ray.wait([self.waiting_ready], timeout=0)[0]:
            group, self.waiting_group = self.waiting_group, None
            self.counts["engines/added"] += 1
            self._start(group, "growth", time.time())


def _quietly(call) -> None:
    try:
        call()
    except Exception:
        pass


def start_fleet(cfg, model_path: str, shared_group=None):
    """The fleet actor, on the driver's node (it only starts engines and answers where they are); with the hybrid
    engine's shared_group, its engines' bundles chosen here (ConfigError where they would span nodes)."""
    import ray

    from openrlhf_async.utils.ray_utils import on_this_node

    placed = None
    if shared_group is not None:
        nodes = ray.util.placement_group_table(shared_group)["bundles_to_node_id"]
        placed = hybrid_engine_bundles(nodes, cfg.vllm.tensor_parallel_size, cfg.num_engines)
    return ray.remote(EngineFleet).options(**on_this_node()).remote(cfg, model_path, shared_group, placed)
