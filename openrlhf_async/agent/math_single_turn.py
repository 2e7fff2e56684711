"""The default agent: one turn, the model's answer scored against the label with the math reward.

A plain `def`, so the engine runs it in a thread and a slow parse cannot stall generation."""

from openrlhf_async.reward.math_verify_reward import math_reward


def step(state, action, label):
    return math_reward(action, label), state + action, True, {}
