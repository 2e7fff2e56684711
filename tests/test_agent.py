"""Agent files: the default math agent, and steps isolated in worker processes with a timeout."""

import asyncio
import os
import textwrap

import pytest

from openrlhf_async.agent import load_agent


def test_default_agent_scores_the_answer():
    agent = load_agent()
    result = asyncio.run(agent.step("1+1=", "2", "2", timeout=10))
    assert (result.reward, result.done, result.next_state) == (1.0, True, "1+1=2")
    assert asyncio.run(agent.step("1+1=", "3", "2", timeout=10)).reward == 0.0


def test_worker_processes_run_steps_elsewhere_and_survive_a_hung_step(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent("""
        import os, time

        def step(state, action, label):
            if action == "hang":
                time.sleep(60)
            return 1.0, state + action, True, {"pid": os.getpid()}
    """))
    agent = load_agent(str(path), workers=1)
    try:
        result = asyncio.run(agent.step("s", "a", "l", timeout=30))
        assert result.reward == 1.0 and result.extra_info["pid"] != os.getpid()
        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(agent.step("s", "hang", "l", timeout=1))
        again = asyncio.run(agent.step("s", "a", "l", timeout=30))  # a fresh worker replaced the hung one
        assert again.reward == 1.0 and again.extra_info["pid"] != result.extra_info["pid"]
    finally:
        agent.close()
