"""The example agent files in agents/: their steps on crafted actions (fast), a multi-turn tool episode through
the real episode loop and sandbox with a scripted model, and each file on the tiny model through the real engines."""

import asyncio
import itertools
import os

import pytest

from conftest import action_ranges, assert_model_logprobs, tokenized_prompts, unfinished
from openrlhf_async.agent import load_agent
from openrlhf_async.config import config_with
from openrlhf_async.reward.math_verify_reward import math_score
from openrlhf_async.rollout.controller import RolloutController
from openrlhf_async.rollout.episode import run_episode

AGENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agents")
SINGLE_TURN = os.path.join(AGENTS, "math_single_turn.py")
TOOL = os.path.join(AGENTS, "python_tool_multi_turn.py")
EXECUTOR = os.path.join(AGENTS, "openrlhf_executor.py")
OPENAI_CHAT = os.path.join(AGENTS, "openai_chat_math.py")
PROMPT = "What is 6*7? Use Python when it helps; put your final answer within \\boxed{}.\n"
CODE = "Let me compute it.\n```python\nprint(6 * 7)\n```"


def step(agent, state, action, label="42", timeout=30.0):
    return asyncio.run(agent.step(state, action, label, timeout))


@pytest.fixture
def tool_agent():
    agent = load_agent(TOOL)
    yield agent
    agent.close()


def test_single_turn_scores_the_answer_and_reports_it():
    agent = load_agent(SINGLE_TURN)
    right = step(agent, PROMPT, "6 times 7 is \\boxed{42}.")
    assert (right.reward, right.done, right.next_state) == (1.0, True, PROMPT + "6 times 7 is \\boxed{42}.")
    assert right.extra_info == {"accuracy": 1.0, "pred": "42"}
    wrong = step(agent, PROMPT, "\\boxed{41}")
    assert (wrong.reward, wrong.done, wrong.extra_info["accuracy"], wrong.extra_info["pred"]) == (0.0, True, 0.0, "41")


def test_tool_agent_runs_a_code_block_and_returns_its_output_as_the_observation(tool_agent):
    result = step(tool_agent, PROMPT, CODE)
    assert (result.reward, result.done, result.extra_info) == (0.0, False, {"tool_calls": 1})
    assert result.next_state == PROMPT + CODE + "\n```output\n42\n```\n"
    # Errors come back as text for the model to read, not as a failed step.
    failing = step(tool_agent, PROMPT, "```python\nprint(1 / 0)\n```")
    assert not failing.done and "ZeroDivisionError: division by zero" in failing.next_state


def test_tool_agent_scores_a_final_boxed_answer(tool_agent):
    state = PROMPT + CODE + "\n```output\n42\n```\n"
    right = step(tool_agent, state, "So the answer is \\boxed{42}.")
    assert (right.reward, right.done, right.next_state) == (1.0, True, state + "So the answer is \\boxed{42}.")
    assert right.extra_info == {"accuracy": 1.0, "pred": "42", "tool_calls": 1}
    wrong = step(tool_agent, PROMPT, "\\boxed{41}")
    assert (wrong.reward, wrong.done, wrong.extra_info["tool_calls"]) == (0.0, True, 0)
    nothing = step(tool_agent, PROMPT, "I am not sure.")
    assert (nothing.reward, nothing.done, nothing.extra_info["pred"]) == (0.0, True, None)


def test_tool_agent_scores_instead_of_running_code_on_its_last_turn(tool_agent):
    module = tool_agent._step.__globals__
    state = PROMPT + (CODE + "\n```output\n42\n```\n") * (module["MAX_TURNS"] - 1)
    last = step(tool_agent, state, CODE + "\n\\boxed{42}")
    assert (last.reward, last.done, last.next_state) == (1.0, True, state + CODE + "\n\\boxed{42}")


