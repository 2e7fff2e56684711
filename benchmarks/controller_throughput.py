"""Orchestration overhead: the rollout controller, the episode loop and agent steps against engines that answer
instantly. Prints a final JSON line; the target is at least 10,000 episode steps per second."""

import argparse
import json
import os
import sys
import tempfile
import time

from openrlhf_async.agent import load_agent
from openrlhf_async.config import config_with, preset_config
from openrlhf_async.rollout.controller import LocalHandle, RolloutController
from openrlhf_async.rollout.episode import run_episode, run_group
from openrlhf_async.rollout.filter import GroupFilter

AGENT = '''
async def step(state, action, label):
    turns = state.count("|") + 1
    done = turns >= {turns}
    return float(done and hash(state) % 2 == 0), state + action + ("" if done else "|"), done, {{}}
'''


class Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "x" * len(ids)

    def encode(self, text, add_special_tokens=False):
        return [1] * len(text)


class InstantEngine:
    """generate_group as the real engine runs it, with a generate that answers at once."""

    def __init__(self, agent, turns):
        self.agent, self.turns, self.tokenizer = agent, turns, Tokenizer()

    async def _generate(self, prompt_ids, sampling, request_id):
        return {"response_ids": [7, 7], "logprobs": [-0.5, -0.5], "token_versions": [0, 0], "finish_reason": "stop"}

    async def generate_group(self, prompt_ids, label, n, sampling, group_id, budget, agent_path=None, screen=0,
                             group_filter=GroupFilter(), reward_source=None, prompt=None):
        return await run_group(lambda i: run_episode(self._generate, self.agent, self.tokenizer, prompt_ids, label,
                                                     sampling, budget, self.turns, 30.0, f"{group_id}-{i}"),
                               n, screen, group_filter)

    async def abort_groups(self, group_ids):
        return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--groups", type=int, default=1024, help="valid groups to collect")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="agent steps per episode")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "agent.py")
        with open(path, "w") as f:
            f.write(AGENT.format(turns=args.turns))
        agent = load_agent(path)
        engines = [LocalHandle(InstantEngine(agent, args.turns)) for _ in range(args.engines)]
        cfg = config_with(preset_config("tiny_cpu"), rollout={"n_samples_per_prompt": args.n,
                                                              "max_new_tokens": 10 * args.turns,
                                                              "vllm_generate_batch_size": 256},
                          vllm={"max_concurrency": 512}, algo={"dynamic_filtering_enable": False})
        controller = RolloutController(cfg, engines, sampling={})
        prompts = iter(lambda: {"prompt_ids": [1, 2, 3], "label": "1"}, None)
        start = time.perf_counter()
        groups, metrics = controller.run(prompts.__next__, args.groups)
        wall = time.perf_counter() - start
    steps = sum(ep.turns for g in groups for ep in g)
    assert steps == args.groups * args.n * args.turns
    print(json.dumps({"episode_steps": steps, "episodes": args.groups * args.n, "wall_s": round(wall, 3),
                      "steps_per_s": round(steps / wall), "target_steps_per_s": 10000}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
