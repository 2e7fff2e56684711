"""A reward service speaking OpenRLHF's remote RM protocol: `python -m openrlhf_async.cli.reward_server --help`.

POST /score (or /get_reward) {"query": [...], "prompts": [...], "labels": [...]} answers
{"rewards", "scores", "extra_logs", "errors", "timeout"}; with no --reward.func_path it scores with the built-in
math-verify reward. Each sample (or reward_func call) runs on a worker under --timeout: one over it scores 0.0 and
is listed in "errors", and its worker alone is killed. A sample (or call) waits at most --timeout and 5 s more for a
worker, else its request answers 503, however many hung ones came before it. A reward_func that raises answers 422,
a bad request 4xx. A client must send its headers, and then its body, each within --read_timeout, or its connection is
closed. Failures are counted in GET /health and logged in one line each, at most 10 lines a second."""

import argparse
import asyncio
import collections
import errno
import inspect
import json
import logging
import math
import os
import socket
import sys
import threading
import time

LOG_LINES_PER_SECOND = 10
_log = logging.getLogger("openrlhf_async.reward_server")


class _RateLimitedLines(logging.Handler):
    """Each record in one line (a traceback only for an error of the server's own), at most `per_second` lines a
    second; the rest are counted, and the count is written when the second is over: malformed requests by the
    thousand cannot flood the log."""

    def __init__(self, stream, per_second: int = LOG_LINES_PER_SECOND):
        super().__init__()
        self.stream, self.per_second = stream, per_second
        self._second, self._written, self._suppressed, self._timer = 0.0, 0, 0, None

    def emit(self, record):  # called under self.lock
        now = time.monotonic()
        if now - self._second >= 1.0:
            self._write_suppressed()
            self._second, self._written = now, 0
        if self._written >= self.per_second:
            self._suppressed += 1
            if self._timer is None:
                self._timer = threading.Timer(self._second + 1.0 - now, self._flush)
                self._timer.daemon = True
                self._timer.start()
            return
        self._written += 1
        self._write(self._one_line(record))

    def _one_line(self, record) -> str:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        line = " ".join(f"{record.getMessage()}{f': {type(exc).__name__}: {exc}' if exc else ''}".split())[:1000]
        if exc is not None and not isinstance(exc, HttpProcessingError):  # not the client's fault: a bug to fix
            line += "\n" + logging.Formatter().formatException(record.exc_info)
        return line

    def _flush(self):
        with self.lock:
            self._timer = None
            self._write_suppressed()

    def _write_suppressed(self):
        if self._suppressed:
            self._write(f"{self._suppressed} more such lines in that second not written")
            self._suppressed = 0

    def _write(self, line: str):
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: nothing to tell
            pass


def _one_line_logs():
    handler = _RateLimitedLines(sys.stderr)
    for name in ("aiohttp.server", "aiohttp.web", _log.name):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False


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


async def _read_json(request, read_timeout: float, max_body_mb: float):
    """The request's JSON body, or (status, message) when it is not one."""
    from aiohttp import web
    from aiohttp.http_exceptions import HttpProcessingError

    # The protocol is plain JSON: a compressed body is refused unread (no decompression bomb to open).
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        return 415, f"Content-Encoding {encoding} is not accepted; send the JSON body uncompressed"
    try:  # the headers had their own time: the server's keepalive_timeout
        raw = await asyncio.wait_for(request.read(), read_timeout)
    except asyncio.TimeoutError:
        return 408, f"the request body did not arrive within --read_timeout {read_timeout:g} s"
    except web.HTTPRequestEntityTooLarge:
        return 413, f"body over --max_body_mb {max_body_mb:g}"
    except HttpProcessingError as e:  # e.g. broken chunked framing
        return 400, f"body is malformed ({' '.join(str(e.message).split())})"
    try:
        return json.loads(raw)  # bytes: UTF-8 (or 16, 32) as JSON says, whatever charset the header names
    except RecursionError:
        return 400, "body is not JSON this service reads (nested too deeply)"
    except ValueError as e:
        return 400, f"body is not JSON ({e})"


