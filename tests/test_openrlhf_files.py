"""OpenRLHF's user files as OpenRLHF accepts them: reward_func answers (a number per one-query call, a list, a
tensor; "scores" apart from "rewards"; "extra_logs"), OpenRLHF 0.8 dict-returning step files, and 0.11
AgentInstances with an `async def __init__`. Fakes stand in for vLLM and the tokenizer; the episode loop, agents,
reward sources, shaping, the batch's filter and the advantages are real."""

import asyncio
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ByteTokenizer, FakeEngine, user_file
from openrlhf_async.agent import AgentStepError, check_step_result, load_agent
from openrlhf_async.config import AgentConfig, RewardConfig
from openrlhf_async.reward.shaping import shape_rewards
from openrlhf_async.reward.sources import RewardError, load_reward_func
from openrlhf_async.rollout.batch import RolloutBatch, StartedGroup, stop_rule
from openrlhf_async.rollout.episode import Episode, extra_log_means, run_executor_episode
from openrlhf_async.rollout.filter import GroupFilter
from openrlhf_async.rollout.group_runner import GroupRunner
from openrlhf_async.trainer.losses import group_advantages


def _reward_func(tmp_path, answer: str):
    return load_reward_func(user_file(tmp_path, "reward.py", f"""
        import math

        import numpy as np
        import torch

        def reward_func(queries, prompts, labels):
            return {answer}
    """))


@pytest.mark.parametrize("answer, reward, score", [
    ("{'rewards': 1}", 1.0, 1.0),  # a plain number for the one query of the call, as OpenRLHF 0.11 takes it
    ("{'rewards': 0.5}", 0.5, 0.5),
    ("{'rewards': torch.tensor(0.5), 'scores': np.float32(1.0)}", 0.5, 1.0),
    ("{'rewards': [0.25], 'scores': None}", 0.25, 0.25),
    ("{'rewards': torch.tensor([0.25]), 'scores': torch.tensor([0.0])}", 0.25, 0.0),
])
def test_a_reward_func_called_with_one_query_may_answer_one_number(tmp_path, answer, reward, score):
    (result,) = asyncio.run(_reward_func(tmp_path, answer).score(["q"], ["p"], ["l"]))
    assert result == {"reward": reward, "score": score, "extra": {}}
    assert type(result["reward"]) is float and type(result["score"]) is float


@pytest.mark.parametrize("answer, queries, message", [
    ("{'rewards': 1.0}", 2, "rewards: got float for 2 queries; expected one number per query"),
    ("{'rewards': float('nan')}", 1, "rewards[0] is nan; expected a finite number"),
    ("{'rewards': 1e7}", 1, "rewards[0] is 10000000.0; expected a finite number"),
    ("{'rewards': '1.0'}", 1, "rewards[0] is '1.0'; expected a number"),
    ("{'rewards': 1.0, 'scores': torch.tensor(math.inf)}", 1, "scores[0] is inf; expected a finite number"),
    ("{'rewards': [1.0, 0.0]}", 1, "rewards: got length 2 for 1 queries"),
    ("1.0", 1, "reward returned float without 'rewards'"),  # OpenRLHF wants the dict too
])
def test_bad_reward_func_answers_are_still_refused(tmp_path, answer, queries, message):
    reward = _reward_func(tmp_path, answer)
    with pytest.raises(RewardError, match="^" + re.escape(message)):
        asyncio.run(reward.score(["q"] * queries, ["p"] * queries, ["l"] * queries))


def test_extra_logs_keep_numbers_and_leave_the_rest_out(tmp_path):
    reward = _reward_func(tmp_path, """{"rewards": [1.0, 0.0], "extra_logs": {
        "acc": torch.tensor([1.0, 0.0]), "batch": 3, "pred": ["42", "41"], "note": "text", "nan": [float("nan"), 2]}}
    """)
    results = asyncio.run(reward.score(["a", "b"], ["", ""], ["", ""]))
    assert [r["extra"] for r in results] == [{"acc": 1.0, "batch": 3.0}, {"acc": 0.0, "batch": 3.0, "nan": 2.0}]


def test_extra_log_means_are_per_key_over_the_episodes_that_logged_a_number():
    def ep(**extra):
        return Episode("r", [1], extra_info=extra)

    groups = [[ep(accuracy=1.0, pred="42", turns=torch.tensor(2)), ep(accuracy=0, turns=np.int64(1))],
              [ep(accuracy=True, bad=math.nan, many=torch.tensor([1.0, 2.0])), ep(other=[1.0], agent_reward=0.5)]]
    assert extra_log_means(groups) == {"rollout/extra/accuracy": 2 / 3, "rollout/extra/turns": 1.5,
                                       "rollout/extra/agent_reward": 0.5}
    assert extra_log_means([[ep(pred="x")]]) == {}


