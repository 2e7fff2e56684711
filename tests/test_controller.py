"""The rollout controller's logic with in-process fake engines: FIFO, load balancing, filtering, early stop."""

import asyncio
import re

import pytest

from conftest import NO_POLICY, preset_config
from stand_in_sync import StandInSync
from openrlhf_async.config import config_with
from openrlhf_async.reward.shaping import overlong_penalty
from openrlhf_async.rollout.batch import AgentFailureError
from openrlhf_async.rollout.controller import LoadBalancer, LocalHandle, RolloutController
from openrlhf_async.rollout.engine import _engine_died
from openrlhf_async.rollout.episode import Episode, run_group
from openrlhf_async.rollout.filter import GroupFilter



class FakeEngine:
    """A group's label says how long it takes and what its episodes score: {"delay": s, "scores": [...]}."""

    def __init__(self, started=None):
        self.started, self.aborted, self.running = [] if started is None else started, [], {}

    async def generate_group(self, prompt_ids, label, n, sampling, group_id, budget, agent_path=None, screen=0,
                             group_filter=GroupFilter(), reward_source=None, prompt=None):
        self.started.append(prompt_ids[0])
        if label.get("raise"):
            raise RuntimeError("engine failed")
        stop = self.running[group_id] = asyncio.Event()
        try:
            await asyncio.wait_for(stop.wait(), label["delay"])
            aborted = True
        except asyncio.TimeoutError:
            aborted = False
        finally:
            self.running.pop(group_id)

        async def episode(i):
            tokens = label.get("tokens", 4) // (2 if aborted else 1)
            return Episode(f"{group_id}-{i}", list(prompt_ids), response_ids=[5] * tokens, logprobs=[-1.0] * tokens,
                           action_mask=[1] * tokens, score=0.0 if aborted else float(label["scores"][i]),
                           aborted=aborted, error=label.get("error"))

        return await run_group(episode, min(n, len(label["scores"])), screen, group_filter)

    async def abort_groups(self, group_ids):
        self.aborted += list(group_ids)
        for group_id in group_ids:
            if group_id in self.running:
                self.running[group_id].set()
        return len(group_ids)


class DyingEngine(FakeEngine):
    """Dies when kill() is called, or once it has started `after_starts` groups (events, not timers): its running
    calls then fail as a dead Ray actor's do, and so does every later call. Calls made once the controller knows
    (known_dead(), set by the test) are counted: it should make none."""

    def __init__(self, after_starts=None, started=None):
        super().__init__(started)
        self.after_starts, self.dead, self.calls_after_death, self.calls = after_starts, False, 0, set()
        self.known_dead = lambda: False

    def kill(self):
        self.dead = True
        for call in self.calls:
            call.cancel()

    async def generate_group(self, prompt_ids, label, *args):
        from ray.exceptions import ActorDiedError

        if self.dead:
            self.calls_after_death += self.known_dead()
            raise ActorDiedError()
        call = asyncio.ensure_future(super().generate_group(prompt_ids, label, *args))
        self.calls.add(call)
        try:
            await asyncio.sleep(0)  # the call records its start
            if self.after_starts is not None and len(self.started) >= self.after_starts:
                self.kill()
            return await call
        except asyncio.CancelledError:
            if self.dead and call.cancelled():
                raise ActorDiedError() from None
            raise
        finally:
            self.calls.discard(call)

    async def abort_groups(self, group_ids):
        from ray.exceptions import ActorDiedError

        if self.dead:
            self.calls_after_death += self.known_dead()
            raise ActorDiedError()
        return await super().abort_groups(group_ids)


def _controller(engines, rollout=(), algo=(), agent=(), reward=(), vllm=(), **kwargs):
    """Settings by config section; unless told: n 2, budget 8, 4 prompts in flight, any share of errors allowed."""
    rollout = {"n_samples_per_prompt": 2, "max_new_tokens": 8, "vllm_generate_batch_size": 4, **dict(rollout)}
    cfg = config_with(preset_config(validated=False), rollout=rollout, algo=dict(algo), vllm={"max_concurrency": 64, **dict(vllm)},
                      agent={"max_error_ratio": 1.0, **dict(agent)}, reward={"max_error_ratio": 1.0, **dict(reward)})
    return RolloutController(cfg, [LocalHandle(e) for e in engines], sampling={}, **kwargs)


def keep_group(scores, rule="std"):
    return GroupFilter(rule).keep(scores)


def _source(labels):
    it = enumerate(labels)

    def next_prompt():
        index, label = next(it)
        return {"prompt_ids": [index, 2], "label": label}  # the first token numbers the prompt

    return next_prompt


VALID, FLAT = [0.0, 1.0], [1.0, 1.0]
NO_FILTER = {"dynamic_filtering_enable": False}


def test_filter_rules_and_overlong_shaping():
    assert keep_group([0.0, 1.0]) and not keep_group([1.0, 1.0]) and not keep_group([0.0, 0.0])
    assert keep_group([0.0, 0.5], rule="mean_range") and not keep_group([1.0, 1.0], rule="mean_range")
    assert overlong_penalty(10, budget=20, buffer=5, factor=1.0) == 0.0
    assert overlong_penalty(20, budget=20, buffer=5, factor=1.0) == -1.0
    assert overlong_penalty(18, budget=20, buffer=5, factor=0.5) == pytest.approx(-0.3)


