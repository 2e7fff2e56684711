"""A multi-node Ray cluster on one machine (several raylets on loopback, Ray's own cluster_utils.Cluster), and the
faults that the elasticity tests and benchmarks/soak.py inject into a run on it: an engine, a node or a policy rank
killed, a node added. The run itself is the real one (train_async's main, in a thread of the process that holds
the cluster). Test and benchmark code: the package does not use it."""

import os
import signal
import threading
import time

ENGINE, POLICY = "LLMRayActorAsync", "PolicyActor"


class LocalCluster:
    def __init__(self, head_cpus: int = 1, node_cpus: tuple = ()):
        """A head node with head_cpus CPUs (the driver, trainer and generator take none) and a worker node per
        entry of node_cpus; this process connects to it."""
        import ray
        from ray.cluster_utils import Cluster

        # Read by every raylet at start: a dead worker's whole process group goes (an engine's vLLM processes).
        os.environ["RAY_process_group_cleanup_enabled"] = "1"
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus,
                                                                     "include_dashboard": False})
        self.nodes = {}  # node id -> the worker Node
        for cpus in node_cpus:
            self.add_node(cpus)
        os.environ["RAY_ADDRESS"] = self.cluster.address  # runs started here join it (train_async reads it)
        self.connect()
        self.head = ray.get_runtime_context().get_node_id()

    def connect(self) -> None:
        """(Re)connect this process: a finished run's train_async disconnects it."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)

    def add_node(self, cpus: int = 1) -> str:
        node = self.cluster.add_node(num_cpus=cpus)
        self.nodes[node.node_id] = node
        return node.node_id

    def kill_node(self, node_id: str) -> None:
        """The node goes at once (its raylet and everything on it killed), as a preempted machine. Ray kills the
        raylet alone; its workers (an engine actor and vLLM's processes) would run on for a moment, long enough to
        answer calls in flight, so they are killed with it."""
        from ray._private import ray_constants

        node = self.nodes.pop(node_id)
        for raylet in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            _signal_tree(raylet.process.pid, signal.SIGKILL)
        self.cluster.remove_node(node, allow_graceful=False)  # the rest; it passes over processes already gone

    def actors(self, class_name: str) -> list:
        """The live actors of a class: [{"actor_id", "node_id", "pid"}], oldest first."""
        from ray._private.state import actors

        found = [a for a in actors().values() if a["ActorClassName"] == class_name and a["State"] == "ALIVE"]
        return [{"actor_id": a["ActorID"], "node_id": a["Address"]["NodeID"], "pid": a["Pid"]}
                for a in sorted(found, key=lambda a: a.get("StartTime", 0))]

    def busy_engine_nodes(self) -> set:
        """Nodes of the engines that have requests in flight right now."""
        import ray

        busy = set()
        for name in ray.util.list_named_actors():
            if not name.startswith("openrlhf_async-engine-"):
                continue
            try:
                engine = ray.get_actor(name)
                if ray.get(engine.__ray_call__.remote(lambda actor: len(actor.in_flight)), timeout=5):
                    busy.add(ray.get(engine.__ray_call__.remote(
                        lambda actor: ray.get_runtime_context().get_node_id()), timeout=5))
            except Exception:  # gone meanwhile
                pass
        return busy

    def kill_actor(self, class_name: str, index: int = 0) -> dict:
        """SIGKILL one live actor's process (and its children), as the OOM killer would."""
        actor = self.actors(class_name)[index]
        _signal_tree(actor["pid"], signal.SIGKILL)
        return actor

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        os.environ.pop("RAY_ADDRESS", None)


def _signal_tree(pid: int, sig) -> None:
    import psutil

    try:
        process = psutil.Process(pid)
        targets = [process] + process.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in targets:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


class ProcessWatch:
    """Every process this one starts (raylets, Ray workers, vLLM's processes: all descendants), seen while polling;
    after shutdown, those still alive were left behind."""

    def __init__(self):
        self.seen = {}  # pid -> psutil.Process

    def poll(self) -> None:
        import psutil

        for p in psutil.Process().children(recursive=True):
            self.seen.setdefault(p.pid, p)

    def leftover(self) -> list:
        """"pid command" of the processes seen that are still running (a stopped one counts)."""
        import psutil

        left = []
        for pid, p in self.seen.items():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:100]}")
            except psutil.NoSuchProcess:
                pass
        return left


class RunThread(threading.Thread):
    """main(argv) in a thread of this process (connected to the cluster): its exit code in .code. main: the run's
    entry point, train_async's (passed in by the caller: nothing below cli/ imports it)."""

    def __init__(self, main, argv: list):
        super().__init__(daemon=True)
        self.main, self.argv, self.code, self.error = main, argv, None, None

    def run(self):
        try:
            self.code = self.main(self.argv)
        except BaseException as e:  # reported by the caller
            self.error, self.code = e, -1


def read_steps(run_dir: str) -> list:
    """The step records metrics.jsonl holds so far."""
    import json

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5, watch: ProcessWatch = None):
    """Poll until predicate() is truthy (returned); TimeoutError naming `what` otherwise. watch: polled too."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if watch is not None:
            watch.poll()
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
