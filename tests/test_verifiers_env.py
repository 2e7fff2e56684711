"""`verifiers` environments (0.4, verifiers.v1) as the agent: their tasks as the prompts, their episodes run through
the engines' OpenAI endpoint by verifiers' own machinery (its proxy, its env's turns, the in-process harness), their
tasks' rewards as the episodes' rewards, and the tokens vLLM sampled as the training samples. The environments are
written here, as a user would (no environment package is installed)."""

import json
import subprocess
import sys

import pytest

from conftest import user_file
from openrlhf_async.agent import AgentFileError
from openrlhf_async.agent.verifiers_env import load_env, prompt_rows
from test_reward_model import _trained_steps

SINGLE_TURN = """
import verifiers.v1 as vf

__all__ = ["SumTaskset"]


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(10, 18):
            yield SumTask(SumData(prompt=f"{a}+3=", answer=str(a + 3), system_prompt=None), self.config.task)
"""

# Two turns each: the env asks a follow-up question in a user turn; the task scores both answers.
MULTI_TURN = """
import verifiers.v1 as vf

__all__ = ["FollowUpTaskset", "FollowUpEnv"]


class FollowUpData(vf.TaskData):
    answers: list


class FollowUpTask(vf.Task[FollowUpData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum(float(r.strip() == a) for r, a in zip(replies, self.data.answers)) / 2

    @vf.metric
    async def second_correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answers[1])


class FollowUpTaskset(vf.Taskset[FollowUpTask, vf.TasksetConfig]):
    def load(self):
        for a in range(20, 28):
            yield FollowUpTask(FollowUpData(prompt=f"{a}+5=", answers=[str(a + 5), str(a + 6)]), self.config.task)


class FollowUpEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime={"type": "subprocess"}, max_turns=3)


class FollowUpEnv(vf.Env[FollowUpEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            turn = await chat.turn()
            if not turn.terminated:
                await chat.turn(task.data.prompt.replace("+5=", "+6="))
"""


def test_an_environments_tasks_are_the_prompts_with_their_index_as_the_label(tmp_path):
    rows = prompt_rows(load_env(user_file(tmp_path, "vf_sums.py", SINGLE_TURN)), 100)
    assert rows[0] == {"prompt": "10+3=", "label": "0"} and len(rows) == 8 and rows[-1]["label"] == "7"


@pytest.mark.parametrize("body, args, message", [
    ("import no_such_module\n", "{}", "does not import (ModuleNotFoundError: No module named 'no_such_module')"),
    ("x = 1\n", "{}", "defines no `__all__`; a taskset must export its Taskset subclass"),
    (SINGLE_TURN, "[1]", "--agent.verifiers_args: expected a JSON object"),
    ("import sys\nsys.exit(0)\n", "{}", "does not import (SystemExit: 0)"),
    ("while True:\n    pass\n", "{}", "did not finish importing within 2 s (a loop or a blocking call at module level?)"),
])
def test_a_broken_environment_is_refused_in_one_line(tmp_path, monkeypatch, body, args, message):
    monkeypatch.setattr("openrlhf_async.utils.user_files.IMPORT_TIMEOUT_S", 2.0)
    with pytest.raises(AgentFileError) as error:
        load_env(user_file(tmp_path, f"vf_broken_{abs(hash(body + args))}.py", body), args)
    assert message in str(error.value) and "\n" not in str(error.value)


