"""The rollout controller: FIFO task creation, a global least-load balancer, the dynamic-sampling filter applied
to each group as it completes, and early stop (queued groups never start, running ones are aborted in vLLM).

The controller talks to the engines; the batch it is making (rollout/batch.py) keeps what happened and its stop
rule says when it is complete (or, past its starvation bound, what it becomes). With screening on, a group whose
first samples fail the filter comes back from its engine with those alone, and is dropped. A group whose engine
actor dies restarts from its prompt on a live engine; the dead engine is not used again."""

import asyncio
import itertools
import math
import time
from types import SimpleNamespace
from typing import Callable, Optional

from openrlhf_async.reward.shaping import shape_rewards
from openrlhf_async.rollout.batch import (ERROR_KINDS, RolloutBatch, StartedGroup, Starvation, State, awaited,
                                          group_tokens, stop_rule)
from openrlhf_async.rollout.engine import _engine_died, all_engines_dead, raising, submit
from openrlhf_async.rollout.filter import GroupFilter
from openrlhf_async.rollout.seeds import derive_seed


class LoadBalancer:
    """In-flight episodes per engine id. A group goes to the least-loaded live engine if it fits under that engine's
    capacity (a group larger than the capacity still runs alone on an idle engine)."""

    def __init__(self, engine_ids, capacity: int):
        self.loads, self.capacity = {i: 0 for i in engine_ids}, capacity
        self.dead = set()  # engines never chosen again; their load stays 0
        self._samples = dict.fromkeys(self.loads, 0)  # for the time-averaged load per engine
        self._events = 0

    def add(self, engine: int) -> None:
        """A new engine (a replacement, or growth) takes work from now on."""
        if engine not in self.loads:
            self.loads[engine], self._samples[engine] = 0, 0

    def live(self) -> list:
        return [i for i in self.loads if i not in self.dead]

    def acquire(self, amount: int) -> Optional[int]:
        live = self.live()
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
        for i, load in self.loads.items():
            self._samples[i] += load

    def mean_loads(self) -> list:
        """The time-averaged load of each live engine."""
        return [self._samples[i] / max(1, self._events) for i in self.live()] or [0.0]


