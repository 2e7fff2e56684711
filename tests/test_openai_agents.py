"""Agents written against the OpenAI API, on a real engine: vLLM's own OpenAI serving layer over the engine's
AsyncLLM, reached in process through the `openai` SDK. The training record is the tokens vLLM sampled (not
re-tokenised text); a chat template that rewrites history splits the episode into segments; sampling an episode may
not change is refused; early stop aborts an agent's requests. The engine runs the tiny model with a chat template
that renders tool calls as Hermes does, and vLLM's hermes tool-call parser."""

import json
import shutil
import time

import pytest
from transformers import AutoTokenizer

from conftest import free_port, preset_config, unfinished, user_file
from openrlhf_async.models.tiny import ASSISTANT, EOS, USER
from openrlhf_async.rollout.endpoint import Call, episode_from_calls
from openrlhf_async.rollout.episode import Episode
from openrlhf_async.trainer.experience import training_samples

# The tiny model's template, with an assistant's tool calls written as <tool_call>{json}</tool_call> (the hermes
# parser's form; vLLM renders the arguments as compact JSON) and, as Qwen3's template does, the thinking of assistant turns before the last user turn dropped.
# The tool call rendered as the agent's regex holds the model to (compact JSON: the tiny tokenizer keeps spaces), so a
# conversation that goes on after it extends the sampled tokens.
TOOL_TEMPLATE = (
    "{% set ns = namespace(last_user=0) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}" + ASSISTANT +
    "{% if m.get('tool_calls') %}{% for tc in m['tool_calls'] %}"
    "<tool_call>{\"name\":\"{{ tc['function']['name'] }}\",\"arguments\":{{ tc['function']['arguments'] | tojson | replace(': ', ':') | replace(', ', ',') }}}"
    "</tool_call>{% endfor %}"
    "{% elif loop.index0 < ns.last_user %}{{ (m['content'] or '').split('</think>')[-1] }}"
    "{% else %}{{ m['content'] or '' }}{% endif %}" + EOS +
    "{% else %}" + USER + "{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

# Two turns and a tool call: the first is held to the tool-call form (the tiny model writes no tool calls of its
# own), vLLM's hermes parser turns it into `tool_calls`, the tool's answer goes back as a tool message, and the second
# turn is the model's own. The agent keeps what vLLM returned (token ids, log-probs) to compare with the record.
TOOL_AGENT = r'''
import json

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = r'<tool_call>\{"name":"add","arguments":\{"a":[0-9],"b":[0-9]\}\}</tool_call>'


async def run(client, model, prompt, label, **info):
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=80,
        extra_body={"structured_outputs": {"regex": CALL}, "return_token_ids": True})
    message = first.choices[0].message
    (call,) = message.tool_calls
    args = json.loads(call.function.arguments)
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=12, logprobs=True,
                                                  extra_body={"return_token_ids": True})
    answer = second.choices[0].message.content
    return {"reward": float(answer.strip() == label),
            "extra_logs": {"tool": call.function.name, "args": args, "tokens": [
                first.choices[0].token_ids, second.choices[0].token_ids],
                "second_logprobs": [t.logprob for t in second.choices[0].logprobs.content]}}
'''

# The first reply is held to "<think>..</think>answer"; after a user turn the template drops its thinking, so the
# second prompt does not extend the first prompt and reply.
THINK_AGENT = r'''
async def run(client, model, prompt, label, **info):
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=30,
        extra_body={"structured_outputs": {"regex": "<think>[0-9]{1,3}</think>[0-9]{1,2}"}})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "sure?"}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    return 1.0
'''

HOT_AGENT = r'''
async def run(client, model, prompt, label, **info):
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                         temperature=0.3)
    return 1.0
'''

# Generates until stopped: its group is aborted while it runs, whenever that is.
LONG_AGENT = r'''
async def run(client, model, prompt, label, **info):
    while True:
        await client.completions.create(model=model, prompt=prompt, max_tokens=100, extra_body={"ignore_eos": True})
'''

# Fresh conversations, each a segment of its own, all drawing on the one episode budget.
BUDGET_AGENT = r'''
async def run(client, model, prompt, label, **info):
    for _ in range(5):
        await client.completions.create(model=model, prompt=prompt, max_tokens=50, extra_body={"ignore_eos": True})
    return 1.0
'''


@pytest.fixture(scope="module")
def tool_model(tiny_model_path, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_tools") / "model"
    shutil.copytree(tiny_model_path, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return str(folder)


@pytest.fixture(scope="module")
def openai_cfg():
    return preset_config("--vllm.num_engines", "1", "--agent.tool_call_parser", "hermes",
                         "--agent.openai_port", str(free_port()))


@pytest.fixture(scope="module")
def tool_engine(ray_cluster, openai_cfg, tool_model):
    import ray

    from openrlhf_async.rollout.engine import create_engines

    (engine,) = create_engines(openai_cfg, tool_model)
    yield engine
    ray.kill(engine)


def _group(engine, tool_model, agent, prompt="3+4=", label="7", n=2, budget=120, group_id="g0"):
    import ray
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False)
    return ray.get(engine.generate_group.remote(ids, label, n, {"temperature": 1.0, "top_p": 1.0}, group_id, budget,
                                                agent, 0, None, None, prompt))


def test_an_openai_sdk_agent_with_a_tool_call_trains_on_the_tokens_vllm_sampled_at_vllms_logprobs(
        tool_engine, tool_model, tmp_path, policy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    episodes = _group(tool_engine, tool_model, user_file(tmp_path, "tool_agent.py", TOOL_AGENT), n=2)
    for ep in episodes:
        assert ep.error is None and not ep.aborted, ep.error
        assert ep.extra_info["tool"] == "add" and ep.turns == 2 and ep.segments == []
        first, second = ep.extra_info["tokens"]
        # One sequence: the prompt, the model's tool call as sampled (its end-of-turn token included), the tool's
        # answer as the template writes it (masked), the model's answer as sampled.
        args = ep.extra_info["args"]
        observation = tokenizer.encode(f"{USER}{args['a'] + args['b']}{ASSISTANT}", add_special_tokens=False)
        assert ep.prompt_ids == tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}],
                                                              add_generation_prompt=True, return_dict=False)
        assert ep.response_ids == first + observation + second
        assert ep.action_mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
        assert tokenizer.decode(first).startswith('<tool_call>{"name":"add"')
        assert ep.raw_reward == float(tokenizer.decode(second, skip_special_tokens=True).strip() == "7")
        # The record's log-probs are the ones vLLM returned to the agent ...
        assert ep.logprobs[-len(second):] == pytest.approx(ep.extra_info["second_logprobs"], abs=1e-6)
        # ... and the trainer's for the model's own turn agree with them (the tool call was held to its form, so its
        # tokens carry the log-probs of the constrained distribution and are not compared).
        (sample,) = training_samples(ep, 1.0)
        (trainer,) = policy.logprobs([sample], 1.0)
        assert trainer[-len(second):] == pytest.approx(ep.logprobs[-len(second):], abs=2e-3)