def test_screening_runs_the_rest_of_a_group_only_when_its_first_samples_vary():
    started = []

    def episode_with(scores):
        def episode(i):
            async def run():
                started.append(i)
                await asyncio.sleep(0.01)
                return Episode(f"e{i}", [1], score=scores[i])
            return run()
        return episode

    flat = asyncio.run(run_group(episode_with([1.0] * 8), 8, screen=3))
    assert [ep.score for ep in flat] == [1.0] * 3 and started == [0, 1, 2], "a flat screen must start no more"
    started.clear()
    varied = asyncio.run(run_group(episode_with([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), 8, screen=3))
    assert len(varied) == 8 and started == list(range(8)) and [ep.score for ep in varied][2] == 1.0
    started.clear()
    # Screening decides on the fixed first samples: a later sample that differs does not rescue a flat screen.
    late = asyncio.run(run_group(episode_with([0.0] * 4 + [1.0] * 4), 8, screen=4))
    assert len(late) == 4 and started == [0, 1, 2, 3]
    started.clear()
    assert len(asyncio.run(run_group(episode_with([1.0] * 8), 8, screen=0))) == 8 and len(started) == 8


def test_screened_groups_are_dropped_as_flat_counted_and_cost_only_their_first_samples():
    flat_seen = []
    labels = [{"delay": 0.0, "scores": [1.0] * 4} if i % 2 else {"delay": 0.0, "scores": [0.0, 1.0, 1.0, 0.0]}
              for i in range(40)]
    c = _controller([FakeEngine()], rollout=dict(n_samples_per_prompt=4, screen_samples=2),
                    on_group=lambda p, flat: flat_seen.append(flat))
    groups, m = c.run(_source(labels), target=3)
    assert len(groups) == 3 and all(len(g) == 4 and keep_group([e.score for e in g]) for g in groups)
    assert m["rollout/groups_screened"] >= 2 and m["rollout/groups_filtered"] == m["rollout/groups_screened"]
    assert m["rollout/tokens_screened"] == m["rollout/groups_screened"] * 2 * 4, "a screened group costs 2 samples"
    assert m["rollout/tokens_generated"] == (m["rollout/tokens_accepted"] + m["rollout/tokens_screened"]
                                             + m["rollout/tokens_aborted"])
    assert flat_seen.count(True) == m["rollout/groups_screened"] and list(c.balancer.loads.values()) == [0]
    # Without screening the same flat groups cost all 4 samples each.
    _, plain = _controller([FakeEngine()], rollout=dict(n_samples_per_prompt=4)).run(_source(labels), target=3)
    assert plain["rollout/groups_screened"] == 0
    assert (plain["rollout/tokens_generated"] - plain["rollout/tokens_accepted"] - plain["rollout/tokens_aborted"]
            == plain["rollout/groups_filtered"] * 16)


def test_screening_judges_the_first_samples_by_the_configured_filter_rule():
    # Rewards all 0.5: flat for the std rule, but their mean lies inside (0, 1), so the mean_range rule keeps them.
    labels = [{"delay": 0.0, "scores": [0.5] * 4}] * 2 + [{"delay": 0.0, "scores": [0.0, 1.0, 1.0, 0.0]}] * 10
    screening = dict(n_samples_per_prompt=4, screen_samples=2)
    groups, m = _controller([FakeEngine()], rollout=screening, algo={"dynamic_filtering_rule": "mean_range"}).run(
        _source(labels), target=2)
    assert [g[0].score for g in groups] == [0.5, 0.5] and [len(g) for g in groups] == [4, 4]
    assert m["rollout/groups_screened"] == 0
    _, std = _controller([FakeEngine()], rollout=screening).run(_source(labels), target=2)
    assert std["rollout/groups_screened"] == 2 and std["rollout/tokens_screened"] == 2 * 2 * 4


def test_balancer_sends_to_least_loaded_engine_under_capacity():
    lb = LoadBalancer(range(3), capacity=8)
    assert [lb.acquire(4) for _ in range(3)] == [0, 1, 2]
    assert [lb.acquire(4) for _ in range(3)] == [0, 1, 2]
    assert lb.acquire(4) is None  # every engine is full
    lb.release(1, 4)
    assert lb.acquire(2) == 1 and lb.loads == {0: 8, 1: 6, 2: 8}
    big = LoadBalancer([0], capacity=2)
    assert big.acquire(5) == 0  # a group larger than the capacity still runs, alone


def test_balancer_takes_new_engines_and_never_chooses_a_dead_one_again():
    lb = LoadBalancer([0, 1], capacity=8)
    assert lb.acquire(8) == 0 and lb.acquire(8) == 1 and lb.acquire(8) is None
    lb.mark_dead(0)
    lb.release(0, 8)  # a late release of the dead engine's group changes nothing
    lb.add(2)  # its replacement, with an id of its own
    assert lb.acquire(8) == 2 and lb.acquire(8) is None and lb.live() == [1, 2]
    assert lb.loads == {0: 0, 1: 8, 2: 8}


def test_early_stop_aborts_running_groups_and_keeps_fifo_order():
    started = []  # across both engines, in the order the groups reached them
    engines = [FakeEngine(started), FakeEngine(started)]
    c = _controller(engines, rollout=dict(vllm_generate_batch_size=4))
    # Three quick valid groups, one flat group, then slow groups that should be aborted, never waited for.
    labels = [{"delay": 0.01, "scores": VALID}, {"delay": 0.01, "scores": FLAT}, {"delay": 0.02, "scores": VALID},
              {"delay": 0.03, "scores": VALID}] + [{"delay": 30, "scores": VALID} for _ in range(10)]
    groups, m = c.run(_source(labels), target=3)
    assert len(groups) == 3 and all(keep_group([e.score for e in g]) for g in groups)
    assert m["rollout/groups_accepted"] == 3 and m["rollout/groups_filtered"] == 1
    assert m["rollout/groups_aborted"] == m["rollout/groups_started"] - m["rollout/groups_finished"] > 0
    assert m["rollout/time_to_batch_s"] < 5, "waited for a group that should have been aborted"
    assert m["rollout/tokens_aborted"] > 0 and 0 < m["rollout/wasted_fraction"] < 1
    aborted = set(engines[0].aborted + engines[1].aborted)
    assert aborted and not any(e.running for e in engines)
    assert started == list(range(len(started))), "groups did not start in prompt order"
    assert list(c.balancer.loads.values()) == [0, 0]


def test_at_most_vllm_generate_batch_size_run_at_once():
    engine = FakeEngine()
    c = _controller([engine], rollout=dict(vllm_generate_batch_size=2))
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, len(engine.running))
            await asyncio.sleep(0.001)

    async def run():
        watcher = asyncio.ensure_future(watch())
        out = await c.run_async(_source([{"delay": 0.02, "scores": VALID}] * 6), target=5)
        watcher.cancel()
        return out

    groups, m = asyncio.run(run())
    assert peak == 2 and m["rollout/groups_started"] <= 7 and list(c.balancer.loads.values()) == [0]


