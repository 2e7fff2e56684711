"""Rewards that cannot poison training: every reward and score, from an agent step, an executor episode, a
reward_func file or a reward service, is a finite number of sane size, or its episode is a counted reward error.
Fakes stand in for vLLM and the tokenizer; the episode loop, the engine's rescoring and the controller are real."""

import asyncio
import json
import math
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import preset_config
from openrlhf_async.agent import StepResult
from openrlhf_async.config import config_with
from openrlhf_async.data.prompts import load_prompts
from openrlhf_async.reward.math_verify_reward import math_score
from openrlhf_async.reward.sources import load_reward_func, parse_reward_output
from openrlhf_async.rollout.controller import LocalHandle, RolloutController
from openrlhf_async.rollout.episode import Episode, run_episode, run_executor_episode, run_group
from openrlhf_async.rollout.filter import GroupFilter
from openrlhf_async.rollout.group_runner import rescored
from openrlhf_async.trainer.losses import group_advantages

BAD = [1e160, math.inf, math.nan, -math.inf, 1e7, "1.0", None]
GOOD = [True, np.float32(0.5), torch.tensor(0.25), -1e6]  # real numbers of each type, taken as plain floats
PROMPT = "Q:"


class ByteTokenizer:
    """One token per byte; records the length of every text it is asked to encode."""

    def __init__(self):
        self.encoded = []

    def encode(self, text, add_special_tokens=False):
        self.encoded.append(len(text))
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode()


async def scripted_generate(prompt_ids, sampling, request_id):
    """The model writes `i,t|` in turn t of episode i (request ids end in `-{i}-t{t}`)."""
    _, episode, turn = request_id.rsplit("-", 2)
    ids = list(f"{episode},{turn[1:]}|".encode())
    return {"response_ids": ids, "logprobs": [-1.0] * len(ids), "token_versions": [0] * len(ids),
            "finish_reason": "stop"}


class ScriptedAgent:
    """Turn t of episode i earns label["turns"][i][t], unchecked (a step file's reward that is not a number stops
    at check_step_result as an agent error); the episode ends after its last turn."""

    async def step(self, state, action, label, timeout):
        i, t = map(int, action.rstrip("|").split(","))
        turns = label["turns"][i]
        return StepResult(turns[t], state + action + ".", t == len(turns) - 1, {})


def final_reward(query: str, prompt: str, label):
    return label["final"][int(query[len(prompt):].split(",")[0])]


REWARD_FUNC = """
    def reward_func(queries, prompts, labels):
        return {"rewards": [l["final"][int(q[len(p):].split(",")[0])] for q, p, l in zip(queries, prompts, labels)]}
"""


class ServiceAnswers:
    """A reward service as RemoteReward reads it: its JSON answer (NaN and Infinity included) through
    parse_reward_output."""

    async def score(self, queries, prompts, labels):
        body = json.dumps({"rewards": [final_reward(*args) for args in zip(queries, prompts, labels)]}, default=float)
        return parse_reward_output(json.loads(body), len(queries))


class ScriptedEngine:
    """generate_group as the engine runs it, without vLLM: the real episode loop, and the engine's own rescoring
    when a reward source is given."""

    def __init__(self, reward=None):
        self.tokenizer, self.agent, self.reward = ByteTokenizer(), ScriptedAgent(), reward

    async def generate_group(self, prompt_ids, label, n, sampling, group_id, budget, agent_path=None, screen=0,
                             group_filter=GroupFilter(), reward_source=None, prompt=None):
        prompt_text = self.tokenizer.decode(prompt_ids)

        def episode(i):
            ep = run_episode(scripted_generate, self.agent, self.tokenizer, prompt_ids, label, sampling, budget,
                             max_steps=4, step_timeout=5.0, request_id=f"{group_id}-{i}")
            return ep if self.reward is None else rescored(ep, self.reward, self.tokenizer, prompt_text, label)

        return await run_group(episode, n, screen, group_filter)

    async def abort_groups(self, group_ids):
        return 0


