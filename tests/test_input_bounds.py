"""Input past what its use can take (an attacker's report, 2026-11-27): reasoning-gym sets too large, too slow or of
huge questions, an endless verifiers taskset, JSON nested 200k deep, a memory plan past the machine's memory, model
and LoRA-target flags naming nothing, and the semaphores of a reward worker pool killed outright. Each is refused in
one line naming the flag or file before any actor starts, read only as far as its bound (the taskset), or cleaned up
at the next start."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import user_file
from test_hostile_inputs import dry_run, one_error_line
from openrlhf_async.config import ConfigError, preset_config, preset_path, validate

DEEP = "[" * 200_000 + "]" * 200_000


# 1. reasoning-gym: the task count is bounded, and the generation runs in a child under a time and memory limit.

def test_a_reasoning_gym_size_past_its_bound_is_refused_saying_to_prepare_a_dataset():
    with pytest.raises(ConfigError) as e:
        validate(preset_config("tiny_cpu", "--data.reasoning_gym", "chain_sum", "--data.reasoning_gym_size",
                               "1000000000"))
    assert str(e.value).startswith("--data.reasoning_gym_size 1000000000: must be at most 100000 (questions per "
                                   "task); a larger set is a dataset:") and "--data.prompt_dataset" in str(e.value)


def test_generator_settings_that_make_a_question_endless_are_refused_in_one_line(tmp_path):
    # The real command, the probe's time limit shortened; today it grows ~20 MB/s until the subprocess timeout.
    program = ("import sys; import openrlhf_async.data.reasoning_gym_tasks as t; t.PROBE_TIMEOUT_S = 10; "
               "from openrlhf_async.cli.train_async import main; sys.exit(main(sys.argv[1:]))")
    args = json.dumps({"chain_sum": {"min_terms": 999999999, "max_terms": 999999999}})
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", program, "@" + preset_path("tiny_cpu"), "--dry_run", "--runs_dir",
                           str(tmp_path / "runs"), "--data.reasoning_gym", "chain_sum", "--data.reasoning_gym_args",
                           args], capture_output=True, text=True, timeout=90)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --data.reasoning_gym_args: chain_sum made no 3 questions within 10 s (under a "
                          "4 GiB memory limit)"), err
    assert time.monotonic() - started < 60


def test_a_set_whose_generation_would_outlast_the_bound_is_refused_from_the_probe(tmp_path, monkeypatch):
    from openrlhf_async.data import reasoning_gym_tasks as t

    monkeypatch.setattr(t, "GENERATE_TIMEOUT_S", 0.01, raising=False)
    with pytest.raises(ValueError) as e:
        t.write_tasks("chain_sum", 100_000, 0, str(tmp_path))
    message = str(e.value)
    assert message.startswith("--data.reasoning_gym_size 100000 / --data.reasoning_gym_args: chain_sum's questions "
                              "take ") and "past the 0.01 s bound" in message and "\n" not in message, message
    assert not os.listdir(tmp_path)


def test_a_set_of_huge_questions_is_refused_from_the_probe_by_its_memory(tmp_path, monkeypatch):
    from openrlhf_async.data import reasoning_gym_tasks as t

    monkeypatch.setattr(t, "GENERATE_MEMORY", 2**30, raising=False)
    with pytest.raises(ValueError) as e:
        t.write_tasks("chain_sum", 5000, 0, str(tmp_path), '{"chain_sum": {"min_terms": 20000, "max_terms": 20000}}')
    message = str(e.value)
    assert message.startswith("--data.reasoning_gym_size 5000 / --data.reasoning_gym_args: chain_sum's questions "
                              "take ") and "past the 1 GiB bound" in message and "\n" not in message, message


# 2. verifiers: a taskset is read up to its bound (--agent.verifiers_max_tasks).

ENDLESS = """
import itertools

import verifiers.v1 as vf

__all__ = ["EndlessTaskset"]


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class EndlessTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    INFINITE = FLAGGED

    def load(self):
        for a in itertools.count():
            yield SumTask(SumData(prompt=f"{a}+3=", answer=str(a + 3)), self.config.task)
