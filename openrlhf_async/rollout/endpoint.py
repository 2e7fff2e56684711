"""An OpenAI-compatible endpoint on an engine: vLLM's own OpenAI serving layer (chat and text completions, models,
tool-call and reasoning parsers) over the engine's in-process AsyncLLM, for agents written against the OpenAI API.

Every request goes through the engine's request path (LLMRayActorAsync.request: its semaphore, its groups for early
stop, its weight versions per token). A request under `/episodes/<key>/v1/...` belongs to an open episode: its exact
prompt token ids, sampled token ids, log-probs and weight versions are recorded there, and the episode's training
sample is built from those tokens (episode_from_calls), never from re-tokenised text. Sampling settings an episode
may not change (the trainer scores every token at the run's temperature) are refused per request.

An agent in the engine's process reaches the endpoint without a network hop: its `openai.AsyncOpenAI` client talks
to the app through httpx's ASGI transport, in the agent's own task, so cancelling the episode (early stop) cancels
its request and vLLM aborts it. With --agent.openai_port (and for a verifiers environment, whose proxy forwards over
HTTP) the same app also listens on the network (uvicorn, on loopback by default).

What it trusts (docs/SANDBOX.md): a request is served only with a credential. An episode's key is random (144 bits,
not derived from anything a caller can see) and is the episode's credential: `/episodes/<key>/...` (or, with the run's
credential, the key in the body's EPISODE_FIELD). The run's credential (a random bearer token per endpoint, known to
the engine's process alone) serves a request outside any episode. Only the routes an agent needs are mounted (chat and
text completions, the model list), both sampling routes are checked the same way, and a request without a credential,
with a wrong one, or for an episode that is closed or never was gets the same 404."""

import asyncio
import contextvars
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Optional

from openrlhf_async.agent import EPISODE_FIELD  # the body field naming a request's episode
from openrlhf_async.rollout.episode import Episode, sampled_logprobs
from openrlhf_async.rollout.seeds import derive_seed

# The open episode a request belongs to, and its session (SESSION_HEADER), set by the routing middleware for the
# request's task.
_EPISODE = contextvars.ContextVar("openrlhf_async_episode", default=None)
_SESSION = contextvars.ContextVar("openrlhf_async_session", default=None)
# Which conversation of its episode a request belongs to: verifiers sends its trace's id so (each seat's, each
# attempt's); an agent's run may give each session its own reward (StepResult.sessions).
SESSION_HEADER = b"x-session-id"
SESSION_MAX_CHARS = 128
_EPISODE_PATH = re.compile(r"^/episodes/([A-Za-z0-9_.\-]+)(/.*)$")
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
ROUTES = (*COMPLETION_PATHS, "/v1/models")  # all an agent needs; vLLM's other routes (admin, metrics, ...) are not served
MODEL_NAME = "policy"  # the name agents pass as `model` (the served model's name)
MAX_BODY_BYTES = 16 << 20  # a completion request's body (a long conversation is a few MB)
BODY_TIMEOUT_S = 30.0  # for the body to arrive, once the headers have
KEEP_ALIVE_S = 30  # an idle connection's life on the server's side: longer than clients' own (Endpoint.listen)
NOT_FOUND = "not found: no such route, or no open episode of this key"

# What a request may not change beside temperature and top_p, as {field: its allowed values}: the trainer scores every
# token with the run's temperature and top_p and no other filter, so a token sampled otherwise would be trained on the
# log-probs of another distribution. A field left out of the request takes the run's value.
NEUTRAL = {"top_k": (-1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,), "presence_penalty": (0.0,),
           "frequency_penalty": (0.0,), "n": (1,), "best_of": (1,), "min_tokens": (0,)}
# What reshapes the distribution sampled from and must be absent (or empty): biased, allowed-only or banned tokens,
# beam search. Constrained decoding (structured_outputs, a tool call's form) stays allowed: agents need it, and the
# rollout log-probs it reports are of the constrained distribution, which the importance correction weighs.
RESHAPING = ("logit_bias", "allowed_token_ids", "bad_words", "use_beam_search")


class EpisodeRequestError(ValueError):
    """A request an episode may not make (its message is the HTTP 400's)."""


class EndpointError(RuntimeError):
    """The endpoint cannot serve (its port cannot be bound); one line naming the flags."""


@dataclass
class Call:
    """One completion as vLLM made it."""
    prompt_ids: list
    token_ids: list
    logprobs: list
    versions: list
    finish_reason: Optional[str]
    session: Optional[str] = None  # the request's SESSION_HEADER