def test_a_template_that_rewrites_history_splits_the_episode_into_segments_sharing_its_reward(
        tool_engine, tool_model, tmp_path):
    episodes = _group(tool_engine, tool_model, user_file(tmp_path, "think_agent.py", THINK_AGENT), n=2)
    for ep in episodes:
        assert ep.error is None and ep.turns == 2
        (segment,) = ep.segments  # the first turn, as its own sample
        assert segment["action_mask"] == [1] * len(segment["response_ids"])
        assert ep.action_mask == [1] * len(ep.response_ids)
        samples = training_samples(ep, 0.5)
        assert [s["prompt_ids"] for s in samples] == [segment["prompt_ids"], ep.prompt_ids]
        assert [s["advantage"] for s in samples] == [0.5, 0.5]
        # The second prompt holds the first answer without its thinking: not a continuation of what was sampled.
        first = segment["prompt_ids"] + segment["response_ids"]
        assert ep.prompt_ids[: len(first)] != first


def test_sampling_the_run_fixes_is_refused_per_request_and_counted(tool_engine, tool_model, tmp_path):
    episodes = _group(tool_engine, tool_model, user_file(tmp_path, "hot_agent.py", HOT_AGENT), n=1)
    (ep,) = episodes
    assert ep.error[0] == "error" and "BadRequestError" in ep.error[1]
    assert "temperature=0.3 is refused in a training episode" in ep.error[1] and ep.raw_reward == 0.0


