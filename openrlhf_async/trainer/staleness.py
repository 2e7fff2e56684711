"""Weight versions and staleness, as pure logic: when the generator may produce the next batch, how stale a
group is, and what the trainer reports about the versions it trained on.

Versions count weight syncs: the engines start at 0, and every sync loads version + 1. A batch ("item") of
groups is numbered in production order; the trainer consumes items in that order, so item i is trained at
version i // items_per_sync. A group's staleness is the trainer's version minus the oldest version of the
tokens it trained on."""

import math


def production_window(mode: str, queue_size: int = 1, staleness_threshold: float = 0.0,
                      trigger_parameter_sync_step: int = 1, require_batches: int = 1) -> tuple:
    """(items per sync, slack): the generator may start item i at version v iff i < (v + 1) * items + slack.

    sync: one item per version, nothing ahead (generate, train, sync); async: up to queue_size items ahead;
    fully_async: a sync window of require_batches * trigger_parameter_sync_step items, plus the threshold's
    share of a window (veRL's staleness_threshold), rounded up to whole items."""
    if mode == "sync":
        return 1, 0
    if mode == "async":
        return 1, queue_size
    items = require_batches * trigger_parameter_sync_step
    return items, math.ceil(staleness_threshold * items)


def may_produce(index: int, version: int, items_per_sync: int, slack: int) -> bool:
    return index < (version + 1) * items_per_sync + slack


def trained_version(index: int, items_per_sync: int) -> int:
    """The version item `index` will be trained at."""
    return index // items_per_sync


def _model_versions(episode: dict) -> list:
    return [v for v, m in zip(episode["token_versions"], episode["action_mask"]) if m]


def oldest_version(group: list):
    """The oldest weight version among the tokens the model wrote in a group; None if it wrote none."""
    versions = [v for ep in group for v in _model_versions(ep)]
    return min(versions) if versions else None


def is_fresh(group: list, version: int, limit: int) -> bool:
    oldest = oldest_version(group)
    return oldest is None or version - oldest <= limit


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
