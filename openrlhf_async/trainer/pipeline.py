"""The training pipeline: a GenerateSamplesActor and a TrainingActor exchanging batches over a bounded
queue (a batch's episodes travel packed in Ray's object store, see handover.py), started and watched by
PPOTrainerAsync. One pipeline for every mode (see staleness.py):

- sync: the generator may only produce with the newest weights, so generation, training and sync alternate;
- async: the generator runs up to --train.async_queue_size batches ahead of the trainer;
- fully_async: groups stream batch after batch (groups still running when a batch is complete carry over into
  the next), the trainer syncs every trigger_parameter_sync_step steps, the generator may run a staleness
  threshold's share of a sync window ahead, and with partial rollout the engines freeze running episodes during
  a sync and continue them on the new weights.

The mode is decoded once, into a StalenessPolicy (staleness.py) that both actors build from the config. Every group
carries per-token weight versions; the generator drops (and counts) groups that would be staler than the limit at
the version their batch will be trained at, and makes another in their place. A failure on either side stops both
within seconds and is raised with its cause. A run whose dynamic sampling starves with nothing left to train on (see
--algo.dynamic_filtering_on_starved) ends early and normally: the generator's last item says why, and the trainer's
summary says so ("stopped_early"), so the run driver saves the model as after a full run."""

import threading
import time
from dataclasses import dataclass

from openrlhf_async.trainer import experience
from openrlhf_async.trainer.staleness import StalenessPolicy, version_report
from openrlhf_async.utils.ray_utils import on_this_node, raise_if_interrupted
from openrlhf_async.utils.timeline import Timeline

END = "end"  # the generator's last queue item


@dataclass
class QueuedBatch:
    """What the generator puts on the queue for the trainer: one batch of valid groups and its records."""
    index: int  # production order: the trainer consumes batches in it
    version: int  # the weight version it was made to be trained at
    groups: list  # lists of Episode; inside the queue, a reference to them packed (handover.py)
    metrics: dict  # the rollout's metrics for this batch
    used: list  # (stream position, prompt id) of every prompt this batch used up
    flat: list  # (prompt id, flat) of every finished group, for skipping flat prompts
    spans: list  # the generator's timeline spans while it made this batch


@dataclass
class EarlyEnd:
    """The generator's last queue item when the run ends before --train.max_steps: dynamic sampling starved with
    nothing left to train on, or the whole prompt set came out flat."""
    index: int  # the batch it could not make
    reason: str


class PromptSetSolved(Exception):
    """Every prompt's last group was flat, with --rollout.skip_flat_prompts setting flat prompts aside and
    --algo.dynamic_filtering_on_starved stop: nothing is left to learn from."""


_COUNTERS = ("rollout/groups_", "rollout/tokens_", "rollout/agent_errors", "rollout/agent_timeouts",
             "rollout/reward_errors", "rollout/reward_timeouts", "rollout/stale_groups_dropped",
             "rollout/engine_failures", "rollout/prompts_skipped", "rollout/starved_batches",
             "rollout/episodes_segmented")


def _merge_rollout_metrics(into: dict, new: dict) -> None:
    """Fold one rollout's metrics into a batch's: counters add up, the rest take the newest value."""
    for key, value in new.items():
        into[key] = into[key] + value if key.startswith(_COUNTERS) and key in into else value


def _put(queue, item, stopped: threading.Event) -> bool:
    """Block until the queue takes the item; False if asked to stop meanwhile."""
    from ray.util.queue import Full

    while not stopped.is_set():
        try:
            queue.put(item, timeout=0.5)
            return True
        except Full:
            pass
    return False


def _live_version(engines: list) -> int:
    """The oldest weight version the live engines hold."""
    from openrlhf_async.rollout.engine import live_versions

    return min(live_versions(engines).values())


def _get(queue, stopped: threading.Event, idle=None):
    """The next queue item, or None if asked to stop meanwhile; idle() is called while waiting."""
    from ray.util.queue import Empty

    while not stopped.is_set():
        try:
            return queue.get(timeout=0.5)
        except Empty:
            if idle is not None:
                idle()
    return None


