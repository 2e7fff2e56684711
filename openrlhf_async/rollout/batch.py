"""One rollout batch: the groups started for it, in start order, what became of each, and when it is complete.

The controller drives it (it starts groups on engines, awaits them and aborts them); the batch keeps the state
and takes the events: a group admitted, a group finished, an engine died. When the batch is complete is a stop
rule, chosen once per controller from the config:
- EarlyStop: the first `target` groups to finish valid; only as many groups run as are expected to yield them.
- UnbiasedEarlyStop: the first `target` valid groups in start order, so long groups started early are waited
  for rather than passed over for quicker ones. Without carry over, the groups started after its cut give their
  prompts back (give_back): the next batch starts them first, so each batch is the same prefix of the prompt stream
  however the groups' timing went, and its counters are the prefix's (what ran beyond it: groups_overrun).
- Waves (no early stop, the usual dynamic sampling): a whole wave of prompts is generated and waited for, then
  filtered, and another wave starts until enough groups are valid.

Whatever the rule, dynamic sampling cannot starve: a batch that has judged its bound of groups (Starvation) without
filling (the policy has learned what its prompts teach, or cannot learn them) ends as the bound's action says."""

import asyncio
import enum
import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

from openrlhf_async.rollout.filter import GroupFilter

# An episode's error kind -> (failure family, the counter it goes to).
ERROR_KINDS = {"error": ("agent", "agent_errors"), "timeout": ("agent", "agent_timeouts"),
               "reward_error": ("reward", "reward_errors"), "reward_timeout": ("reward", "reward_timeouts")}
COUNTERS = ["started", "finished", "aborted", "screened", "tokens", "tokens_aborted", "tokens_screened", "episodes",
            "agent_errors", "agent_timeouts", "reward_errors", "reward_timeouts", "rerouted", "starved", "flat_filled"]


class AgentFailureError(RuntimeError):
    """Too many of a batch's episodes failed in the agent's step or lost their reward."""


@dataclass(frozen=True)
class Starvation:
    """Dynamic sampling's bound. A batch is starved once it has judged max_gen_batches x its target groups (veRL's
    max_num_gen_batches), or run max_wait_s, without filling; it then ends as `action` says: partial (the valid
    groups it has, a smaller batch; with none, the run stops), fill (its valid groups topped up with filtered ones)
    or stop (the run stops)."""
    max_gen_batches: int = 10
    max_wait_s: Optional[float] = None
    action: str = "partial"

    @classmethod
    def from_config(cls, algo) -> "Starvation":
        return cls(algo.dynamic_filtering_max_num_gen_batches, algo.dynamic_filtering_max_wait_s,
                   algo.dynamic_filtering_on_starved)


class State(enum.Enum):
    RUNNING = "running"  # its engine call is in flight
    REROUTE = "reroute"  # its engine died: it restarts from its prompt on a live engine, before any new prompt
    FINISHED = "finished"


@dataclass(eq=False)
class StartedGroup:
    """A prompt's group from the moment it is admitted; with carry over it may outlive its batch."""
    prompt: dict
    index: int = 0  # its place in its batch's start order
    state: State = State.RUNNING
    group_id: str = ""
    engine: int = -1
    budget: Any = None  # its response token budget (one, or one per sample)
    seed: Optional[int] = None  # its sampling seed (rollout/seeds.py), from the prompt's place
    call: Any = None  # the engine's generate_group call (a Ray ObjectRef, or an awaitable for local engines)
    episodes: Optional[list] = None
    valid: Optional[bool] = None
    flat: bool = False  # its scores all equal (or screened as such)
    given_back: bool = False  # started beyond an unbiased cut: its prompt restarts from scratch in the next batch


def group_tokens(episodes: list) -> int:
    """Tokens the model generated for a group's episodes (observation tokens left out)."""
    return sum(sum(ep.action_mask) for ep in episodes)