def test_unbiased_early_stop_waits_for_long_groups_started_earlier():
    # Two quick flat groups lower the valid rate, so the controller starts extra groups beside the long one.
    labels = ([{"delay": 0.3, "scores": VALID, "tokens": 40}] + [{"delay": 0.01, "scores": FLAT}] * 2
              + [{"delay": 0.01, "scores": VALID} for _ in range(8)])
    biased, _ = _controller([FakeEngine()]).run(_source(labels), target=2)
    unbiased, _ = _controller([FakeEngine()], rollout=dict(unbiased_early_stop=True)).run(_source(labels), target=2)
    assert all(len(g[0].response_ids) == 4 for g in biased), "the biased rule should skip the long group"
    assert len(unbiased[0][0].response_ids) == 40, "the unbiased rule must keep the long group started first"


def test_without_early_stop_whole_waves_are_generated_and_waited_for():
    labels = ([{"delay": 0.01, "scores": VALID}, {"delay": 0.2, "scores": FLAT}]
              + [{"delay": 0.01, "scores": VALID}, {"delay": 0.01, "scores": VALID}])
    engine = FakeEngine()
    groups, m = _controller([engine], rollout=dict(early_stop=False)).run(_source(labels), target=2)
    # Wave 1 (2 prompts) gives 1 valid group, so wave 2 runs; nothing is aborted, the flat group is waited for.
    assert len(groups) == 2 and m["rollout/groups_started"] == 4 and m["rollout/groups_aborted"] == 0
    assert m["rollout/groups_filtered"] == 1 and not engine.aborted


def test_load_returns_to_zero_after_an_engine_failure():
    engines = [FakeEngine(), FakeEngine()]
    c = _controller(engines)
    labels = [{"delay": 30, "scores": VALID}, {"raise": True}] + [{"delay": 30, "scores": VALID}] * 4
    with pytest.raises(RuntimeError, match="engine failed"):
        c.run(_source(labels), target=3)
    assert list(c.balancer.loads.values()) == [0, 0] and not any(e.running for e in engines)
    assert c.dead_engines == set(), "an error raised inside a live engine is no engine death"


def test_only_a_lost_actor_counts_as_an_engine_death():
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    assert _engine_died(ActorDiedError()) and _engine_died(ActorUnavailableError("gone", None))
    # The engine's own call failed on another actor (say a reward service): the engine itself is alive.
    wrapped = RayTaskError("generate_group", "traceback", ActorDiedError()).as_instanceof_cause()
    assert isinstance(wrapped, ActorDiedError) and not _engine_died(wrapped)
    assert not _engine_died(RuntimeError("engine failed"))


def test_groups_of_an_engine_that_dies_restart_from_their_prompts_on_a_live_engine():
    live, dying = FakeEngine(), DyingEngine(after_starts=2)
    c = _controller([live, dying], rollout=dict(vllm_generate_batch_size=4))
    dying.known_dead = lambda: 1 in c.dead_engines
    labels = [{"delay": 0.2, "scores": VALID} for _ in range(20)]
    groups, m = c.run(_source(labels), target=4)
    # Groups 1 and 3 were on the dying engine: they rerun on the live one, no new prompt replaces them.
    assert sorted(g[0].prompt_ids[0] for g in groups) == [0, 1, 2, 3] and m["rollout/groups_started"] == 4
    assert m["rollout/engine_failures"] == 1 and m["rollout/groups_rerouted"] == len(dying.started) == 2
    assert c.dead_engines == {1} and dying.calls_after_death == 0 and not dying.running
    assert dying.started == [1, 3] and live.started == [0, 2, 1, 3], "rerouted groups restart in start order"
    assert list(c.balancer.loads.values()) == [0, 0]
    _, again = c.run(_source(labels), target=2)  # a later batch uses only the live engine
    assert again["rollout/engine_failures"] == 0 and dying.calls_after_death == 0


def test_when_every_engine_dies_the_rollout_stops_with_a_clear_error():
    engines = [DyingEngine(after_starts=1), DyingEngine(after_starts=1)]
    c = _controller(engines)
    for i, engine in enumerate(engines):
        engine.known_dead = lambda i=i: i in c.dead_engines
    with pytest.raises(RuntimeError, match="all 2 vLLM engines died; last error: ActorDiedError"):
        c.run(_source([{"delay": 1.0, "scores": VALID}] * 20), target=3)
    assert c.dead_engines == {0, 1} and list(c.balancer.loads.values()) == [0, 0]
    assert not any(e.calls_after_death for e in engines)
    with pytest.raises(RuntimeError, match="all 2 vLLM engines died"):  # and not a hang on the next batch
        c.run(_source([{"delay": 0.0, "scores": VALID}] * 4), target=1)


