"""GroupRunner without vLLM: a fake engine answers, the episode loop, agents and reward sources are real. The agent
and the reward source are chosen per call on one runner (as on one shared engine), and each is loaded once."""

import asyncio

from conftest import FakeEngine, user_file
from openrlhf_async.config import AgentConfig, RewardConfig
from openrlhf_async.rollout.group_runner import GroupRunner


def test_agent_and_reward_source_are_chosen_per_call_and_loaded_once(tmp_path):
    own = user_file(tmp_path, "own.py", """
        async def step(state, action, label):
            return 0.25, state + action, True, {}
    """)
    counting = user_file(tmp_path, "counting.py", """
        import itertools

        calls = itertools.count()  # module state: survives between calls only if the file is loaded once

        async def step(state, action, label):
            return float(next(calls)), state + action, True, {}
    """)
    reward_file = user_file(tmp_path, "reward.py", """
        async def reward_func(queries, prompts, labels):
            return {"rewards": [float(q == p + "ok") for q, p in zip(queries, prompts)]}
    """)
    runner = GroupRunner(AgentConfig(func_path=own, max_steps=1), RewardConfig())
    reward = RewardConfig(remote_url=reward_file).source()
    engine = FakeEngine()

    async def group(group_id, **per_call):
        episodes = await runner.run(engine, list(b"Q:"), "7", 2, {}, group_id, 8, **per_call)
        return [(ep.score, ep.extra_info.get("agent_reward")) for ep in episodes]

    async def main():
        return [await group("g0"), await group("g1", reward_source=reward), await group("g2"),
                await group("g3", agent_path=counting), await group("g4", agent_path=counting, reward_source=reward),
                await group("g5", agent_path=counting)]

    own_reward, scored, own_again, counted, counted_scored, counted_again = asyncio.run(main())
    assert own_reward == own_again == [(0.25, None)] * 2, "the run's own agent reward stands without a source"
    assert scored == [(1.0, 0.25)] * 2, "the per-call source scores the whole text; the agent's reward kept aside"
    assert sorted(counted) == [(0.0, None), (1.0, None)]
    assert sorted(counted_scored) == [(1.0, 2.0), (1.0, 3.0)]
    assert sorted(counted_again) == [(4.0, None), (5.0, None)], "the per-call agent file was loaded again"
    assert runner.reward_source(dict(reward)) is runner.reward_source(reward), "the same settings made a new source"
