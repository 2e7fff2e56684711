"""A run spread over several nodes, on a real 2-node Ray cluster on loopback (two raylets; 2 fake GPUs each, so
placement groups of the cuda shapes can be placed): engine actors see the node's GPUs, the trainer ranks are placed
first and together, the driver's network variables reach actors on every node, and folders the ranks write on another
node are checked to be shared with the driver."""

import os

import pytest

from conftest import preset_config

NETWORK = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


@pytest.fixture(scope="module")
def cluster():
    """(driver's node id, the other node's id). The raylets start without the variables the run must forward, as
    raylets started by `ray start` on other machines would; the driver then sets them and connects."""
    import ray
    from ray.cluster_utils import Cluster

    from openrlhf_async.utils.cluster import connect

    assert not ray.is_initialized(), "these tests need a Ray of their own"
    saved = {k: os.environ.pop(k, None) for k in [*NETWORK, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "RAY_ADDRESS"]}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    other = cluster.add_node(num_cpus=2, num_gpus=2).node_id
    os.environ.update(NETWORK, RAY_ADDRESS=cluster.address)
    try:
        connect()
        yield ray.get_runtime_context().get_node_id(), other
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def _probe(**options):
    """A cheap actor started with these options: returns its environment."""
    import ray

    class Probe:
        def env(self):
            return dict(os.environ)

    return ray.get(ray.remote(Probe).options(**options).remote().env.remote(), timeout=120)


def test_a_tensor_parallel_engine_actor_sees_its_nodes_gpus(cluster):
    """The engine actor of tensor parallel 2 takes no GPU (its vLLM workers take the bundles'), so Ray would empty its
    CUDA_VISIBLE_DEVICES, and its engine-core process's, unless its own worker has RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0:
    the raylet here has no such variable, as on a `ray start` node."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from openrlhf_async.rollout.engine import engine_actor_options
    from openrlhf_async.rollout.engine import engine_placement_group

    cfg = preset_config("--device", "cuda", "--vllm.tensor_parallel_size", "2", validated=False)
    group = engine_placement_group(cfg)
    ray.get(group.ready(), timeout=60)
    try:
        options = engine_actor_options(cfg, group)
        assert options["num_gpus"] == 0
        env = _probe(**options)
    finally:
        remove_placement_group(group)
    assert env.get("CUDA_VISIBLE_DEVICES") != "", "Ray hid the node's GPUs from the engine actor"
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "0,1"


def test_the_trainer_ranks_are_placed_before_the_engines_and_together(cluster):
    """As run.start_actors: the ranks' placement group first, then the engines', which take the other node; the two
    ranks share one node."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from openrlhf_async.rollout.engine import engine_placement_group
    from openrlhf_async.trainer.ranks import trainer_placement_group
    from openrlhf_async.utils.cluster import group_nodes

    cfg = preset_config("--device", "cuda", "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2",
                        validated=False)
    group = trainer_placement_group(cfg)
    engines = [engine_placement_group(cfg) for _ in range(cfg.num_engines)]
    try:
        ray.get([g.ready() for g in engines], timeout=60)
        nodes = group_nodes(group)
        assert len(nodes) == 1 and all(group_nodes(g).isdisjoint(nodes) for g in engines)
    finally:
        for g in engines + [group]:
            remove_placement_group(g)


def test_the_drivers_network_variables_reach_actors_on_every_node(cluster):
    """Through the job's runtime_env (cluster.connect), also into actors that pass env_vars of their own, as the
    trainer ranks and the engines do."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in cluster:
        env = _probe(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        assert {k: env.get(k) for k in NETWORK} == NETWORK and env["OMP_NUM_THREADS"] == "1"


def test_folders_the_ranks_write_on_another_node_must_be_the_drivers(cluster, tmp_path):
    """The driver writes a token file in --ckpt.output_dir and --ckpt.path and a task on each rank's node reads it.
    Here both raylets share the disk, so a plain folder passes; /proc/self/fd/<a descriptor only the driver holds> is a
    folder for the driver and none for any other process: a disk the other node does not share."""
    from openrlhf_async.config import ConfigError
    from openrlhf_async.utils.cluster import check_shared_folders

    driver, other = cluster
    shared = preset_config("--ckpt.output_dir", str(tmp_path / "out"), "--ckpt.path", str(tmp_path / "ckpt"),
                           "--ckpt.save_steps", "1")
    check_shared_folders(shared, {driver, other})
    assert list(tmp_path.iterdir()) == []  # no token file left, no folder made before the run writes it

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        unshared = preset_config("--ckpt.output_dir", str(tmp_path / "out"), "--ckpt.path", f"/proc/self/fd/{fd}/ckpt",
                                 "--ckpt.save_steps", "1")
        check_shared_folders(unshared, {driver})  # ranks on the driver's node write where it reads
        with pytest.raises(ConfigError) as refused:
            check_shared_folders(unshared, {driver, other})
    finally:
        os.close(fd)
    message = str(refused.value)
    assert message.startswith(f"--ckpt.path /proc/self/fd/{fd}/ckpt: trainer ranks run on node ") and "\n" not in message
    assert "DeepSpeed" in message and "every node mounts" in message
    assert list(tmp_path.iterdir()) == []