def test_scores_drive_the_filter_and_rewards_drive_the_advantages(tmp_path):
    agent = user_file(tmp_path, "agent.py", """
        async def step(state, action, label):
            return 0.0, state + action, True, {}
    """)
    # Called once per episode: the group's two episodes get i = 0 and 1. One figure varies, the other does not.
    reward = user_file(tmp_path, "reward.py", """
        import itertools

        calls = itertools.count()

        async def reward_func(queries, prompts, labels):  # on the engine's loop: one counter for the group
            i = float(next(calls) % 2)
            if labels[0] == "flat rewards":
                return {"rewards": 1.0, "scores": i, "extra_logs": {"i": i}}
            return {"rewards": i, "scores": 1.0}
    """)
    runner = GroupRunner(AgentConfig(func_path=agent, max_steps=1), RewardConfig())
    source = RewardConfig(remote_url=reward).source()

    def judged(label):
        group = asyncio.run(runner.run(FakeEngine(), list(b"Q:"), label, 2, {}, "g0", 8, reward_source=source))
        shape_rewards(group, 8, 0, 0.0)
        batch = RolloutBatch(1, 2, stop_rule(True, False, 0.0, 0), GroupFilter(), {"agent": 1.0, "reward": 1.0})
        record = StartedGroup({})
        batch.group_finished(record, group)
        return group, record.valid, group_advantages(torch.tensor([[ep.reward for ep in group]]))

    group, valid, advantages = judged("flat rewards")
    assert sorted(ep.score for ep in group) == [0.0, 1.0] and [ep.reward for ep in group] == [1.0, 1.0]
    assert valid, "the scores vary: the filter keeps the group"
    assert advantages.abs().max() == 0, "the rewards are flat: no advantage"
    assert extra_log_means([group]) == {"rollout/extra/i": 0.5, "rollout/extra/agent_reward": 0.0}
    group, valid, advantages = judged("flat scores")
    assert [ep.score for ep in group] == [1.0, 1.0] and sorted(ep.reward for ep in group) == [0.0, 1.0]
    assert not valid, "the scores are flat: the filter drops the group, though its rewards vary"


def test_overlong_shaping_goes_to_the_reward_not_the_score():
    group = [Episode("r", [1], response_ids=[1, 2], action_mask=[1, 1], score=1.0, raw_reward=0.25),
             Episode("s", [1], response_ids=[1, 2], action_mask=[1, 1], score=0.5)]  # one figure: both
    shape_rewards(group, budget=3, buffer=2, factor=1.0)  # 2 tokens, 1 into the buffer of 2: -0.5
    assert [(ep.score, ep.raw_reward, ep.reward) for ep in group] == [(1.0, 0.25, -0.25), (0.5, 0.5, 0.0)]
    bad = [Episode("r", [1], score=1.0, raw_reward=math.nan)]
    shape_rewards(bad, budget=3, buffer=0, factor=1.0)
    assert (bad[0].score, bad[0].reward) == (0.0, 0.0) and bad[0].error[1].startswith("RewardError: the episode's")


def test_overlong_shaping_counts_the_models_tokens_against_each_episodes_own_budget():
    # A two-turn episode: 4 model tokens, 6 observation tokens, 2 model tokens. Its length is the model's 6 tokens
    # (DAPO's |y|), not the 12 of its response, which would put it at the budget and give the full penalty.
    multi_turn = Episode("m", [1], response_ids=list(range(12)), action_mask=[1] * 4 + [0] * 6 + [1] * 2, score=1.0)
    shape_rewards([multi_turn], budget=12, buffer=8, factor=1.0)  # 6 tokens, 2 into the buffer of 8
    assert multi_turn.reward == pytest.approx(1.0 - 0.25)
    # One budget per episode (a group carried over with what each sample had left): each is judged by its own.
    pair = [Episode(x, [1], response_ids=[1] * 6, action_mask=[1] * 6, score=0.0) for x in "ab"]
    shape_rewards(pair, budget=[6, 20], buffer=4, factor=1.0)
    assert [ep.reward for ep in pair] == [-1.0, 0.0]


STEP_0_8 = """
    import torch

    observations = []  # what each call saw

    async def step(observation, action, label, **kwargs):
        observations.append(observation)
        done = "[feedback]" in observation
        return {
            "rewards": torch.tensor(0.25),
            "scores": torch.tensor(1.0 if done else 0.0),
            "next_observation": observation + action + ("" if done else " [feedback] "),
            "done": done,
            "sampling_params": kwargs.get("sampling_params", None),
            "extra_logs": {"turns": torch.tensor(len(observations))},
        }
"""


def test_an_openrlhf_0_8_step_file_runs_a_two_turn_episode(tmp_path):
    path = user_file(tmp_path, "agent_0_8.py", STEP_0_8)
    runner = GroupRunner(AgentConfig(func_path=path, max_steps=4), RewardConfig())
    (ep,) = asyncio.run(runner.run(FakeEngine(), list(b"Q:"), "7", 1, {}, "g0", 64))
    assert ep.error is None and ep.turns == 2
    assert runner.agent(path)._step.__globals__["observations"] == ["Q:", "Q:ok [feedback] "], \
        "the observation is the whole text so far, and next_observation replaced it"
    assert bytes(ep.response_ids).decode() == "ok [feedback] ok"
    assert ep.action_mask == [1, 1] + [0] * len(" [feedback] ") + [1, 1]
    assert (ep.score, ep.raw_reward) == (1.0, 0.5), "the last step's scores; the rewards summed"
    assert extra_log_means([[ep]]) == {"rollout/extra/turns": 2.0}


