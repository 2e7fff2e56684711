"""A batch's episodes from the generator to the trainer (trainer/handover.py): packed into flat arrays and back
exactly, and through the queue by reference, surviving the generator that made them."""

import time

import numpy as np
import pytest

from openrlhf_async.rollout.episode import Episode
from openrlhf_async.trainer.handover import pack, unpack


def _logprobs(n: int, seed: int) -> list:
    # vLLM's logprobs are float32 values
    return np.random.default_rng(seed).uniform(-12, 0, n).astype(np.float32).tolist()


def _groups() -> list:
    multi_turn = Episode("g0-0", [5, 6, 7], response_ids=[151000, 8, 9, 10, 11, 12], logprobs=[-0.5, -1.25, 0.0, 0.0,
                         -2.0, -0.125], action_mask=[1, 1, 0, 0, 1, 1], token_versions=[3, 3, 3, 3, 4, 4],
                         finish_reason="stop", score=1.0, raw_reward=1.0, reward=0.75, turns=2,
                         extra_info={"pred": "42", "accuracy": 1.0})
    long = Episode("g0-1", [5, 6, 7], response_ids=list(range(1000)), logprobs=_logprobs(1000, 0),
                   action_mask=[1] * 1000, token_versions=[4] * 1000, finish_reason="length", reward=-1.0)
    empty = Episode("g1-0", [9], finish_reason="stop", error=("error", "ValueError: bad step"), turns=1)
    aborted = Episode("g1-1", [], response_ids=[1], logprobs=[-0.25], action_mask=[1], token_versions=[0],
                      finish_reason="abort", aborted=True)
    return [[multi_turn, long], [empty, aborted], []]


def test_a_batch_comes_back_exactly_as_packed():
    groups = _groups()
    packed = pack(groups)
    assert packed["response_ids"].dtype == np.int32 and packed["response_ids"].size == 6 + 1000 + 0 + 1
    assert packed["logprobs"].dtype == np.float32 and packed["action_mask"].dtype == np.int8
    back = unpack(packed)
    assert back == groups
    # plain Python values, as the trainer sums, concatenates and logs them
    assert type(back[0][0].response_ids[0]) is int and type(back[0][0].logprobs[1]) is float
    assert unpack(pack([])) == []


def test_logprobs_beyond_float32_come_back_rounded_to_it():
    ep = Episode("r", [1], response_ids=[2], logprobs=[-0.1], action_mask=[1], token_versions=[0])
    assert unpack(pack([[ep]]))[0][0].logprobs == [float(np.float32(-0.1))]


def test_a_queued_batch_outlives_its_generator_and_a_full_queue_packs_it_once(ray_cluster, monkeypatch):
    import ray
    from ray.util.queue import Full

    from openrlhf_async.trainer import handover
    from openrlhf_async.trainer.pipeline import END, QueuedBatch

    queue = handover.BatchQueue(maxsize=1, actor_options={})
    groups = _groups()

    @ray.remote
    class Generator:
        def put(self, queue, item) -> list:
            queue.put(item, timeout=10)
            return [ray.put("owned by the generator")]  # in a list: the ref itself comes back

    generator = Generator.remote()
    [own] = ray.get(generator.put.remote(queue, QueuedBatch(0, 1, groups, {}, [], [], [])))
    ray.kill(generator, no_restart=True)
    deadline = time.time() + 60
    while time.time() < deadline:  # until Ray has dropped the objects the dead generator owned
        try:
            ray.get(own, timeout=1)
        except ray.exceptions.OwnerDiedError:
            break
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.5)
    else:
        pytest.fail("the generator's own object outlived it for a minute")
    item = queue.get(timeout=10)
    assert (item.index, item.version, item.groups) == (0, 1, groups)

    packs = []
    monkeypatch.setattr(handover, "pack", lambda g: packs.append(g) or pack(g))
    first, second = QueuedBatch(1, 1, groups, {}, [], [], []), QueuedBatch(2, 1, groups[:1], {}, [], [], [])
    queue.put(first, timeout=1)
    with pytest.raises(Full):
        queue.put(second, timeout=0.1)
    assert queue.get(timeout=1).index == 1
    queue.put(second, timeout=1)
    assert len(packs) == 2 and queue.get(timeout=1).groups == groups[:1]
    queue.put(END, timeout=1)
    assert queue.get(timeout=1) == END
