"""The math reward on hand-labelled cases."""

import pytest

from openrlhf_async.reward.math_verify_reward import math_reward


@pytest.mark.parametrize("completion, label, expected", [
    ("65", "65", 1.0),
    (" 65", "65", 1.0),
    ("65.0", "65", 1.0),
    ("56", "65", 0.0),
    ("", "65", 0.0),
    ("6 5", "65", 0.0),
    ("The answer is \\boxed{65}", "65", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("-3", "-3", 1.0),
    ("3", "-3", 0.0),
])
def test_math_reward(completion, label, expected):
    assert math_reward(completion, label) == expected
