"""A single-turn agent whose reward is a coin with the prompt's own pass rate (the label), so the share of groups
whose rewards are all equal is set by the workload, not by the model."""

import random


async def step(state, action, label):
    return float(random.random() < float(label)), state + action, True, {}