"""


@pytest.mark.parametrize("flagged", [False, True])
def test_an_endless_verifiers_taskset_is_read_as_far_as_its_bound(tmp_path, capsys, flagged):
    # Whether or not it says it is INFINITE: the first --agent.verifiers_max_tasks tasks, in the dry run as in a run.
    path = user_file(tmp_path, "vf_endless.py", ENDLESS.replace("FLAGGED", str(flagged)))
    assert dry_run(tmp_path, "--agent.verifiers_env", path, "--agent.verifiers_max_tasks", "5") == 0
    report = json.JSONDecoder().raw_decode(capsys.readouterr().out)[0]  # then the summary line
    assert report["datasets"]["train_rows"] == 5 and report["config"]["agent"]["verifiers_max_tasks"] == 5


def test_an_endless_verifiers_taskset_reads_the_default_bound(tmp_path, capsys):
    from openrlhf_async.agent.verifiers_env import VerifiersAgent

    path = user_file(tmp_path, "vf_endless.py", ENDLESS.replace("FLAGGED", "True"))
    assert dry_run(tmp_path, "--agent.verifiers_env", path) == 0
    assert json.JSONDecoder().raw_decode(capsys.readouterr().out)[0]["datasets"]["train_rows"] == 1000
    assert len(VerifiersAgent(path, max_tasks=7).tasks) == 7  # an engine reads as far


# 3. JSON nested past a bound is refused before it is parsed.

def test_deep_json_in_the_reasoning_gym_args_is_one_line(tmp_path, capsys):
    assert dry_run(tmp_path, "--data.reasoning_gym", "chain_sum", "--data.reasoning_gym_args", DEEP) == 2
    assert one_error_line(capsys) == ("error: --data.reasoning_gym_args: the JSON nests deeper than 100 levels; give "
                                      "a flatter one")


def test_deep_json_in_the_verifiers_args_is_one_line(tmp_path, capsys):
    from test_verifiers_env import SINGLE_TURN

    path = user_file(tmp_path, "vf_sums.py", SINGLE_TURN)
    assert dry_run(tmp_path, "--agent.verifiers_env", path, "--agent.verifiers_args", DEEP) == 2
    assert one_error_line(capsys) == ("error: --agent.verifiers_args: the JSON nests deeper than 100 levels; give a "
                                      "flatter one")


def test_a_deep_config_json_of_the_model_is_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": ' + DEEP + "}")
    assert dry_run(tmp_path, "--actor.model_name_or_path", str(model)) == 2
    assert one_error_line(capsys) == (f"error: --actor.model_name_or_path {model}: config.json: the JSON nests deeper "
                                      "than 100 levels; give a flatter one")


def test_the_depth_scan_ignores_brackets_inside_strings():
    from openrlhf_async.utils.json_text import loads

    assert loads(json.dumps({"text": "[" * 1000 + "\\\"{" * 1000}), "--x") == {"text": "[" * 1000 + '\\"{' * 1000}
    with pytest.raises(ConfigError, match="^--x: the JSON nests deeper than 100 levels"):
        loads("[" * 101 + "]" * 101, "--x")
    assert loads("[" * 100 + "]" * 100, "--x") is not None


# 4. On cpu, a memory plan past the machine's memory is refused.

def fresh_dry_run(tmp_path, *flags) -> subprocess.CompletedProcess:
    """The dry run as a user's command runs it, in a process of its own: the host's memory is checked only where no
    Ray runs in the process (a Ray there is a cluster's), which this test process's others may have started."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
                           "--runs_dir", str(tmp_path / "runs"), "--no-progress", "--dry_run", *flags],
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_memory_plan_past_the_machines_memory_is_refused_on_cpu(tmp_path):
    proc = fresh_dry_run(tmp_path, "--ds.lora.rank", "10000000")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: memory plan: 2 trainer ranks x ") and "this machine has" in err, err
    assert "the largest part is the optimizer" in err and "from --ds.lora.rank 10000000" in err, err


def test_the_tiny_preset_still_fits_and_its_summary_says_the_host_check(tmp_path):
    proc = fresh_dry_run(tmp_path)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and "not checked" not in summary and "host memory" in summary, summary


# 5. Model flags and LoRA targets that name nothing.

@pytest.mark.parametrize("flag", ["--reward.model_name_or_path", "--critic.model_name_or_path"])
def test_a_model_folder_without_a_config_is_refused(tmp_path, capsys, flag):
    junk = tmp_path / "junk"
    junk.mkdir()
    assert dry_run(tmp_path, "--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "1",
                   "--reward.num_gpus_per_node", "1", flag, str(junk)) == 2
    assert one_error_line(capsys) == (f"error: {flag} {junk}: the folder has no config.json (not a model folder?); "
                                      "give a Hugging Face model folder or id")


def test_lora_target_modules_the_model_lacks_are_refused(tmp_path, capsys):
    assert dry_run(tmp_path, "--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj", "no_such_proj") == 2
    assert one_error_line(capsys).startswith(
        "error: --ds.lora.target_modules no_such_proj: the model has no such linear layer (its linear layers: "
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj); name some of them, or use all-linear")
    # Names as peft matches them (a layer's dotted name or its ending) pass.
    assert dry_run(tmp_path, "--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj", "self_attn.v_proj") == 0


# 6. The named semaphores of a reward worker pool killed with SIGKILL are removed at the next start.

POOL = """
import asyncio
from openrlhf_async.reward.math_verify_reward import MathVerifyPool

async def main():
    pool = MathVerifyPool(1, 30.0)
    await pool.start()
    print("started", flush=True)
    await asyncio.sleep(HOLD)
    pool.close()

if __name__ == "__main__":
    asyncio.run(main())
"""


def _semaphores() -> set:
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.")}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_the_semaphores_of_a_killed_pool_are_removed_at_the_next_start():
    before = _semaphores()
    killed = subprocess.Popen([sys.executable, "-c", POOL.replace("HOLD", "600")], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # a group of its own: the kill takes its resource tracker too
    try:
        assert killed.stdout.readline().strip() == "started"
        left = _semaphores() - before
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert len(left) >= 5 and left <= _semaphores()  # a pool's queues' named semaphores, left behind
    nxt = subprocess.run([sys.executable, "-c", POOL.replace("HOLD", "0")], capture_output=True, text=True,
                         timeout=120)
    assert nxt.returncode == 0 and nxt.stdout.strip() == "started", nxt.stderr
    assert not left & _semaphores()