def _train(tmp_path, env_file, *flags):
    # The preset's dynamic filter keeps the groups whose rewards vary: every step trains on a non-zero advantage.
    from openrlhf_async.config import preset_path

    run = subprocess.run(
        [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
         "--agent.verifiers_env", env_file, "--runs_dir", str(tmp_path / "runs"), "--run_name", "vf",
         "--no-progress", "--train.max_steps", "2", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4",
         "--train.batch_size", "16", "--rollout.max_new_tokens", "32",
         *flags],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "runs" / "vf"
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return _trained_steps(run_dir), [s for s in samples if s["kind"] == "train"]


def test_a_multi_turn_verifiers_environment_trains(tmp_path):
    # Sampled with the run's seeds (--train.seed), and each batch a prefix of the start order (unbiased early stop):
    # which groups train does not depend on which finished first.
    trained, samples = _train(tmp_path, user_file(tmp_path, "vf_follow_up.py", MULTI_TURN),
                              "--rollout.unbiased_early_stop")
    assert [m["engine_weight_version"] for m in trained] == [1, 2]
    for m in trained:
        # Every step trains on groups whose rewards vary (the preset's filter). Its gradient norm is its last
        # update's, which PPO's clip zeroes where that update's every token is clipped (vLLM 0.32's samples: step 1).
        assert m["rollout/agent_errors"] == 0 and m["loss"] != 0 and (m["grad_norm"] > 0 or m["clip_ratio"] > 0)
        # The template appends turns: one sequence per episode, but for a reply in which the tiny model sampled one of
        # its special tokens (it writes "<|user|>" now and then): vLLM's text leaves it out, so the history the env
        # sends back is not what was sampled, and that episode is rightly split (one in 16 in a fresh-clone run).
        assert m["rollout/episodes_segmented"] <= 2
    # Both turns in every episode, but where the model's first reply ran out of --rollout.max_new_tokens: with no
    # answer to follow up, the env ends the episode there (the tiny model, sampling at temperature 1, now and then
    # writes 32 tokens of noise).
    episodes = {}
    for sample in samples:  # a segmented episode has a row a segment
        episodes.setdefault(sample["episode"], []).append(sample)
    for rows in episodes.values():
        assert sum(len(r["turns"]) for r in rows) == 2 or rows[-1]["finish_reason"] == "length", rows
    one_sequence = [sample for sample in samples if len(sample["turns"]) == 2]  # a segment's row shows its own turns
    assert len(one_sequence) >= len(samples) - 4
    for sample in one_sequence:
        # The env's follow-up is a user turn between the model's two answers, masked (the "observation").
        first, second = sample["turns"]
        assert first["observation"].endswith("+6=<|assistant|>") and sample["error"] is None
        a = int(sample["prompt"].split("+")[0][-2:])
        answers = [turn["response"].replace("<|endoftext|>", "").strip() for turn in (first, second)]
        assert sample["reward"] == (float(answers[0] == str(a + 5)) + float(answers[1] == str(a + 6))) / 2


@pytest.mark.long
def test_a_single_turn_verifiers_environment_trains(tmp_path):
    trained, samples = _train(tmp_path, user_file(tmp_path, "vf_sums.py", SINGLE_TURN))
    assert [m["engine_weight_version"] for m in trained] == [1, 2]
    assert all(m["rollout/agent_errors"] == 0 and m["rollout/extra/reply_chars"] > 0 for m in trained)
    assert all(len(s["turns"]) == 1 for s in samples)


def test_a_taskset_missing_nltk_data_offline_fails_in_one_line_naming_it_and_how_to_install_it(capfd):
    """verifiers' textarena taskset (wordle) downloads NLTK corpora as it loads; offline NLTK prints its banners and
    raises LookupError. What is shown: one line naming the environment, the data and the command that installs it."""
    import os
    from types import SimpleNamespace

    from openrlhf_async.agent import AgentFileError
    from openrlhf_async.agent.verifiers_env import tasks

    def load():
        os.write(2, b"[nltk_data] Error loading words: <urlopen error ...>\n")  # as NLTK does, past sys.stderr
        raise LookupError("\n" + "*" * 70 + "\n  Resource \x1b[93mwords\x1b[0m not found.\n  Please use the NLTK "
                          "Downloader to obtain the resource:\n\n  >>> import nltk\n  >>> nltk.download('words')\n")
        yield

    env = SimpleNamespace(config=SimpleNamespace(taskset=SimpleNamespace(id="textarena")), taskset=load())
    with pytest.raises(AgentFileError) as raised:
        tasks(env, 3)
    message = str(raised.value)
    assert "\n" not in message and "--agent.verifiers_env textarena" in message
    assert "'words'" in message and "python -m nltk.downloader words" in message
    assert "nltk_data" not in capfd.readouterr().err


NLTK_AT_LOAD = '''
import os
import verifiers.v1 as vf

__all__ = ["WordsTaskset"]


class WordsTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def __init__(self, *args, **kwargs):  # as a taskset that reads an NLTK corpus when it is made
        os.write(2, b"[nltk_data] Error loading words: <urlopen error [Errno -3] Temporary failure>\\n")
        raise LookupError("\\n" + "*" * 70 + "\\n  Resource \\x1b[93mwords\\x1b[0m not found.\\n  Please use the NLTK "
                          "Downloader to obtain the resource:\\n\\n  >>> import nltk\\n  >>> nltk.download('words')\\n")

    def load(self):
        yield from ()
'''


def test_an_environment_missing_nltk_data_as_it_loads_fails_in_one_line_naming_it(tmp_path, capfd):
    """The same when the data is read as verifiers makes the environment (load_environment), not as its tasks are
    read: one line naming the data and how to install it, NLTK's banner not shown."""
    with pytest.raises(AgentFileError) as raised:
        load_env(user_file(tmp_path, "vf_words.py", NLTK_AT_LOAD))
    message = str(raised.value)
    assert "\n" not in message and "could not load it" in message
    assert "'words'" in message and "python -m nltk.downloader words" in message
    assert "nltk_data" not in capfd.readouterr().err
