"""The training pipeline: a GenerateSamplesActor and a TrainingActor exchanging batches over a bounded
ray.util.queue.Queue, started and watched by PPOTrainerAsync. One pipeline for every mode (see staleness.py):

- sync: the generator may only produce with the newest weights, so generation, training and sync alternate;
- async: the generator runs up to --train.async_queue_size batches ahead of the trainer;
- fully_async: groups stream batch after batch (groups still running when a batch is complete carry over into
  the next), the trainer syncs every trigger_parameter_sync_step steps, the generator may run a staleness
  threshold's share of a sync window ahead, and with partial rollout the engines freeze running episodes during
  a sync and continue them on the new weights.

Every group carries per-token weight versions; groups staler than the limit are dropped and counted, never trained
on. A failure on either side stops both within seconds and is raised with its cause."""

import threading
import time

import torch

from openrlhf_async.trainer.staleness import (is_fresh, may_produce, production_window, trained_version,
                                              version_report)
from openrlhf_async.rollout.controller import live_versions
from openrlhf_async.utils.timeline import Timeline

END = "end"  # the generator's last queue item
_COUNTERS = ("rollout/groups_", "rollout/tokens_", "rollout/agent_errors", "rollout/agent_timeouts",
             "rollout/reward_errors", "rollout/reward_timeouts", "rollout/stale_groups_dropped",
             "rollout/engine_failures", "rollout/prompts_skipped")


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


def _get(queue, stopped: threading.Event):
    from ray.util.queue import Empty

    while not stopped.is_set():
        try:
            return queue.get(timeout=0.5)
        except Empty:
            pass
    return None


class GenerateSamplesActor:
    """Produces batches of valid groups with the rollout controller, as fast as the staleness bounds allow.
    Each batch says which prompt-stream positions it used up (see data/prompts.py), so a checkpoint knows where
    the data stands: started groups whose outcome is not in a batch yet (carried over) are not used up. It also
    says which prompts' groups came out flat (all rewards equal), for --rollout.skip_flat_prompts."""

    def __init__(self, cfg, engines: list, prompts: list, queue, data_position: dict = None):
        from openrlhf_async.data.prompts import PromptSampler
        from openrlhf_async.rollout.controller import RolloutController

        self.cfg, self.engines, self.queue = cfg, engines, queue
        self.controller = RolloutController.from_config(cfg, engines, carry_over=cfg.mode == "fully_async",
                                                        on_group=self._group_done)
        self.sampler = PromptSampler(prompts, cfg.train.seed, skip_flat=cfg.rollout.skip_flat_prompts,
                                     **(data_position or {}))
        self._outcomes = []  # (dataset row, flat) of the groups finished in the batch being made
        self.timeline = Timeline("generator")
        self.window = production_window(cfg.mode, cfg.queue_size, cfg.train.staleness_threshold,
                                        cfg.train.trigger_parameter_sync_step, cfg.train.require_batches)
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()

    def _group_done(self, prompt: dict, flat: bool) -> None:
        self._outcomes.append((prompt["id"], flat))
        self.sampler.record([(prompt["id"], flat)])

    def _version(self) -> int:
        return min(live_versions(self.engines).values())

    def _batch(self, target_version: int) -> tuple:
        """batch_size valid groups, none staler than the limit at the version they will be trained at."""
        size, groups, metrics = self.cfg.rollout.batch_size, [], {}
        dropped, used = 0, {}  # used: stream position -> dataset row, for the prompts this batch used up

        def carried() -> dict:
            return {r["prompt"]["position"]: r["prompt"]["id"] for r in self.controller.carried}

        def next_prompt() -> dict:
            prompt = self.sampler.next()
            skipped = self.sampler.take_skipped()  # passed over (--rollout.skip_flat_prompts): used up, no group
            used.update(skipped)
            metrics["rollout/prompts_skipped"] = metrics.get("rollout/prompts_skipped", 0) + len(skipped)
            used[prompt["position"]] = prompt["id"]
            return prompt

        while len(groups) < size:
            used.update(carried())
            got, m = self.controller.run(next_prompt, size - len(groups))
            for position in carried():
                used.pop(position, None)
            fresh = [g for g in got if is_fresh(g, target_version, self.cfg.staleness_limit)]
            dropped += len(got) - len(fresh)
            groups += fresh
            _merge_rollout_metrics(metrics, m)
        metrics["rollout/stale_groups_dropped"] = dropped
        metrics.setdefault("rollout/prompts_skipped", 0)
        outcomes, self._outcomes = self._outcomes, []
        return groups, metrics, sorted(used.items()), outcomes

    def run(self, num_items: int) -> dict:
        items_per_sync, slack = self.window
        start, idle = time.perf_counter(), 0.0
        base = self._version()  # the engines' version when training starts (0 unless they were synced before)
        try:
            for index in range(num_items):
                t0 = time.perf_counter()
                while not may_produce(index, self._version() - base, items_per_sync, slack):
                    if self.stopped.wait(0.02):
                        return {"items": index, "stopped": True}
                t1 = time.perf_counter()
                self.timeline.add("wait", time.time() - (t1 - t0), time.time())
                with self.timeline.span("generate"):
                    groups, metrics, used, outcomes = self._batch(base + trained_version(index, items_per_sync))
                idle += t1 - t0
                metrics["rollouter/idle_ratio"] = idle / max(1e-9, time.perf_counter() - start)
                metrics["rollouter/gate_wait_s"] = t1 - t0
                t2 = time.perf_counter()
                with self.timeline.span("wait"):
                    item = {"index": index, "groups": groups, "metrics": metrics, "used": used,
                            "flat": outcomes, "spans": self.timeline.take()}
                    if not _put(self.queue, item, self.stopped):
                        return {"items": index, "stopped": True}
                idle += time.perf_counter() - t2
            _put(self.queue, END, self.stopped)
            return {"items": num_items, "idle_ratio": idle / max(1e-9, time.perf_counter() - start)}
        finally:
            self.controller.close()  # groups still running will never be used


