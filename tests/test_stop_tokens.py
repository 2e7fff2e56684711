"""A turn ends at a stop string or stop token, set by the --rollout flags or by an agent's sampling_params for its
next turns; the response keeps the tokens vLLM sampled, each with its log-prob."""

import asyncio
import itertools

import pytest

from conftest import ByteTokenizer, action_ranges, assert_model_logprobs, tokenized_prompts, user_file
from openrlhf_async.agent import load_agent
from openrlhf_async.config import ConfigError, config_with, preset_config, validate
from openrlhf_async.rollout.controller import RolloutController, turn_sampling
from openrlhf_async.rollout.episode import run_episode

DIGITS = "0123456789"  # the tiny model answers "12+34=" with digits and its end token: "46<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def digit_ids(tokenizer) -> set:
    return set(tokenizer.convert_tokens_to_ids(list(DIGITS)))


@pytest.fixture(scope="module")
def prompts(tiny_model_path):
    return tokenized_prompts(tiny_model_path, 16, seed=5)


def _episodes(engines, cfg, prompts, target: int = 2) -> list:
    """The episodes of `target` groups, greedy (sampling is not what these tests are about: each answer is then the
    tiny model's one answer) and without early stop (the first `target` prompts, whichever finishes first)."""
    cfg = config_with(cfg, rollout={"early_stop": False})
    source = itertools.cycle(prompts)
    controller = RolloutController(cfg, engines, sampling={**turn_sampling(cfg.rollout), "temperature": 0.0})
    groups, _ = controller.run(lambda: next(source), target=target)
    episodes = [ep for group in groups for ep in group]
    assert len(episodes) == target * cfg.rollout.n_samples_per_prompt
    return episodes


def _ends_at_its_first_digit(tokens: list, digit_ids: set) -> bool:
    return tokens[-1] in digit_ids and not digit_ids & set(tokens[:-1])


@pytest.mark.parametrize("flag", ["stop", "stop_token_ids"])
def test_a_stop_flag_ends_every_turn_there_and_keeps_the_sampled_tokens(engines, stack_cfg, prompts, tokenizer,
                                                                        digit_ids, flag, tiny_model_path):
    value = tuple(DIGITS) if flag == "stop" else tuple(sorted(digit_ids))
    cfg = config_with(stack_cfg, rollout={flag: value, "n_samples_per_prompt": 2},
                      algo={"dynamic_filtering_enable": False})
    episodes = _episodes(engines, cfg, prompts, target=4)
    for ep in episodes:
        # Without the flag the greedy answer runs on past its first digit to the end token ("46<|endoftext|>").
        assert ep.finish_reason == "stop" and _ends_at_its_first_digit(ep.response_ids, digit_ids), (
            tokenizer.decode(ep.response_ids))
        assert_model_logprobs(tiny_model_path, ep)  # the tokens sampled up to the stop, each its own log-prob


def test_an_agents_stop_strings_end_its_next_turn_and_not_the_one_before(engines, stack_cfg, prompts, tokenizer,
                                                                          digit_ids, tmp_path, tiny_model_path):
    agent = user_file(tmp_path, "stop_next_turn.py", """
        async def step(state, action, label):
            if state.count("=") > 1:  # the second turn, which answered the question below
                return {"rewards": 1.0, "next_observation": state + action, "done": True}
            return {"rewards": 0.0, "next_observation": state + action + "3+4=", "done": False,
                    "sampling_params": {"stop": list("0123456789")}}
    """)
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 2, "max_new_tokens": 24},
                      algo={"dynamic_filtering_enable": False}, agent={"func_path": agent})
    episodes = _episodes(engines, cfg, prompts, target=4)
    for ep in episodes:
        assert ep.error is None and ep.turns == 2 and ep.score == 1.0
        (a0, a1), (b0, b1) = action_ranges(ep.action_mask)
        first, second = ep.response_ids[a0:a1], ep.response_ids[b0:b1]
        # The stop strings not yet in force: the first answer runs on past its first digit to the end token...
        assert first[-1] == tokenizer.eos_token_id and digit_ids & set(first[:-1]), tokenizer.decode(first)
        # ... and the second ends at its first digit.
        assert ep.finish_reason == "stop" and _ends_at_its_first_digit(second, digit_ids), tokenizer.decode(second)
        assert_model_logprobs(tiny_model_path, ep)