async def _math_batch(pool, admission, queries, prompts, labels) -> dict:
    """The batch's answer; ServiceBusy when the queue is full as it comes, or a sample found no worker in time."""
    from openrlhf_async.reward.admission import ServiceBusy

    # The query is prompt + response: only the response may hold the answer (prompts carry worked examples).
    responses = [q[len(p):] if p and q.startswith(p) else q for q, p in zip(queries, prompts)]
    labels = [str(label) for label in labels]
    # A request is let in whole, so that a batch larger than the queue is served too, or refused whole.
    if admission.full and any(map(pool.needs_worker, responses, labels)):
        raise ServiceBusy(f"{admission.queue} samples already wait for the {admission.size} {admission.what}")
    tasks = [asyncio.ensure_future(pool.score(r, label, admission)) for r, label in zip(responses, labels)]
    try:
        pending = tasks
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            busy = [task.exception() for task in done if isinstance(task.exception(), ServiceBusy)]
            if busy:
                raise busy[0]
    finally:  # the rest leave the queue; those already on a worker finish there, unread
        for task in tasks:
            task.cancel()
    results = [task.exception() or task.result() for task in tasks]
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


class _Scorer:
    """The service's reward (a reward_func, or math-verify's worker pool), the admission bounding its calls in flight,
    the failures counted for GET /health, and the request handlers over them."""

    def __init__(self, func_path: str, workers: int, timeout: float, max_concurrency: int, max_body_mb: float,
                 read_timeout: float):
        from openrlhf_async.reward.admission import Admission
        from openrlhf_async.reward.math_verify_reward import MathVerifyPool
        from openrlhf_async.reward.sources import load_reward_func

        self.timeout, self.max_body_mb, self.read_timeout = timeout, max_body_mb, read_timeout
        # A plain def reward_func runs in the worker processes, where a hung call is killed.
        self.func = load_reward_func(func_path, timeout, workers=workers, max_concurrency=max_concurrency) \
            if func_path else None
        self.pool = None if self.func else MathVerifyPool(workers, timeout)
        self.on_loop = False
        if self.func is None:
            self.admission, self.more = Admission(workers, max_concurrency, timeout, "math-verify workers"), "--workers"
        else:  # an async def reward_func runs on the event loop, up to max_concurrency calls at once
            self.on_loop = inspect.iscoroutinefunction(self.func.func)
            self.admission = Admission(max_concurrency if self.on_loop else workers, max_concurrency, timeout,
                                       "places for reward_func calls" if self.on_loop else "reward_func workers")
            self.more = "--max_concurrency" if self.on_loop else "--workers"
        self.counts = collections.Counter()  # failures by kind, for GET /health

    def refuse(self, request, status: int, message: str, **headers):
        from aiohttp import web

        self.counts[f"answered_{status}"] += 1
        _log.warning("answered %d to %s from %s: %s", status, request.path, request.remote, message)
        return web.json_response({"error": message}, status=status, headers=headers)

    def math_answer(self, out):
        from aiohttp import web

        for error in out["errors"]:
            kind = "timeouts" if error["error"].startswith("RewardTimeout") else "sample_errors"
            self.counts[kind] += 1
            _log.warning("%s (%d %s so far)", error["error"], self.counts[kind], kind)
        return web.json_response({**out, "timeout": self.timeout})

    async def score(self, request):
        from openrlhf_async.reward.admission import ServiceBusy
        from openrlhf_async.reward.sources import RewardError, RewardTimeout

        body = await _read_json(request, self.read_timeout, self.max_body_mb)
        if isinstance(body, tuple):
            status, message = body
            return self.refuse(request, status, message, **({"Accept-Encoding": "identity"} if status == 415 else {}))
        batch = _read_batch(body, need_labels=self.func is None)
        if isinstance(batch, str):
            return self.refuse(request, 400, batch)
        queries, prompts, labels = batch
        try:
            if self.func is None:
                return self.math_answer(await _math_batch(self.pool, self.admission, queries, prompts, labels))
            async with self.admission.slot():
                results = await self.func.score(queries, prompts, labels)
        except ServiceBusy as e:  # the client retries a 5xx with backoff; by then a worker is free
            return self.refuse(request, 503, f"{e}; retry later, or start the service with more {self.more}",
                               **{"Retry-After": str(math.ceil(self.timeout))})
        except RewardTimeout as e:  # as for a math sample over its time: scored 0 and listed
            return self.timed_out(e, len(queries))
        except RewardError as e:  # the reward_func fails on this request: it would fail again, so not a 5xx
            return self.refuse(request, 422, f"RewardError: {e}")
        return self.func_answer(results)

    def timed_out(self, e, n: int):
        """A reward_func call over --timeout: its n samples scored 0 and listed."""
        from aiohttp import web

        self.counts["timeouts"] += 1
        _log.warning("%s; %s (%d so far)", e, "the call was cancelled" if self.on_loop else
                     "its worker was killed and replaced", self.counts["timeouts"])
        return web.json_response({"rewards": [0.0] * n, "scores": [0.0] * n, "timeout": self.timeout,
                                  "errors": [{"index": i, "error": f"RewardTimeout: {e}"} for i in range(n)],
                                  "extra_logs": {"reward_errors": [1.0] * n}})

    def func_answer(self, results: list):
        """A reward_func's results as the protocol's answer, with the extra logs every sample has."""
        from aiohttp import web

        logged = [k for k in (results[0]["extra"] if results else {}) if all(k in r["extra"] for r in results)]
        return web.json_response({"rewards": [r["reward"] for r in results],
                                  "scores": [r["score"] for r in results],
                                  "extra_logs": {k: [r["extra"][k] for r in results] for k in logged},
                                  "errors": [], "timeout": self.timeout})

    async def health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok", "running": self.admission.running,
                                  "waiting": self.admission.waiting, "counts": dict(self.counts)})

    async def start_workers(self, app):
        if self.pool is not None:  # start the math-verify workers before listening, not inside the first requests
            await self.pool.start()

    async def stop_workers(self, app):
        if self.pool is not None:
            self.pool.close()
        if self.func is not None:
            await self.func.close()


