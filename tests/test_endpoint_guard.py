"""The OpenAI endpoint's guard on its own (rollout/endpoint.py), in front of a stand-in app: credentials, routes,
bodies bounded in size and time, and a port that cannot be bound. The real engine's endpoint is attacked in
tests/test_openai_agents.py."""

import asyncio
import json
import socket

import pytest

from openrlhf_async.rollout import endpoint as ep
from openrlhf_async.rollout.endpoint import Endpoint, EndpointError, EpisodeCalls, _Routes


class App:
    """Answers 200 with the request's path and body; records what reached it."""

    def __init__(self):
        self.seen = []

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.seen.append((scope["path"], message.get("body", b"")))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(routes, path, body=b"", method="POST", headers=(), chunks=None, endless=False):
    """(status, body) of one request through the guard; chunks: the body as so many messages; endless: its client
    never sends the rest."""
    parts = chunks if chunks is not None else [body]
    messages = [{"type": "http.request", "body": c, "more_body": endless or i < len(parts) - 1}
                for i, c in enumerate(parts)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "headers": list(headers)}
    asyncio.run(routes(scope, receive, send))
    return sent[0]["status"], sent[1]["body"]


@pytest.fixture
def guarded():
    app, episodes = App(), {}
    episodes["k" * 24] = EpisodeCalls("k" * 24, "g0", 100, {"temperature": 1.0, "top_p": 1.0})
    return app, _Routes(app, episodes, "the-token")


def test_only_a_credential_is_served_and_every_refusal_looks_the_same(guarded):
    app, routes = guarded
    body = json.dumps({"model": "policy", "prompt": "1+1="}).encode()
    bearer = [(b"authorization", b"Bearer the-token")]
    assert call(routes, f"/episodes/{'k' * 24}/v1/completions", body)[0] == 200
    assert call(routes, "/v1/completions", json.dumps({"prompt": "x", "openrlhf_episode": "k" * 24}).encode())[0] == 200
    assert call(routes, "/v1/completions", body, headers=bearer)[0] == 200
    assert call(routes, "/v1/models", method="GET", headers=bearer)[0] == 200
    assert len(app.seen) == 4 and b"openrlhf_episode" not in app.seen[1][1]
    refused = [call(routes, "/episodes/g0-0/v1/completions", body),
               call(routes, "/episodes/g0-0/v1/completions", json.dumps({"temperature": 0.1}).encode()),
               call(routes, "/v1/completions", json.dumps({"prompt": "x", "openrlhf_episode": "g0-0"}).encode()),
               call(routes, "/v1/completions", body),
               call(routes, "/v1/completions", body, headers=[(b"authorization", b"Bearer the-toke")]),
               call(routes, "/v1/models", method="GET"),
               call(routes, "/invocations", body, headers=bearer),
               call(routes, f"/episodes/{'k' * 24}/inference/v1/generate", body),
               call(routes, "/metrics", method="GET", headers=bearer)]
    assert {status for status, _ in refused} == {404} and len({answer for _, answer in refused}) == 1
    assert len(app.seen) == 4


def test_reshaping_the_sampled_distribution_is_refused_in_an_episode(guarded):
    app, routes = guarded
    key = "k" * 24
    for extra in ({"logit_bias": {"5": 50}}, {"allowed_token_ids": [5]}, {"bad_words": ["7"]}, {"min_tokens": 3},
                  {"n": 2}, {"best_of": 2}, {"repetition_penalty": 1.5}, {"use_beam_search": True}):
        status, answer = call(routes, f"/episodes/{key}/v1/chat/completions",
                              json.dumps({"model": "policy", "messages": [], **extra}).encode())
        assert status == 400 and next(iter(extra)) in json.loads(answer)["error"]["message"], extra
    assert call(routes, f"/episodes/{key}/v1/completions", json.dumps({"logit_bias": {}}).encode())[0] == 200
    assert len(app.seen) == 1


def test_a_body_is_read_whole_in_chunks_and_bounded_in_size_and_time(guarded, monkeypatch):
    app, routes = guarded
    path = f"/episodes/{'k' * 24}/v1/completions"
    body = json.dumps({"prompt": "y" * 100_000}).encode()
    assert call(routes, path, chunks=[body[i:i + 1000] for i in range(0, len(body), 1000)])[0] == 200
    assert app.seen[-1][1] == body
    monkeypatch.setattr(ep, "MAX_BODY_BYTES", 50_000)
    assert call(routes, path, chunks=[body[i:i + 1000] for i in range(0, len(body), 1000)])[0] == 413
    monkeypatch.setattr(ep, "BODY_TIMEOUT_S", 0.2)
    status, answer = call(routes, path, chunks=[b'{"prompt": '], endless=True)
    assert status == 408 and "did not arrive within 0.2 s" in json.loads(answer)["error"]["message"]
    assert len(app.seen) == 1


def test_a_port_that_cannot_be_bound_is_one_line_naming_the_flags():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        endpoint = Endpoint(None, App(), {}, "t")
        with pytest.raises(EndpointError) as refused:
            asyncio.run(endpoint.listen("127.0.0.1", port))
        message = str(refused.value)
        assert "\n" not in message and "--agent.openai_port" in message and f"127.0.0.1:{port}" in message
        assert "Address already in use" in message
    finally:
        taken.close()