class RolloutBatch:
    def __init__(self, target: int, n: int, stop, group_filter: GroupFilter, error_ratios: dict,
                 carried: list = (), dead_engines: set = (), starvation: Starvation = Starvation()):
        """stop: the stop rule's class (see stop_rule). error_ratios: failure family -> the share of episodes that
        may fail. carried: groups started for an earlier batch and not used yet; they come first."""
        self.target, self.n, self.filter, self.error_ratios = target, n, group_filter, error_ratios
        self.stop = stop(target)
        self.starvation, self.bound = starvation, starvation.max_gen_batches * target
        self.start_time = time.perf_counter()
        self.records, self.finished, self.reroute = [], [], []  # start order, finish order, start order
        self.pending = {}  # task awaiting a group's engine call -> its record
        self.stats = dict.fromkeys(COUNTERS, 0)
        self.first_error = {}  # failure family ("agent", "reward") -> its first error message
        self.failure = None  # the error the batch stops on
        self.carried_in = sum(1 for r in carried if not r.given_back)  # prompts given back were not carried
        self.cut = None  # set by give_back: the start index of the batch's last group
        for record in carried:
            record.index = len(self.records)
            self.records.append(record)
            if record.state is State.FINISHED:
                self.finished.append(record)
            elif record.state is State.REROUTE:  # its engine died in an earlier batch, counted there
                self.reroute.append(record)
            elif record.engine in dead_engines:
                record.state = State.REROUTE
                self.reroute.append(record)
                self.stats["rerouted"] += 1
            else:
                self.watch(record)

    def admit(self, prompt: dict) -> StartedGroup:
        record = StartedGroup(prompt, index=len(self.records))
        self.records.append(record)
        self.stats["started"] += 1
        return record

    def watch(self, record: StartedGroup) -> None:
        """The group's engine call is in flight: await it."""
        record.state = State.RUNNING
        self.pending[asyncio.ensure_future(awaited(record.call))] = record

    def group_finished(self, record: StartedGroup, episodes: list) -> bool:
        """Count the group and judge it by its scores. Returns whether it is flat (all scores equal, or screened as
        such)."""
        record.episodes, record.state = episodes, State.FINISHED
        self.stats["finished"] += 1
        for ep in episodes:
            self.stats["episodes"] += 1
            self.stats["tokens"] += sum(ep.action_mask)
            if ep.error:
                family, counter = ERROR_KINDS[ep.error[0]]
                self.stats[counter] += 1
                self.first_error.setdefault(family, ep.error[1])
        scores = [ep.score for ep in episodes]
        screened = len(episodes) < self.n  # its first samples failed the filter: dropped without the others
        if screened:
            self.stats["screened"] += 1
            self.stats["tokens_screened"] += group_tokens(episodes)
        record.valid = not screened and self.filter.keep(scores)
        record.flat = screened or self.filter.flat(scores)
        self.finished.append(record)
        return record.flat

    def engine_died(self, engine: int, record: Optional[StartedGroup] = None) -> None:
        """The engine is gone: its running groups (and the record whose call failed, if any) restart elsewhere
        (their calls would fail anyway)."""
        moved = ([record] if record is not None else []) + [r for r in self.pending.values() if r.engine == engine]
        for task in [t for t, r in self.pending.items() if r.engine == engine]:
            _discard(task)
            del self.pending[task]
        for r in moved:
            r.state = State.REROUTE
        self.reroute = sorted(self.reroute + moved, key=lambda r: r.index)
        self.stats["rerouted"] += len(moved)

    def fail(self, error: Optional[BaseException]) -> None:
        self.failure = self.failure or error

    def idle(self) -> bool:
        return not self.pending and not self.reroute

    def wanted(self) -> int:
        """Groups the stop rule wants in flight now, within the starvation bound."""
        return min(self.stop.wanted(self), len(self.pending) + max(0, self.bound - len(self.records)))

    def starved(self) -> bool:
        """Whether the batch is starved: short of valid groups with its bound of groups judged or its time bound
        passed (groups still running are then aborted, or carried over), or with its bound started and none left
        running."""
        if self.idle() and len(self.records) >= self.bound:
            return True  # nothing more will come (a rule waiting for a whole wave may have been cut at the bound)
        if sum(1 for r in self.finished if r.valid) >= self.target:
            return False  # the stop rule has what it needs and waits for the groups its order needs
        wait_s = self.starvation.max_wait_s
        return len(self.finished) >= self.bound or (wait_s is not None and self.elapsed() >= wait_s)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start_time

    def time_left(self) -> Optional[float]:
        """Seconds until the time bound; None without one."""
        wait_s = self.starvation.max_wait_s
        return None if wait_s is None else max(0.0, wait_s - self.elapsed())

    def starved_choice(self) -> Optional[list]:
        """The groups a starved batch is trained on, as the bound's action says (and counted); None: the run is to
        stop."""
        valid = [r for r in self.records if r.state is State.FINISHED and r.valid][: self.target]
        if len(valid) == self.target:  # cut at the bound with enough after all (a wave's rule)
            return valid
        self.stats["starved"] += 1
        action = self.starvation.action
        if action == "stop" or (action == "partial" and not valid):
            return None
        if action == "fill":  # whole groups only (screening refuses fill): the trainer takes n samples a group
            fill = [r for r in self.records if r.state is State.FINISHED and not r.valid  # start order: no timing
                    and len(r.episodes) == self.n][: self.target - len(valid)]
            self.stats["flat_filled"] += len(fill)
            valid += fill
        return valid

    def starvation_report(self, score_range: tuple = None, verdict: str = None) -> str:
        """Why the batch starved, in one line. score_range: the lowest and highest scores the run has seen, which
        say whether flat groups are solved prompts or prompts out of reach. verdict: the why, when the caller knows
        better."""
        flat = [r for r in self.finished if r.flat]
        score = mean_score(flat or self.finished)
        if verdict is None:
            verdict = "the policy's scores no longer vary"
        if score_range is not None and score_range[0] < score_range[1] and flat:
            if score >= score_range[1] - 1e-6:
                verdict = "the task is solved"
            elif score <= score_range[0] + 1e-6:
                verdict = "the prompts are out of the policy's reach"
        found = sum(1 for r in self.finished if r.valid)
        return (f"{verdict}: {len(flat)} of the last {len(self.finished)} groups were flat (every sample scored the "
                f"same; mean score {score:.3g}) and {found} of the {self.target} groups wanted varied, after "
                f"{self.elapsed():.0f} s")

    def selected(self) -> Optional[list]:
        """The batch's groups once it is complete; None while it is not."""
        return self.stop.selected(self)

    def beyond_cut(self) -> dict:
        """Groups that can no longer enter the batch (unbiased early stop: started after the target-th valid one).
        Those waiting to reroute are dropped, counted as aborted; the running ones are returned (task -> record)
        for the caller to abort."""
        cut = self.stop.cut(self)
        if cut is None:
            return {}
        self.stats["aborted"] += sum(1 for r in self.reroute if r.index > cut)
        self.reroute = [r for r in self.reroute if r.index < cut]
        return {task: r for task, r in self.pending.items() if r.index > cut}

    def carry_out(self, chosen: list) -> list:
        """The groups the next batch takes over, in their start order (its prefix is what unbiased early stop
        takes): valid ones left out of this one, running ones, rerouted ones."""
        surplus = [r for r in self.finished if r.valid and r not in chosen]
        carried = sorted(surplus + list(self.pending.values()) + self.reroute, key=lambda r: r.index)
        self.pending.clear()
        return carried

    def give_back(self) -> list:
        """Unbiased early stop without carry over, once the batch is complete (or starved): the groups started after
        its cut, in start order, as fresh records for the next batch to start first (their seeds kept). What they
        ran is dropped (aborted, or finished with weights about to change), so how many ran, which depends on the
        valid rate seen along the way and so on timing, decides neither where the next batch starts in the stream
        nor this batch's counters (metrics() counts the prefix alone, and the overrun apart)."""
        cut = self.stop.cut(self)
        if cut is None:  # starved: every group started is used up, as with the other rules
            self.drop_reroutes()
            return []
        self.cut, self.reroute = cut, []
        return [StartedGroup(r.prompt, seed=r.seed, state=State.REROUTE, given_back=True)
                for r in self.records[cut + 1:]]

    def settled(self) -> list:
        """The finished groups whose outcome counts, in start order: those inside the cut once give_back has cut the
        batch, else every finished one."""
        records = self.records if self.cut is None else self.records[: self.cut + 1]
        return [r for r in records if r.state is State.FINISHED]

    def drop_reroutes(self) -> None:
        self.stats["aborted"] += len(self.reroute)

    def too_many_failures(self, min_episodes: int = 0) -> Optional[AgentFailureError]:
        """An AgentFailureError once at least min_episodes have ended and too many of them failed in the agent
        (or lost their reward)."""
        episodes = self.stats["episodes"]
        for family, ratio in self.error_ratios.items():
            failed = self.stats[f"{family}_errors"] + self.stats[f"{family}_timeouts"]
            if episodes >= min_episodes and failed > ratio * max(1, episodes):
                what = "failed in the agent" if family == "agent" else "lost their reward"
                return AgentFailureError(f"{failed} of {episodes} episodes {what} in this batch, above "
                                         f"--{family}.max_error_ratio {ratio}; first error: {self.first_error[family]}")
        return None

    def hopeless(self) -> Optional[Exception]:
        """An error to stop on when the batch cannot go well: agents failing above the allowed share over a
        batch's worth of episodes. (Groups that all come out flat are no error: the batch starves, see starved().)"""
        return self.too_many_failures(min_episodes=self.target * self.n)

    def _prefix_stats(self) -> tuple:
        """The counters and first errors of the groups inside the cut alone (all finished), in start order."""
        inside = self.records[: self.cut + 1]
        stats, first_error = dict.fromkeys(COUNTERS, 0), {}
        stats["started"] = stats["finished"] = len(inside)
        for r in inside:
            for ep in r.episodes:
                stats["episodes"] += 1
                stats["tokens"] += sum(ep.action_mask)
                if ep.error:
                    family, counter = ERROR_KINDS[ep.error[0]]
                    stats[counter] += 1
                    first_error.setdefault(family, ep.error[1])
            if len(r.episodes) < self.n:
                stats["screened"] += 1
                stats["tokens_screened"] += group_tokens(r.episodes)
        for key in ("rerouted", "starved", "flat_filled"):
            stats[key] = self.stats[key]
        return stats, first_error, inside

    def metrics(self, chosen: list, carried_out: int, engine_failures: int, loads: list) -> dict:
        stats, first_error, judged = self.stats, self.first_error, self.finished
        overrun = overrun_tokens = 0
        if self.cut is not None:  # cut by give_back: the prefix's figures, which do not depend on timing
            stats, first_error, judged = self._prefix_stats()
            overrun, overrun_tokens = len(self.records) - len(judged), self.stats["tokens"] - stats["tokens"]
        accepted_tokens = sum(group_tokens(r.episodes) for r in chosen)
        metrics = {
            "rollout/groups_started": stats["started"],
            "rollout/groups_finished": stats["finished"],
            "rollout/groups_accepted": len(chosen),
            "rollout/groups_filtered": sum(1 for r in judged if r.valid is False),  # screened ones too
            "rollout/groups_screened": stats["screened"],
            "rollout/groups_aborted": stats["aborted"],
            "rollout/groups_carried_in": self.carried_in,
            "rollout/groups_carried_out": carried_out,
            "rollout/tokens_generated": stats["tokens"],
            "rollout/tokens_accepted": accepted_tokens,
            "rollout/tokens_aborted": stats["tokens_aborted"],
            "rollout/tokens_screened": stats["tokens_screened"],
            "rollout/wasted_fraction": 1 - accepted_tokens / max(1, stats["tokens"]),
            # What the policy scores on the prompts it was given; reward/mean is the filtered batch's (DAPO's filter
            # keeps groups whose scores vary: about 0.5 however good the policy is).
            "rollout/score_all_mean": mean_score(judged),
            # Unbiased early stop without carry over: groups started beyond the cut (their prompts given back to
            # the next batch) and the tokens they generated. How many depends on timing; 0 with the other rules.
            "rollout/groups_overrun": overrun,
            "rollout/tokens_overrun": overrun_tokens,
            "rollout/time_to_batch_s": time.perf_counter() - self.start_time,
            "rollout/engine_load_max": max(loads),
            "rollout/engine_load_min": min(loads),
            "rollout/agent_errors": stats["agent_errors"],
            "rollout/agent_timeouts": stats["agent_timeouts"],
            "rollout/reward_errors": stats["reward_errors"],
            "rollout/reward_timeouts": stats["reward_timeouts"],
            "rollout/engine_failures": engine_failures,
            "rollout/groups_rerouted": stats["rerouted"],
            "rollout/starved_batches": stats["starved"],
            "rollout/groups_flat_filled": stats["flat_filled"],  # with --algo.dynamic_filtering_on_starved fill
            "rollout/groups_missing": self.target - len(chosen),  # a starved batch trained smaller (partial)
            # OpenAI-API agents' episodes whose turns were not one token sequence (a chat template that rewrites
            # history): each trains as several samples (rollout/endpoint.py)
            "rollout/episodes_segmented": sum(1 for r in chosen for ep in r.episodes if ep.segments),
        }
        for family, message in first_error.items():
            metrics[f"rollout/{family}_first_error"] = message
        return metrics