def _engine(source: str, tmp_path):
    if source == "reward_func":
        path = tmp_path / "reward.py"
        path.write_text(textwrap.dedent(REWARD_FUNC))
        return ScriptedEngine(load_reward_func(str(path)))
    return ScriptedEngine(ServiceAnswers() if source == "service" else None)


def _label(rewards: list, source: str) -> dict:
    """Episode i of the group earns rewards[i]: from its one step, or from the reward source (the step earns 0)."""
    if source == "agent":
        return {"turns": [[r] for r in rewards]}
    return {"turns": [[0.0]] * len(rewards), "final": rewards}


def _run(engine, labels: list, target: int, n: int = 2, algo=(), **kwargs):
    cfg = config_with(preset_config(validated=False), rollout={"n_samples_per_prompt": n, "max_new_tokens": 64, "vllm_generate_batch_size": 4,
                                         "early_stop": False}, algo=dict(algo), vllm={"max_concurrency": 64},
                      agent={"max_error_ratio": 1.0}, reward={"max_error_ratio": 1.0})
    controller = RolloutController(cfg, [LocalHandle(engine)], sampling={}, **kwargs)
    it = iter(labels)
    groups, metrics = controller.run(lambda: {"prompt_ids": list(PROMPT.encode()), "label": next(it)}, target)
    return controller, groups, metrics


def test_check_reward_takes_real_numbers_and_refuses_the_rest():
    from openrlhf_async.reward.sources import MAX_REWARD, RewardError, check_reward

    for value, expected in [(True, 1.0), (False, 0.0), (3, 3.0), (0.5, 0.5), (np.float32(0.25), 0.25),
                            (np.int64(-2), -2.0), (torch.tensor(1.5), 1.5), (MAX_REWARD, MAX_REWARD)]:
        assert check_reward(value, "reward") == expected and type(check_reward(value, "reward")) is float
    for value in BAD + [10 ** 400, np.float64("nan"), torch.tensor(math.inf), torch.tensor([1.0, 2.0]), "x\ny"]:
        with pytest.raises(RewardError, match="^reward is .*; expected a") as error:
            check_reward(value, "reward")
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("source", ["agent", "reward_func", "service"])
@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_bad_reward_is_a_counted_reward_error_and_the_rollout_goes_on(source, bad, tmp_path):
    good, poisoned = _label(GOOD, source), _label([bad, 1.0, 0.0, 1.0], source)
    controller, groups, m = _run(_engine(source, tmp_path), [good, poisoned] * 4, target=2, n=4)
    assert [[ep.reward for ep in g] for g in groups] == [[1.0, 0.5, 0.25, -1e6], [0.0, 1.0, 0.0, 1.0]]
    assert all(type(ep.reward) is float and ep.error is None for ep in groups[0]), "its neighbours unaffected"
    kind, message = groups[1][0].error
    assert kind == "reward_error" and [ep.error for ep in groups[1][1:]] == [None] * 3
    assert m["rollout/reward_errors"] == 1 and m["rollout/reward_first_error"] == message
    assert f"is {bad!r}; expected a" in message and "\n" not in message, message
    groups, m = controller.run(lambda: {"prompt_ids": list(PROMPT.encode()), "label": good}, 1)
    assert m["rollout/reward_errors"] == 0 and [ep.reward for ep in groups[0]] == [1.0, 0.5, 0.25, -1e6]


def test_the_reward_summed_over_turns_is_checked_too():
    label = {"turns": [[6e5, 6e5], [1.0]]}  # each turn's reward is fine; their sum is not
    _, (group,), m = _run(ScriptedEngine(), [label], target=1)
    assert group[0].error == ("reward_error", "RewardError: the reward summed over 2 turns is 1200000.0; "
                                                 "expected a finite number of size at most 1e+06")
    assert [ep.score for ep in group] == [0.0, 1.0] and m["rollout/reward_errors"] == 1


