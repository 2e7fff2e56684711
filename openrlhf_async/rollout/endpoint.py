"""An OpenAI-compatible endpoint on an engine: vLLM's own OpenAI serving layer (chat and text completions, models,
tool-call and reasoning parsers) over the engine's in-process AsyncLLM, for agents written against the OpenAI API.

Every request goes through the engine's request path (LLMRayActorAsync.request: its semaphore, its groups for early
stop, its weight versions per token). A request under `/episodes/<key>/v1/...` belongs to an open episode: its exact
prompt token ids, sampled token ids, log-probs and weight versions are recorded there, and the episode's training
sample is built from those tokens (episode_from_calls), never from re-tokenised text. Sampling settings an episode
may not change (the trainer scores every token at the run's temperature) are refused per request.

An agent in the engine's process reaches the endpoint without a network hop: its `openai.AsyncOpenAI` client talks
to the app through httpx's ASGI transport, in the agent's own task, so cancelling the episode (early stop) cancels
its request and vLLM aborts it. With --agent.openai_port the same app also listens on the network (uvicorn)."""

import contextvars
import json
import math
import re
from dataclasses import dataclass, field
from typing import Optional

from openrlhf_async.agent import EPISODE_FIELD  # the body field naming a request's episode
from openrlhf_async.rollout.episode import Episode, sampled_logprobs
from openrlhf_async.rollout.seeds import derive_seed

# The open episode a request belongs to, set by the routing middleware for the request's task.
_EPISODE = contextvars.ContextVar("openrlhf_async_episode", default=None)
_EPISODE_PATH = re.compile(r"^/episodes/([A-Za-z0-9_.\-]+)(/.*)$")
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
MODEL_NAME = "policy"  # the name agents pass as `model` (the served model's name)

# What a request may not change beside temperature and top_p, as {field: its allowed values}: the trainer scores every
# token with the run's temperature and top_p and no other filter, so a token sampled otherwise would be trained on the
# log-probs of another distribution. A field left out of the request takes the run's value.
NEUTRAL = {"top_k": (-1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,), "presence_penalty": (0.0,),
           "frequency_penalty": (0.0,), "n": (1,)}


class EpisodeRequestError(ValueError):
    """A request an episode may not make (its message is the HTTP 400's)."""


@dataclass
class Call:
    """One completion as vLLM made it."""
    prompt_ids: list
    token_ids: list
    logprobs: list
    versions: list
    finish_reason: Optional[str]


@dataclass
class EpisodeCalls:
    """An open episode: where its requests go (group_id, for early stop), what they may use, what they made."""
    group_id: str
    budget: int  # response tokens (the model's and the environment's) the episode may use in all
    sampling: dict  # the run's sampling for this episode (temperature, top_p)
    calls: list = field(default_factory=list)
    aborted: bool = False
    in_flight: set = field(default_factory=set)  # its request ids vLLM may hold
    closed: bool = False
    spent: bool = False  # a request was refused because the budget was spent
    used: int = 0  # response tokens of the calls so far: what the model wrote, and the tokens between its turns
    requests: int = 0  # requests sent to vLLM so far: each its own sampling seed

    def check(self, body: dict) -> None:
        """Refuse a request body that sets what the run fixes (see NEUTRAL)."""
        fixed = {"temperature": (self.sampling.get("temperature", 1.0),), "top_p": (self.sampling.get("top_p", 1.0),),
                 **NEUTRAL}
        for key, allowed in fixed.items():
            value = body.get(key)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or not any(math.isclose(value, a, abs_tol=1e-6) for a in allowed):
                raise EpisodeRequestError(
                    f"{key}={value!r} is refused in a training episode: the run samples and trains with "
                    f"{key}={allowed[0]!r} (--rollout flags); leave it out or pass that value")

    def between(self, prompt_ids: list) -> int:
        """The tokens a call with this prompt adds between the last call's completion and its own (0 when it starts
        a new sequence)."""
        if not self.calls:
            return 0
        last = self.calls[-1]
        return len(continuation(prompt_ids, last.prompt_ids + last.token_ids) or ())

    def left(self, prompt_ids: list) -> int:
        """Response tokens the budget leaves for a call with this prompt."""
        return self.budget - self.used - self.between(prompt_ids)

    def record(self, call: Call) -> None:
        self.used += self.between(call.prompt_ids) + len(call.token_ids)
        self.calls.append(call)


def continuation(prompt_ids: list, sequence: list) -> Optional[list]:
    """The tokens prompt_ids adds after sequence when it extends it token for token; None when it does not."""
    return prompt_ids[len(sequence):] if prompt_ids[: len(sequence)] == sequence else None