def mean_score(records: list) -> float:
    """The mean score of the finished groups' episodes, before the filter (0 without any)."""
    scores = [ep.score for r in records for ep in r.episodes]
    return sum(scores) / len(scores) if scores else 0.0


def stop_rule(early_stop: bool, unbiased: bool, admission_margin: float, wave_size: int):
    """The stop rule for these settings: a class taking the batch target, one instance per batch."""
    if not early_stop:
        return functools.partial(Waves, size=wave_size)
    return functools.partial(UnbiasedEarlyStop if unbiased else EarlyStop, margin=admission_margin)


class EarlyStop:
    """The batch is the first `target` groups to finish valid."""

    def __init__(self, target: int, margin: float = 0.0):
        self.target, self.margin = target, margin

    def wanted(self, batch: RolloutBatch) -> int:
        """Groups in flight expected to yield the valid groups still missing, at the valid rate seen so far
        (optimistic prior: one valid group). Starting more only buys speed with aborted tokens."""
        valid = sum(1 for r in batch.finished if r.valid)
        rate = (valid + 1) / (len(batch.finished) + 1)
        return math.ceil(max(0, self.target - valid) / rate * (1 + self.margin))

    def selected(self, batch: RolloutBatch) -> Optional[list]:
        valid = [r for r in batch.finished if r.valid]
        # in start order: a batch's order (its micro batches' sums) then does not depend on which finished first
        return sorted(valid[: self.target], key=lambda r: r.index) if len(valid) >= self.target else None

    def cut(self, batch: RolloutBatch) -> Optional[int]:
        """The start index after which no group can enter the batch; None: any may."""
        return None