class FakeFleet:
    """What the controller asks an EngineFleet: its active engines, whether replacements are coming, and deaths. A
    dead engine's replacement (spare; None: restarts used up) becomes active `delay` seconds later (its start and
    catch-up sync), under an id of its own."""

    def __init__(self, engines, spare=None, delay=0.3):
        self.engines, self.spare, self.delay, self.reported, self.starting = dict(enumerate(engines)), spare, delay, [], 0

    async def active(self):
        return {i: LocalHandle(e) for i, e in self.engines.items()}

    async def coming(self):
        return self.starting

    async def died(self, ids):
        self.reported += ids
        for i in ids:
            self.engines.pop(i, None)
        if self.spare is not None:
            self.starting += 1
            await asyncio.sleep(self.delay)
            self.engines[100 + len(self.reported)] = self.spare
            self.starting -= 1


def test_with_a_fleet_the_rollout_waits_for_a_replacement_when_its_only_engine_dies():
    dying, spare = DyingEngine(after_starts=2), FakeEngine()
    fleet = FakeFleet([dying], spare)
    c = _controller([], fleet=LocalHandle(fleet), rollout=dict(vllm_generate_batch_size=2))
    dying.known_dead = lambda: 0 in c.dead_engines
    groups, m = c.run(_source([{"delay": 0.2, "scores": VALID}] * 20), target=4)
    assert fleet.reported == [0], "the death was reported to the fleet once"
    assert sorted(g[0].prompt_ids[0] for g in groups) == [0, 1, 2, 3] and m["rollout/groups_rerouted"] == 2
    assert spare.started[:2] == [0, 1], "the dead engine's groups restarted first, on the replacement"
    assert dying.calls_after_death == 0 and list(c.balancer.loads.values()) == [0, 0]


def test_groups_on_an_engine_the_fleet_retires_restart_at_once_even_if_its_calls_never_answer():
    """A weight sync found the engine dead (its node lost) and the fleet retired it, but calls already made to it
    hang: the rollout restarts its groups elsewhere at its next look at the fleet, rather than waiting on them."""
    class Hanging(FakeEngine):
        async def generate_group(self, prompt_ids, label, *args):
            self.started.append(prompt_ids[0])
            if len(self.started) == 2:
                fleet.engines.pop(0)
            await asyncio.Event().wait()

    hanging, healthy = Hanging(), FakeEngine()
    fleet = FakeFleet([hanging, healthy])
    c = _controller([], fleet=LocalHandle(fleet))
    groups, m = c.run(_source([{"delay": 0.6, "scores": VALID}] * 20), target=6)
    assert hanging.started == [0, 2] and m["rollout/groups_rerouted"] == 2
    assert sorted(g[0].prompt_ids[0] for g in groups) == [0, 1, 2, 3, 4, 5], "the retired engine's groups were lost"
    assert healthy.started[4:6] == [0, 2], "its groups restarted before any new prompt"
    assert c.dead_engines == {0} and fleet.reported == []


def test_with_a_fleet_that_has_no_replacement_left_the_rollout_stops_with_the_error():
    dying = DyingEngine(after_starts=1)
    c = _controller([], fleet=LocalHandle(FakeFleet([dying])))
    dying.known_dead = lambda: 0 in c.dead_engines
    with pytest.raises(RuntimeError, match="all 1 vLLM engines died"):
        c.run(_source([{"delay": 0.2, "scores": VALID}] * 20), target=3)


def test_too_many_agent_failures_stop_the_run_with_the_first_error():
    labels = [{"delay": 0.0, "scores": VALID, "error": ("error", "ValueError: bad tool call")}] * 4
    with pytest.raises(AgentFailureError, match="bad tool call"):
        _controller([FakeEngine()], agent=dict(max_error_ratio=0.5)).run(_source(labels), target=2)
    groups, m = _controller([FakeEngine()], agent=dict(max_error_ratio=1.0)).run(_source(labels), target=2)
    assert m["rollout/agent_errors"] >= 4 and m["rollout/agent_first_error"] == "ValueError: bad tool call"


def test_reward_failures_are_counted_apart_from_agent_failures_and_stop_past_their_own_ratio():
    timeouts = [{"delay": 0.0, "scores": VALID, "error": ("reward_timeout", "RewardTimeout: 10 s")}] * 4
    groups, m = _controller([FakeEngine()], agent=dict(max_error_ratio=0.0), reward=dict(max_error_ratio=1.0)).run(
        _source(timeouts), target=2)
    assert m["rollout/reward_timeouts"] >= 4 and m["rollout/agent_errors"] == m["rollout/agent_timeouts"] == 0
    assert m["rollout/reward_first_error"] == "RewardTimeout: 10 s"
    with pytest.raises(AgentFailureError, match="lost their reward in this batch, above --reward.max_error_ratio "
                                                "0.5; first error: RewardTimeout"):
        _controller([FakeEngine()], agent=dict(max_error_ratio=1.0), reward=dict(max_error_ratio=0.5)).run(
            _source(timeouts), 2)


def test_admission_margin_starts_extra_groups_and_aborts_them():
    labels = [{"delay": 0.01, "scores": VALID}] * 4 + [{"delay": 30, "scores": VALID}] * 8
    _, exact = _controller([FakeEngine()], rollout=dict(vllm_generate_batch_size=16), algo=NO_FILTER).run(
        _source(labels), 4)
    _, extra = _controller([FakeEngine()], rollout=dict(vllm_generate_batch_size=16, admission_margin=1.0),
                           algo=NO_FILTER).run(_source(labels), 4)
    assert exact["rollout/groups_started"] == 4 and exact["rollout/groups_aborted"] == 0
    assert extra["rollout/groups_started"] == 8 and extra["rollout/groups_aborted"] == 4


