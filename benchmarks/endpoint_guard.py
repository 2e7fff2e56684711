"""What the OpenAI endpoint's guard (rollout/endpoint.py: credentials, routes, the body read and checked) costs per
request: the same completion request, an episode's (key in the path) and the run's (bearer token), through the guard
and straight to a stand-in app that answers at once, in process. vLLM's own handling and the model's generation
(milliseconds at least) come on top in a real run. Prints a final JSON line."""

import argparse
import asyncio
import json
import time

from openrlhf_async.rollout.endpoint import EpisodeCalls, _Routes


async def app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def per_request_us(handler, path: str, headers: list, body: bytes, n: int) -> float:
    async def send(message):
        pass

    start = time.perf_counter()
    for _ in range(n):
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop() if messages else {"type": "http.disconnect"}

        await handler({"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                       "headers": headers}, receive, send)
    return (time.perf_counter() - start) / n * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args(argv)
    key = "k" * 24
    routes = _Routes(app, {key: EpisodeCalls(key, "g", 100, {"temperature": 1.0, "top_p": 1.0})}, "token")
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "12+34=" * 50}],
                       "max_tokens": 16, "temperature": 1.0}).encode()
    bearer = [(b"authorization", b"Bearer token")]
    out = {"body_bytes": len(body), "requests": args.requests}
    for name, handler, path, headers in (
            ("bare_app_us", app, "/v1/chat/completions", []),
            ("guard_episode_key_us", routes, f"/episodes/{key}/v1/chat/completions", []),
            ("guard_run_token_us", routes, "/v1/chat/completions", bearer),
            ("guard_refused_us", routes, "/episodes/g0-0/v1/chat/completions", [])):
        asyncio.run(per_request_us(handler, path, headers, body, 500))  # warm up
        out[name] = round(asyncio.run(per_request_us(handler, path, headers, body, args.requests)), 2)
    out["guard_cost_us"] = round(out["guard_episode_key_us"] - out["bare_app_us"], 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
