"""A run spread over several nodes, on a real 2-node Ray cluster on loopback (two raylets; 2 fake GPUs each, so
placement groups of the cuda shapes can be placed): engine actors see the node's GPUs."""

import os

import pytest

from conftest import preset_config

@pytest.fixture(scope="module")
def cluster():
    """(driver's node id, the other node's id). The raylets start without the variables the run sets in the driver,
    as raylets started by `ray start` on other machines would."""
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "these tests need a Ray of their own"
    saved = {k: os.environ.pop(k, None) for k in ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "RAY_ADDRESS"]}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    other = cluster.add_node(num_cpus=2, num_gpus=2).node_id
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
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
    from openrlhf_async.rollout.fleet import engine_placement_group

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