def episode_from_calls(request_id: str, calls: list) -> Episode:
    """The training record of an episode's completions, token for token. A call whose prompt extends the previous
    call's prompt and completion continues the same sequence (the tokens in between, the environment's, masked out);
    one that does not (a chat template that rewrites history, a new conversation) starts a new segment, which trains
    as a sample of its own with the episode's reward. The Episode's own fields hold the last segment, and
    `segments` the earlier ones."""
    segments = []
    for call in calls:
        current = segments[-1] if segments else None
        observation = None if current is None else continuation(call.prompt_ids,
                                                                current.prompt_ids + current.response_ids)
        if observation is not None:
            current.response_ids += observation
            current.logprobs += [0.0] * len(observation)
            current.action_mask += [0] * len(observation)
            current.token_versions += current.token_versions[-1:] * len(observation)
        else:
            current = Episode(request_id, list(call.prompt_ids))
            segments.append(current)
        current.response_ids += call.token_ids
        current.logprobs += list(call.logprobs)
        current.action_mask += [1] * len(call.token_ids)
        current.token_versions += list(call.versions)
        current.finish_reason = call.finish_reason
    if not segments:
        return Episode(request_id, [])
    last = segments[-1]
    last.turns = len(calls)
    last.segments = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "logprobs": s.logprobs,
                      "action_mask": s.action_mask, "token_versions": s.token_versions} for s in segments[:-1]]
    return last


class _Recorder:
    """The engine client vLLM's serving layer is given: the engine's AsyncLLM, whose generate goes through the
    engine actor's request path and records what an episode's request made."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        return getattr(self._actor.engine, name)

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        episode = _EPISODE.get()
        if episode is None:  # a request outside any episode: served, not recorded
            final, _ = await self._actor.request(prompt, sampling_params, request_id, "", **kwargs)
            yield final
            return
        if episode.closed:
            raise EpisodeRequestError("the episode has ended (its run returned, timed out or was aborted)")
        sampling_params.temperature = episode.sampling.get("temperature", 1.0)
        sampling_params.top_p = episode.sampling.get("top_p", 1.0)
        sampling_params.top_k, sampling_params.min_p = 0, 0.0
        if sampling_params.logprobs is None:
            sampling_params.logprobs = 0  # the rollout log-prob of each sampled token, for the trainer
        left = episode.left(list(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else [])
        if left <= 0:
            episode.spent = True
            raise EpisodeRequestError(f"the episode's token budget ({episode.budget} response tokens, "
                                      "--rollout.max_new_tokens) is spent")
        sampling_params.max_tokens = min(sampling_params.max_tokens or left, left)
        if episode.sampling.get("seed") is not None:  # the agent's own seed, if any, gives way to the run's
            sampling_params.seed = derive_seed(episode.sampling["seed"], "turn", episode.requests)
        episode.requests += 1
        episode.in_flight.add(request_id)
        try:
            final, versions = await self._actor.request(prompt, sampling_params, request_id, episode.group_id,
                                                        **kwargs)
        finally:
            episode.in_flight.discard(request_id)
        completion = final.outputs[0]
        episode.record(Call(list(final.prompt_token_ids), list(completion.token_ids), sampled_logprobs(completion),
                            versions, completion.finish_reason))
        episode.aborted = episode.aborted or completion.finish_reason == "abort"
        yield final


class _Routes:
    """ASGI middleware: `/episodes/<key>/...` is the app's `/...` within episode <key> (its requests recorded, their
    sampling checked); other paths go to the app as they are."""

    def __init__(self, app, episodes: dict):
        self.app, self.episodes = app, episodes

    async def __call__(self, scope, receive, send):
        episode = key = request = None
        if scope["type"] == "http":
            match = _EPISODE_PATH.match(scope["path"])
            if match:
                key = match.group(1)
                scope = {**scope, "path": match.group(2), "raw_path": match.group(2).encode()}
            if scope["method"] == "POST" and scope["path"] in COMPLETION_PATHS:
                body = await _read_body(receive)
                try:
                    request = json.loads(body or b"{}")
                except ValueError:
                    pass  # vLLM answers it
                if not isinstance(request, dict):
                    request = {}
                elif EPISODE_FIELD in request:
                    key = key or str(request.pop(EPISODE_FIELD))
                    body = json.dumps(request).encode()
                receive = _replay(body, receive)
            if key is not None:
                episode = self.episodes.get(key)
                if episode is None:
                    return await _error(send, 404, f"no open episode {key!r} on this engine")
                try:
                    episode.check(request or {})
                except EpisodeRequestError as e:
                    return await _error(send, 400, str(e))
        token = _EPISODE.set(episode)
        try:
            await self.app(scope, receive, send)
        finally:
            _EPISODE.reset(token)


async def _read_body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def _replay(body: bytes, receive):
    """The request's messages again, the body (read to check it) first: then the client's own, e.g. its disconnect,
    which vLLM's handlers listen for to cancel the request."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _error(send, status: int, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError" if status == 400 else "NotFound",
                                    "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def serving_args(model_path: str, agent) -> list:
    """vLLM's `vllm serve` arguments of the endpoint, from the --agent flags."""
    args = ["--model", model_path, "--served-model-name", MODEL_NAME, "--generation-config", "vllm",
            "--disable-log-stats", "--disable-uvicorn-access-log"]
    if agent.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", agent.tool_call_parser]
    if agent.reasoning_parser:
        args += ["--reasoning-parser", agent.reasoning_parser]
    return args