@dataclass
class EpisodeCalls:
    """An open episode: its key (its credential), where its requests go (group_id, for early stop), what they may
    use, what they made."""
    key: str
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
        for key in RESHAPING:
            if body.get(key) not in (None, False, {}, []):
                raise EpisodeRequestError(f"{key} is refused in a training episode: the trainer scores each token "
                                          "on the model's own distribution; leave it out")

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


def episode_from_calls(request_id: str, calls: list, sessions: Optional[dict] = None) -> Episode:
    """The training record of an episode's completions, token for token. A call whose prompt extends the previous
    call's prompt and completion continues the same sequence (the tokens in between, the environment's, masked out);
    one that does not (a chat template that rewrites history, a new conversation) starts a new segment, which trains
    as a sample of its own with the episode's reward. The Episode's own fields hold the last segment, and
    `segments` the earlier ones.
    sessions (StepResult.sessions): {session: (seat, reward)}. Then each session's calls are sequences of their own
    (a call continues its session's last one), each segment carries its session's seat and reward (Episode.seat,
    seat_reward), and calls of a session not in it are left out."""
    segments, last = [], {}  # last: the newest segment of each session
    for call in calls:
        if sessions is not None and call.session not in sessions:
            continue
        key = call.session if sessions is not None else None
        current = last.get(key)
        observation = None if current is None else continuation(call.prompt_ids,
                                                                current.prompt_ids + current.response_ids)
        if observation is not None:
            current.response_ids += observation
            current.logprobs += [0.0] * len(observation)
            current.action_mask += [0] * len(observation)
            current.token_versions += current.token_versions[-1:] * len(observation)
        else:
            current = last[key] = Episode(request_id, list(call.prompt_ids))
            if sessions is not None:
                current.seat, current.seat_reward = sessions[key]
            segments.append(current)
        current.response_ids += call.token_ids
        current.logprobs += list(call.logprobs)
        current.action_mask += [1] * len(call.token_ids)
        current.token_versions += list(call.versions)
        current.finish_reason = call.finish_reason
    if not segments:
        return Episode(request_id, [])
    final = segments[-1]
    final.turns = len(calls)
    seated = ("seat", "seat_reward") if sessions is not None else ()
    final.segments = [{name: getattr(s, name) for name in ("prompt_ids", "response_ids", "logprobs", "action_mask",
                                                           "token_versions", *seated)} for s in segments[:-1]]
    return final


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
                            versions, completion.finish_reason, _SESSION.get()))
        episode.aborted = episode.aborted or completion.finish_reason == "abort"
        yield final


