"""Verifiable math reward: 1.0 when the completion's answer equals the label, else 0.0."""

import logging

# math-verify warns on every call when its signal-based timeout is off; it must be off outside the main thread.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def math_reward(completion: str, label: str) -> float:
    from math_verify import parse, verify

    gold = parse(label, parsing_timeout=None)
    if not gold:  # a label math-verify cannot read: fall back to exact text
        return float(completion.strip() == label.strip())
    pred = parse(completion, parsing_timeout=None)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=None))