def test_aborting_a_group_aborts_its_agents_requests(tool_engine, tool_model, tmp_path):
    import ray

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True, return_dict=False)
    call = tool_engine.generate_group.remote(ids, "2", 2, {"temperature": 1.0, "top_p": 1.0}, "g-abort", 220,
                                             user_file(tmp_path, "long_agent.py", LONG_AGENT), 0, None, None, "1+1=")

    def running():
        return ray.get(tool_engine.__ray_call__.remote(lambda actor: len(actor.groups.get("g-abort", ()))))

    deadline = time.monotonic() + 120
    while running() < 1:  # the agents' requests have reached the engine
        assert time.monotonic() < deadline, "the agents' requests never reached the engine"
    assert ray.get(tool_engine.abort_groups.remote(["g-abort"])) >= 1
    episodes = ray.get(call, timeout=60)
    assert [ep.aborted for ep in episodes] == [True, True] and all(ep.error is None for ep in episodes)
    assert unfinished(tool_engine) == {"vllm": 0, "actor": 0}


def test_an_agent_that_spends_its_budget_ends_truncated_within_it(tool_engine, tool_model, tmp_path):
    (ep,) = _group(tool_engine, tool_model, user_file(tmp_path, "budget_agent.py", BUDGET_AGENT), n=1, budget=60)
    assert ep.error is None and ep.finish_reason == "length" and ep.raw_reward == 0.0
    parts = training_samples(ep, 0.0)
    assert [len(p["response_ids"]) for p in parts] == [50, 10]  # the third call is refused: nothing was left


# Holds its episode open until the test has tried its attacks, and makes its own call on either side of them.
HELD_AGENT = r'''
import asyncio, os

async def run(client, model, prompt, label, **info):
    flag = os.environ["HELD_AGENT_FLAG"]
    await client.completions.create(model=model, prompt=prompt, max_tokens=4)
    open(flag + ".open", "w").close()
    for _ in range(1200):
        if os.path.exists(flag):
            break
        await asyncio.sleep(0.05)
    await client.completions.create(model=model, prompt=prompt, max_tokens=4)
    return 1.0
'''

# vLLM's routes beyond what an agent needs, as `vllm serve` mounts them (0.29).
OTHER_ROUTES = ["/metrics", "/docs", "/openapi.json", "/health", "/version", "/invocations", "/inference/v1/generate",
                "/v1/messages", "/v1/responses", "/scale_elastic_ep", "/is_scaling_elastic_ep", "/tokenize",
                "/detokenize", "/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
                "/v1/audio/transcriptions", "/ping", "/load", "/server_info", "/reset_prefix_cache", "/sleep",
                "/wake_up", "/collective_rpc", "/v1/load_lora_adapter"]