def test_openrlhf_0_8_step_dicts_are_checked():
    result = check_step_result({"rewards": 1, "next_observation": "s", "done": 1, "extra_logs": None})
    assert (result.reward, result.score, result.next_state, result.done, result.extra_info) == (1.0, None, "s", True, {})
    for bad, message in [({"rewards": 1.0, "done": True}, "without 'next_observation'"),
                         ({"rewards": "1", "next_observation": "s", "done": True}, "reward '1'; expected a number"),
                         ({"rewards": 1.0, "scores": [1.0, 2.0], "next_observation": "s", "done": True}, "scores"),
                         ({"rewards": 1.0, "next_observation": "s", "done": True, "sampling_params": {"n": 1}},
                          "sampling_params 'n'; a step may set stop, stop_token_ids, max_tokens")]:
        with pytest.raises(AgentStepError, match=message):
            check_step_result(bad)


ASYNC_INIT_AGENT = """
    import asyncio

    import torch
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


    class AgentInstance(AgentInstanceBase):
        async def __init__(self, *args, **kwargs):
            await asyncio.sleep(0)  # e.g. opening a session to an environment
            self.turn = 0

        async def reset(self, states: dict, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states: dict, **kwargs):
            self.turn += 1
            done = self.turn >= 2
            return {"rewards": torch.tensor(0.25), "scores": torch.tensor(1.0 if done else 0.0),
                    "environment_feedback": "" if done else " [again] ", "done": done,
                    "sampling_params": states.get("sampling_params", None),
                    "extra_logs": {"turn": torch.tensor(self.turn)}}


    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)
"""


async def _say_ok(prompt_ids, params, request_id):
    ids = list(b"ok")
    out = SimpleNamespace(token_ids=ids, text="ok", finish_reason="stop",
                          logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in ids])
    return SimpleNamespace(outputs=[out]), [3] * len(ids)


def test_an_agent_instance_with_an_async_init_is_awaited(tmp_path):
    agent = load_agent(user_file(tmp_path, "async_init.py", ASYNC_INIT_AGENT))
    with pytest.raises(TypeError, match="should return None"):  # why OpenRLHF's executor cannot build it
        with pytest.warns(RuntimeWarning, match="never awaited"):
            agent.executor.agent_instance_cls.__mro__[1]()
    ep = asyncio.run(run_executor_episode(_say_ok, agent, ByteTokenizer(), list(b"Q:"), "7",
                                          SimpleNamespace(logprobs=0, max_tokens=None), 64, "g0-0"))
    assert ep.error is None and ep.turns == 2
    assert bytes(ep.response_ids).decode() == "ok [again] ok" and ep.token_versions == [3] * len(ep.response_ids)
    assert (ep.score, ep.raw_reward) == (1.0, 0.5), "the last step's scores; the rewards summed"
    assert extra_log_means([[ep]]) == {"rollout/extra/turn": 2.0}
    assert ep.logprobs == [-1.0, -1.0] + [0.0] * len(" [again] ") + [-1.0, -1.0], "vLLM's log-probs, as it gave them"


def test_an_executor_without_rollout_log_probs_gets_vllms_or_an_error_never_zeros():
    """The behaviour log-probs drive TIS and ICEPOP: an executor that returns none gets the engine's record of its
    turns when its tokens are the ones vLLM generated, and an error otherwise (a 0.0 would weigh each token by its
    own probability)."""
    class Executor:
        def __init__(self, rewrite):
            self.rewrite = rewrite

        async def execute(self, prompt, label, sampling_params, max_length, tokenizer, engine):
            out = await engine.generate(list(b"Q:"), sampling_params)
            action = list(b"OK") if self.rewrite else list(out.outputs[0].token_ids)
            return {"observation_tokens": list(b"Q:") + action, "action_ranges": [(2, 4)], "reward": 1.0}

    def episode(rewrite):
        return asyncio.run(run_executor_episode(_say_ok, SimpleNamespace(executor=Executor(rewrite)), ByteTokenizer(),
                                                list(b"Q:"), "7", SimpleNamespace(logprobs=None), 64, "g0-0"))

    kept = episode(rewrite=False)
    assert kept.error is None and kept.logprobs == [-1.0, -1.0] and kept.action_mask == [1, 1]
    rewritten = episode(rewrite=True)
    assert rewritten.error[0] == "error" and rewritten.error[1].startswith("MissingLogprobs: the executor returned no "
                                                                           "rollout_log_probs for 4 tokens")
