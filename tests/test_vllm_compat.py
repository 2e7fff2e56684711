"""rollout/vllm_compat.py: each difference between the vLLM releases it bridges, against stand-ins shaped as those
releases' sources have them (0.26: finish_weight_update() without a version and no get_weight_version; 0.27 on:
both), and against the installed vLLM. make test-vllm VLLM=0.27.1 runs the engines themselves on another release."""

import asyncio

from openrlhf_async.rollout import vllm_compat


class Release026:
    def __init__(self):
        self.calls = []

    async def finish_weight_update(self) -> None:
        self.calls.append(())


class Release027On:
    def __init__(self):
        self.calls, self.version = [], "default"

    async def finish_weight_update(self, weight_version=None) -> None:
        self.calls.append((weight_version,))
        if weight_version is not None:
            self.version = weight_version

    async def get_weight_version(self) -> str:
        return self.version


def test_the_weight_version_is_vllms_where_it_keeps_one_and_the_engine_actors_where_not():
    old, new = Release026(), Release027On()
    assert not vllm_compat.keeps_weight_version(old) and vllm_compat.keeps_weight_version(new)

    async def sync_to(version: int) -> tuple:
        before = await vllm_compat.weight_version(new, own=version - 1)
        for engine in (old, new):
            await vllm_compat.finish_weight_update(engine, version)
        return before, await vllm_compat.weight_version(new, own=-1), await vllm_compat.weight_version(old, own=version)

    assert asyncio.run(sync_to(3)) == (0, 3, 3)  # vLLM's "default" before the first sync is version 0
    assert new.calls == [("3",)] and old.calls == [()]


def _from_0_27() -> bool:
    """Whether the installed vLLM is 0.27 or later (make test-vllm VLLM=0.26.0 runs this file on 0.26)."""
    from openrlhf_async.config.probes import vllm_release

    return tuple(int(part) for part in vllm_release().split(".")[:2]) >= (0, 27)


def test_the_installed_vllm_is_in_range_keeps_weight_versions_from_0_27_and_serves_its_openai_app():
    from vllm.v1.engine.async_llm import AsyncLLM

    vllm_compat.check_release()
    assert vllm_compat.keeps_weight_version(AsyncLLM) == _from_0_27()
    build_app, init_app_state, make_arg_parser = vllm_compat.openai_server()
    assert {f.__name__ for f in (build_app, init_app_state, make_arg_parser)} == \
        {"build_app", "init_app_state", "make_arg_parser"}


def test_the_hybrid_engines_ipc_transport_is_this_projects_engine_on_every_release():
    """On cuda the hybrid engine's CUDA IPC handles go through this project's weight-transfer engine, whatever the
    release: vLLM 0.26's own ipc engine imports Ray at its top (ipc_engine.py:11), which the GPU machines lack."""
    from openrlhf_async.rollout.weight_transfer import (BroadcastInitInfo, BroadcastUpdateInfo,
                                                        BroadcastWeightTransferEngine)

    assert BroadcastInitInfo(transport="ipc").transport == "ipc"
    engine = object.__new__(BroadcastWeightTransferEngine)
    handles = [{"GPU-0": ("rebuild", "args")}]
    info = engine.parse_update_info({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]],
                                     "ipc_handles": handles})
    assert isinstance(info, BroadcastUpdateInfo) and info.ipc_handles == handles
    assert engine.parse_update_info({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}).ipc_handles is None


def test_the_model_runner_is_v1_for_routing_replay_else_the_drivers_choice_else_vllms():
    """rollout/routes.py reads the V1 runner's batch, which V2 has none of: V1 whatever the driver asked for. Otherwise
    the driver's VLLM_USE_V2_MODEL_RUNNER reaches the engine's actor (the GPU check runs each runner so), and without
    one vLLM chooses (V2 for a dense model where Triton imports, V1 on CPU)."""
    env = vllm_compat.model_runner_env
    assert env(True, {}) == env(True, {"VLLM_USE_V2_MODEL_RUNNER": "1"}) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert env(False, {"VLLM_USE_V2_MODEL_RUNNER": "0"}) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert env(False, {"VLLM_USE_V2_MODEL_RUNNER": "1"}) == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert env(False, {}) == env(False, {"VLLM_USE_V2_MODEL_RUNNER": ""}) == {}


def test_the_docstring_names_what_differs_between_vllms_model_runners():
    doc = vllm_compat.__doc__
    assert "The V1 and V2 model runners (vLLM 0.26 read" in doc
    for aspect in ("Seeded sampling", "Processed log-probs under top-p", "Sleep and wake", "The weight update",
                   "The model runner's attributes"):
        assert f"- {aspect}." in doc, aspect


def test_an_engines_environment_carries_the_model_runner_chosen_in_vllm_compat(monkeypatch):
    from conftest import preset_config
    from openrlhf_async.rollout import engine

    cfg = preset_config()
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in engine.engine_env(cfg)  # CPU behaviour unchanged: vLLM's own choice
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert engine.engine_env(cfg)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.setattr(engine, "records_routes", lambda path, vllm: True)
    assert engine.engine_env(cfg)["VLLM_USE_V2_MODEL_RUNNER"] == "0"