def test_tool_agent_a_hanging_code_block_gives_a_timeout_observation(tool_agent, monkeypatch):
    # The code's bound (wall-clock, the sandbox's start included) is the agent's default, so that a busy machine
    # still prints "working" within it; the step's own bound is far above it. The TimeoutError line is the sandbox's
    # word that it stopped the code at its bound: the loop never ends by itself.
    monkeypatch.setitem(tool_agent._step.__globals__, "CODE_TIMEOUT", 5.0)
    result = step(tool_agent, PROMPT, "```python\nprint('working', flush=True)\nwhile True:\n    pass\n```",
                  timeout=120.0)
    assert result.reward == 0.0 and not result.done
    observation = result.next_state[len(PROMPT):].split("```output\n", 1)[1]
    assert observation.startswith("working\nTimeoutError: the code ran longer than 5 s")


def test_executor_instance_retries_once_after_a_wrong_answer():
    import torch

    instance_cls = load_agent(EXECUTOR).executor.agent_instance_cls
    feedback = instance_cls.__init__.__globals__["FEEDBACK"]

    async def episode(*actions):
        instance = instance_cls()
        return [await instance.step({"observation_text": PROMPT, "action_text": a, "label": "42"})
                for a in actions]

    right, = asyncio.run(episode("\\boxed{42}"))
    assert right["done"] and right["rewards"] == torch.tensor(1.0) and right["environment_feedback"] == ""
    first, second = asyncio.run(episode("\\boxed{41}", "\\boxed{42}"))
    assert not first["done"] and first["rewards"].item() == 0.0 and first["environment_feedback"] == feedback
    assert second["done"] and second["rewards"].item() == 1.0 and second["extra_logs"]["attempts"].item() == 2
    _, last = asyncio.run(episode("\\boxed{41}", "\\boxed{40}"))
    assert last["done"] and last["rewards"].item() == 0.0 and last["extra_logs"]["accuracy"].item() == 0.0