class LocalHandle:
    """Calls an in-process object the way Ray calls an actor: handle.method.remote(...) returns an awaitable.
    Lets tests and the controller benchmark drive the controller with fake engines."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return SimpleNamespace(remote=lambda *args, **kwargs: asyncio.ensure_future(method(*args, **kwargs)))


_group_ids = itertools.count()


def _empty(ep) -> bool:
    """The model answered nothing: its end token (or nothing) and the episode stopped there."""
    return sum(ep.action_mask) <= 1 and ep.finish_reason == "stop" and not ep.error


def turn_sampling(rollout, temperature: Optional[float] = None, top_p: Optional[float] = None) -> dict:
    """A turn's vLLM sampling: --rollout.temperature and top_p (or the evaluation's), and the stop strings and token
    ids where set."""
    sampling = {"temperature": rollout.temperature if temperature is None else temperature,
                "top_p": rollout.top_p if top_p is None else top_p}
    for key in ("stop", "stop_token_ids"):
        if getattr(rollout, key):
            sampling[key] = list(getattr(rollout, key))  # vLLM takes lists
    return sampling


class RolloutController:
    def __init__(self, cfg, engines: list, *, sampling: Optional[dict] = None, carry_over: bool = False,
                 on_group: Optional[Callable] = None, wave_size: int = 0, abort_timeout: float = 60.0,
                 fleet=None, engine_wait_s: float = 1800.0):
        """cfg: the run's Config; its rollout, algo, agent, reward and vllm sections set the rollout.
        sampling: vLLM sampling parameters (None: --rollout.temperature, top_p, stop and stop_token_ids).
        carry_over (early stop only): groups still running when a batch is complete keep running and join the next
        batch (surplus valid groups too) instead of being aborted; their tokens may then span weight versions.
        on_group(prompt, flat) is called for each finished group; flat: its scores are all equal.
        wave_size: without early stop, prompts per wave (0: the batch target; DAPO uses 3x).
        fleet: the run's EngineFleet actor (engines then None): its active engines are used, dead ones reported to it,
        and when none is left the rollout waits up to engine_wait_s for the replacements it starts."""
        rollout = cfg.rollout
        self.engines, self.n, self.budget = engines, rollout.n_samples_per_prompt, cfg.budget
        self.sampling = turn_sampling(rollout) if sampling is None else sampling
        self.seed, self.unplaced = cfg.train.seed, 0  # unplaced: groups started for prompts without a stream position
        self.max_concurrent_prompts = cfg.max_concurrent_prompts
        self.agent_path = cfg.agent.func_path
        self.filter = GroupFilter.from_config(cfg.algo)
        # Without a filter every group is valid: nothing can starve, and no time bound cuts a slow batch short.
        self.starvation = Starvation.from_config(cfg.algo) if self.filter.rule else Starvation()
        # Screening drops a group whose first samples the filter drops: without a filter there is nothing to screen.
        self.screen_samples = rollout.screen_samples if self.filter.rule else 0
        self.stop_rule = stop_rule(rollout.early_stop, rollout.unbiased_early_stop, rollout.admission_margin,
                                   wave_size)
        self.carry_over = carry_over and rollout.early_stop
        # Unbiased early stop without carry over: a batch is the prefix of the start order up to its cut; groups
        # started beyond it give their prompts back to the next batch, and only the prefix's outcomes are taken
        # (on_group, the valid rate, the score range), in start order, once the batch is complete. Then neither the
        # batch, nor where the next one starts, nor what the run learns about its prompts depends on timing.
        self.gives_back = rollout.early_stop and rollout.unbiased_early_stop and not self.carry_over
        self.carried = []  # groups started for an earlier batch and not used yet
        self.overlong = (cfg.reward.overlong_buffer_len or 0, cfg.reward.overlong_penalty_factor)
        self.error_ratios = {"agent": cfg.agent.max_error_ratio, "reward": cfg.reward.max_error_ratio}
        self.on_group, self.abort_timeout = on_group, abort_timeout
        self.engines = dict(enumerate(engines or ()))  # engine id -> handle
        self.fleet, self.engine_wait_s, self._refreshed = fleet, engine_wait_s, 0.0
        self.balancer = LoadBalancer(self.engines, cfg.vllm.concurrency())
        self._last_engine_error = None
        self.groups_finished = self.groups_valid = 0  # over the controller's life: the valid rate of later batches
        self.score_range = None  # (lowest, highest) score seen over its life: what a flat group's score means
        self.answers = self.answers_empty = 0  # episodes finished over its life, and those the model left empty
        self.reward_failures, self.first_reward_failure = 0, None  # episodes scored 0 because the reward failed

    @property
    def dead_engines(self) -> set:
        """Ids of the engines found dead (their actor gone); this controller never uses them again."""
        return set(self.balancer.dead)

    def _all_dead_error(self) -> RuntimeError:
        return all_engines_dead(len(self.engines), self._last_engine_error)

    async def _refresh(self, every_s: float = 1.0) -> list:
        """Take the fleet's active engines: new ones (replacements, growth) join the balancer, and those it retired
        (found dead by a weight sync) leave it. At most every every_s seconds. Returns the engines it retired."""
        if self.fleet is None or time.monotonic() - self._refreshed < every_s:
            return []
        active = await self.fleet.active.remote()
        self._refreshed = time.monotonic()
        for engine, handle in active.items():
            if engine not in self.engines:
                self.engines[engine] = handle
                self.balancer.add(engine)
        retired = [engine for engine in self.balancer.live() if engine not in active]
        for engine in retired:
            self.balancer.mark_dead(engine)
        return retired

    async def _wait_for_engines(self) -> bool:
        """No engine is live: wait for the fleet's replacements to take work. False when none is coming."""
        if self.fleet is None:
            return False
        deadline = time.monotonic() + self.engine_wait_s
        while time.monotonic() < deadline:
            await self._refresh(every_s=0)
            if self.balancer.live():
                return True
            if not await self.fleet.coming.remote():
                return False
            await asyncio.sleep(1.0)
        return False

    def run(self, next_prompt: Callable[[], dict], target: int, remaining: Optional[int] = None) -> tuple:
        """Collect `target` valid groups. next_prompt() -> {"prompt_ids", "label"} (and optionally "budget": the
        group's token budget, or one per sample) is called once per started group, in order.
        remaining: batches of `target` the run will ask for after this one (None: no end in sight). With carry over
        the engines are kept full with groups for later batches, but with no more of them than those batches are
        expected to use at the valid rate seen so far: a group started for a batch never asked for is aborted
        unused when the run ends (close()).
        Returns (groups, metrics); each episode's reward is set (its raw reward plus shaping). A batch past its
        starvation bound (--algo.dynamic_filtering_max_num_gen_batches) has fewer groups, or flat ones, as
        --algo.dynamic_filtering_on_starved says, and metrics["rollout/starved_reason"] says why; when the run is to
        stop instead, groups is empty and metrics["rollout/stop_reason"] says why."""
        return asyncio.run(self.run_async(next_prompt, target, remaining))

    async def run_async(self, next_prompt: Callable[[], dict], target: int, remaining: Optional[int] = None) -> tuple:
        await self._refresh(every_s=0)
        dead_before = len(self.balancer.dead)
        if not self.balancer.live() and not await self._wait_for_engines():
            raise self._all_dead_error()
        batch = RolloutBatch(target, self.n, self.stop_rule, self.filter, self.error_ratios, self.carried,
                             self.balancer.dead, self.starvation)
        self.carried, chosen, starved = [], None, False
        try:
            chosen = batch.selected()  # carried-over groups alone may complete it
            while chosen is None:
                for engine in await self._refresh():  # its groups restart now: a call to it may never answer
                    batch.engine_died(engine)
                self._launch(batch, next_prompt, self._later_need(target, remaining))
                if batch.starved():
                    chosen, starved = batch.starved_choice(), True
                    break
                if not batch.pending:
                    if self.balancer.live():
                        break
                    if await self._wait_for_engines():  # every engine died: their replacements may take over
                        continue
                    batch.fail(self._all_dead_error())
                    break
                done, _ = await asyncio.wait(list(batch.pending), timeout=batch.time_left(),
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._collect(batch, task)
                batch.fail(batch.hopeless())
                if batch.failure is not None:
                    break
                chosen = batch.selected()
                if chosen is None and not self.carry_over:  # with carry over they wait for the next batch
                    await self._abort(batch.beyond_cut(), batch.pending, batch.stats)
        finally:
            if self.carry_over and chosen is not None and batch.failure is None:
                self.carried = batch.carry_out(chosen)
            elif self.gives_back and chosen is not None and batch.failure is None:
                self.carried = batch.give_back()  # their prompts come first in the next batch
            else:
                batch.drop_reroutes()
            await self._abort(dict(batch.pending), batch.pending, batch.stats)
        if batch.failure is not None:
            raise batch.failure
        if self.gives_back:
            for record in batch.settled():
                self._settle(record)
        if chosen is None and not starved:
            raise RuntimeError("rollout ended without enough valid groups")
        carried_out = sum(1 for r in self.carried if not r.given_back)
        metrics = batch.metrics(chosen or [], carried_out, len(self.balancer.dead) - dead_before,
                                self.balancer.mean_loads())
        failure = batch.too_many_failures()
        if failure is not None:
            raise failure
        if starved:
            metrics["rollout/starved_reason" if chosen is not None else "rollout/stop_reason"] = (
                batch.starvation_report(self.score_range, self.never_varied()))
        return [r.episodes for r in chosen or []], metrics

    def _later_need(self, target: int, remaining: Optional[int]) -> float:
        """Groups worth starting now for later batches: none without carry over (the stop rule's need alone), as
        many as the engines hold with no end in sight, else what `remaining` batches of `target` are expected to use
        at the valid rate of the groups finished so far (prior: one valid in one)."""
        if not self.carry_over:
            return 0
        if remaining is None:
            return math.inf
        return math.ceil(remaining * target * (self.groups_finished + 1) / (self.groups_valid + 1))

    def _launch(self, batch: RolloutBatch, next_prompt: Callable[[], dict], later_need: float) -> None:
        """Restart the groups whose engine died (admitted already, they only wait for room on a live engine), then
        start new prompts while an engine has room and the groups in flight are fewer than the stop rule wants for
        this batch plus later_need."""
        while batch.reroute and len(batch.pending) < self.max_concurrent_prompts:
            engine = self.balancer.acquire(self.n)
            if engine is None:
                return
            self._start(batch, batch.reroute.pop(0), engine)
        # Groups carried over are never lost, so with carry over the engines are kept full (bounded by the groups in
        # flight and by what the run's later batches can use); otherwise the stop rule says how many more are worth
        # their aborted tokens.
        limit = min(self.max_concurrent_prompts, batch.wanted() + later_need)
        while len(batch.pending) < limit:
            engine = self.balancer.acquire(self.n)
            if engine is None:
                return
            try:
                prompt = next_prompt()
            except BaseException:
                self.balancer.release(engine, self.n)
                raise
            self._start(batch, batch.admit(prompt), engine)

    def _start(self, batch: RolloutBatch, record: StartedGroup, engine: int) -> None:
        prompt = record.prompt
        record.group_id, record.engine = f"g{next(_group_ids)}", engine
        # At least one token: a prompt that leaves no room is vLLM's to refuse, with its own error.
        record.budget = prompt.get("budget") or max(1, self.budget(len(prompt["prompt_ids"])))
        if record.seed is None:  # kept when the group restarts on another engine
            if "position" in prompt:
                record.seed = derive_seed(self.seed, "position", prompt["position"])
            else:  # an evaluation's prompts, in their order
                record.seed, self.unplaced = derive_seed(self.seed, "order", self.unplaced), self.unplaced + 1
        call = submit(self.engines[engine], "generate_group", prompt["prompt_ids"], prompt["label"], self.n,
                      {**self.sampling, "seed": record.seed}, record.group_id, record.budget, self.agent_path, self.screen_samples, self.filter,
                      None, prompt.get("prompt"), *([prompt["info"]] if prompt.get("info") else []))
        record.call = raising(call) if isinstance(call, Exception) else call  # a refused call: its engine died
        batch.watch(record)

    def _collect(self, batch: RolloutBatch, task) -> None:
        """A group's engine call ended: shape its rewards and judge it, or reroute it if its engine died."""
        record = batch.pending.pop(task, None)
        if record is None:  # moved off an engine that died meanwhile
            return
        self.balancer.release(record.engine, self.n)
        try:
            group = task.result()
        except Exception as e:
            if batch.failure is None and _engine_died(e):  # the engine actor is gone: run it elsewhere
                self._engine_died(record.engine, e)
                batch.engine_died(record.engine, record)
            else:  # an engine failed: stop, after cleaning up
                batch.fail(e)
            return
        shape_rewards(group, record.budget, *self.overlong)
        batch.group_finished(record, group)
        if not self.gives_back:  # else once the batch is complete, for the groups inside its cut
            self._settle(record)

    def _settle(self, record: StartedGroup) -> None:
        """Take a finished group's outcome into the controller's life: the score range, the valid rate, on_group."""
        group = record.episodes
        scores = [ep.score for ep in group] + list(self.score_range or ())
        self.score_range = (min(scores), max(scores)) if scores else None
        self.answers += len(group)
        self.answers_empty += sum(1 for ep in group if _empty(ep))
        failed = [ep.error[1] for ep in group if ep.error and ERROR_KINDS.get(ep.error[0], ("",))[0] == "reward"]
        self.reward_failures += len(failed)
        self.first_reward_failure = self.first_reward_failure or (failed[0] if failed else None)
        self.groups_finished, self.groups_valid = self.groups_finished + 1, self.groups_valid + record.valid
        if self.on_group is not None:
            self.on_group(record.prompt, record.flat)

    def never_varied(self) -> Optional[str]:
        """What to tell a user whose run has never seen two scores differ (None when they have): nothing is learned,
        and the likely causes."""
        if self.score_range is None or self.score_range[0] != self.score_range[1]:
            return None
        what = (f"all {self.answers} answers were empty (the model wrote only its end token)"
                if self.answers and self.answers_empty == self.answers else
                f"all {self.answers} samples scored {self.score_range[0]:g}")
        if self.reward_failures:
            return (f"the scores have never varied in this run: {what}, {self.reward_failures} of them because the "
                    f"reward failed (first: {self.first_reward_failure[:300]}), so nothing is learned; fix the reward "
                    "(--reward.max_error_ratio below 1 stops a run whose rewards fail this often)")
        return (f"the scores have never varied in this run: {what}, so every advantage, loss and gradient is 0 and "
                "nothing is learned; check the prompt template (--data.apply_chat_template, --data.input_template), "
                "the labels (--data.label_key) and the reward")

    def _engine_died(self, engine: int, error: BaseException) -> None:
        self._last_engine_error = error
        if engine not in self.balancer.dead and self.fleet is not None:
            self.fleet.died.remote([engine])  # it starts a replacement
        self.balancer.mark_dead(engine)

    def close(self) -> dict:
        """Drop the groups carried over for a batch that will never be asked for, aborting those still running.
        Returns counts: groups dropped ("aborted"), their tokens, and the tokens generated meanwhile."""
        async def abort_all():
            stats = {"aborted": 0, "tokens": 0, "tokens_aborted": 0}
            pending = {asyncio.ensure_future(awaited(r.call)): r for r in self.carried
                       if r.state is State.RUNNING}
            for r in self.carried:
                if r.state is not State.RUNNING:  # finished and valid but never used, or waiting to restart
                    stats["aborted"] += 1
                    stats["tokens_aborted"] += group_tokens(r.episodes) if r.state is State.FINISHED else 0
            self.carried = []
            await self._abort(dict(pending), pending, stats)
            return stats
        return asyncio.run(abort_all())

    async def _abort(self, groups: dict, pending: dict, stats: dict) -> None:
        """Abort these running groups (task -> record), wait for the engines to hand them back, release their
        load and take them out of pending."""
        if not groups:
            return
        by_engine = {}
        for record in groups.values():
            if record.engine not in self.balancer.dead:  # a call to a dead actor only raises
                by_engine.setdefault(record.engine, []).append(record.group_id)
        calls = [submit(self.engines[e], "abort_groups", ids) for e, ids in by_engine.items()]
        aborts = [raising(c) if isinstance(c, Exception) else awaited(c) for c in calls]
        await asyncio.gather(*aborts, return_exceptions=True)  # an engine that died here shows in its groups
        done, not_done = await asyncio.wait(list(groups), timeout=self.abort_timeout)
        for task, record in groups.items():
            pending.pop(task, None)
            self.balancer.release(record.engine, self.n)
            stats["aborted"] += 1
            if task in done and not task.cancelled() and _engine_died(task.exception()):
                self._engine_died(record.engine, task.exception())
            elif task in done and not task.cancelled() and task.exception() is None:
                tokens = group_tokens(task.result())
                stats["tokens"] += tokens
                stats["tokens_aborted"] += tokens
            elif task in not_done:
                task.cancel()