def test_carry_over_hands_running_and_surplus_groups_to_the_next_batch():
    engine = FakeEngine()
    c = _controller([engine], rollout=dict(vllm_generate_batch_size=8, admission_margin=1.0, unbiased_early_stop=True),
                    algo=NO_FILTER, carry_over=True)
    # Batch 1 fills with two quick groups while two slow ones run; they must finish into batch 2, not be aborted.
    # (Unbiased, so batch 2 is a prefix of the start order; the biased rule would prefer quicker new groups.)
    labels = ([{"delay": 0.01, "scores": VALID}] * 2 + [{"delay": 0.2, "scores": VALID, "tokens": 40}] * 2
              + [{"delay": 0.01, "scores": VALID}] * 400)  # carry over keeps 8 in flight all along

    async def two_batches():  # one event loop, so the fake engine's tasks outlive the first batch
        source = _source(labels)
        first = await c.run_async(source, target=2)
        carried = len(c.carried)
        second = await c.run_async(source, target=2)
        return first, carried, second

    (g1, m1), carried, (g2, m2) = asyncio.run(two_batches())
    assert m1["rollout/groups_aborted"] == 0 and carried == m1["rollout/groups_carried_out"] >= 2
    assert m2["rollout/groups_carried_in"] == carried
    lengths = [len(g[0].response_ids) for g in g2]
    assert lengths == [40, 40], "the carried groups must run to the end and come first in the next batch"
    assert not engine.aborted
    stats = c.close()
    assert c.carried == [] and list(c.balancer.loads.values()) == [0] and not engine.running
    assert stats["aborted"] + len(g1) + len(g2) == m1["rollout/groups_started"] + m2["rollout/groups_started"]


def test_carried_over_groups_of_an_engine_that_died_between_batches_are_rerouted():
    live, dying = FakeEngine(), DyingEngine()
    c = _controller([live, dying], rollout=dict(vllm_generate_batch_size=8, admission_margin=1.0,
                                                  unbiased_early_stop=True), algo=NO_FILTER, carry_over=True)
    dying.known_dead = lambda: 1 in c.dead_engines
    # Batch 1: two quick groups, while one slow group runs on each engine and is carried over.
    labels = ([{"delay": 0.01, "scores": VALID}] * 2 + [{"delay": 0.3, "scores": VALID, "tokens": 40}] * 2
              + [{"delay": 0.01, "scores": VALID}] * 400)  # carry over keeps 8 in flight all along

    async def two_batches():
        source = _source(labels)
        first = await c.run_async(source, target=2)
        dying.kill()  # between the batches, while its carried group runs
        return first, await c.run_async(source, target=2)

    (_, m1), (g2, m2) = asyncio.run(two_batches())
    assert m1["rollout/engine_failures"] == 0 and m1["rollout/groups_carried_out"] >= 2
    assert m2["rollout/engine_failures"] == 1 and m2["rollout/groups_rerouted"] >= 1
    assert [g[0].prompt_ids[0] for g in g2] == [2, 3], "the carried groups, rerun if need be, come first"
    assert [len(g[0].response_ids) for g in g2] == [40, 40]
    c.close()
    assert list(c.balancer.loads.values()) == [0, 0] and dying.calls_after_death == 0 and not live.running


def _starving(**algo):
    """Settings for starvation tests: batches of 4 groups, a bound of 2 batches' worth (8 groups judged)."""
    return {"dynamic_filtering_max_num_gen_batches": 2, **algo}


@pytest.mark.parametrize("rollout", [{}, {"unbiased_early_stop": True}, {"early_stop": False}],
                         ids=["early_stop", "unbiased", "waves"])
def test_a_starved_batch_does_what_the_flag_says_after_its_bound_of_groups(rollout):
    # The task is learned: 3 groups still vary, every later one is flat. The batch wants 4 and may judge 8.
    labels = [{"delay": 0.0, "scores": VALID}] * 3 + [{"delay": 0.0, "scores": FLAT}] * 100
    outcomes = {}
    for action in ("partial", "fill", "stop"):
        c = _controller([FakeEngine()], rollout=rollout, algo=_starving(dynamic_filtering_on_starved=action))
        outcomes[action] = c.run(_source(labels), target=4)
        assert list(c.balancer.loads.values()) == [0]
    for action, (groups, m) in outcomes.items():
        assert m["rollout/groups_started"] == 8 and m["rollout/groups_finished"] == 8, action
        assert m["rollout/starved_batches"] == 1
    partial, m = outcomes["partial"]
    assert [g[0].prompt_ids[0] for g in partial] == [0, 1, 2] and m["rollout/groups_missing"] == 1
    assert m["rollout/groups_accepted"] == 3 and m["rollout/groups_flat_filled"] == 0
    assert m["rollout/starved_reason"] == ("the task is solved: 5 of the last 8 groups were flat (every sample "
                                           "scored the same; mean score 1) and 3 of the 4 groups wanted varied, "
                                           f"after {m['rollout/time_to_batch_s']:.0f} s")
    filled, m = outcomes["fill"]
    assert [[ep.score for ep in g] for g in filled] == [VALID] * 3 + [FLAT]
    assert m["rollout/groups_flat_filled"] == 1 and m["rollout/groups_missing"] == 0 and "rollout/stop_reason" not in m
    stopped, m = outcomes["stop"]
    assert stopped == [] and m["rollout/stop_reason"].startswith("the task is solved: 5 of the last 8 groups")
    assert "rollout/starved_reason" not in m


