"""The staleness policy (the production gate, the staleness limit, the sync behaviour) and staleness accounting,
as pure logic."""

import pytest

from openrlhf_async.config import Config
from openrlhf_async.rollout.episode import Episode
from openrlhf_async.trainer.staleness import StalenessPolicy, oldest_version, version_report


def _episode(versions, mask=None):
    mask = mask or [1] * len(versions)
    return Episode("r0", [1], response_ids=[2] * len(versions), token_versions=versions, action_mask=mask)


def _policy(mode, queue=1, threshold=0.0, trigger=1, require=1, max_staleness=-1, partial=False):
    cfg = Config()
    cfg.mode, cfg.train.async_queue_size, cfg.train.staleness_threshold = mode, queue, threshold
    cfg.train.trigger_parameter_sync_step, cfg.train.require_batches = trigger, require
    cfg.train.max_staleness, cfg.train.partial_rollout_enable = max_staleness, partial
    return StalenessPolicy.from_config(cfg)


def test_each_mode_decodes_to_its_window_limit_and_sync_behaviour():
    window = lambda p: (p.items_per_sync, p.slack, p.limit, p.carry_over, p.pause_mode)  # noqa: E731
    assert window(_policy("sync")) == (1, 0, 0, False, "wait")
    assert window(_policy("async", queue=2)) == (1, 2, 2, False, "wait")
    assert window(_policy("fully_async", threshold=0.5, trigger=2, require=2)) == (4, 2, 2, True, "wait")
    assert window(_policy("fully_async", threshold=0.5)) == (1, 1, 2, True, "wait")  # rounded up to a whole batch
    assert window(_policy("fully_async", require=3, partial=True)) == (3, 0, 1, True, "keep")
    assert window(_policy("fully_async", threshold=2.0)) == (1, 2, 3, True, "wait")
    assert _policy("fully_async", threshold=2.0, max_staleness=0).limit == 0  # the flag overrides the mode's bound
    assert _policy("async", queue=2, max_staleness=5).limit == 5


def test_sync_mode_never_runs_ahead_and_async_runs_k_ahead():
    sync, async_2 = _policy("sync"), _policy("async", queue=2)
    assert sync.may_produce(0, 0) and not sync.may_produce(1, 0) and sync.may_produce(1, 1)
    assert async_2.may_produce(2, 0) and not async_2.may_produce(3, 0)


def _earliest_version(index, policy):
    return next(v for v in range(index + 2) if policy.may_produce(index, v))


@pytest.mark.parametrize("mode,queue,threshold,trigger,require", [
    ("sync", 1, 0.0, 1, 1), ("async", 1, 0.0, 1, 1), ("async", 3, 0.0, 1, 1),
    ("fully_async", 1, 0.0, 1, 1), ("fully_async", 1, 0.5, 1, 1), ("fully_async", 1, 0.5, 4, 1),
    ("fully_async", 1, 1.0, 2, 2), ("fully_async", 1, 2.0, 1, 3),
])
def test_the_gate_keeps_every_batch_within_the_modes_staleness_limit(mode, queue, threshold, trigger, require):
    policy = _policy(mode, queue, threshold, trigger, require)
    worst = 0
    for index in range(60):
        # A group started as early as the gate allows; with carry-over it may also come from the batch before
        # (started as early as that batch could start).
        first = index - 1 if policy.carry_over and index else index
        worst = max(worst, policy.trained_version(index) - _earliest_version(first, policy))
    assert worst <= policy.limit
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
    policy = _policy("fully_async", threshold=1.0)  # limit 2
    assert policy.is_fresh(partial, 3) and not policy.is_fresh(partial, 4)
    assert policy.is_fresh([_episode([0, 0], mask=[0, 0])], 9)  # no model tokens: nothing to be stale
