"""The rollout controller: FIFO task creation, a global least-load balancer, the dynamic-sampling filter applied
to each group as it completes, and early stop (queued groups never start, running ones are aborted in vLLM).

With screening on, a group whose first samples all score the same comes back from its engine with those alone,
and is dropped as flat.
With early stop off it runs the usual dynamic sampling instead: generate a whole wave of prompts, wait for all of
it, filter, and start another wave until enough groups are valid. Both modes share everything else.
A group whose engine actor dies restarts from its prompt on a live engine; the dead engine is not used again."""

import asyncio
import itertools
import math
import time
from types import SimpleNamespace
from typing import Callable, Optional

from openrlhf_async.reward.sources import RewardError, check_reward
from openrlhf_async.rollout.episode import scores_vary


class LoadBalancer:
    """In-flight episodes per engine. A group goes to the least-loaded engine if it fits under that engine's
    capacity (a group larger than the capacity still runs alone on an idle engine)."""

    def __init__(self, num_engines: int, capacity: int):
        self.loads, self.capacity = [0] * num_engines, capacity
        self.dead = set()  # engines never chosen again; their load stays 0
        self._samples = [0] * num_engines  # for the time-averaged load per engine
        self._events = 0

    def acquire(self, amount: int) -> Optional[int]:
        live = [i for i in range(len(self.loads)) if i not in self.dead]
        if not live:
            return None
        engine = min(live, key=lambda i: (self.loads[i], i))
        if self.loads[engine] and self.loads[engine] + amount > self.capacity:
            return None
        self.loads[engine] += amount
        self._sample()
        return engine

    def mark_dead(self, engine: int) -> None:
        """The engine is gone: its groups are dropped (or rerouted) by the caller, so its load is too."""
        self.dead.add(engine)
        self.loads[engine] = 0
        self._sample()

    def release(self, engine: int, amount: int) -> None:
        if engine in self.dead:  # already zeroed when it died
            return
        self.loads[engine] -= amount
        if self.loads[engine] < 0:
            raise AssertionError(f"engine {engine} released more load than it held")
        self._sample()

    def _sample(self):
        self._events += 1
        for i, load in enumerate(self.loads):
            self._samples[i] += load

    def mean_loads(self) -> list:
        return [s / max(1, self._events) for s in self._samples]


def keep_group(scores: list, rule: str = "std", eps: float = 1e-6, low: float = 0.0, high: float = 1.0) -> bool:
    """DAPO dynamic sampling: keep a group only if it carries a learning signal."""
    if rule == "std":
        return scores_vary(scores, eps)
    mean = sum(scores) / len(scores)
    return low + 1e-6 < mean < high - 1e-6  # OpenRLHF's rule: the mean strictly inside (low, high)


