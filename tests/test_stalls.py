"""Hung user code (plain def agent steps and reward functions) never stalls the calls beside it: in threads of its
own, 50 hung calls leave room for a healthy one; in worker processes, a hung call's worker alone is killed."""

import asyncio
import os
import textwrap

import pytest

from openrlhf_async.agent import load_agent
from openrlhf_async.reward.sources import load_reward_func

HUNG = 50


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _agent(tmp_path):
    agent = load_agent(_write(tmp_path, "agent.py", """
        import threading

        STARTED, RELEASE = threading.Semaphore(0), threading.Event()

        def step(state, action, label):
            if action == "hang":
                STARTED.release()
                RELEASE.wait()
            return 1.0, state + action, True, {}
    """))
    call = lambda action: agent.step("s", action, "l", timeout=600)  # noqa: E731
    return call, agent._step.__globals__, lambda result: result.reward


def _reward(tmp_path):
    reward = load_reward_func(_write(tmp_path, "reward.py", """
        import threading

        STARTED, RELEASE = threading.Semaphore(0), threading.Event()

        def reward_func(queries, prompts, labels):
            if queries[0] == "hang":
                STARTED.release()
                RELEASE.wait()
            return {"rewards": [1.0] * len(queries)}
    """), timeout=600)
    return lambda query: reward.score([query], [""], [""]), reward.func.__globals__, lambda result: result[0]["reward"]


@pytest.mark.parametrize("make", [_agent, _reward], ids=["agent_step", "reward_func"])
def test_fifty_hung_plain_def_calls_do_not_delay_a_healthy_one(tmp_path, make):
    call, user_globals, value = make(tmp_path)
    started, release = user_globals["STARTED"], user_globals["RELEASE"]

    async def run():
        hung = [asyncio.ensure_future(call("hang")) for _ in range(HUNG)]
        try:
            # Their timeout is 600 s: the healthy call must not wait for any of them to give up.
            healthy = await asyncio.wait_for(call("ok"), 20)
            pending = sum(not task.done() for task in hung)
            running = sum(started.acquire(timeout=10) for _ in range(HUNG))
        finally:
            release.set()
        await asyncio.gather(*hung)
        return value(healthy), pending, running

    try:
        assert asyncio.run(run()) == (1.0, HUNG, HUNG)  # done while all 50 hung calls were running
    finally:
        release.set()


def test_a_hung_step_in_a_worker_is_killed_alone(tmp_path):
    go_on = tmp_path / "go_on"
    path = _write(tmp_path, "agent.py", f"""
        import os, time

        def step(state, action, label):
            if action == "hang":
                time.sleep(600)
            while action == "wait" and not os.path.exists({str(go_on)!r}):
                time.sleep(0.05)
            return 1.0, state + action, True, {{"pid": os.getpid()}}
    """)
    agent = load_agent(path, workers=2)

    async def run():
        waiting = asyncio.ensure_future(agent.step("s", "wait", "l", timeout=60))
        with pytest.raises(asyncio.TimeoutError):
            await agent.step("s", "hang", "l", timeout=1)
        go_on.touch()  # the step beside the hung one runs on in its own worker
        return await waiting

    try:
        result = asyncio.run(run())
        assert result.reward == 1.0 and result.extra_info["pid"] != os.getpid()
    finally:
        agent.close()
