"""A reward service speaking OpenRLHF's remote RM protocol: `python -m openrlhf_async.cli.reward_server --help`.

POST /score (or /get_reward) {"query": [...], "prompts": [...], "labels": [...]} answers
{"rewards", "scores", "extra_logs", "errors", "timeout"}; with no --reward.func_path it scores with the built-in
math-verify reward. Each sample (or reward_func call) runs on a worker under --timeout: one over it scores 0.0 and
is listed in "errors", and its worker is killed. A reward_func that raises answers 422, a bad request 4xx. A client
must send its headers, and then its body, each within --read_timeout, or its connection is closed."""

import argparse
import asyncio
import errno
import math
import socket
import sys


def _bad_request(message: str, status: int = 400):
    from aiohttp import web

    return web.json_response({"error": message}, status=status)


def _read_batch(body, need_labels: bool):
    """The request's (queries, prompts, labels), or an error message."""
    if not isinstance(body, dict):
        return f"body is {type(body).__name__}; expected a JSON object with 'query' and 'labels'"
    queries = body.get("query", body.get("queries"))
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        return "'query' must be a list of strings"
    n = len(queries)
    prompts, labels = body.get("prompts"), body.get("labels")
    if prompts is not None and (not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts)
                                or len(prompts) != n):
        return f"'prompts' must be a list of {n} strings, one per query"
    if labels is None and need_labels:
        return "'labels' is required: the built-in math reward compares each query's answer with its label"
    if labels is not None and (not isinstance(labels, list) or len(labels) != n
                               or not all(isinstance(x, (str, int, float)) for x in labels)):
        return f"'labels' must be a list of {n} strings or numbers, one per query"
    return queries, prompts or [""] * n, labels if labels is not None else [""] * n


async def _math_batch(pool, queries, prompts, labels) -> dict:
    # The query is prompt + response: only the response may hold the answer (prompts carry worked examples).
    responses = [q[len(p):] if p and q.startswith(p) else q for q, p in zip(queries, prompts)]
    results = await asyncio.gather(*(pool.score(r, str(label)) for r, label in zip(responses, labels)),
                                   return_exceptions=True)
    rewards, errors = [], []
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result
            errors.append({"index": i, "error": f"{type(result).__name__}: {result}"})
            rewards.append(0.0)
        else:
            rewards.append(result["score"])
    failed = {e["index"] for e in errors}
    return {"rewards": rewards, "scores": rewards, "errors": errors,
            "extra_logs": {"accuracy": rewards, "reward_errors": [float(i in failed) for i in range(len(rewards))]}}


def build_app(func_path: str = "", workers: int = 2, timeout: float = 10.0, max_concurrency: int = 64,
              max_body_mb: float = 16, read_timeout: float = 30.0):
    """The aiohttp application; raises RewardFileError for a bad --reward.func_path."""
    from aiohttp import web

    from openrlhf_async.reward.math_verify_reward import MathVerifyPool
    from openrlhf_async.reward.sources import RewardError, RewardTimeout, load_reward_func

    # A plain def reward_func runs in the worker processes, where a hung call is killed.
    func = load_reward_func(func_path, timeout, workers=workers, max_concurrency=max_concurrency) if func_path else None
    pool = None if func else MathVerifyPool(workers, timeout, max_concurrency)
    func_slots = asyncio.Semaphore(max_concurrency)

    async def score(request):
        try:  # the headers had their own time: the server's keepalive_timeout
            body = await asyncio.wait_for(request.json(), read_timeout)
        except asyncio.TimeoutError:
            return _bad_request(f"the request body did not arrive within --read_timeout {read_timeout:g} s", 408)
        except web.HTTPRequestEntityTooLarge:
            return _bad_request(f"body over --max_body_mb {max_body_mb:g}", 413)
        except ValueError as e:
            return _bad_request(f"body is not JSON ({e})")
        batch = _read_batch(body, need_labels=func is None)
        if isinstance(batch, str):
            return _bad_request(batch)
        queries, prompts, labels = batch
        if func is None:
            return web.json_response({**await _math_batch(pool, queries, prompts, labels), "timeout": timeout})
        try:
            async with func_slots:
                results = await func.score(queries, prompts, labels)
        except RewardTimeout as e:  # as for a math sample over its time: scored 0 and listed
            n = len(queries)
            return web.json_response({"rewards": [0.0] * n, "scores": [0.0] * n, "timeout": timeout,
                                      "errors": [{"index": i, "error": f"RewardTimeout: {e}"} for i in range(n)],
                                      "extra_logs": {"reward_errors": [1.0] * n}})
        except RewardError as e:  # the reward_func fails on this request: it would fail again, so not a 5xx
            return _bad_request(f"RewardError: {e}", 422)
        logged = [k for k in (results[0]["extra"] if results else {}) if all(k in r["extra"] for r in results)]
        return web.json_response({"rewards": [r["reward"] for r in results],
                                  "scores": [r["score"] for r in results],
                                  "extra_logs": {k: [r["extra"][k] for r in results] for k in logged},
                                  "errors": [], "timeout": timeout})

    async def health(request):
        return web.json_response({"status": "ok"})

    async def start_workers(app):
        if pool is not None:  # start the math-verify workers before listening, not inside the first requests
            await pool.score("\\boxed{\\frac{1}{2}}", "0.5")

    async def stop_workers(app):
        if pool is not None:
            pool.close()
        if func is not None:
            await func.close()

    app = web.Application(client_max_size=int(max_body_mb * 2 ** 20))
    app.add_routes([web.post("/score", score), web.post("/get_reward", score), web.get("/health", health)])
    app.on_startup.append(start_workers)
    app.on_cleanup.append(stop_workers)
    return app