class Endpoint:
    """The engine's OpenAI-compatible app, and the episodes open on it."""

    def __init__(self, actor, app, episodes: dict, url: Optional[str] = None):
        self.actor, self.app, self.episodes, self.url = actor, app, episodes, url
        self.server = None

    @classmethod
    async def start(cls, actor, model_path: str, agent) -> "Endpoint":
        """vLLM's app over the actor's engine; listening on --agent.openai_host:--agent.openai_port (+ the engine's
        index) when a port is given."""
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(serving_args(model_path, agent))
        client = _Recorder(actor)
        tasks = await actor.engine.get_supported_tasks()
        app = build_app(args, tasks, actor.engine.model_config)
        await init_app_state(client, app.state, args, tasks)
        episodes = {}
        endpoint = cls(actor, _Routes(app, episodes), episodes)
        if agent.openai_port:
            await endpoint.listen(agent.openai_host, agent.openai_port + actor.engine_index)
        return endpoint

    async def listen(self, host: str, port: int = 0) -> None:
        """Serve the app on host:port too (uvicorn, on the engine's event loop); port 0: one the system picks."""
        import asyncio

        import uvicorn

        if self.server is not None:
            return
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off")
        self.server = uvicorn.Server(config)
        serving = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if serving.done():  # e.g. the port is taken: uvicorn logs why and exits
                raise RuntimeError(f"the OpenAI endpoint could not listen on {host}:{port} (--agent.openai_host, "
                                   "--agent.openai_port)")
            await asyncio.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"

    def open(self, key: str, group_id: str, budget: int, sampling: dict) -> EpisodeCalls:
        episode = self.episodes[key] = EpisodeCalls(group_id, budget, sampling)
        return episode

    async def close(self, key: str) -> Optional[EpisodeCalls]:
        """End episode `key`: no request of it starts from now on, and vLLM aborts those still running (vLLM's
        handlers run a request in a task of their own, which outlives a cancelled client call)."""
        episode = self.episodes.pop(key, None)
        if episode is not None:
            episode.closed = True
            if episode.in_flight:
                await self.actor.abort(list(episode.in_flight))
        return episode

    def client(self, key: Optional[str] = None, timeout: float = None):
        """An `openai.AsyncOpenAI` bound to episode `key` (None: no episode), talking to the app in process."""
        import httpx
        import openai

        base = "http://engine" + (f"/episodes/{key}" if key else "")
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=base, timeout=timeout)
        # No retries: a refused or aborted request is the episode's answer, not a network hiccup.
        return openai.AsyncOpenAI(base_url=base + "/v1", api_key="EMPTY", http_client=http, max_retries=0)

    def base_url(self, key: Optional[str] = None) -> Optional[str]:
        """The network address of the endpoint (of episode `key`), or None when it does not listen."""
        if self.url is None:
            return None
        return self.url + (f"/episodes/{key}" if key else "") + "/v1"


async def run_openai_episode(endpoint: Endpoint, agent, prompt, label, sampling: dict, budget: int, timeout: float,
                             request_id: str, group_id: str) -> Episode:
    """An OpenAI-API agent's episode: its run(client, model, prompt, label, **info) under `timeout` seconds, its
    completions recorded on the endpoint and turned into the training record (episode_from_calls). An agent that
    raises or runs out of time gives its episode reward 0, counted; one whose group was aborted (early stop) comes
    back aborted; one that spent its token budget ends as truncated ("length")."""
    import asyncio

    from openrlhf_async.reward.sources import RewardError, check_reward

    calls = endpoint.open(request_id, group_id, budget, sampling)
    client = endpoint.client(request_id)
    reward = score = 0.0
    extra, error = {}, None
    try:
        result = await asyncio.wait_for(agent.run(client, MODEL_NAME, prompt, label, budget=budget,
                                                  episode=request_id, base_url=endpoint.base_url(request_id)),
                                        timeout)
        reward, score = check_reward(result.reward, "the agent's reward"), check_reward(result.score, "its score")
        extra = result.extra_info
    except (asyncio.TimeoutError, TimeoutError):
        error = ("timeout", f"the agent's run took over {timeout:g} s (--agent.step_timeout x --agent.max_steps)")
    except RewardError as e:
        error = ("reward_error", f"{type(e).__name__}: {e}")
    except Exception as e:  # the user's code, or a request the endpoint refused: contained, counted
        error = ("error", f"{type(e).__name__}: {e}")
    finally:
        await endpoint.close(request_id)
        await client.close()
    ep = episode_from_calls(request_id, calls.calls)
    if calls.aborted or group_id in endpoint.actor.aborted_groups:
        ep.aborted, ep.finish_reason = True, "abort"
        return ep
    if error and calls.calls and (calls.spent or calls.used >= calls.budget):
        error, ep.finish_reason = None, "length"  # the agent failed because its budget ran out: truncated
    elif error is None and not calls.calls:
        error = ("error", "AgentRunError: the agent's run made no completion request")
    if error:
        ep.error = error
        ep.score = ep.raw_reward = 0.0
        return ep
    ep.score, ep.raw_reward, ep.extra_info = score, reward, extra
    return ep

