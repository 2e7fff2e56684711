"""Session-wide real stack for the end-to-end tests: one Ray cluster, one tiny model, shared engines and policy.
Engine start dominates test time (15-20 s each), so they are started once and shared."""

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_process_group_cleanup_enabled", "1")  # as train_async sets it: engines killed in tests


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from openrlhf_async.config import default_cache_dir
    from openrlhf_async.models.tiny import build_tiny_model

    # The demo's own model, shared with `make demo` through the cache: warm enough that rewards vary in a group.
    return build_tiny_model(default_cache_dir())


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def stack_cfg():
    from openrlhf_async.config import Config, validate

    cfg = Config()
    cfg.device = "cpu"
    cfg.vllm.num_engines = 2
    cfg.actor.num_gpus_per_node = 2
    cfg.agent.step_timeout = 2.0  # the agent tests' hanging step must time out quickly
    return validate(cfg)


@pytest.fixture(scope="session")
def engines(ray_cluster, stack_cfg, tiny_model_path):
    from openrlhf_async.rollout.engine import create_engines

    return create_engines(stack_cfg, tiny_model_path)


@pytest.fixture(scope="session")
def policy(ray_cluster, stack_cfg, tiny_model_path):
    from openrlhf_async.trainer.policy import PolicyGroup

    return PolicyGroup(stack_cfg, tiny_model_path)


@pytest.fixture(scope="session")
def weight_sync(engines, policy, stack_cfg):
    from openrlhf_async.trainer.weight_sync import WeightSync

    return WeightSync(policy, engines, stack_cfg)