class CharTokenizer:
    """One token per character (newlines included, which the tiny model's vocabulary lacks)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_tool_episode_masks_the_code_output_and_keeps_the_models_logprobs(tool_agent):
    # The real episode loop, agent and sandbox; a scripted model writes code, then answers.
    tokenizer = CharTokenizer()
    actions = iter([CODE, "The output says \\boxed{42}."])

    async def generate(prompt_ids, sampling, request_id):
        ids = tokenizer.encode(next(actions))
        return {"response_ids": ids, "logprobs": [-0.5] * len(ids), "token_versions": [3] * len(ids),
                "finish_reason": "stop"}

    ep = asyncio.run(run_episode(generate, tool_agent, tokenizer, tokenizer.encode(PROMPT), "42", {}, budget=500,
                                 max_steps=4, step_timeout=30.0, request_id="r0"))
    observation = "\n```output\n42\n```\n"
    assert ep.error is None and ep.turns == 2 and ep.score == 1.0
    assert ep.extra_info == {"accuracy": 1.0, "pred": "42", "tool_calls": 1}
    assert tokenizer.decode(ep.response_ids) == CODE + observation + "The output says \\boxed{42}."
    a, o = len(CODE), len(observation)
    assert ep.action_mask == [1] * a + [0] * o + [1] * (len(ep.response_ids) - a - o)
    assert ep.logprobs == [-0.5] * a + [0.0] * o + [-0.5] * (len(ep.response_ids) - a - o)


# --- each file on the tiny model, through the real engines ---

@pytest.fixture(scope="module")
def prompts(tiny_model_path):
    return tokenized_prompts(tiny_model_path, 16, seed=5)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _rollout(engines, stack_cfg, prompts, agent_path, temperature=1.0):
    """Three groups of two on the first three prompts (no early stop: whichever finishes first), each request seeded
    by the controller (temperature 0: greedy)."""
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 2, "max_new_tokens": 48, "early_stop": False},
                      algo={"dynamic_filtering_enable": False}, agent={"func_path": agent_path})
    controller = RolloutController(cfg, engines, sampling={"temperature": temperature})
    source = itertools.cycle(prompts)
    groups, metrics = controller.run(lambda: next(source), target=3)
    assert list(controller.balancer.loads.values()) == [0] * len(engines)
    for engine in engines:
        assert unfinished(engine) == {"vllm": 0, "actor": 0}
    episodes = [e for g in groups for e in g]
    assert len(episodes) == 6
    assert metrics["rollout/agent_errors"] == metrics["rollout/agent_timeouts"] == 0, metrics.get(
        "rollout/agent_first_error")
    for ep in episodes:
        assert ep.error is None and not ep.aborted and ep.finish_reason in ("stop", "length")
        assert len(ep.action_mask) == len(ep.logprobs) == len(ep.response_ids) > 0
        assert ep.score in (0.0, 1.0)
    return groups


@pytest.mark.parametrize("path", [SINGLE_TURN, TOOL], ids=["math_single_turn", "python_tool_multi_turn"])
def test_step_file_runs_on_the_engines_and_scores_the_models_answer(engines, stack_cfg, prompts, tokenizer, path):
    groups = _rollout(engines, stack_cfg, prompts, path)
    labels = {tuple(p["prompt_ids"]): p["label"] for p in prompts}
    for ep in [e for g in groups for e in g]:
        # The tiny model writes no code: one turn, scored like the reference check on its own text.
        assert ep.turns == 1 and ep.action_mask == [1] * len(ep.response_ids)
        answer = tokenizer.decode(ep.response_ids, skip_special_tokens=True)
        assert ep.score == ep.extra_info["accuracy"] == math_score(answer, labels[tuple(ep.prompt_ids)])["score"]
        if path == TOOL:
            assert ep.extra_info["tool_calls"] == 0


def test_openrlhf_executor_file_runs_on_the_engines(engines, stack_cfg, prompts, tokenizer):
    feedback = tokenizer(text=load_agent(EXECUTOR).executor.agent_instance_cls.__init__.__globals__["FEEDBACK"],
                         add_special_tokens=False)["input_ids"]
    # A label no answer matches, so that every episode takes the retry turn. Greedy (sampling is not the point): the
    # tiny model's answer is a few digits and its end token, far within the budget, so none is cut short of its retry.
    prompts = [{**p, "label": "1000"} for p in prompts]
    groups = _rollout(engines, stack_cfg, prompts, EXECUTOR, temperature=0.0)
    for ep in [e for g in groups for e in g]:
        assert ep.turns == 2 and float(ep.extra_info["accuracy"]) == ep.score == 0.0
        # A wrong first answer: the feedback follows it, masked out, and the model answers again.
        (a0, a1), (b0, b1) = action_ranges(ep.action_mask)
        assert ep.response_ids[a1 - 1] == tokenizer.eos_token_id, tokenizer.decode(ep.response_ids[a0:a1])
        assert ep.response_ids[a1:b0] == feedback
        assert ep.action_mask == [1] * a1 + [0] * (b0 - a1) + [1] * (b1 - b0)


def test_tool_agent_sandbox_runs_inside_the_engine_in_a_two_turn_episode(engines, stack_cfg, prompts, tokenizer,
                                                                          tmp_path, tiny_model_path):
    # The tiny model writes no code, so a wrapper runs a block on its behalf on the first turn, with the tool
    # agent's own sandbox call and observation format, then hands the second turn to the tool agent's step.
    wrapper = tmp_path / "tool_wrapper.py"
    wrapper.write_text(f"""
import importlib.util

spec = importlib.util.spec_from_file_location("python_tool_multi_turn", {TOOL!r})
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


async def step(state, action, label):
    if tool.tool_calls(state) == 0:
        result = await tool.run_python_async("import os\\nprint(6 * 7, os.getpid())", timeout=60)
        return 0.0, state + action + tool.observation(result), False, {{"tool_calls": 1}}
    return await tool.step(state, action, label)