def _at_least_one(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number; give 1 or more") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} would never score anything; give 1 or more")
    return number


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number; give a whole number from 1 to 65535")
    return port


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:  # false for nan
        raise argparse.ArgumentTypeError(f"{value!r} is not a number above 0; give one such as 10")
    return number


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the flag, without the usage block
        self.exit(2, f"error: {message}\n")


def _bind_error(e: OSError, host: str, port: int) -> str:
    if isinstance(e, socket.gaierror):
        return f"--host {host}: cannot resolve it ({e.strerror}); give an address of this machine, e.g. 127.0.0.1"
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: {host}:{port} is already in use; give a free port, or stop what listens there"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine; give 127.0.0.1, 0.0.0.0 or one of its addresses"
    if e.errno == errno.EACCES:
        return f"--port {port}: permission denied; give a port above 1023"
    return f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port"


def main(argv=None) -> int:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    parser.add_argument("--port", type=_port, default=5000)
    parser.add_argument("--reward.func_path", dest="func_path", default="",
                        help="an OpenRLHF reward_func .py file; empty: the built-in math-verify reward")
    parser.add_argument("--workers", type=_at_least_one, default=2,
                        help="worker processes scoring samples (math-verify, or a plain def reward_func)")
    parser.add_argument("--timeout", type=_positive, default=10.0,
                        help="seconds one sample (or one reward_func call) may take on a worker")
    parser.add_argument("--max_concurrency", type=_at_least_one, default=64, help="samples scored at once")
    parser.add_argument("--max_body_mb", type=_positive, default=16, help="largest request body accepted")
    parser.add_argument("--read_timeout", type=_positive, default=30.0,
                        help="seconds a client may take to send a request's headers, and then its body; a slower "
                             "or stalled connection is closed")
    args = parser.parse_args(argv)

    from aiohttp import web

    from openrlhf_async.reward.sources import RewardFileError

    try:
        app = build_app(args.func_path, args.workers, args.timeout, args.max_concurrency, args.max_body_mb,
                        args.read_timeout)
    except RewardFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        # keepalive_timeout: since aiohttp 3.14.4 it runs from the connection's start and is not reset by incoming
        # bytes, so a client that has not sent whole headers by then is closed (slow or stalled alike).
        # lingering_time: how long an unread request body is drained after the answer.
        web.run_app(app, host=args.host, port=args.port, access_log=None, keepalive_timeout=args.read_timeout,
                    lingering_time=min(10.0, args.read_timeout), handler_cancellation=True,
                    print=lambda _: print(f"reward server listening on http://{args.host}:{args.port}", flush=True))
    except OSError as e:
        print(f"error: {_bind_error(e, args.host, args.port)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