def test_partial_with_no_valid_group_stops_the_run_and_a_full_batch_is_never_starved():
    c = _controller([FakeEngine()], algo=_starving())
    flat = [{"delay": 0.0, "scores": [0.0, 0.0]}] * 100
    groups, m = c.run(_source(flat), target=4)
    assert groups == [] and m["rollout/groups_started"] == 8
    # Nothing but zeros seen: the scores never varied, which is not a task learned (nor out of reach).
    assert m["rollout/stop_reason"].startswith("the scores have never varied in this run: all 16 samples scored 0")
    assert "check the prompt template" in m["rollout/stop_reason"]
    assert "8 of the last 8 groups" in m["rollout/stop_reason"]
    # Scores of 0 the reward gave by failing (a service's timeout above the run's, say) name the reward, not the
    # template: the soak benchmark ran 6,080 such samples under --reward.max_error_ratio 1 and trained nothing.
    failing = [{"delay": 0.0, "scores": [0.0, 0.0], "error": ("reward_error", "RewardError: the service's cause")}]
    _, m = _controller([FakeEngine()], algo=_starving()).run(_source(failing * 100), target=4)
    assert m["rollout/stop_reason"].startswith("the scores have never varied in this run: all 16 samples scored 0, "
                                               "16 of them because the reward failed (first: RewardError: the "
                                               "service's cause)")
    assert "check the prompt template" not in m["rollout/stop_reason"]
    c.score_range = (0.0, 1.0)  # the run has seen both
    _, m = c.run(_source(flat), target=4)
    assert m["rollout/stop_reason"].startswith("the prompts are out of the policy's reach: 8 of the last 8")
    # The default bound, 10 batches' worth: 15 flat groups before the valid ones still make a full batch.
    late = [{"delay": 0.0, "scores": FLAT}] * 15 + [{"delay": 0.0, "scores": VALID}] * 10
    groups, m = _controller([FakeEngine()]).run(_source(late), target=2)
    assert len(groups) == 2 and m["rollout/starved_batches"] == 0 and "rollout/starved_reason" not in m
    assert m["rollout/groups_started"] <= 20
    # Agents that fail are an error, reported before the batch starves.
    failing = [{"delay": 0.0, "scores": FLAT, "error": ("error", "ValueError: tool down")}] * 200
    with pytest.raises(AgentFailureError, match="tool down"):
        _controller([FakeEngine()], agent=dict(max_error_ratio=0.5)).run(_source(failing), target=2)


def test_a_time_bound_starves_a_slow_batch_and_aborts_what_still_runs():
    engine = FakeEngine()
    labels = [{"delay": 0.01, "scores": VALID}] + [{"delay": 30, "scores": VALID}] * 10
    c = _controller([engine], rollout=dict(vllm_generate_batch_size=4),
                    algo=_starving(dynamic_filtering_max_wait_s=0.3))
    groups, m = c.run(_source(labels), target=4)
    assert len(groups) == 1 and m["rollout/starved_batches"] == 1 and m["rollout/time_to_batch_s"] < 5
    assert m["rollout/groups_aborted"] == 3 and len(engine.aborted) == 3 and list(c.balancer.loads.values()) == [0]
    assert re.search(r"after [01] s$", m["rollout/starved_reason"]), m  # 0.3 s bound; rounded, 1 s under load
    # Without dynamic sampling nothing starves: a slow batch is waited for.
    _, m = _controller([FakeEngine()], algo={**NO_FILTER, "dynamic_filtering_max_wait_s": 0.05}).run(
        _source([{"delay": 0.2, "scores": VALID}] * 4), target=4)
    assert m["rollout/starved_batches"] == 0 and m["rollout/groups_accepted"] == 4


def test_with_carry_over_a_starved_batch_counts_groups_judged_and_carries_the_running_ones():
    engine = FakeEngine()
    c = _controller([engine], rollout=dict(vllm_generate_batch_size=8), algo=_starving(), carry_over=True)
    labels = ([{"delay": 0.0, "scores": VALID}] + [{"delay": 0.0, "scores": FLAT}] * 7
              + [{"delay": 0.2, "scores": VALID}] * 400)

    async def two_batches():
        source = _source(labels)
        first = await c.run_async(source, target=4)
        carried = len(c.carried)
        return first, carried, await c.run_async(source, target=4)

    (g1, m1), carried, (g2, m2) = asyncio.run(two_batches())
    assert len(g1) == 1 and m1["rollout/starved_batches"] == 1 and m1["rollout/groups_finished"] == 8
    assert carried == m1["rollout/groups_carried_out"] > 0 and m1["rollout/groups_aborted"] == 0
    assert len(g2) == 4 and m2["rollout/starved_batches"] == 0, "the slow valid groups fill the next batch"
    c.close()
    assert list(c.balancer.loads.values()) == [0] and not engine.running


def test_a_batch_of_several_rollouts_adds_up_their_counters():
    from openrlhf_async.trainer.pipeline import _merge_rollout_metrics

    batch = {}
    for m in ({"rollout/engine_failures": 1, "rollout/groups_rerouted": 2, "rollout/time_to_batch_s": 3.0},
              {"rollout/engine_failures": 1, "rollout/groups_rerouted": 0, "rollout/time_to_batch_s": 1.0}):
        _merge_rollout_metrics(batch, m)
    assert batch == {"rollout/engine_failures": 2, "rollout/groups_rerouted": 2, "rollout/time_to_batch_s": 1.0}


