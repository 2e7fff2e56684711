"""Weight versions and staleness, as pure logic: when the generator may produce the next batch, how stale a
group is, and what the trainer reports about the versions it trained on.

Versions count weight syncs: the engines start at 0, and every sync loads version + 1. A batch ("item") of
groups is numbered in production order; the trainer consumes items in that order, so item i is trained at
version i // items_per_sync. A group's staleness is the trainer's version minus the oldest version of the
tokens it trained on."""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class StalenessPolicy:
    """The mode (--mode, --train.partial_rollout_enable and the async bounds) decoded once: how far the generator may run
    ahead, how stale a trained sample may be, and how the engines behave around a weight sync.

    The generator may start item i at version v iff i < (v + 1) * items_per_sync + slack:
    sync: one item per version, nothing ahead (generate, train, sync); async: up to queue_size items ahead;
    fully_async: a sync window of require_batches * trigger_parameter_sync_step items, plus the threshold's share
    of a window (veRL's staleness_threshold), rounded up to whole items."""

    items_per_sync: int  # items trained at one weight version
    slack: int  # items the generator may start beyond the current version's window
    limit: int  # the hard bound on a trained sample's staleness, in versions; staler groups are dropped
    carry_over: bool  # groups still running when a batch is complete go on into the next one
    pause_mode: str  # engines during a sync: "keep" freezes running episodes (partial rollout), "wait" drains them
    # (for --vllm.sync_drain_timeout at most; what still runs then is frozen as with "keep")

    @classmethod
    def for_mode(cls, mode: str, queue_size: int = 1, staleness_threshold: float = 0.0,
                 trigger_parameter_sync_step: int = 1, require_batches: int = 1, max_staleness: int = -1,
                 partial_rollout: bool = False) -> "StalenessPolicy":
        if mode == "sync":
            items, slack, limit = 1, 0, 0
        elif mode == "async":
            items, slack, limit = 1, queue_size, queue_size
        else:
            items = require_batches * trigger_parameter_sync_step
            slack = math.ceil(staleness_threshold * items)
            # The gate lets a group start up to ceil(threshold) versions before it is trained; one more for a group
            # carried over from the previous batch.
            limit = 1 + math.ceil(staleness_threshold)
        return cls(items, slack, max_staleness if max_staleness >= 0 else limit, carry_over=mode == "fully_async",
                   pause_mode="keep" if partial_rollout else "wait")

    @classmethod
    def from_config(cls, cfg) -> "StalenessPolicy":
        t = cfg.train
        return cls.for_mode(cfg.mode, cfg.queue_size, t.staleness_threshold, t.trigger_parameter_sync_step,
                            t.require_batches, t.max_staleness, t.partial_rollout_enable)

    def may_produce(self, index: int, version: int) -> bool:
        return index < (version + 1) * self.items_per_sync + self.slack

    def trained_version(self, index: int) -> int:
        """The version item `index` will be trained at."""
        return index // self.items_per_sync

    def is_fresh(self, group: list, version: int) -> bool:
        """Whether a group trained at `version` is within the limit."""
        oldest = oldest_version(group)
        return oldest is None or version - oldest <= self.limit


def _model_versions(episode) -> list:
    return [v for v, m in zip(episode.token_versions, episode.action_mask) if m]


def oldest_version(group: list):
    """The oldest weight version among the tokens the model wrote in a group; None if it wrote none."""
    versions = [v for ep in group for v in _model_versions(ep)]
    return min(versions) if versions else None


def version_report(groups: list, version: int) -> dict:
    """Staleness and partial-rollout figures for the samples trained at `version`."""
    staleness, spans = [], []
    for group in groups:
        for ep in group:
            versions = _model_versions(ep)
            if versions:
                staleness.append(version - min(versions))
                spans.append(max(versions) - min(versions))
    count = max(1, len(staleness))
    return {
        "staleness/max": max(staleness, default=0),
        "staleness/mean": sum(staleness) / count,
        "staleness/stale_samples": sum(1 for s in staleness if s > 0),
        "partial_ratio": sum(1 for s in spans if s > 0) / count,  # samples generated with more than one version
        "max_partial_span": max(spans, default=0),
    }