def test_the_endpoint_serves_only_the_runs_own_agents(tool_engine, tool_model, tmp_path, monkeypatch):
    """An outsider on the machine that guesses episode keys, probes them and posts to every route gets the same 404
    and puts nothing into any episode, while the episode's own agent is served as before."""
    import concurrent.futures
    import os

    import httpx
    import ray

    url = ray.get(tool_engine.openai_base_url.remote())
    token = ray.get(tool_engine.__ray_call__.remote(lambda actor: actor._endpoint.token))
    root = url[: -len("/v1")]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    # The run's own credential serves the model list; nothing else does.
    assert httpx.get(url + "/models").status_code == 404
    assert httpx.get(url + "/models", headers={"Authorization": "Bearer guess"}).status_code == 404
    authorised = httpx.get(url + "/models", headers={"Authorization": f"Bearer {token}"})
    assert [m["id"] for m in authorised.json()["data"]] == ["policy"]

    flag = str(tmp_path / "attacked")
    ray.get(tool_engine.__ray_call__.remote(lambda actor: os.environ.__setitem__("HELD_AGENT_FLAG", flag)))
    agent = user_file(tmp_path, "held_agent.py", HELD_AGENT)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_group, tool_engine, tool_model, agent, "2+2=", "4", 2, 120, "g0")
        deadline = time.monotonic() + 120
        while not os.path.exists(flag + ".open"):
            assert time.monotonic() < deadline and not running.done(), "the agent never opened its episode"
            time.sleep(0.05)
        keys = ray.get(tool_engine.__ray_call__.remote(lambda actor: list(actor._endpoint.episodes)))
        assert len(keys) == 2 and all(len(k) >= 24 for k in keys)
        answers = []
        injected = {"model": "policy", "prompt": "OUTSIDER~INJECTED~1+1=", "max_tokens": 4}
        near_miss = keys[0][:-1] + ("y" if keys[0].endswith("x") else "x")  # one character off, never the key itself
        # Guessing keys as they were once made (g<k>-<i>), and probing with a refused setting, which an open episode
        # once answered with 400 and a closed one with 404.
        for guess in [f"g{k}-{i}" for k in range(5) for i in range(2)] + ["g0", "policy", near_miss]:
            for body in (injected, {**injected, "temperature": 0.01}):
                answers.append(httpx.post(f"{root}/episodes/{guess}/v1/completions", json=body))
                answers.append(httpx.post(f"{url}/completions", json={**body, "openrlhf_episode": guess}))
        # Every other route, bare, under an open episode's key, and with the run's token: not mounted.
        for route in OTHER_ROUTES:
            for prefix in ("", f"/episodes/{keys[0]}"):
                answers.append(httpx.post(root + prefix + route, json=injected))
                answers.append(httpx.get(root + prefix + route))
            answers.append(httpx.post(root + route, json=injected, headers={"Authorization": f"Bearer {token}"}))
        assert {a.status_code for a in answers} == {404} and len({a.content for a in answers}) == 1
        # Inside the episode the sampling check holds on every sampling route, logit_bias and penalties included.
        for path, body in (("/v1/completions", {**injected, "logit_bias": {"20": 100}}),
                           ("/v1/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "x"}],
                                                     "repetition_penalty": 2.0}),
                           ("/v1/completions", {**injected, "n": 2})):
            assert httpx.post(f"{root}/episodes/{keys[0]}{path}", json=body).status_code == 400
        open(flag, "w").close()
        episodes = running.result(timeout=120)
    for ep in episodes:  # the agent's own two calls, and nothing of the outsider's
        assert ep.error is None and ep.raw_reward == 1.0 and ep.turns == 2
        assert "OUTSIDER" not in AutoTokenizer.from_pretrained(tool_model).decode(ep.prompt_ids + ep.response_ids)
    # Closed now: its key is as unknown as any other.
    closed = httpx.post(f"{root}/episodes/{keys[0]}/v1/completions", json=injected)
    assert closed.status_code == 404 and closed.content == answers[0].content


def test_episode_records_are_one_sequence_while_prompts_extend_and_segments_where_they_do_not():
    calls = [Call([1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop"),
             Call([1, 2, 3, 4, 9], [5], [-0.3], [1], "stop"),  # extends: 9 is the environment's
             Call([7, 8], [6], [-0.4], [1], "length")]  # a new conversation
    ep = episode_from_calls("r", calls)
    assert (ep.prompt_ids, ep.response_ids, ep.action_mask, ep.finish_reason) == ([7, 8], [6], [1], "length")
    assert ep.segments == [{"prompt_ids": [1, 2], "response_ids": [3, 4, 9, 5], "logprobs": [-0.1, -0.2, 0.0, -0.3],
                            "action_mask": [1, 1, 0, 1], "token_versions": [0, 0, 0, 1]}]
    assert ep.turns == 3
    assert isinstance(episode_from_calls("r", []), Episode)