def test_the_generator_skips_flat_prompts_and_records_what_it_passed_over():
    """GenerateSamplesActor's batches (run in-process on a fake engine): a prompt whose group came out flat is
    passed over at --rollout.skip_flat_prompts when its turn comes again; the positions passed over count as used
    up, and each batch says which prompts came out flat for the trainer's checkpoint."""
    from openrlhf_async.data.prompts import PromptSampler, StreamProgress
    from openrlhf_async.trainer.pipeline import GenerateSamplesActor

    cfg = preset_config("--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4",
                        "--rollout.skip_flat_prompts", "0.9")
    prompts = [{"prompt_ids": [i], "label": {"delay": 0.0, "scores": FLAT if i % 2 else VALID}} for i in range(8)]
    generator = GenerateSamplesActor(cfg, [LocalHandle(FakeEngine())], prompts, queue=None)
    progress, batches = StreamProgress(), []
    for _ in range(12):
        groups, metrics, used, flat = generator._batch(target_version=0)
        assert [g[0].prompt_ids[0] % 2 for g in groups] == [0, 0]
        progress.add((p for p, _ in used), flat)
        batches.append((metrics, used, flat))
    used = [u for _, batch_used, _ in batches for u in batch_used]
    skipped_total = sum(m["rollout/prompts_skipped"] for m, _, _ in batches)
    # Every position is used up exactly once, passed over or not.
    assert sorted(p for p, _ in used) == list(range(len(used)))
    # The first epoch has no history, so nothing in it is passed over; its flat prompts are recorded as such.
    outcomes = [o for _, _, flat in batches for o in flat]
    assert {row for row, is_flat in outcomes if is_flat} == {1, 3, 5, 7}
    assert not any(is_flat for row, is_flat in outcomes if row % 2 == 0)
    flat_drawn = sum(1 for _, is_flat in outcomes if is_flat)
    aborted = sum(m["rollout/groups_aborted"] for m, _, _ in batches)
    assert len(used) == len(outcomes) + skipped_total + aborted
    assert skipped_total > 3 * (flat_drawn - 4), "about 9 in 10 later turns of a flat prompt are passed over"
    assert progress.state()["flat"] == [1, 3, 5, 7] and progress.frontier == len(used)
    # A resumed run passes over the same flat prompts.
    again = PromptSampler(prompts, cfg.train.seed, skip_flat=0.9, **progress.state())
    drawn = [again.next()["id"] for _ in range(20)]
    assert sum(row % 2 for row in drawn) < 5 and {row for _, row in again.take_skipped()} <= {1, 3, 5, 7}


def test_carry_over_keeps_every_allowed_group_in_flight_and_the_balancer_counts_episodes_per_engine(monkeypatch):
    # Without carry over the stop rule starts only what the batch needs (2 groups for 2 valid); with it, running
    # groups are never lost, so the controller fills --rollout.vllm_generate_batch_size to keep vLLM's batch full.
    labels = [{"delay": 0.05, "scores": VALID}] * 40
    _, alone = _controller([FakeEngine()], rollout=dict(vllm_generate_batch_size=8), algo=NO_FILTER).run(
        _source(labels), 2)
    filled = _controller([FakeEngine()], rollout=dict(vllm_generate_batch_size=8), algo=NO_FILTER, carry_over=True)
    _, full = filled.run(_source(labels), 2)
    filled.close()
    assert alone["rollout/groups_started"] == 2 and full["rollout/groups_started"] == 8
    # Near a run's end no more are started than the batches left will use: with one batch of 2 to follow (and no
    # rate seen yet, so one valid in one), 2 for this batch and 2 for the next.
    ending = _controller([FakeEngine()], rollout=dict(vllm_generate_batch_size=8), algo=NO_FILTER, carry_over=True)
    _, one_more = ending.run(_source(labels), 2, remaining=1)
    ending.close()
    assert one_more["rollout/groups_started"] == 4
    # A run's last batch starts only what it needs: no batch follows to use the rest; the groups it carried in run on.
    ending = _controller([FakeEngine()], rollout=dict(vllm_generate_batch_size=8), algo=NO_FILTER, carry_over=True)

    async def a_full_batch_then_the_last():
        source = _source(labels)
        await ending.run_async(source, 2)
        carried = len(ending.carried)
        _, last = await ending.run_async(source, 2, remaining=0)
        return carried, last

    carried_in, last = asyncio.run(a_full_batch_then_the_last())
    stats = ending.close()
    assert carried_in == 6 and last["rollout/groups_carried_in"] == 6 and last["rollout/groups_started"] == 0
    assert stats["aborted"] == 4  # the carried groups the last batch did not use, and nothing else
    # The engine's capacity: 4 x --vllm.max_num_seqs by default, the flag, or OPENRLHF_ASYNC_NUM_TASKS over both.
    vllm = preset_config(validated=False).vllm
    assert config_with(preset_config(validated=False), vllm={"max_num_seqs": 16}).vllm.concurrency() == 64
    assert config_with(preset_config(validated=False), vllm={"max_concurrency": 24}).vllm.concurrency() == 24
    monkeypatch.setenv("OPENRLHF_ASYNC_NUM_TASKS", "12")
    assert vllm.concurrency() == 12
    assert _controller([FakeEngine()], vllm={"max_concurrency": 100}).balancer.capacity == 12


class LearningEngine(FakeEngine):
    """A policy that learns its task: every group after the first `solved_after` scores 1.0 on every sample."""

    def __init__(self, solved_after: int):
        super().__init__()
        self.solved_after = solved_after

    async def generate_group(self, prompt_ids, label, *args, **kwargs):
        if len(self.started) >= self.solved_after:
            label = {**label, "scores": [1.0] * len(label["scores"])}
        return await super().generate_group(prompt_ids, label, *args, **kwargs)


class _ThreadQueue:
    """ray.util.queue.Queue's calls, between two threads of one process."""

    def __init__(self):
        import queue

        self.items = queue.Queue()

    def qsize(self):
        return self.items.qsize()

    def put(self, item, timeout=None):
        self.items.put(item)

    def get(self, timeout=None):
        import queue

        from ray.util.queue import Empty

        try:
            return self.items.get(timeout=timeout)
        except queue.Empty:
            raise Empty from None


