"""The math reward on hand-labelled cases, its worker pool against hostile LaTeX, and reward_func files."""

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest

from openrlhf_async.reward.math_verify_reward import (
    MathVerifyPool,
    configure_math_verify,
    extract_answer,
    math_score,
    math_verify,
)
from openrlhf_async.reward.sources import (
    RemoteReward,
    RewardError,
    RewardFileError,
    RewardTimeout,
    load_reward_func,
    make_reward,
)

# sympy tries to decide this tower equals 1 and does not come back; math-verify's own timeouts stop it only
# where they can run (a process's main thread), so the pool is what bounds it.
HOSTILE = "\\boxed{9^{9^{9^{9^{9}}}}}"


@pytest.mark.parametrize("completion, label, expected", [
    ("65", "65", 1.0),
    (" 65", "65", 1.0),
    ("65.0", "65", 1.0),
    ("56", "65", 0.0),
    ("", "65", 0.0),
    ("6 5", "65", 0.0),
    ("The answer is \\boxed{65}", "65", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("-3", "-3", 1.0),
    ("3", "-3", 0.0),
])
def test_math_score_is_the_reward(completion, label, expected):
    assert math_score(completion, label)["score"] == expected


@pytest.mark.parametrize("completion, label, pred, score", [
    ("so x = \\boxed{\\frac12}.", "0.5", "\\frac12", 1.0),
    ("\\boxed{0.75}", "\\dfrac{3}{4}", "0.75", 1.0),
    ("The roots form \\boxed{\\{2, 1\\}}", "\\{1,2\\}", "\\{2, 1\\}", 1.0),
    ("\\boxed{(0, 1]}", "(0,1]", "(0, 1]", 1.0),
    ("\\boxed{[0, 1]}", "(0,1]", "[0, 1]", 0.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", "\\sqrt{8}", 1.0),
    ("\\boxed{2}", "2\\sqrt{2}", "2", 0.0),
    ("First \\boxed{3}, then on reflection the total is \\boxed{\\frac{7}{2}} apples.", "3.5", "\\frac{7}{2}", 1.0),
    ("nested \\boxed{\\frac{\\sqrt{4}}{4}}", "1/2", "\\frac{\\sqrt{4}}{4}", 1.0),
    ("\\fbox{12}", "12", "12", 1.0),
    ("Step 1 ... Step 9.\nAnswer: $\\frac{1}{2}$", "0.5", "\\frac{1}{2}", 1.0),
    ("Step 1 ... Step 9.\nAnswer: 41", "42", "41", 0.0),
    ("so the answer is 3.5.", "7/2", "3.5", 1.0),
    ("\\boxed{x = 5}", "5", "x = 5", 1.0),
    ("\\boxed{1,000}", "1000", "1,000", 1.0),
    ("12345678901234567890", "12345678901234567891", "12345678901234567890", 0.0),
    ("I am not sure what it is", "65", None, 0.0),
    ("the last box is cut off \\boxed{6", "6", None, 0.0),
    ("\\boxed{2}", "$2$", "2", 1.0),
])
def test_math_score(completion, label, pred, score):
    assert math_score(completion, label) == {"score": score, "accuracy": score, "pred": pred}


def test_extract_answer_prefers_the_last_box_then_the_answer_line():
    assert extract_answer("Answer: 3 but \\boxed{4}") == "4"
    assert extract_answer("the answer is 2\nAnswer: 5") == "5"
    assert extract_answer("\\boxed{\\frac{a}{b}} and \\boxed{}") == "\\frac{a}{b}"
    assert extract_answer("  -3/4 ") == "-3/4"
    assert extract_answer("") is None


def test_hostile_latex_hangs_inline_but_is_bounded_by_the_pool():
    inline = (f"from openrlhf_async.reward.math_verify_reward import math_score; "
              f"math_score({HOSTILE!r}, '1')")
    with pytest.raises(subprocess.TimeoutExpired):  # no timeout inline: still computing after 4 s
        subprocess.run([sys.executable, "-c", inline], timeout=4, capture_output=True)

    async def run():
        # timeout 0.5 s is below math-verify's own 1 s floor: only killing the worker can stop it.
        pool = MathVerifyPool(workers=1, timeout=0.5)
        try:
            assert (await pool.score("\\boxed{\\frac12}", "0.5"))["score"] == 1.0  # workers started
            start = time.monotonic()
            with pytest.raises(RewardTimeout, match="over 0.5 s"):
                await pool.score(HOSTILE, "1")
            assert time.monotonic() - start < 4  # inline it was still computing after 4 s: the pool ended it
            assert (await pool.score("\\boxed{\\frac12}", "0.5"))["score"] == 1.0  # a fresh worker
        finally:
            pool.close()
        # A longer timeout: math-verify's own timeouts in the worker end it first, as a wrong answer.
        pool = MathVerifyPool(workers=2, timeout=4)
        try:
            start = time.monotonic()
            results = await asyncio.gather(pool.score(HOSTILE, "1"), *(
                pool.score(f"\\boxed{{\\frac{{{i}}}{{4}}}}", str(i / 4)) for i in range(20)), return_exceptions=True)
            assert time.monotonic() - start < 4 + 5  # workers start inside this window too
            assert isinstance(results[0], RewardTimeout) or results[0]["score"] == 0.0
            assert [r["score"] for r in results[1:]] == [1.0] * 20
        finally:
            pool.close()

    asyncio.run(run())


def test_math_verify_uses_the_configured_default_pool():
    configure_math_verify(workers=1, timeout=5)

    async def run():
        return await asyncio.gather(
            math_verify("\\boxed{\\dfrac{1}{4}}", "0.25"), math_verify("\\boxed{\\dfrac{1}{3}}", "0.25"),
            math_verify("no answer here at all", "1"), math_verify("7", "7"))

    try:
        results = asyncio.run(run())
        assert [r["score"] for r in results] == [1.0, 0.0, 0.0, 1.0]
        assert [r["pred"] for r in results] == ["\\dfrac{1}{4}", "\\dfrac{1}{3}", None, "7"]
    finally:
        configure_math_verify()  # back to the defaults; closes the pool this test started


def test_in_an_engine_a_hostile_answer_costs_only_its_own_worker():
    """math_verify as the built-in agent calls it, 4 hostile answers among 36 healthy ones on 2 workers: each hostile
    one is a RewardTimeout, every healthy one is scored, and only the worker of a hostile answer is killed and
    replaced (the pool once restarted both workers on every timeout, re-running or failing the samples beside it)."""
    import psutil

    def workers():
        pids = set()
        for child in psutil.Process().children():
            try:
                if "spawn_main" in " ".join(child.cmdline()):
                    pids.add(child.pid)
            except psutil.Error:  # gone, or a zombie of a killed worker
                pass
        return pids

    configure_math_verify(workers=2, timeout=0.5)
    samples = [(HOSTILE, "1") if i % 10 == 0 else (f"\\boxed{{\\frac{{{i}}}{{8}}}}", str(i / 8)) for i in range(40)]
    before, seen = workers(), set()

    async def watch():
        while True:
            seen.update(workers() - before)
            await asyncio.sleep(0.05)

    async def run():
        watcher = asyncio.ensure_future(watch())
        try:
            await math_verify("\\boxed{\\frac12}", "0.5")  # the default pool started
            return await asyncio.gather(*(math_verify(c, label) for c, label in samples), return_exceptions=True)
        finally:
            watcher.cancel()

    try:
        results = asyncio.run(run())
    finally:
        configure_math_verify()
    assert all(isinstance(r, RewardTimeout) for r in results[::10])
    assert [r["score"] for i, r in enumerate(results) if i % 10] == [1.0] * 36
    assert 2 <= len(seen) <= 2 + 4  # both workers, and at most one replacement per hostile answer


def _write(tmp_path, text):
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("text, message", [
    (None, "no such file"),
    ("import not_a_module_anywhere\n", "does not import (ModuleNotFoundError"),
    ("def reward_fn(queries, prompts, labels):\n    return {}\n", "defines no reward_func"),
])
def test_bad_reward_files_fail_in_one_line_naming_the_flag(tmp_path, text, message):
    path = str(tmp_path / "missing.py") if text is None else _write(tmp_path, text)
    with pytest.raises(RewardFileError) as e:
        load_reward_func(path)
    assert str(e.value).startswith(f"--reward.func_path {path}: {message}") and "\n" not in str(e.value)


def test_openrlhf_style_reward_func_with_tensors(tmp_path):
    path = _write(tmp_path, """
        import torch

        def reward_func(queries, prompts, labels, **kwargs):
            rewards = torch.tensor([float(q[len(p):].strip() == l) for q, p, l in zip(queries, prompts, labels)])
            return {"rewards": rewards, "scores": rewards * 10,
                    "extra_logs": {"length": torch.tensor([float(len(q)) for q in queries])}}
    """)
    results = asyncio.run(load_reward_func(path).score(["1+1= 2", "2+2= 5"], ["1+1=", "2+2="], ["2", "4"]))
    assert results == [{"reward": 1.0, "score": 10.0, "extra": {"length": 6.0}},
                       {"reward": 0.0, "score": 0.0, "extra": {"length": 6.0}}]


def test_reward_func_failures_become_reward_errors(tmp_path):
    path = _write(tmp_path, """
        import asyncio, time

        async def reward_func(queries, prompts, labels):
            if queries[0] == "raise":
                raise KeyError("oops")
            if queries[0] == "slow":
                await asyncio.sleep(10)
            if queries[0] == "short":
                return {"rewards": [1.0]}
            return [1.0] * len(queries)
    """)
    reward = load_reward_func(path, timeout=0.5)
    with pytest.raises(RewardError, match="raised KeyError"):
        asyncio.run(reward.score(["raise"], [""], [""]))
    with pytest.raises(RewardTimeout):
        asyncio.run(reward.score(["slow"], [""], [""]))
    with pytest.raises(RewardError, match="length 1 for 2 queries"):
        asyncio.run(reward.score(["short", "b"], ["", ""], ["", ""]))
    with pytest.raises(RewardError, match="without 'rewards'; expected a module-level `reward_func"):
        asyncio.run(reward.score(["list"], [""], [""]))


def test_make_reward_checks_its_flags(tmp_path):
    assert make_reward() is None
    with pytest.raises(RewardFileError, match="--reward.remote_url /no/r.py: no such file"):
        make_reward(remote_url="/no/r.py")  # OpenRLHF's flag takes a reward_func file too
    with pytest.raises(RewardFileError, match="--reward.remote_url localhost:5000"):
        make_reward(remote_url="localhost:5000")
    remote = make_reward(remote_url="http://a:1/score, http://b:2/score", retries=2)
    assert isinstance(remote, RemoteReward) and remote.urls == ["http://a:1/score", "http://b:2/score"]
    path = _write(tmp_path, "def reward_func(queries, prompts, labels):\n"
                            "    return {'rewards': [0.0] * len(queries)}\n")
    assert asyncio.run(make_reward(remote_url=path).score(["q"], ["p"], ["l"]))[0]["reward"] == 0.0