def test_an_executor_episode_reward_is_checked():
    class Executor:
        async def execute(self, prompt, label, sampling_params, max_length, tokenizer, engine):
            return {"observation_tokens": [1, 2, 3, 4], "action_ranges": [(2, 4)], "reward": label,
                    "rollout_log_probs": [0.0, 0.0, -0.5, -0.5]}

    def episode(reward):
        return asyncio.run(run_executor_episode(None, SimpleNamespace(executor=Executor()), ByteTokenizer(), [1, 2],
                                                reward, None, 8, "g0-0"))

    for reward, score in [(torch.tensor(0.5), 0.5), (torch.tensor([0.5]), 0.5), (1, 1.0), (None, 0.0)]:
        ep = episode(reward)
        assert ep.error is None and ep.score == score and type(ep.score) is float
    for reward in BAD[:-1]:  # None: the executor left the reward to a reward source, 0 until then
        ep = episode(reward)
        assert ep.score == 0.0 and ep.error[0] == "reward_error" and ep.response_ids == [3, 4]
        assert f"is {reward!r}; expected a" in ep.error[1]


class RawScoreEngine:
    """An engine that hands back whatever scores its label lists, unchecked."""

    async def generate_group(self, prompt_ids, label, n, *args):
        return [Episode(f"e{i}", list(prompt_ids), response_ids=[1], logprobs=[-1.0], action_mask=[1], score=s)
                for i, s in enumerate(label)]

    async def abort_groups(self, group_ids):
        return 0


def test_the_controller_refuses_a_bad_score_from_any_engine_before_the_filter():
    labels = [[1e160, 0.0], [0.0, 1.0], [math.nan, 1.0], [math.inf, 2.0]]
    _, groups, m = _run(RawScoreEngine(), labels, target=4, algo={"dynamic_filtering_enable": False})
    assert [[ep.reward for ep in g] for g in groups] == [[0.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 2.0]]
    assert m["rollout/reward_errors"] == 3 and m["rollout/reward_first_error"].startswith("RewardError: the episode")
    _, groups, m = _run(RawScoreEngine(), labels, target=3, wave_size=4)  # std filter: no OverflowError
    assert len(groups) == 3 and m["rollout/groups_filtered"] == 1 and m["rollout/reward_errors"] == 3


def test_the_group_filter_does_not_overflow_on_large_finite_scores():
    keep = GroupFilter().keep
    assert keep([1e160, 0.0]) and keep([1e300, -1e300]) and not keep([1e160, 1e160])


def test_the_trainer_refuses_non_finite_rewards():
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="inf or nan reached the advantages"):
            group_advantages(torch.tensor([[0.0, 1.0], [bad, 1.0]]))


def test_a_json_number_label_compares_as_a_number(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "How small?", "label": 1e-7}) + "\n")
    (row,) = load_prompts(str(path), "prompt", "label", "--data.prompt_dataset")
    for label in (1e-7, row["label"]):  # as a JSON number, and as data loading hands it on
        assert math_score("\\boxed{0.0000001}", label)["score"] == 1.0
        assert math_score("\\boxed{1e-7}", label)["score"] == 1.0
        assert math_score("\\boxed{10^{-7}}", label)["score"] == 1.0  # through math-verify
        assert math_score("\\boxed{0.000001}", label)["score"] == 0.0


def test_a_huge_observation_is_cut_before_it_is_tokenised():
    class Flood:
        async def step(self, state, action, label, timeout):
            return StepResult(0.0, state + action + label, False, {})

    # The model writes `0,0|`, the observation follows (its first token masked), then `0,1|` if budget is left.
    for observation, budget, response in [("x" * 50_000_000, 100, "0,0|" + "x" * 96),
                                          ("\nobservation\n", 1000, "0,0|\nobservation\n0,1|")]:
        tokenizer = ByteTokenizer()
        ep = asyncio.run(run_episode(scripted_generate, Flood(), tokenizer, list(PROMPT.encode()), observation, {},
                                     budget, max_steps=2, step_timeout=5.0, request_id="g0-0"))
        assert tokenizer.decode(ep.response_ids) == response and ep.error is None
        assert ep.action_mask[:5] == [1, 1, 1, 1, 0]
        assert max(tokenizer.encoded) < 100_000, "the observation was tokenised whole"