class GenerateSamplesActor:
    """Produces batches of valid groups with the rollout controller, as fast as the staleness bounds allow.
    Each batch says which prompt-stream positions it used up (see data/prompts.py), so a checkpoint knows where
    the data stands: started groups whose outcome is not in a batch yet (carried over) are not used up. It also
    says which prompts' groups came out flat (all rewards equal), for --rollout.skip_flat_prompts."""

    def __init__(self, cfg, engines: list, prompts: list, queue, data_position: dict = None, fleet=None):
        """engines: a fixed list of engines, or None with fleet: the run's EngineFleet actor."""
        from openrlhf_async.data.prompts import PromptSampler
        from openrlhf_async.rollout.controller import RolloutController

        self.cfg, self.engines, self.queue, self.fleet = cfg, engines, queue, fleet
        self.staleness = StalenessPolicy.from_config(cfg)
        self.controller = RolloutController(cfg, engines, carry_over=self.staleness.carry_over,
                                            on_group=self._group_done, fleet=fleet)
        self.sampler = PromptSampler(prompts, cfg.train.seed, skip_flat=cfg.rollout.skip_flat_prompts,
                                     **(data_position or {}))
        self.drawable = sum(1 for p in prompts if not p.get("too_long"))  # the prompts the sampler ever gives
        self._outcomes = []  # (dataset row, flat) of the groups finished in the batch being made
        self.timeline = Timeline("generator")
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()

    def _engine_version(self) -> int:
        """The weight version the engines hold: the fleet's newest sync, or the oldest a live engine reports."""
        import ray

        return ray.get(self.fleet.weight_version.remote()) if self.fleet is not None else _live_version(self.engines)

    def _group_done(self, prompt: dict, flat: bool) -> None:
        self._outcomes.append((prompt["id"], flat))
        self.sampler.record([(prompt["id"], flat)])

    def _prompt_set_solved(self) -> bool:
        """Every prompt's last group was flat while flat prompts are set aside, and a starved run is to stop."""
        return (self.controller.filter.rule is not None and self.controller.starvation.action == "stop"
                and self.sampler.skip_flat > 0 and len(self.sampler.flat) >= self.drawable)

    def _batch(self, target_version: int, remaining: int = None) -> tuple:
        """batch_size valid groups, none staler than the limit at the version they will be trained at; fewer, or
        flat ones, when dynamic sampling starved (metrics["rollout/starved_reason"] says why), and none when the run
        is to stop (metrics["rollout/stop_reason"]).
        remaining: batches the run asks for after this one (the controller starts no more groups than they use)."""
        size, groups, metrics = self.cfg.rollout.batch_size, [], {}
        dropped, used = 0, {}  # used: stream position -> dataset row, for the prompts this batch used up

        def carried() -> dict:
            return {r.prompt["position"]: r.prompt["id"] for r in self.controller.carried}

        def next_prompt() -> dict:
            if self._prompt_set_solved():
                raise PromptSetSolved(f"the whole prompt set is solved: the last group of each of its "
                                      f"{self.drawable} prompts was flat")
            prompt = self.sampler.next()
            skipped = self.sampler.take_skipped()  # passed over (--rollout.skip_flat_prompts): used up, no group
            used.update(skipped)
            metrics["rollout/prompts_skipped"] = metrics.get("rollout/prompts_skipped", 0) + len(skipped)
            used[prompt["position"]] = prompt["id"]
            return prompt

        while len(groups) < size:
            used.update(carried())
            try:
                got, m = self.controller.run(next_prompt, size - len(groups), remaining)
            except PromptSetSolved as solved:
                metrics["rollout/stop_reason"] = str(solved)
                break
            for position in carried():
                used.pop(position, None)
            fresh = [g for g in got if self.staleness.is_fresh(g, target_version)]
            dropped += len(got) - len(fresh)
            groups += fresh
            _merge_rollout_metrics(metrics, m)
            if "rollout/starved_reason" in m or "rollout/stop_reason" in m:
                break  # starved: no second round of its bound
        if not groups and "rollout/stop_reason" not in metrics:  # starved with nothing usable: nothing to train
            metrics["rollout/stop_reason"] = metrics["rollout/starved_reason"]
        metrics["rollout/stale_groups_dropped"] = dropped
        metrics.setdefault("rollout/prompts_skipped", 0)
        outcomes, self._outcomes = self._outcomes, []
        return groups, metrics, sorted(used.items()), outcomes

    def run(self, num_items: int) -> dict:
        start = time.time()
        base = self._engine_version()  # the engines' version when training starts (0 unless synced before)
        try:
            for index in range(num_items):
                with self.timeline.span("wait"):  # until the staleness bound lets this batch start
                    while not self.staleness.may_produce(index, self._engine_version() - base):
                        if self.stopped.wait(0.02):
                            return {"items": index, "stopped": True}
                version = base + self.staleness.trained_version(index)
                with self.timeline.span("generate"):
                    groups, metrics, used, outcomes = self._batch(version, remaining=num_items - 1 - index)
                if "rollout/stop_reason" in metrics:
                    reason = metrics["rollout/stop_reason"]
                    _put(self.queue, EarlyEnd(index, reason), self.stopped)
                    return {"items": index, "stopped_early": reason, "idle_ratio": self.timeline.idle_ratio(start)}
                metrics["rollouter/idle_ratio"] = self.timeline.idle_ratio(start)
                metrics["rollouter/gate_wait_s"] = self.timeline.last["wait"]
                with self.timeline.span("wait"):
                    item = QueuedBatch(index, version, groups, metrics, used, outcomes, self.timeline.take())
                    if not _put(self.queue, item, self.stopped):
                        return {"items": index, "stopped": True}
            _put(self.queue, END, self.stopped)
            return {"items": num_items, "idle_ratio": self.timeline.idle_ratio(start),
                    "never_varied": self.controller.never_varied()}
        finally:
            self.controller.close()  # groups still running will never be used


