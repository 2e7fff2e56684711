"""Sampling seeds. Each vLLM request carries a seed of its own, derived from --train.seed and the request's place:
the prompt's position in the data stream (or its order in an evaluation), the sample's index in its group and the
turn. What a request samples then depends on its place alone, not on the engine that took it, the requests that
share its batch or what the engines ran before it (up to the floating-point differences a batch's shape makes in the
logits, which can flip a token whose two choices are nearly tied)."""

import hashlib


def derive_seed(*place) -> int:
    """A seed in [0, 2**63) from the parts of a place, the same in every process and on every machine (Python's hash()
    is salted per process)."""
    digest = hashlib.sha256(":".join(map(str, place)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seeded(sampling: dict, *place) -> dict:
    """`sampling` with its seed moved down to this place under it (a sample of a group, a turn of a sample); the
    same dict when it has no seed."""
    if sampling.get("seed") is None:
        return sampling
    return {**sampling, "seed": derive_seed(sampling["seed"], *place)}