class _Generate:
    """The model always answers "ok"; records the sampling of each turn."""

    def __init__(self):
        self.sampling = []

    async def __call__(self, prompt_ids, sampling, request_id):
        self.sampling.append(sampling)
        return {"response_ids": list(b"ok"), "logprobs": [-1.0, -1.0], "token_versions": [0, 0],
                "finish_reason": "stop"}


def _episode(tmp_path, answers: str):
    """An episode of the agent whose step returns answers[i] (a Python expression) at turn i, on _Generate."""
    agent = load_agent(user_file(tmp_path, "scripted.py", f"""
        ANSWERS = {answers}

        async def step(state, action, label):
            turn = state.count("[obs]")
            return {{"rewards": 0.0, "next_observation": state + action + "[obs]", "done": turn == len(ANSWERS) - 1,
                     "sampling_params": ANSWERS[turn]}}
    """))
    generate = _Generate()
    ep = asyncio.run(run_episode(generate, agent, ByteTokenizer(), list(b"Q:"), None, {"temperature": 1.0},
                                 30, max_steps=8, step_timeout=5, request_id="e"))
    return ep, generate.sampling


def test_an_agents_sampling_params_hold_from_its_next_turn_with_max_tokens_capped_by_the_budget(tmp_path):
    ep, sampling = _episode(tmp_path, '[{"stop": ["x"], "max_tokens": 1000}, {"max_tokens": 3}, None, None]')
    assert ep.error is None and ep.turns == 4
    # Each turn writes 2 tokens and gets a 5-token observation back: 30, 23, 16, then 9 tokens of budget are left.
    assert sampling == [{"temperature": 1.0, "max_tokens": 30}, {"temperature": 1.0, "stop": ["x"], "max_tokens": 23},
                        {"temperature": 1.0, "stop": ["x"], "max_tokens": 3},
                        {"temperature": 1.0, "stop": ["x"], "max_tokens": 3}]


@pytest.mark.parametrize("params, expected", [
    ('{"temperature": 0.5}', "sampling_params 'temperature'; a step may set stop, stop_token_ids, max_tokens"),
    ('{"stop": ["</a>", ""]}', "sampling_params stop ['</a>', '']; expected a non-empty string or a list of them"),
    ('{"stop_token_ids": [3, -1]}', "sampling_params stop_token_ids [3, -1]; expected a list of token ids"),
    ('{"max_tokens": 0}', "sampling_params max_tokens 0; expected a whole number from 1"),
    ('"stop"', "sampling_params of type str; expected a dict"),
])
def test_bad_agent_sampling_params_fail_the_episode_as_an_agent_error(tmp_path, params, expected):
    ep, sampling = _episode(tmp_path, f"[{params}, None]")
    assert ep.error[0] == "error" and expected in ep.error[1], ep.error  # counted in rollout/agent_errors
    assert ep.score == 0.0 and len(sampling) == 1


@pytest.mark.parametrize("flags, expected", [
    (["--rollout.stop", "</answer>", ""], "--rollout.stop '</answer>' '': an empty string would end every turn at "
                                          "once; give non-empty strings"),
    (["--rollout.stop_token_ids", "5", "-1"], "--rollout.stop_token_ids 5 -1: each must not be negative"),
    (["--rollout.stop_token_ids", "x"], "argument --rollout.stop_token_ids: invalid int value: 'x'"),
])
def test_bad_stop_flags_are_one_line_errors_naming_the_flag(flags, expected):
    with pytest.raises(ConfigError) as e:
        validate(preset_config("tiny_cpu", *flags))
    assert str(e.value) == expected


def test_stop_flags_reach_every_turns_request_as_lists():
    cfg = validate(preset_config("tiny_cpu", "--rollout.stop", "</answer>", "\n\n", "--rollout.stop_token_ids", "7"))
    assert RolloutController(cfg, []).sampling == {"temperature": 1.0, "top_p": 1.0, "stop": ["</answer>", "\n\n"],
                                                   "stop_token_ids": [7]}
    assert "stop" not in RolloutController(validate(preset_config("tiny_cpu")), []).sampling