def overlong_penalty(length: int, budget: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to budget - buffer, then down linearly to -factor at the budget."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -factor * min(1.0, (length - (budget - buffer)) / buffer)


def group_tokens(group: list) -> int:
    """Tokens the model generated for a group's episodes (observation tokens left out)."""
    return sum(sum(ep["action_mask"]) for ep in group)


class LocalHandle:
    """Calls an in-process object the way Ray calls an actor: handle.method.remote(...) returns an awaitable.
    Lets tests and the controller benchmark drive the controller with fake engines."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return SimpleNamespace(remote=lambda *args, **kwargs: asyncio.ensure_future(method(*args, **kwargs)))


class AgentFailureError(RuntimeError):
    """Too many of a batch's episodes failed in the agent's step or lost their reward."""


# An episode's error kind -> (failure family, the counter it goes to).
ERROR_KINDS = {"error": ("agent", "agent_errors"), "timeout": ("agent", "agent_timeouts"),
               "reward_error": ("reward", "reward_errors"), "reward_timeout": ("reward", "reward_timeouts")}


_group_ids = itertools.count()
HOPELESS_GROUPS = 20  # batches' worth of finished groups with none valid, after which a rollout gives up


class RolloutController:
    def __init__(self, engines: list, *, n: int, sampling: dict, budget: int, max_concurrent_prompts: int,
                 capacity_per_engine: int, filter_rule: Optional[str] = "std", filter_eps: float = 1e-6,
                 filter_range: tuple = (0.0, 1.0), early_stop: bool = True, unbiased: bool = False,
                 overlong_buffer: int = 0, overlong_factor: float = 1.0, max_error_ratio: float = 1.0,
                 max_reward_error_ratio: float = 1.0,
                 abort_timeout: float = 60.0, agent_path: Optional[str] = None, admission_margin: float = 0.0,
                 carry_over: bool = False, wave_size: int = 0, on_group: Optional[Callable] = None,
                 screen_samples: int = 0):
        self.engines, self.n, self.sampling, self.budget = engines, n, sampling, budget
        self.max_concurrent_prompts, self.capacity = max_concurrent_prompts, capacity_per_engine
        self.filter_rule, self.filter_eps, self.filter_range = filter_rule, filter_eps, filter_range
        self.early_stop, self.unbiased = early_stop, unbiased
        self.overlong_buffer, self.overlong_factor = overlong_buffer, overlong_factor
        self.max_error_ratio, self.abort_timeout = max_error_ratio, abort_timeout
        self.max_reward_error_ratio = max_reward_error_ratio
        self.agent_path = agent_path  # None: the engines' own agent
        self.admission_margin = admission_margin
        # Carry over: groups still running when a batch is complete keep running and join the next batch
        # (surplus valid groups too) instead of being aborted. Their tokens may then span weight versions.
        self.carry_over = carry_over and early_stop
        self.carried = []  # records of groups started for an earlier batch and not used yet
        self.wave_size = wave_size  # waves (no early stop): prompts per wave; 0: the batch target. DAPO uses 3x
        self.on_group = on_group  # on_group(prompt, flat) for each finished group; flat: its rewards are all equal
        # Screening: a group's first screen_samples episodes run first; if they all score the same the engine
        # returns them alone and the group is dropped as flat without spending the other samples' tokens.
        self.screen_samples = screen_samples
        self.balancer = LoadBalancer(len(engines), capacity_per_engine)
        self._last_engine_error = None

    @property
    def dead_engines(self) -> set:
        """Indices of the engines found dead (their actor gone); this controller never uses them again."""
        return set(self.balancer.dead)

    def _all_dead_error(self) -> RuntimeError:
        return all_engines_dead(len(self.engines), self._last_engine_error)

    @classmethod
    def from_config(cls, cfg, engines: list, **overrides):
        settings = dict(
            n=cfg.rollout.n_samples_per_prompt,
            sampling={"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p},
            budget=cfg.rollout.max_new_tokens, max_concurrent_prompts=cfg.max_concurrent_prompts,
            capacity_per_engine=cfg.vllm.max_concurrency,
            filter_rule=cfg.algo.dynamic_filtering_rule if cfg.algo.dynamic_filtering_enable else None,
            filter_eps=cfg.algo.dynamic_filtering_std_eps, filter_range=tuple(cfg.algo.dynamic_filtering_range),
            early_stop=cfg.rollout.early_stop, unbiased=cfg.rollout.unbiased_early_stop,
            admission_margin=cfg.rollout.admission_margin, screen_samples=cfg.rollout.screen_samples,
            overlong_buffer=cfg.reward.overlong_buffer_len, overlong_factor=cfg.reward.overlong_penalty_factor,
            max_error_ratio=cfg.agent.max_error_ratio, max_reward_error_ratio=cfg.reward.max_error_ratio,
            agent_path=cfg.agent.func_path)
        settings.update(overrides)
        return cls(engines, **settings)

    def _keep(self, group: list) -> bool:
        if self.filter_rule is None:
            return True
        return keep_group([e["score"] for e in group], self.filter_rule, self.filter_eps, *self.filter_range)

    def run(self, next_prompt: Callable[[], dict], target: int) -> tuple:
        """Collect `target` valid groups. next_prompt() -> {"prompt_ids", "label"} (and optionally "budget": the
        group's token budget, or one per sample) is called once per started group, in order.
        Returns (groups, metrics); each episode carries "reward" (score plus shaping)."""
        return asyncio.run(self.run_async(next_prompt, target))

    async def run_async(self, next_prompt: Callable[[], dict], target: int) -> tuple:
        start = time.perf_counter()
        records, pending = [], {}  # records in start order; pending: task -> record
        stats = dict.fromkeys(["started", "finished", "aborted", "screened", "tokens", "tokens_aborted",
                               "tokens_screened", "episodes",
                               "agent_errors", "agent_timeouts", "reward_errors", "reward_timeouts", "rerouted"], 0)
        dead_before = len(self.balancer.dead)
        if dead_before == len(self.engines):
            raise self._all_dead_error()
        reroute = []  # records whose engine died, in start order: they restart before any new prompt
        first_error, failure = {}, None  # failure family ("agent", "reward") -> its first error message
        wave_size = self.wave_size or target
        wave_left = wave_size if not self.early_stop else None  # prompts still to start in the current wave

        def wanted() -> int:
            """Early stop: groups in flight expected to yield the valid groups still missing, at the valid rate
            seen so far (optimistic prior: one valid group). Starting more only buys speed with aborted tokens."""
            if not self.early_stop:
                return self.max_concurrent_prompts
            valid = sum(1 for r in finished_order if r["valid"])
            if self.unbiased and valid >= target:
                return 0  # the batch will come from groups already started
            rate = (valid + 1) / (len(finished_order) + 1)
            return math.ceil(max(0, target - valid) / rate * (1 + self.admission_margin))

        def start_group(record: dict, engine: int) -> None:
            prompt = record["prompt"]
            record.update(group_id=f"g{next(_group_ids)}", engine=engine)
            record["ref"] = self.engines[engine].generate_group.remote(
                prompt["prompt_ids"], prompt["label"], self.n, self.sampling, record["group_id"],
                prompt.get("budget", self.budget), self.agent_path, self.screen_samples, self.filter_eps)
            pending[asyncio.ensure_future(_awaitable(record["ref"]))] = record

        def launch():
            nonlocal wave_left
            # Groups whose engine died were admitted already: they only wait for room on a live engine.
            while reroute and len(pending) < self.max_concurrent_prompts:
                engine = self.balancer.acquire(self.n)
                if engine is None:
                    return
                start_group(reroute.pop(0), engine)
            while (len(pending) < min(self.max_concurrent_prompts, wanted())
                   and (wave_left is None or wave_left > 0)):
                engine = self.balancer.acquire(self.n)
                if engine is None:
                    return
                try:
                    prompt = next_prompt()
                except BaseException:
                    self.balancer.release(engine, self.n)
                    raise
                record = {"index": len(records), "prompt": prompt, "group": None, "valid": None}
                records.append(record)
                start_group(record, engine)
                stats["started"] += 1
                if wave_left is not None:
                    wave_left -= 1

        def engine_died(engine: int, error: BaseException) -> Optional[RuntimeError]:
            """Stop using the engine and queue its running groups to restart elsewhere (their calls fail anyway).
            Returns the error to stop on once no engine is left."""
            self._last_engine_error = error
            self.balancer.mark_dead(engine)
            for task, record in list(pending.items()):
                if record["engine"] == engine:
                    pending.pop(task)
                    _discard(task)
                    reroute.append(record)
                    stats["rerouted"] += 1
            reroute.sort(key=lambda r: r["index"])
            return self._all_dead_error() if len(self.balancer.dead) == len(self.engines) else None

        def selected():
            """The batch, once it is decided; None while it is not."""
            if self.early_stop and not self.unbiased:
                valid = [r for r in finished_order if r["valid"]]
                return valid[:target] if len(valid) >= target else None
            if self.early_stop:  # unbiased: a prefix of the start order, all finished, with enough valid groups
                valid = []
                for r in records:
                    if r["group"] is None:
                        return None
                    if r["valid"]:
                        valid.append(r)
                        if len(valid) == target:
                            return valid
                return None
            if pending or wave_left or reroute:  # waves: decide only between waves
                return None
            valid = [r for r in records if r["valid"]]
            return valid[:target] if len(valid) >= target else None

        finished_order = []
        batch = None
        carried_in, self.carried = self.carried, []
        for record in carried_in:  # started earlier, so first in start order
            record["index"] = len(records)
            records.append(record)
            if record["group"] is not None:
                finished_order.append(record)
            elif record["ref"] is None or record["engine"] in self.balancer.dead:
                reroute.append(record)  # its engine died in an earlier batch
                stats["rerouted"] += record["ref"] is not None
            else:
                pending[asyncio.ensure_future(_awaitable(record["ref"]))] = record
        try:
            batch = selected()  # carried-over groups alone may complete it
            if batch is None:
                launch()
            while batch is None and pending:
                done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task not in pending:  # moved off an engine that died meanwhile
                        continue
                    record = pending.pop(task)
                    self.balancer.release(record["engine"], self.n)
                    try:
                        group = task.result()
                    except Exception as e:
                        if _engine_died(e) and failure is None:  # the engine actor is gone: run it elsewhere
                            reroute.append(record)
                            stats["rerouted"] += 1
                            failure = engine_died(record["engine"], e)
                        else:  # an engine failed: stop, after cleaning up
                            failure = failure or e
                        continue
                    record["group"] = group
                    stats["finished"] += 1
                    self._score(group, stats)
                    for ep in group:
                        if ep["error"]:
                            first_error.setdefault(ERROR_KINDS[ep["error"][0]][0], ep["error"][1])
                    screened = len(group) < self.n  # its first samples all scored the same: dropped as flat
                    if screened:
                        stats["screened"] += 1
                        stats["tokens_screened"] += group_tokens(group)
                    record["valid"] = not screened and self._keep(group)
                    finished_order.append(record)
                    if self.on_group is not None:
                        self.on_group(record["prompt"], screened or not scores_vary([e["score"] for e in group],
                                                                                    self.filter_eps))
                if failure is None:
                    failure = self._hopeless(stats, first_error, target, finished_order)
                if failure is not None:
                    break
                batch = selected()
                if batch is None and self.unbiased and self.early_stop and not self.carry_over:
                    # Groups started after the target-th valid one cannot enter this batch: abort them now
                    # (with carry over they wait for the next one instead).
                    valid = [r["index"] for r in records if r["valid"]]
                    if len(valid) >= target:
                        last = valid[target - 1]
                        await self._abort({t: r for t, r in pending.items() if r["index"] > last}, pending, stats)
                        stats["aborted"] += sum(1 for r in reroute if r["index"] > last)
                        reroute[:] = [r for r in reroute if r["index"] < last]
                if batch is None:
                    if not self.early_stop and not pending and not wave_left and not reroute:
                        wave_left = wave_size  # the wave is done and short of valid groups: start another
                    launch()
        finally:
            if self.carry_over and batch is not None and failure is None:
                chosen = {id(r) for r in batch}
                self.carried = [r for r in finished_order if r["valid"] and id(r) not in chosen]
                self.carried += list(pending.values())
                pending.clear()
                for record in reroute:  # restarted on a live engine by the next batch
                    record["ref"] = None
                self.carried += reroute
            else:
                stats["aborted"] += len(reroute)
            await self._abort(dict(pending), pending, stats)
        if failure is not None:
            raise failure
        if batch is None:
            raise RuntimeError("rollout ended without enough valid groups")

        accepted_tokens = sum(group_tokens(r["group"]) for r in batch)
        loads = self.balancer.mean_loads()
        metrics = {
            "rollout/groups_started": stats["started"],
            "rollout/groups_finished": stats["finished"],
            "rollout/groups_accepted": len(batch),
            "rollout/groups_filtered": sum(1 for r in records if r["valid"] is False),  # screened ones too
            "rollout/groups_screened": stats["screened"],
            "rollout/groups_aborted": stats["aborted"],
            "rollout/groups_carried_in": len(carried_in),
            "rollout/groups_carried_out": len(self.carried),
            "rollout/tokens_generated": stats["tokens"],
            "rollout/tokens_accepted": accepted_tokens,
            "rollout/tokens_aborted": stats["tokens_aborted"],
            "rollout/tokens_screened": stats["tokens_screened"],
            "rollout/wasted_fraction": 1 - accepted_tokens / max(1, stats["tokens"]),
            "rollout/time_to_batch_s": time.perf_counter() - start,
            "rollout/engine_load_max": max(loads),
            "rollout/engine_load_min": min(loads),
            "rollout/agent_errors": stats["agent_errors"],
            "rollout/agent_timeouts": stats["agent_timeouts"],
            "rollout/reward_errors": stats["reward_errors"],
            "rollout/reward_timeouts": stats["reward_timeouts"],
            "rollout/engine_failures": len(self.balancer.dead) - dead_before,
            "rollout/groups_rerouted": stats["rerouted"],
        }
        for family, message in first_error.items():
            metrics[f"rollout/{family}_first_error"] = message
        failure = self._agent_failure(stats, first_error)
        if failure is not None:
            raise failure
        return [r["group"] for r in batch], metrics

    def _agent_failure(self, stats: dict, first_error: dict, min_episodes: int = 0):
        """An AgentFailureError once at least min_episodes have ended and too many of them failed in the agent
        (or lost their reward)."""
        for family, ratio in (("agent", self.max_error_ratio), ("reward", self.max_reward_error_ratio)):
            failed = stats[f"{family}_errors"] + stats[f"{family}_timeouts"]
            if stats["episodes"] >= min_episodes and failed > ratio * max(1, stats["episodes"]):
                what = "failed in the agent" if family == "agent" else "lost their reward"
                return AgentFailureError(f"{failed} of {stats['episodes']} episodes {what} in this batch, above "
                                         f"--{family}.max_error_ratio {ratio}; first error: {first_error[family]}")
        return None

    def _hopeless(self, stats: dict, first_error, target: int, finished: list):
        """An error to stop on when the batch cannot go well: agents failing above the allowed share over a
        batch's worth of episodes, or so many groups finished without one valid that none is likely to come."""
        failure = self._agent_failure(stats, first_error, min_episodes=target * self.n)
        if failure is not None:
            return failure
        if len(finished) >= HOPELESS_GROUPS * target and not any(r["valid"] for r in finished):
            return RuntimeError(f"none of {len(finished)} finished groups passed the dynamic-sampling filter (all "
                                f"rewards equal within each group): check the reward and the labels, or relax "
                                f"--algo.dynamic_filtering_rule / --algo.dynamic_filtering_enable")
        return None

    def close(self) -> dict:
        """Drop the groups carried over for a batch that will never be asked for, aborting those still running.
        Returns counts: groups dropped ("aborted"), their tokens, and the tokens generated meanwhile."""
        async def abort_all():
            stats = {"aborted": 0, "tokens": 0, "tokens_aborted": 0}
            pending = {asyncio.ensure_future(_awaitable(r["ref"])): r for r in self.carried
                       if r["group"] is None and r["ref"] is not None}
            for r in self.carried:
                if r["ref"] is None:  # waiting to restart after its engine died
                    stats["aborted"] += 1
                elif r["group"] is not None:  # finished and valid, but never used
                    stats["aborted"] += 1
                    stats["tokens_aborted"] += group_tokens(r["group"])
            self.carried = []
            await self._abort(dict(pending), pending, stats)
            return stats
        return asyncio.run(abort_all())

    def _score(self, group: list, stats: dict) -> None:
        for ep in group:
            stats["episodes"] += 1
            stats["tokens"] += sum(ep["action_mask"])
            try:
                check_reward(ep["score"], "the episode's score")
            except RewardError as e:  # whatever scored it, a bad score must reach neither the filter nor the trainer
                ep.update(score=0.0, error=ep["error"] or ("reward_error", f"{type(e).__name__}: {e}"))
            if ep["error"]:
                stats[ERROR_KINDS[ep["error"][0]][1]] += 1
            ep["reward"] = ep["score"] + overlong_penalty(len(ep["response_ids"]), self.budget,
                                                          self.overlong_buffer, self.overlong_factor)

    async def _abort(self, groups: dict, pending: dict, stats: dict) -> None:
        """Abort these running groups (task -> record), wait for the engines to hand them back, release their
        load and take them out of pending."""
        if not groups:
            return
        by_engine = {}
        for record in groups.values():
            if record["engine"] not in self.balancer.dead:  # a call to a dead actor only raises
                by_engine.setdefault(record["engine"], []).append(record["group_id"])
        aborts = [_awaitable(self.engines[e].abort_groups.remote(ids)) for e, ids in by_engine.items()]
        await asyncio.gather(*aborts, return_exceptions=True)  # an engine that died here shows in its groups
        done, not_done = await asyncio.wait(list(groups), timeout=self.abort_timeout)
        for task, record in groups.items():
            pending.pop(task, None)
            self.balancer.release(record["engine"], self.n)
            stats["aborted"] += 1
            if task in done and not task.cancelled() and _engine_died(task.exception()):
                self._last_engine_error = task.exception()
                self.balancer.mark_dead(record["engine"])
            elif task in done and not task.cancelled() and task.exception() is None:
                tokens = group_tokens(task.result())
                stats["tokens"] += tokens
                stats["tokens_aborted"] += tokens
            elif task in not_done:
                task.cancel()


def all_engines_dead(count: int, last_error: BaseException) -> RuntimeError:
    return RuntimeError(f"all {count} vLLM engines died; last error: {type(last_error).__name__}: {last_error}")


def live_versions(engines: list, timeout_s: float = 60.0) -> dict:
    """{index: loaded weight version} of the engines whose actor is alive; raises when none is."""
    import ray

    refs = [e.get_weight_version.remote() for e in engines]
    versions, error = {}, None
    for i, ref in enumerate(refs):
        try:
            versions[i] = ray.get(ref, timeout=timeout_s)
        except Exception as e:
            if not _engine_died(e):
                raise
            error = e
    if not versions:
        raise all_engines_dead(len(engines), error)
    return versions


async def _awaitable(ref):
    return await ref


def _discard(task) -> None:
    """Drop a group's task: cancel it, or, if it already ended, take its result so asyncio does not warn."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


def _engine_died(error) -> bool:
    """Whether a call failed because the engine actor itself is gone (killed, crashed, unreachable), rather
    than because the call raised inside a live engine (RayTaskError, even when it wraps an actor error)."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
    except ImportError:  # no Ray: local engines cannot die apart from the caller
        return False
    return isinstance(error, (RayActorError, ActorUnavailableError)) and not isinstance(error, RayTaskError)