class UnbiasedEarlyStop(EarlyStop):
    """The batch is a prefix of the start order, all finished, with `target` valid groups."""

    def wanted(self, batch: RolloutBatch) -> int:
        if sum(1 for r in batch.finished if r.valid) >= self.target:
            return 0  # the batch will come from groups already started
        return super().wanted(batch)

    def selected(self, batch: RolloutBatch) -> Optional[list]:
        valid = []
        for r in batch.records:
            if r.state is not State.FINISHED:
                return None
            if r.valid:
                valid.append(r)
                if len(valid) == self.target:
                    return valid
        return None

    def cut(self, batch: RolloutBatch) -> Optional[int]:
        valid = [r.index for r in batch.records if r.valid]
        return valid[self.target - 1] if len(valid) >= self.target else None


class Waves:
    """No early stop: waves of `size` prompts (0: the target; DAPO uses 3x), each generated and waited for whole;
    the batch is decided only between waves."""

    def __init__(self, target: int, size: int = 0):
        self.target, self.size = target, max(1, size or target)

    def wanted(self, batch: RolloutBatch) -> int:
        left = -batch.stats["started"] % self.size  # prompts still to start in the current wave
        if not left and batch.idle():
            left = self.size  # the wave is done and short of valid groups: start another
        return len(batch.pending) + left

    def selected(self, batch: RolloutBatch) -> Optional[list]:
        if not batch.idle() or batch.stats["started"] % self.size:
            return None
        valid = [r for r in batch.records if r.valid]
        return valid[: self.target] if len(valid) >= self.target else None

    def cut(self, batch: RolloutBatch) -> Optional[int]:
        return None


async def awaited(call):
    """A coroutine awaiting an engine call (a Ray ObjectRef or a future), for asyncio.wait and gather."""
    return await call


def _discard(task) -> None:
    """Drop a group's task: cancel it, or, if it already ended, take its result so asyncio does not warn."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()
