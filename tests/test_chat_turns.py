"""A multi-turn agent on a real chat template (SmolLM2's ChatML): each observation joins the conversation as a
user or tool turn, the model's own tokens stay exactly as generated (its end-of-turn token included), and the
episode's tokens are the conversation the template itself would write."""

import asyncio

import pytest

from conftest import user_file
from openrlhf_async.agent import load_agent
from openrlhf_async.rollout.episode import ChatTurn, run_episode

AGENT = """
    async def step(state, action, label):
        if action.strip() == label:
            return 1.0, state + action, True, {}
        return 0.0, state + action + "Wrong, try again.", False, {}
"""


def _episode(tokenizer, agent, actions: list, chat_turn):
    """Run an episode whose model answers `actions` (text) in turn, each ended by the end-of-turn token."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    answers = iter(tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id] for a in actions)

    async def generate(ids, sampling, request_id):
        ids = next(answers)
        return {"response_ids": ids, "logprobs": [-0.5] * len(ids), "token_versions": [0] * len(ids),
                "finish_reason": "stop"}

    return prompt, asyncio.run(run_episode(generate, agent, tokenizer, prompt, "5", {}, 200, 4, 5.0, "r", chat_turn))


@pytest.mark.parametrize("role", ["user", "tool"])
def test_observations_are_turns_of_the_chat_template_and_actions_keep_their_tokens(smollm2, tmp_path, role):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    agent = load_agent(user_file(tmp_path, "agent.py", AGENT), 0)
    prompt, ep = _episode(tokenizer, agent, ["6", "5"], ChatTurn(tokenizer, role))
    assert ep.score == 1.0 and ep.turns == 2 and not ep.error

    # Exactly the text the template writes for the whole conversation, with the next assistant turn opened there.
    conversation = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "6"},
                    {"role": role, "content": "Wrong, try again."}, {"role": "assistant", "content": "5"}]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(prompt + ep.response_ids) == expected.rstrip("\n")  # it ends at the model's <|im_end|>

    # Token in, token out: each action's tokens, end-of-turn included, are the model's, trained on (mask 1) with
    # their log-probs; the observation turn's tokens are masked out.
    first = tokenizer.encode("6", add_special_tokens=False) + [tokenizer.eos_token_id]
    second = tokenizer.encode("5", add_special_tokens=False) + [tokenizer.eos_token_id]
    turn = tokenizer.encode(f"\n<|im_start|>{role}\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
    assert ep.response_ids == first + turn + second
    assert ep.action_mask == [1] * len(first) + [0] * len(turn) + [1] * len(second)
    assert ep.logprobs == [-0.5] * len(first) + [0.0] * len(turn) + [-0.5] * len(second)


def test_raw_observations_are_appended_as_the_agent_wrote_them(smollm2, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    agent = load_agent(user_file(tmp_path, "agent.py", AGENT), 0)
    prompt, ep = _episode(tokenizer, agent, ["6", "5"], None)
    assert tokenizer.decode(ep.response_ids) == "6<|im_end|>Wrong, try again.5<|im_end|>"