class TrainingActor:
    """Takes batches off the queue, trains on them, syncs weights to the engines, evaluates, and saves resumable
    checkpoints. Each step's record also carries the prompts it used up ("_used") and every actor's activity spans
    ("_spans"), which the metrics log writes to their own files."""

    def __init__(self, cfg, policy, weight_sync, queue, metrics_queue, eval_prompts: list,
                 num_prompts: int, resumed: dict = None, stand_in_train_s: float = None, critic=None):
        """resumed: the trainer state of the checkpoint this run continues from (see trainer/checkpoint.py); critic:
        PPO's critic (trainer/critic.py's CriticGroup) with --algo.advantage.estimator gae, else None."""
        from openrlhf_async.data.prompts import StreamProgress

        self.cfg, self.policy, self.critic, self.weight_sync = cfg, policy, critic, weight_sync
        # --eval.steps -1: no evaluation at all, as in OpenRLHF.
        self.queue, self.metrics_queue = queue, metrics_queue
        self.eval_prompts = eval_prompts if cfg.eval.steps > 0 else []
        self.stand_in_train_s = stand_in_train_s  # benchmarks: a timed stand-in for the optimizer step
        self.staleness = StalenessPolicy.from_config(cfg)
        self.stopped = threading.Event()
        # Continue from the version the engines hold (tests and benchmarks reuse engines across runs; a resumed
        # run has synced the checkpoint's weights and version to them).
        self.weight_sync.version = _live_version(weight_sync.engines)
        self.num_prompts, self.resumed = num_prompts, resumed
        self.progress = StreamProgress(**resumed["data_position"]) if resumed else StreamProgress()
        self.eval_start = resumed and resumed["eval_start"]  # the scores before training, for the summary
        self.eval_answers = []  # the last evaluation's answers not logged yet
        self.totals = {"max_staleness": 0, "stale_samples_trained": 0, "stale_groups_dropped": 0,
                       "starved_batches": 0, "groups_flat_filled": 0}
        self.timeline = Timeline("trainer")
        from openrlhf_async.trainer.losses import KLController

        a = cfg.algo  # the KL coefficient, adaptive with --algo.kl.target (resumed with the run)
        self.kl = KLController(resumed.get("kl_coef", a.kl_init_coef) if resumed else a.kl_init_coef, a.kl_target,
                               a.kl_horizon)
        self.step, self._critic_seconds = 0, 0.0

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> dict:
        """Wait for a batch, train on it, sync every --train.trigger_parameter_sync_step steps, evaluate every
        --eval.steps, log the step, save every --ckpt.save_steps; returns the run's summary. When the generator ends
        the run early, the last weights are synced and evaluated, and the summary's "stopped_early" says at which
        step ("step", the first not trained; "last_step", the last trained) and why ("reason")."""
        t, cfg = self.cfg.train, self.cfg
        first_step, scores = self._start()
        start, before = time.time(), dict(self.timeline.seconds)  # idle time counts from the first step
        stopped_early = None
        for step in range(first_step, t.max_steps + 1):
            with self.timeline.span("wait"):
                depth, items = self.queue.qsize(), self._next_batch(step)
            if items is None:
                return {"stopped": True}
            if isinstance(items, EarlyEnd):
                stopped_early = {"step": step, "last_step": step - 1, "reason": items.reason}
                scores = self._end_early(step, first_step, scores)
                break
            self.step = step
            metrics = {"step": step, **self._step(items)}
            synced = step % t.trigger_parameter_sync_step == 0 or step == t.max_steps
            if synced:
                with self.timeline.span("sync"):
                    self.weight_sync.sync(self.staleness.pause_mode)
            else:
                self.weight_sync.to_generate()
            metrics.update(self._timing(depth, synced))
            if self.eval_prompts and (step % cfg.eval.steps == 0 or step == t.max_steps):
                scores = self._evaluate()
                metrics.update({**scores, "timing/eval_s": self.timeline.last["eval"]})
            self._log(metrics, items)
            if cfg.ckpt.save_steps > 0 and step % cfg.ckpt.save_steps == 0:
                self._save_checkpoint(step)
        self.weight_sync.settle()  # the last sync's check
        return {"eval_start": self.eval_start, "eval_end": scores, **self.totals,
                "trainer_idle_ratio": self.timeline.idle_ratio(start, before), "staleness_limit": self.staleness.limit,
                "stopped_early": stopped_early}

    def _end_early(self, step: int, first_step: int, scores):
        """The run ends before `step`: the engines get the last trained weights (unless synced after the last step)
        and, with an eval set, those are evaluated unless they just were. Returns the latest scores."""
        t, last = self.cfg.train, step - 1
        if last >= first_step and last % t.trigger_parameter_sync_step:
            with self.timeline.span("sync"):
                self.weight_sync.sync(self.staleness.pause_mode)
        if self.eval_prompts and last >= first_step and last % self.cfg.eval.steps:
            scores = self._evaluate()
        return scores

    def _start(self) -> tuple:
        """(first step, latest scores): a resumed run goes on after its checkpoint; a fresh one evaluates the initial
        policy first, logged as step 0."""
        if self.resumed:
            return self.resumed["step"] + 1, None
        self.eval_start = self._evaluate()
        if self.eval_start is not None:
            self.metrics_queue.put({"step": 0, **self.eval_start, "weight_version": 0, "_spans": self.timeline.take(),
                                    "_samples": self._samples([])})
        return 1, self.eval_start

    def _next_batch(self, step: int):
        """The step's --train.require_batches items off the queue; None when asked to stop."""
        items = []
        for _ in range(self.cfg.train.require_batches):
            item = _get(self.queue, self.stopped, idle=self._catch_up)
            if item is None:
                return None
            if item == END:
                raise RuntimeError(f"the generator ended at step {step}, before --train.max_steps "
                                   f"{self.cfg.train.max_steps}")
            if isinstance(item, EarlyEnd):
                return item  # a batch of this step already taken is not trained: the run ends here
            items.append(item)
        return items

    def _catch_up(self) -> None:
        """While waiting for a batch: engines that joined the fleet (replacements, growth) get the last sync's
        weights now, if the policy still holds them (WeightSync.catch_up), so they take work before the next sync."""
        with self.timeline.span("sync"):
            self.weight_sync.catch_up()

    def _step(self, items: list) -> dict:
        """One optimizer step on a batch's groups; returns the step's training, rollout and staleness figures. The
        generator made the batch for this version and left out what would be staler than the limit here."""
        from openrlhf_async.rollout.episode import extra_log_means

        version, groups = self.weight_sync.version, [g for item in items for g in item.groups]
        if any(item.version != version for item in items):
            raise RuntimeError(f"batches made for weight versions {[item.version for item in items]} reached the "
                               f"trainer at version {version}: the generator's and the trainer's counts disagree")
        metrics = {}
        with self.timeline.span("train"):
            # The last sync's check ends first if this batch holds tokens of its weights; the hybrid engine's engines
            # sleep.
            self.weight_sync.to_train(max((v for g in groups for ep in g for v in ep.token_versions), default=None))
            if self.stand_in_train_s is not None:
                time.sleep(self.stand_in_train_s)
            else:
                metrics = self._train(groups, version)
        for item in items:
            _merge_rollout_metrics(metrics, item.metrics)
        metrics.update(extra_log_means(groups))  # the agents' and reward sources' extra_logs, per step
        report = version_report(groups, version)
        self.totals["max_staleness"] = max(self.totals["max_staleness"], report["staleness/max"])
        self.totals["stale_samples_trained"] += report["staleness/stale_samples"]
        self.totals["stale_groups_dropped"] += metrics["rollout/stale_groups_dropped"]
        self.totals["starved_batches"] += metrics.get("rollout/starved_batches", 0)
        self.totals["groups_flat_filled"] += metrics.get("rollout/groups_flat_filled", 0)
        metrics.update(report)
        metrics["timing/generate_s"] = metrics["rollout/time_to_batch_s"]
        metrics["rollout/tokens_per_s"] = metrics["rollout/tokens_generated"] / max(1e-9, metrics["timing/generate_s"])
        return metrics

    def _train(self, groups: list, version: int) -> dict:
        """The batch's samples (experience.py; with gae the critic's updates first), the policy's updates on them
        once the critic has warmed up, and the KL coefficient moved; returns the step's figures."""
        from openrlhf_async.trainer.ranks import loss_settings

        a, t = self.cfg.algo, self.cfg.train
        rewards = experience.batch_rewards(groups, self.cfg.reward.stop_properly_penalty_coef)
        loss_cfg = loss_settings(self.cfg)
        loss_cfg["kl"] = {**loss_cfg["kl"], "coef": self.kl.value}
        if a.advantage_estimator == "gae":  # the KL is in its rewards already unless --algo.kl.use_loss
            samples, stats = self._with_critic(groups, rewards, version)
            loss_cfg["kl"]["coef"] = self.kl.value if a.kl_use_loss else 0.0
        else:  # one advantage per episode, or per seat's sequence (seats.py)
            samples, stats = experience.group_samples(groups, rewards, a, self.cfg.reward.clip_range), {}
        if self.step > self.cfg.critic.freezing_steps:  # the critic warms up first (gae)
            stats.update(self.policy.train_batch(samples, t.micro_batch_size, loss_cfg, t.batch_size, t.max_epochs,
                                                 seed=t.seed + version))
        # The KL coefficient moves after the step (--algo.kl.target), as OpenRLHF's controller does: by the step's KL
        # and its rollout batch's samples.
        stats["kl_coef"] = self.kl.value
        in_reward = a.advantage_estimator == "gae" and not a.kl_use_loss
        self.kl.update(stats["rollout/kl"] if in_reward else stats.get("kl", 0.0), rewards.numel())
        return {**experience.rollout_figures(groups, rewards), **{k: v for k, v in stats.items() if k != "tokens"}}

    def _with_critic(self, groups: list, rewards, version: int) -> tuple:
        """PPO with a critic (experience.gae_samples): the critic's values, the reference's log-probs and the
        policy's before the updates, GAE's advantages and returns; then the critic's updates on the returns. Returns
        the samples the policy trains on and the critic's and KL's figures. The values are the critic's at training
        time, whatever the episode's age."""
        t, temperature = self.cfg.train, self.cfg.rollout.temperature
        parts, part_rewards = experience.critic_parts(groups, rewards)
        samples = [experience.training_sample(ep, 0.0) for ep in parts]  # episodes of one segment each
        with self.timeline.span("critic"):
            values = self.critic.values(samples)
        samples = self.policy.with_reference(samples, temperature, self.kl.value, self.cfg.rollout.top_p)
        olds = self.policy.logprobs(samples, temperature, top_p=self.cfg.rollout.top_p)
        samples, kl = experience.gae_samples(samples, part_rewards, values, olds, self.cfg.algo, self.kl.value,
                                             self.cfg.reward.clip_range)
        stats = {"rollout/kl": kl}
        with self.timeline.span("critic"):
            stats.update(self.critic.train_batch(samples, t.micro_batch_size,
                                                 {"value_clip": self.cfg.critic.value_clip}, t.batch_size,
                                                 t.max_epochs, seed=t.seed + version))
        stats["timing/critic_s"] = self.timeline.seconds.get("critic", 0.0) - self._critic_seconds
        self._critic_seconds = self.timeline.seconds.get("critic", 0.0)
        return samples, stats

    def _timing(self, depth: int, synced: bool) -> dict:
        """The step's phases as the trainer's timeline recorded them, and where the weight versions stand."""
        wait, train = self.timeline.last["wait"], self.timeline.last["train"]
        sync = self.timeline.last["sync"] if synced else 0.0
        # The hybrid engine: of those, the seconds spent handing the devices over (engines asleep and awake again,
        # the trainer's states offloaded and back).
        handover = {"timing/sleep_s": self.weight_sync.take_handover_s()} if self.cfg.hybrid else {}
        if synced:  # sparse or whole, the share and bytes sent; the wait for the sync before's check
            handover.update({**self.weight_sync.figures, "sync/check_wait_s": self.weight_sync.check_wait_s})
        if synced and self.weight_sync.check:  # LoRA: the engines' probe log-probs against the trainer's
            handover.update({"sync/probe_logprob_diff": self.weight_sync.probe_diff,
                             "sync/probe_adapter_effect": self.weight_sync.probe_adapter_effect})
        return {"trainer/idle_ratio": wait / max(1e-9, wait + train + sync), "queue/depth": depth, **handover,
                "timing/wait_s": wait, "timing/train_s": train, "timing/sync_s": sync,
                "weight_version": self.weight_sync.version, "engine_weight_version": self.weight_sync.engine_version,
                "rollout/engines_alive": len(self.weight_sync.engines), **self._fleet_metrics()}

    def _fleet_metrics(self) -> dict:
        """The fleet's figures (engines alive, starting, died, replaced, added, the last time to replace one) and the
        engines a weight sync left out."""
        import ray

        fleet = self.weight_sync.fleet
        figures = ray.get(fleet.metrics.remote()) if fleet is not None else {}
        return {**{k: v for k, v in figures.items() if v is not None},
                "engines/sync_dropped": self.weight_sync.engines_dropped,
                "engines/drain_frozen": self.weight_sync.drain_frozen,
                "engines/sync_broadcasts_failed": self.weight_sync.broadcasts_failed}

    def _evaluate(self):
        from openrlhf_async.trainer.evaluate import evaluate

        self.weight_sync.settle()  # the scores are of the weights the last sync was checked to have sent
        with self.timeline.span("eval"):  # on the engines alive at the last sync
            scores, groups = evaluate(self.cfg, self.weight_sync.engines, self.eval_prompts)
        self.eval_answers = [g[0] for g in groups[: self.cfg.logger.log_samples]]
        return scores

    def _samples(self, groups: list) -> dict:
        """The episodes whose text the metrics log keeps (utils/samples.py): the first --logger.log_samples groups
        trained on and the evaluation answers since the last step."""
        answers, self.eval_answers = self.eval_answers, []
        return {"train": [ep for g in groups[: self.cfg.logger.log_samples] for ep in g], "eval": answers}

    def _log(self, metrics: dict, items: list) -> None:
        """Send the step's record to the metrics log, with the prompt-stream positions it used up, the spans and the
        episodes of a few samples."""
        used = [u for item in items for u in item.used]
        self.progress.add((position for position, _ in used), [o for item in items for o in item.flat])
        metrics["_used"] = {"positions": [p for p, _ in used], "prompt_ids": [i for _, i in used]}
        metrics["_spans"] = self._spans(items)
        if self.cfg.reward.model_name_or_path:  # the reward models' forward seconds since the last record
            metrics["timing/reward_model_s"] = sum(s["end"] - s["start"] for s in metrics["_spans"]
                                                   if s["kind"] == "reward model")
        metrics["_samples"] = self._samples([g for item in items for g in item.groups])
        self.metrics_queue.put(metrics)

    def _spans(self, items: list) -> list:
        """Every actor's spans since the last step; an actor that died meanwhile has none."""
        import ray

        from openrlhf_async.reward.model import reward_model_actors
        from openrlhf_async.rollout.engine import submit

        spans = self.timeline.take() + [span for item in items for span in item.spans]
        critic = self.critic.actors if self.critic is not None else []
        for ref in [submit(a, "take_spans") for a in self.weight_sync.engines + self.policy.actors + critic
                    + reward_model_actors(self.cfg)]:
            try:
                spans += ray.get(ref, timeout=30)
            except Exception:  # the actor died meanwhile (or Ray refused the call: an error in place of the ref)
                pass
        return spans

    def _save_checkpoint(self, step: int) -> None:
        from openrlhf_async.trainer import checkpoint

        state = {"weight_version": self.weight_sync.version, "eval_start": self.eval_start, "kl_coef": self.kl.value,
                 "data_position": self.progress.state(),
                 "data": {"num_prompts": self.num_prompts, "seed": self.cfg.train.seed}}
        with self.timeline.span("checkpoint"):
            deadline = time.time() + 30  # the step's record must be in metrics.jsonl before the checkpoint exists
            while self.metrics_queue.qsize() and time.time() < deadline:
                time.sleep(0.05)
            c = self.cfg.ckpt
            checkpoint.save(self.cfg.ckpt_path, step, self.policy, state, c.max_num, deepspeed=not c.disable_ds,
                            hf=c.save_hf or c.disable_ds, critic=self.critic)


