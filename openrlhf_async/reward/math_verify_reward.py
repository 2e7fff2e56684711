"""Verifiable math reward: 1.0 when the completion's answer equals the label, else 0.0."""

import logging

# math-verify warns on every call when its signal-based timeout is off; it must be off outside the main thread.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _plain_number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def math_reward(completion: str, label: str) -> float:
    # Plain numbers are compared directly: math-verify's sympy parse costs ~5 ms a call, inline in the engine.
    pred_num, gold_num = _plain_number(completion.strip()), _plain_number(label.strip())
    if pred_num is not None and gold_num is not None:
        return float(pred_num == gold_num)
    from math_verify import parse, verify

    gold = parse(label, parsing_timeout=None)
    if not gold:  # a label math-verify cannot read: fall back to exact text
        return float(completion.strip() == label.strip())
    pred = parse(completion, parsing_timeout=None)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=None))