class _Routes:
    """ASGI middleware in front of vLLM's app: serves a request only with a credential (see the module's docstring)
    and only on ROUTES. `/episodes/<key>/...` is the app's `/...` within episode <key> (its requests recorded, their
    sampling checked)."""

    def __init__(self, app, episodes: dict, token: str):
        self.app, self.episodes = app, episodes
        self.bearer = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        key, path = None, scope["path"]
        match = _EPISODE_PATH.match(path)
        if match:
            key, path = match.group(1), match.group(2)
            scope = {**scope, "path": path, "raw_path": path.encode()}
        trusted = secrets.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.bearer)
        completion = scope["method"] == "POST" and path in COMPLETION_PATHS
        # Nothing is said about a request before its credential holds: an episode key that is wrong, closed or unknown,
        # a missing token and an unserved route all answer the same. (A completion's body may carry its episode's key,
        # so it is read first, bounded in size and time.)
        if path not in ROUTES or (key is not None and key not in self.episodes) or not (key or trusted or completion):
            return await _error(send, 404, NOT_FOUND)
        request = None
        if completion:
            try:
                body = await asyncio.wait_for(_read_body(receive), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                return await _error(send, 408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s")
            except BodyTooLarge:
                return await _error(send, 413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
            try:
                request = json.loads(body or b"{}")
            except (ValueError, RecursionError):
                pass  # vLLM answers it
            if not isinstance(request, dict):
                request = {}
            elif EPISODE_FIELD in request:
                key = key or str(request.pop(EPISODE_FIELD))
                body = json.dumps(request).encode()
            if key is None and not trusted:
                return await _error(send, 404, NOT_FOUND)
            receive = _replay(body, receive)
        episode = None if key is None else self.episodes.get(key)
        if key is not None and episode is None:  # unknown, or closed while its body arrived
            return await _error(send, 404, NOT_FOUND)
        if episode is not None:
            try:
                episode.check(request or {})
            except EpisodeRequestError as e:
                return await _error(send, 400, str(e))
        token = _EPISODE.set(episode)
        session = dict(scope["headers"]).get(SESSION_HEADER)
        session_token = _SESSION.set(session.decode("latin-1")[:SESSION_MAX_CHARS] if session else None)
        try:
            await self.app(scope, receive, send)
        finally:
            _SESSION.reset(session_token)
            _EPISODE.reset(token)


class BodyTooLarge(Exception):
    pass


async def _read_body(receive) -> bytes:
    """The request's body, in linear time, up to MAX_BODY_BYTES."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge()
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


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
    kind = {400: "BadRequestError", 404: "NotFound", 408: "RequestTimeout", 413: "RequestTooLarge"}[status]
    payload = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
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

    def __init__(self, actor, app, episodes: dict, token: str, url: Optional[str] = None):
        self.actor, self.app, self.episodes, self.url = actor, app, episodes, url
        self.token = token  # the run's credential on this endpoint: requests outside any episode need it
        self.server = None

    @classmethod
    async def start(cls, actor, model_path: str, agent) -> "Endpoint":
        """vLLM's app over the actor's engine; listening on --agent.openai_host:--agent.openai_port (+ the engine's
        index) when a port is given."""
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        from openrlhf_async.rollout.vllm_compat import openai_server

        build_app, init_app_state, make_arg_parser = openai_server()

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(serving_args(model_path, agent))
        client = _Recorder(actor)
        tasks = await actor.engine.get_supported_tasks()
        app = build_app(args, tasks, actor.engine.model_config)
        await init_app_state(client, app.state, args, tasks)
        episodes, token = {}, secrets.token_urlsafe(32)
        endpoint = cls(actor, _Routes(app, episodes, token), episodes, token)
        if agent.openai_port:
            await endpoint.listen(agent.openai_host, agent.openai_port + actor.engine_index)
        return endpoint

    async def listen(self, host: str, port: int = 0) -> None:
        """Serve the app on host:port too (uvicorn, on the engine's event loop); port 0: one the system picks."""
        import socket

        import uvicorn

        if self.server is not None:
            return
        # Bound here, not by uvicorn, whose bind error is a SystemExit that escapes the engine's event loop.
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except (OSError, OverflowError) as e:
            sock.close()
            raise EndpointError(f"--agent.openai_host {host} / --agent.openai_port: the OpenAI endpoint cannot listen "
                                f"on {host}:{port} ({getattr(e, 'strerror', None) or e}); free the port or choose another") from None
        # An idle connection is closed by the client first (httpx keeps one 5 s, aiohttp 15 s): a server closing it at
        # the same moment would fail the request the client was sending on it (verifiers' pooled client, a 503).
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=KEEP_ALIVE_S)
        self.server = uvicorn.Server(config)
        serving = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if serving.done():
                raise EndpointError(f"the OpenAI endpoint could not start on {host}:{port}: {serving.exception()}")
            await asyncio.sleep(0.05)
        port = sock.getsockname()[1]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def open(self, group_id: str, budget: int, sampling: dict) -> EpisodeCalls:
        """A new episode, under a key no one can guess (its credential)."""
        key = secrets.token_urlsafe(18)
        episode = self.episodes[key] = EpisodeCalls(key, group_id, budget, sampling)
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
        """An `openai.AsyncOpenAI` bound to episode `key` (None: no episode, with the run's credential), talking to the
        app in process."""
        import httpx
        import openai

        base = "http://engine" + (f"/episodes/{key}" if key else "")
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=base, timeout=timeout)
        # No retries: a refused or aborted request is the episode's answer, not a network hiccup.
        return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key or self.token, http_client=http, max_retries=0)

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
    from openrlhf_async.reward.sources import RewardError, check_reward

    calls = endpoint.open(group_id, budget, sampling)
    client = endpoint.client(calls.key)
    reward = score = 0.0
    extra, error, sessions = {}, None, None
    try:
        result = await asyncio.wait_for(agent.run(client, MODEL_NAME, prompt, label, budget=budget,
                                                  episode=calls.key, base_url=endpoint.base_url(calls.key)),
                                        timeout)
        reward, score = check_reward(result.reward, "the agent's reward"), check_reward(result.score, "its score")
        extra, sessions = result.extra_info, result.sessions
        for seat, seat_reward in (sessions or {}).values():
            check_reward(seat_reward, f"the reward of seat {seat!r}")
    except (asyncio.TimeoutError, TimeoutError):
        error = ("timeout", f"the agent's run took over {timeout:g} s (--agent.step_timeout x --agent.max_steps)")
    except RewardError as e:
        error = ("reward_error", f"{type(e).__name__}: {e}")
    except Exception as e:  # the user's code, or a request the endpoint refused: contained, counted
        error = ("error", f"{type(e).__name__}: {e}")
    finally:
        await endpoint.close(calls.key)
        await client.close()
    ep = episode_from_calls(request_id, calls.calls, sessions)
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

