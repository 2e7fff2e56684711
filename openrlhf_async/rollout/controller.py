"""Rollout controller: spreads prompt groups over the engines and collects the scored samples."""

import itertools

from openrlhf_async.utils.ray_utils import get_all

_group_ids = itertools.count()


def generate_groups(engines: list, prompts: list, n: int, sampling: dict) -> list:
    """prompts: [{"prompt_ids", "label"}]. Returns one list of n scored samples per prompt, in prompt order."""
    refs = [
        engines[i % len(engines)].generate_group.remote(p["prompt_ids"], p["label"], n, sampling, f"g{next(_group_ids)}")
        for i, p in enumerate(prompts)
    ]
    return get_all(refs)
