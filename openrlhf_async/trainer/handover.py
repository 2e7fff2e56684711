"""How a batch's episodes cross from the generator to the trainer: packed into a few flat arrays in Ray's object
store, with only a reference through the bounded queue. At DAPO's size (512 prompts x 16 samples of up to 20k
tokens) the episodes as Python lists would be tens of GB pickled into the queue's one actor and out again.

pack/unpack are pure (numpy): every token list of a batch concatenated into one array per field, with each
episode's lengths, and the episodes' other fields (reward, score, finish reason, ...) as they are. Token ids,
action masks and weight versions come back exactly; logprobs are kept as float32, which is what vLLM gives and what
the policy computes with (trainer/policy.py), so a float64 logprob comes back rounded to float32."""

import dataclasses
import itertools

import numpy as np

from openrlhf_async.rollout.episode import Episode

# An episode's token lists and how each is stored.
ARRAYS = {"prompt_ids": np.int32, "response_ids": np.int32, "logprobs": np.float32, "action_mask": np.int8,
          "token_versions": np.int32}
FIELDS = [f.name for f in dataclasses.fields(Episode) if f.name not in ARRAYS]  # carried as they are


def pack(groups: list) -> dict:
    """groups (lists of Episode) as one flat array per token list ("prompt_ids", ...) with each episode's length of
    it ("<name>_lens"), the group sizes, and each episode's other fields ("fields")."""
    episodes = [ep for group in groups for ep in group]
    packed = {"group_sizes": [len(group) for group in groups],
              "fields": [tuple(getattr(ep, name) for name in FIELDS) for ep in episodes]}
    for name, dtype in ARRAYS.items():
        lists = [getattr(ep, name) for ep in episodes]
        packed[f"{name}_lens"] = np.array([len(values) for values in lists], dtype=np.int64)
        packed[name] = np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype,
                                   count=int(packed[f"{name}_lens"].sum()))
    return packed


def unpack(packed: dict) -> list:
    """pack's groups back, every token list a plain Python list as the trainer had it."""
    bounds = {name: np.concatenate([[0], np.cumsum(packed[f"{name}_lens"])]).tolist() for name in ARRAYS}
    episodes = [Episode(**dict(zip(FIELDS, values)),
                        **{name: packed[name][bounds[name][i] : bounds[name][i + 1]].tolist() for name in ARRAYS})
                for i, values in enumerate(packed["fields"])]
    groups, start = [], 0
    for size in packed["group_sizes"]:
        groups.append(episodes[start : start + size])
        start += size
    return groups


class BatchQueue:
    """The bounded queue between the generator and the trainer (a ray.util.queue.Queue). An item with groups (a
    QueuedBatch) is put with its groups packed in the object store and given back with them unpacked; other items
    (END, EarlyEnd) go as they are. The queue's actor owns the packed objects, so a batch in the queue outlives the
    generator that made it, and is freed once the trainer has taken it."""

    def __init__(self, maxsize: int, actor_options: dict):
        from ray.util.queue import Queue

        self.queue = Queue(maxsize=maxsize, actor_options=actor_options)
        self._pending = None  # (item, packed item) while the queue is full: a retried put packs it once

    def qsize(self) -> int:
        return self.queue.qsize()

    def put(self, item, timeout: float = None) -> None:
        """Raises ray.util.queue.Full after timeout seconds, as Queue.put."""
        import ray

        if hasattr(item, "groups"):
            if self._pending is None or self._pending[0] is not item:
                ref = ray.put(pack(item.groups), _owner=self.queue.actor)
                self._pending = (item, dataclasses.replace(item, groups=ref))
            self.queue.put(self._pending[1], timeout=timeout)
            self._pending = None
        else:
            self.queue.put(item, timeout=timeout)

    def get(self, timeout: float = None):
        """Raises ray.util.queue.Empty after timeout seconds, as Queue.get."""
        import ray

        item = self.queue.get(timeout=timeout)
        if hasattr(item, "groups"):
            item = dataclasses.replace(item, groups=unpack(ray.get(item.groups)))
        return item