def build_app(func_path: str = "", workers: int = 2, timeout: float = 10.0, max_concurrency: int = 64,
              max_body_mb: float = 16, read_timeout: float = 30.0):
    """The aiohttp application; raises RewardFileError for a bad --reward.func_path."""
    from aiohttp import web

    scorer = _Scorer(func_path, workers, timeout, max_concurrency, max_body_mb, read_timeout)
    # Rounded up: a limit of 0 bytes would be no limit at all.
    app = web.Application(client_max_size=math.ceil(max_body_mb * 2 ** 20))
    app.add_routes([web.post("/score", scorer.score), web.post("/get_reward", scorer.score),
                    web.get("/health", scorer.health)])
    app.on_startup.append(scorer.start_workers)
    app.on_cleanup.append(scorer.stop_workers)
    return app


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _in_range(kind, low: float, high: float, why: str):
    """An argparse type: a number of `kind` from low to high, else a one-line error with the range and why."""
    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            number = math.nan
        if not low <= number <= high:  # false for nan
            raise argparse.ArgumentTypeError(f"{value!r} is not {'a whole' if kind is int else 'a'} number from "
                                             f"{low:g} to {high:g} ({why})")
        return number
    return parse


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
    cpus = _cpus()
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    parser.add_argument("--port", type=_in_range(int, 1, 65535, "a TCP port"), default=5000)
    parser.add_argument("--reward.func_path", dest="func_path", default="",
                        help="an OpenRLHF reward_func .py file; empty: the built-in math-verify reward")
    # More processes than a few per CPU only queue for it (an I/O-bound reward_func should be an async def).
    parser.add_argument("--workers", type=_in_range(int, 1, 4 * cpus, f"4 per CPU; this machine has {cpus}"),
                        default=2, help="worker processes scoring samples (math-verify, or a plain def reward_func)")
    parser.add_argument("--timeout", type=_in_range(float, 0.1, 3600, "seconds"), default=10.0,
                        help="seconds one sample (or one reward_func call) may take on a worker; it waits for a "
                             "worker at most this and 5 s more (then 503)")
    parser.add_argument("--max_concurrency", type=_in_range(int, 1, 4096, "more would only wait for the workers"),
                        default=64,
                        help="math-verify samples or reward_func calls that may wait for a worker (a request that "
                             "finds that many waiting gets 503)")
    # At least 1 KB: 0.0000001 once rounded to 0 bytes, which aiohttp takes for no limit at all.
    parser.add_argument("--max_body_mb", type=_in_range(float, 0.001, 1024, "1 KB to 1 GB"), default=16,
                        help="largest request body accepted")
    parser.add_argument("--read_timeout", type=_in_range(float, 1, 3600, "seconds"), default=30.0,
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
    _one_line_logs()
    try:
        # keepalive_timeout: since aiohttp 3.14.4 it runs from the connection's start and is not reset by incoming
        # bytes, so a client that has not sent whole headers by then is closed (slow or stalled alike).
        # lingering_time: how long an unread request body is drained after the answer.
        # auto_decompress off: a compressed body reaches the handler as it came, and is refused there (415).
        web.run_app(app, host=args.host, port=args.port, access_log=None, keepalive_timeout=args.read_timeout,
                    lingering_time=min(10.0, args.read_timeout), handler_cancellation=True, auto_decompress=False,
                    print=lambda _: print(f"reward server listening on http://{args.host}:{args.port}", flush=True))
    except OSError as e:
        print(f"error: {_bind_error(e, args.host, args.port)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
