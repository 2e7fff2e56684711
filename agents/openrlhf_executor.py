"""An OpenRLHF 0.11 agent file, run here unchanged: math answers, with one retry after a wrong one.

Use: --train.agent_func_path agents/openrlhf_executor.py

OpenRLHF's format (openrlhf.utils.agent): an `AgentInstance(AgentInstanceBase)`, made fresh for every episode,
with `async reset(states)` and `async step(states)`, and a module-level `AgentExecutor` class that hands it to
`MultiTurnAgentExecutor`. Its `__init__` may be `async def` (OpenRLHF cannot build such an instance; here it is
awaited before the first reset). The executor generates, calls `step` with
    {"observation_text": the episode text so far, "action_text": what the model just wrote, "label", "sampling_params"}
and appends the returned "environment_feedback" (its tokens are masked out of the loss) until "done".
`step` returns {"rewards": tensor, "scores": tensor, "environment_feedback": str, "done": bool,
"sampling_params": the params for the next turn, "extra_logs": dict of tensors}; the episode's reward is the
sum of "rewards". Here the engine runs the executor in its own process (--agent.workers 0) through an adapter
that routes each generate call through its request path, so early stop and load balancing still apply.

This project's own contract (agents/math_single_turn.py) is shorter; use this one to bring an existing
OpenRLHF file over. Adapting it: change `step`; for a chat model, wrap FEEDBACK in the chat template's turn
markers so that it reads as a new user message."""

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from openrlhf_async.reward.math_verify_reward import math_verify

MAX_ATTEMPTS = 2
FEEDBACK = "\nYour answer is wrong, try again.\n"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.attempts = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.attempts += 1
        result = await math_verify(states["action_text"], states["label"])
        done = result["score"] == 1.0 or self.attempts >= MAX_ATTEMPTS
        return {
            "rewards": torch.tensor(result["score"]),
            "scores": torch.tensor(result["score"]),
            "environment_feedback": "" if done else FEEDBACK,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"accuracy": torch.tensor(result["accuracy"]), "attempts": torch.tensor(self.attempts)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