class PPOTrainerAsync:
    """Starts the generator and the trainer over a bounded queue, relays the trainer's metrics, and stops both
    when either fails (raising its error) or training is done."""

    def __init__(self, cfg, engines: list, policy, weight_sync, train_prompts: list, eval_prompts: list,
                 resumed: dict = None, stand_in_train_s: float = None, critic=None):
        """resumed: the trainer state of the checkpoint to continue from (its weights are loaded and synced); critic:
        PPO's critic beside the policy, or None."""
        import ray
        from ray.util.queue import Queue

        from openrlhf_async.trainer.handover import BatchQueue

        self.cfg = cfg
        self.first_step = resumed["step"] + 1 if resumed else 1
        here = on_this_node()  # a node lost takes engines or ranks with it, never the run's control
        self.queue = BatchQueue(cfg.queue_size, here)
        self.metrics_queue = Queue(actor_options=here)
        options = {**here, "max_concurrency": 2}  # run() blocks; stop() must still get through
        self.generator = ray.remote(GenerateSamplesActor).options(**options).remote(
            cfg, engines, train_prompts, self.queue, resumed and resumed["data_position"], weight_sync.fleet)
        self.trainer = ray.remote(TrainingActor).options(**options).remote(
            cfg, policy, weight_sync, self.queue, self.metrics_queue, eval_prompts, len(train_prompts),
            resumed, stand_in_train_s, critic)

    def _drain_metrics(self, log) -> None:
        while self.metrics_queue.qsize():
            log(self.metrics_queue.get())

    def run(self, log) -> dict:
        """log(metrics) receives every step's metrics, in order. Returns the trainer's summary."""
        import ray

        num_items = (self.cfg.train.max_steps - self.first_step + 1) * self.cfg.train.require_batches
        roles = {self.generator.run.remote(num_items): "generator", self.trainer.run.remote(): "trainer"}
        summary, generator_result = None, None
        try:
            while summary is None:
                done, _ = ray.wait(list(roles), num_returns=1, timeout=0.2)
                raise_if_interrupted()
                self._drain_metrics(log)
                for ref in done:
                    role = roles.pop(ref)
                    result = ray.get(ref)  # raises the role's error
                    if role == "trainer":
                        summary = result
                    else:
                        generator_result = result
        finally:
            self._shutdown(list(roles))
        self._drain_metrics(log)
        if summary.get("stopped"):
            raise RuntimeError("the trainer was stopped before it finished")
        summary["generator_idle_ratio"] = (generator_result or {}).get("idle_ratio")
        if (generator_result or {}).get("never_varied"):
            print(f"warning: {generator_result['never_varied']}", flush=True)
        if summary["stopped_early"]:
            print(f"the run ends before step {summary['stopped_early']['step']} of {self.cfg.train.max_steps}: "
                  f"{summary['stopped_early']['reason']}", flush=True)
        return summary

    def _shutdown(self, running: list) -> None:
        """Ask both sides to stop, give them time to clean up (the generator aborts its running groups), then make
        sure they are gone."""
        import ray

        for actor in (self.generator, self.trainer):
            actor.stop.remote()
        if running:
            ray.wait(running, num_returns=len(running), timeout=10)
        for actor in (self.generator, self.trainer):
            ray.kill(actor, no_restart=True)