class TrainingActor:
    """Takes batches off the queue, trains on the fresh ones, syncs weights to the engines, evaluates, and saves
    resumable checkpoints. Each step's record also carries the prompts it used up ("_used") and every actor's
    activity spans ("_spans"), which the metrics log writes to their own files."""

    def __init__(self, cfg, policy, weight_sync, queue, metrics_queue, eval_prompts: list,
                 num_prompts: int, resumed: dict = None, stand_in_train_s: float = None):
        """resumed: the trainer state of the checkpoint this run continues from (see trainer/checkpoint.py)."""
        from openrlhf_async.data.prompts import StreamProgress

        self.cfg, self.policy, self.weight_sync = cfg, policy, weight_sync
        self.queue, self.metrics_queue, self.eval_prompts = queue, metrics_queue, eval_prompts
        self.stand_in_train_s = stand_in_train_s  # benchmarks: a timed stand-in for the optimizer step
        self.stopped = threading.Event()
        # Continue from the version the engines hold (tests and benchmarks reuse engines across runs; a resumed
        # run has synced the checkpoint's weights and version to them).
        self.weight_sync.version = min(live_versions(weight_sync.engines).values())
        self.num_prompts, self.resumed = num_prompts, resumed
        self.progress = StreamProgress(**resumed["data_position"]) if resumed else StreamProgress()
        self.timeline = Timeline("trainer")

    def stop(self) -> None:
        self.stopped.set()

    def _evaluate(self):
        from openrlhf_async.trainer.ppo_trainer import evaluate

        with self.timeline.span("eval"):  # on the engines alive at the last sync
            return evaluate(self.cfg, self.weight_sync.engines, self.eval_prompts)

    def _spans(self, items: list) -> list:
        """Every actor's spans since the last step; an actor that died meanwhile has none."""
        import ray

        spans = self.timeline.take() + [span for item in items for span in item["spans"]]
        for ref in [a.take_spans.remote() for a in self.weight_sync.engines + self.policy.actors]:
            try:
                spans += ray.get(ref, timeout=30)
            except Exception:
                pass
        return spans

    def _save_checkpoint(self, step: int, scores_start) -> None:
        from openrlhf_async.trainer import checkpoint

        deadline = time.time() + 30  # the step's record must be in metrics.jsonl before the checkpoint exists
        while self.metrics_queue.qsize() and time.time() < deadline:
            time.sleep(0.05)
        state = {"weight_version": self.weight_sync.version, "eval_start": scores_start,
                 "data_position": self.progress.state(),
                 "data": {"num_prompts": self.num_prompts, "seed": self.cfg.train.seed}}
        with self.timeline.span("checkpoint"):
            checkpoint.save(self.cfg.ckpt_path, step, self.policy, state, self.cfg.ckpt.max_num)

    def _train(self, groups: list) -> dict:
        from openrlhf_async.trainer.losses import group_advantages
        from openrlhf_async.trainer.policy import loss_settings

        if self.stand_in_train_s is not None:
            time.sleep(self.stand_in_train_s)
            return {}
        rewards = torch.tensor([[s["reward"] for s in g] for g in groups])
        advantages = group_advantages(rewards, self.cfg.algo.advantage_estimator, self.cfg.algo.advantage_no_std_norm)
        samples = [{**s, "advantage": a} for g, adv in zip(groups, advantages) for s, a in zip(g, adv.tolist())]
        stats = self.policy.train_step(samples, self.cfg.train.micro_batch_size, loss_settings(self.cfg))
        tokens = sum(sum(s["action_mask"]) for s in samples)
        return {"reward/mean": rewards.mean().item(), "rollout/response_len_mean": tokens / len(samples),
                **{k: stats[k] for k in ("loss", "clip_ratio", "is_weight_mean", "is_corrected_ratio", "kl",
                                         "grad_norm")}}

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        pause_mode = "keep" if t.partial_rollout else "wait"
        if self.resumed:
            first_step, scores = self.resumed["step"] + 1, None
            scores_start = self.resumed["eval_start"]
        else:
            first_step, scores = 1, self._evaluate()
            scores_start = scores
            if scores is not None:
                self.metrics_queue.put({"step": 0, **scores, "weight_version": 0, "_spans": self.timeline.take()})
        start, idle, stale_trained, dropped_total, max_staleness = time.perf_counter(), 0.0, 0, 0, 0
        for step in range(first_step, t.max_steps + 1):
            t0 = time.perf_counter()
            depth = self.queue.qsize()
            items = []
            with self.timeline.span("wait"):
                for _ in range(t.require_batches):
                    item = _get(self.queue, self.stopped)
                    if item is None:
                        return {"stopped": True}
                    if item == END:
                        raise RuntimeError(f"the generator ended at step {step}, before --train.max_steps "
                                           f"{t.max_steps}")
                    items.append(item)
            t1 = time.perf_counter()
            version = self.weight_sync.version
            groups = [g for item in items for g in item["groups"]]
            fresh = [g for g in groups if is_fresh(g, version, cfg.staleness_limit)]
            dropped = len(groups) - len(fresh)
            report = version_report(fresh, version)
            with self.timeline.span("train"):
                stats = self._train(fresh) if fresh else {}
            t2 = time.perf_counter()
            sync_s = 0.0
            if step % t.trigger_parameter_sync_step == 0 or step == t.max_steps:
                with self.timeline.span("sync"):
                    sync_s = self.weight_sync.sync(pause_mode)
            t3 = time.perf_counter()
            idle += t1 - t0
            dropped_total += dropped
            stale_trained += report["staleness/stale_samples"]
            max_staleness = max(max_staleness, report["staleness/max"])
            metrics = {"step": step, **stats}
            for item in items:
                _merge_rollout_metrics(metrics, item["metrics"])
            metrics.update(report)
            metrics.update({
                "rollout/tokens_per_s": metrics["rollout/tokens_generated"] / max(1e-9, metrics["rollout/time_to_batch_s"]),
                "trainer/idle_ratio": (t1 - t0) / max(1e-9, t3 - t0),
                "trainer/stale_groups_dropped": dropped,
                "queue/depth": depth,
                "timing/wait_s": t1 - t0,
                "timing/generate_s": metrics["rollout/time_to_batch_s"],
                "timing/train_s": t2 - t1,
                "timing/sync_s": sync_s,
                "weight_version": self.weight_sync.version,
                "engine_weight_version": self.weight_sync.engine_version,
                "rollout/engines_alive": len(self.weight_sync.engines),
            })
            if self.eval_prompts and (step % cfg.eval.steps == 0 or step == t.max_steps):
                t4 = time.perf_counter()
                scores = self._evaluate()
                metrics.update(scores)
                metrics["timing/eval_s"] = time.perf_counter() - t4
            used = [u for item in items for u in item["used"]]
            self.progress.add((position for position, _ in used), [o for item in items for o in item["flat"]])
            metrics["_used"] = {"positions": [p for p, _ in used], "prompt_ids": [i for _, i in used]}
            metrics["_spans"] = self._spans(items)
            self.metrics_queue.put(metrics)
            start += metrics.get("timing/eval_s", 0.0)  # evaluation is neither training nor idling
            if cfg.ckpt.save_steps and step % cfg.ckpt.save_steps == 0:
                t5 = time.perf_counter()
                self._save_checkpoint(step, scores_start)
                start += time.perf_counter() - t5
        busy_s = time.perf_counter() - start
        return {"eval_start": scores_start, "eval_end": scores,
                "trainer_idle_ratio": idle / max(1e-9, busy_s), "max_staleness": max_staleness,
                "stale_samples_trained": stale_trained, "stale_groups_dropped": dropped_total}


class PPOTrainerAsync:
    """Starts the generator and the trainer over a bounded queue, relays the trainer's metrics, and stops both
    when either fails (raising its error) or training is done."""

    def __init__(self, cfg, engines: list, policy, weight_sync, train_prompts: list, eval_prompts: list,
                 resumed: dict = None, stand_in_train_s: float = None):
        """resumed: the trainer state of the checkpoint to continue from (its weights are loaded and synced)."""
        import ray
        from ray.util.queue import Queue

        self.cfg = cfg
        self.first_step = resumed["step"] + 1 if resumed else 1
        self.queue = Queue(maxsize=cfg.queue_size, actor_options={"num_cpus": 0})
        self.metrics_queue = Queue(actor_options={"num_cpus": 0})
        options = {"num_cpus": 0, "max_concurrency": 2}  # run() blocks; stop() must still get through
        self.generator = ray.remote(GenerateSamplesActor).options(**options).remote(
            cfg, engines, train_prompts, self.queue, resumed and resumed["data_position"])
        self.trainer = ray.remote(TrainingActor).options(**options).remote(
            cfg, policy, weight_sync, self.queue, self.metrics_queue, eval_prompts, len(train_prompts),
            resumed, stand_in_train_s)

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