def _starving_run(monkeypatch, action, mode="sync", solved_after=6, *flags):
    """GenerateSamplesActor and TrainingActor in-process (a thread each; a fake engine whose policy learns the task
    after `solved_after` groups; a timed stand-in for the optimizer step) over 6 steps of 2 groups, the starvation
    bound at 2 batches' worth. Returns (the trainer's summary, its step records, the generator's result)."""
    import threading

    import ray.util.queue  # noqa: F401 (imported by both threads at once, Ray's import fails)

    from openrlhf_async.trainer import pipeline

    sync = StandInSync()
    monkeypatch.setattr(pipeline, "_live_version", lambda engines: sync.version)
    cfg = preset_config("--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4",
                        "--rollout.vllm_generate_batch_size", "2", "--train.max_steps", "6", "--ckpt.save_steps", "-1",
                        "--algo.dynamic_filtering_max_num_gen_batches", "2", "--algo.dynamic_filtering_on_starved",
                        action, "--mode", mode, *flags)
    prompts = [{"prompt_ids": [i], "label": {"delay": 0.0, "scores": VALID}} for i in range(20)]
    queue, logged = _ThreadQueue(), _ThreadQueue()
    generator = pipeline.GenerateSamplesActor(cfg, [LocalHandle(LearningEngine(solved_after))], prompts, queue)
    trainer = pipeline.TrainingActor(cfg, NO_POLICY, sync, queue, logged, [],
                                     num_prompts=len(prompts), stand_in_train_s=0.0)
    result = {}
    thread = threading.Thread(target=lambda: result.update(generator.run(cfg.train.max_steps)))
    thread.start()
    try:
        summary = trainer.run()
    finally:
        generator.stop()
        thread.join(timeout=30)
    steps = [logged.items.get() for _ in range(logged.qsize())]
    return summary, steps, result


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_whose_task_is_learned_ends_as_the_flag_says(monkeypatch, mode):
    # Groups 1-6 vary (3 full steps), then every group is flat: step 4 starves after judging 4 groups.
    summary, steps, result = _starving_run(monkeypatch, "stop", mode)
    assert summary["stopped_early"]["step"] == 4 and [m["step"] for m in steps] == [1, 2, 3]
    assert summary["stopped_early"]["reason"].startswith("the task is solved: 4 of the last 4 groups were flat")
    assert result["stopped_early"] == summary["stopped_early"]["reason"] and summary["starved_batches"] == 0
    # partial: a step with one valid group trains on it; with none the run ends as with stop.
    summary, steps, _ = _starving_run(monkeypatch, "partial", mode, 7)
    assert summary["stopped_early"]["step"] == 5 and [m["step"] for m in steps] == [1, 2, 3, 4]
    assert [m["rollout/groups_accepted"] for m in steps] == [2, 2, 2, 1]
    assert [m["rollout/starved_batches"] for m in steps] == [0, 0, 0, 1] and summary["starved_batches"] == 1
    assert steps[-1]["rollout/groups_missing"] == 1 and steps[-1]["rollout/groups_started"] == 4
    assert "1 of the 2 groups wanted varied" in steps[-1]["rollout/starved_reason"]
    # fill: the run goes on to its last step, each starved batch topped up with flat groups (counted).
    summary, steps, _ = _starving_run(monkeypatch, "fill", mode, 7)
    assert summary["stopped_early"] is None and [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    assert [m["rollout/groups_flat_filled"] for m in steps] == [0, 0, 0, 1, 2, 2]
    assert all(m["rollout/groups_accepted"] == 2 for m in steps) and summary["groups_flat_filled"] == 5


def test_a_prompt_set_all_flat_and_set_aside_ends_the_run_when_starvation_stops_it():
    from openrlhf_async.trainer.pipeline import GenerateSamplesActor

    prompts = [{"prompt_ids": [i], "label": {"delay": 0.0, "scores": FLAT}} for i in range(3)]

    def first_batch(action, skip):
        cfg = preset_config("--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.batch_size",
                            "4", "--rollout.skip_flat_prompts", skip, "--algo.dynamic_filtering_on_starved", action)
        return GenerateSamplesActor(cfg, [LocalHandle(FakeEngine())], prompts, queue=None)._batch(target_version=0)

    groups, metrics, _, flat = first_batch("stop", "0.5")
    assert groups == [] and {row for row, is_flat in flat if is_flat} == {0, 1, 2}
    assert len(flat) < 20, "it ends once every prompt is flat, before the starvation bound"
    assert metrics["rollout/stop_reason"] == ("the whole prompt set is solved: the last group of each of its 3 "
                                              "prompts was flat")
    # Without setting flat prompts aside, or with a flag that goes on while it can, the prompts keep coming back
    # until the starvation bound (10 batches' worth) ends the batch.
    for action, skip in (("stop", "0"), ("partial", "0.5")):
        groups, metrics, _, _ = first_batch(action, skip)
        assert groups == [] and metrics["rollout/groups_started"] == 20 and metrics["rollout/starved_batches"] == 1
        assert metrics["rollout/stop_reason"].startswith("the scores have never varied in this run: all 40 samples")


def test_the_unbiased_stop_gives_the_same_batches_and_counters_however_long_each_group_takes():
    """--rollout.unbiased_early_stop in sync mode repeats (docs/RUNNING.md): three batches of two runs whose groups
    score alike but finish in other orders (each group's time drawn by another seed) are the same prompts with the
    same counters (each batch starting where the one before left off). 090a44e aborted the groups past the cut and took
    outcomes as groups finished: its batch 1 aborted 3 groups in one run and 1 in the other, and its batch 3 differed."""
    import random

    def three_batches(seed):
        times, scores = random.Random(seed), random.Random(0)
        labels = iter(enumerate([{"delay": times.choice([0.001, 0.05, 0.2]),
                                  "scores": VALID if scores.random() < 0.4 else FLAT} for _ in range(200)]))

        def next_prompt():
            i, label = next(labels)
            return {"prompt_ids": [i, 2], "label": label}

        c = _controller([FakeEngine(), FakeEngine()], rollout=dict(unbiased_early_stop=True,
                                                                   vllm_generate_batch_size=8))
        batches = []
        for _ in range(3):
            groups, m = c.run(next_prompt, target=4)
            counters = {k: v for k, v in m.items() if k.startswith("rollout/") and not k.endswith("_s")
                        and "overrun" not in k and "engine_load" not in k and "per_s" not in k}
            batches.append(([g[0].prompt_ids[0] for g in groups], counters))
        return batches

    assert three_batches(1) == three_batches(2)
