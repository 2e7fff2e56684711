"""Staleness accounting and the production gate, as pure logic."""

import pytest

from openrlhf_async.config import Config
from openrlhf_async.trainer.staleness import (is_fresh, may_produce, oldest_version, production_window,
                                              trained_version, version_report)


def _episode(versions, mask=None):
    mask = mask or [1] * len(versions)
    return {"token_versions": versions, "action_mask": mask}


def test_windows_per_mode():
    assert production_window("sync") == (1, 0)
    assert production_window("async", queue_size=2) == (1, 2)
    assert production_window("fully_async", staleness_threshold=0.5, trigger_parameter_sync_step=2,
                             require_batches=2) == (4, 2)
    assert production_window("fully_async", staleness_threshold=0.5) == (1, 1)  # rounded up to a whole batch
    assert production_window("fully_async", staleness_threshold=0.0, require_batches=3) == (3, 0)


def test_sync_mode_never_runs_ahead_and_async_runs_k_ahead():
    assert may_produce(0, 0, 1, 0) and not may_produce(1, 0, 1, 0) and may_produce(1, 1, 1, 0)
    assert may_produce(2, 0, 1, 2) and not may_produce(3, 0, 1, 2)


def _earliest_version(index, items, slack):
    return next(v for v in range(index + 2) if may_produce(index, v, items, slack))


@pytest.mark.parametrize("mode,queue,threshold,trigger,require", [
    ("sync", 1, 0.0, 1, 1), ("async", 1, 0.0, 1, 1), ("async", 3, 0.0, 1, 1),
    ("fully_async", 1, 0.0, 1, 1), ("fully_async", 1, 0.5, 1, 1), ("fully_async", 1, 0.5, 4, 1),
    ("fully_async", 1, 1.0, 2, 2), ("fully_async", 1, 2.0, 1, 3),
])
def test_the_gate_keeps_every_batch_within_the_modes_staleness_limit(mode, queue, threshold, trigger, require):
    cfg = Config()
    cfg.mode, cfg.train.async_queue_size, cfg.train.staleness_threshold = mode, queue, threshold
    cfg.train.trigger_parameter_sync_step, cfg.train.require_batches = trigger, require
    items, slack = production_window(mode, queue, threshold, trigger, require)
    worst = 0
    for index in range(60):
        # A group started as early as the gate allows; in fully_async it may also have been carried over from
        # the batch before (started as early as that batch could start).
        first = index - 1 if mode == "fully_async" and index else index
        worst = max(worst, trained_version(index, items) - _earliest_version(first, items, slack))
    assert worst <= cfg.staleness_limit
    if mode == "sync":
        assert worst == 0
    if mode == "async":
        assert worst == queue  # the bound is reached, not just respected


def test_staleness_counts_model_tokens_only_and_partial_spans():
    fresh = [_episode([3, 3, 3])]
    partial = [_episode([1, 1, 2, 2]), _episode([2, 2, 2, 2, 2], mask=[1, 1, 0, 0, 1])]
    observation_only_old = [_episode([0, 3, 3], mask=[0, 1, 1])]  # an old version on a masked token is ignored
    report = version_report([fresh, partial, observation_only_old], version=3)
    assert report["staleness/max"] == 2 and report["staleness/stale_samples"] == 2
    assert report["staleness/mean"] == pytest.approx((0 + 2 + 1 + 0) / 4)
    assert report["partial_ratio"] == pytest.approx(1 / 4) and report["max_partial_span"] == 1
    assert oldest_version(partial) == 1 and oldest_version([_episode([])]) is None
    assert is_fresh(partial, 3, limit=2) and not is_fresh(partial, 4, limit=2)