""")
    # A sandbox's start and a Python run on a busy engine: bounds far above them, not the session's 2 s step
    # timeout (kept for the hanging-step tests), set on the engines for this test only.
    import ray

    kept = ray.get([e.__ray_call__.remote(lambda actor: actor.runner.agent_step_timeout) for e in engines])
    ray.get([e.__ray_call__.remote(lambda actor: setattr(actor.runner, "agent_step_timeout", 120.0)) for e in engines])
    try:
        # Greedy (sampling is not the point): short answers, which the built-in math-verify scores at once (a
        # sampled second turn once ran on into digits it took math-verify over its 10 s to read on a loaded machine).
        groups = _rollout(engines, stack_cfg, prompts, str(wrapper), temperature=0.0)
    finally:
        ray.get([e.__ray_call__.remote(lambda actor, t=t: setattr(actor.runner, "agent_step_timeout", t))
                 for e, t in zip(engines, kept)])
    for ep in [e for g in groups for e in g]:
        (a0, a1), (b0, b1) = action_ranges(ep.action_mask)
        assert ep.turns == 2 and ep.extra_info["tool_calls"] == 1 and "accuracy" in ep.extra_info
        # PID 2: in its own PID namespace, after bwrap's init; the output comes back as a user turn of the chat
        # template (an action cut by its budget gets its end-of-turn token there).
        closing = "" if ep.response_ids[a1 - 1] == tokenizer.eos_token_id else tokenizer.eos_token
        observation = tokenizer.encode(closing + "<|user|>\n```output\n42 2\n```\n<|assistant|>",
                                       add_special_tokens=False)
        assert ep.response_ids[a1:b0] == observation
        assert ep.action_mask == [1] * a1 + [0] * (b0 - a1) + [1] * (b1 - b0)
        assert_model_logprobs(tiny_model_path, ep)  # both turns' the model's own, the tool output's 0


# As OpenRLHF's OpenAI-server executor does: its uvicorn app, started by the first episode, runs in a thread with an
# event loop of its own and keeps that episode's llm_engine, whose generate its handler awaits for every episode; the
# executor gives the rollout log-probs itself.
THREADED_EXECUTOR = """
import asyncio

from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    engine = None

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        if self.engine is None:
            self.engine = llm_engine
        ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        output = await asyncio.to_thread(asyncio.run, self.engine.generate(ids, sampling_params))
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [entry[token].logprob for token, entry in zip(tokens, completion.logprobs)]
        return {"prompt": prompt, "label": label, "observation_tokens": ids + tokens,
                "action_ranges": [(len(ids), len(ids) + len(tokens))], "rollout_log_probs": [0.0] * len(ids) + logprobs,
                "reward": 1.0, "scores": 1.0, "extra_logs": {}}
"""

def test_an_executor_calling_the_engine_from_a_thread_of_its_own_runs_on_the_engines(engines, stack_cfg, prompts,
                                                                                       tmp_path, tiny_model_path):
    path = tmp_path / "threaded_executor.py"
    path.write_text(THREADED_EXECUTOR)
    for ep in [e for g in _rollout(engines, stack_cfg, prompts, str(path)) for e in g]:
        assert ep.turns == 1 and ep.score == 1.0 and ep.action_mask == [1] * len(ep.response_ids)
        assert_model_logprobs(tiny_model_path, ep)  # the executor's, from vLLM: the model's own


def test_the_openai_api_example_agent_asks_again_and_trains_on_both_replies_as_sampled(engines, stack_cfg, prompts,
                                                                                       tokenizer, tiny_model_path):
    from openrlhf_async.models.tiny import ASSISTANT, USER

    labels = {tuple(p["prompt_ids"]): p["label"] for p in prompts}
    # The tiny model writes no \boxed{}: every episode is asked again, in a user turn the engine's template writes.
    reminder = tokenizer.encode(USER + "Put your final answer within \\boxed{}." + ASSISTANT, add_special_tokens=False)
    for ep in [e for g in _rollout(engines, stack_cfg, prompts, OPENAI_CHAT) for e in g]:
        assert ep.turns == 2 and ep.extra_info["asked_again"] == 1.0 and ep.segments == []
        assert tuple(ep.prompt_ids) in labels  # the prompt the agent sent, templated by the engine, is the run's
        (a0, a1), (b0, b1) = action_ranges(ep.action_mask)
        between = ep.response_ids[a1:b0]
        if ep.response_ids[a1 - 1] != tokenizer.eos_token_id:  # a reply cut by its budget: the template closes it
            assert between[0] == tokenizer.eos_token_id
            between = between[1:]
        assert between == reminder
        assert_model_logprobs(tiny_model_path, ep)  # both replies as sampled, the reminder's 0
        answer = tokenizer.decode(ep.response_ids[b0:b1], skip_special_tokens=True)
        assert ep.score == math_score(answer, labels[tuple(ep.prompt_ids)])["score"]
