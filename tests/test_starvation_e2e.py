"""Dynamic sampling when the policy learns its task, on the real stack: rewards vary at first, then every episode
scores the same, and the run ends in bounded time with its model, as --algo.dynamic_filtering_on_starved says."""

import copy
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import tokenized_prompts, unfinished
from openrlhf_async.config import preset_path
from openrlhf_async.trainer.pipeline import PPOTrainerAsync

# The task is "solved" once the reward has been asked this many times (a count kept in a file beside it, shared by
# every process that scores). Before, the episodes of a prompt score 1, 0, 1, 0, ... in the order they are scored (a
# count per prompt, in a file of its own under a lock: threads and processes score at once), so that every group of
# 4 varies, whichever of its episodes ends first; after, each scores 1.
ALTERNATING = """
import fcntl
import hashlib
import os


def alternating(key):
    with open(os.path.join({calls!r} + "-by-prompt", hashlib.sha256(key.encode()).hexdigest()), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(".")
        f.flush()
        return float(f.tell() % 2)


def solved():
    with open({calls!r}, "a") as f:
        f.write(".")
    return os.path.getsize({calls!r}) > {solved_after}
"""
SOLVED_REWARD = ALTERNATING + """

def reward_func(queries, prompts, labels, **kwargs):
    return {{"rewards": [1.0 if solved() else alternating(prompt) for prompt in prompts]}}
"""
SOLVED_AGENT = ALTERNATING + """

async def step(state, action, label):
    return (1.0 if solved() else alternating(state)), state, True, {{}}
"""


def _write(path, source: str, solved_after: int) -> None:
    calls = str(path.parent / "calls")
    os.makedirs(calls + "-by-prompt", exist_ok=True)
    path.write_text(source.format(calls=calls, solved_after=solved_after))


def test_the_cli_run_ends_with_its_model_once_the_task_is_solved(tmp_path, tiny_model_path):
    """The user's view: `make smollm2-rl`'s situation in small. The default (partial) trains while valid groups
    come, then ends the run normally, saying why, with the model saved."""
    _write(tmp_path / "reward.py", SOLVED_REWARD, solved_after=40)
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
           "--actor.model_name_or_path", tiny_model_path, "--rollout.batch_size", "4",
           "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16", "--rollout.vllm_generate_batch_size", "4",
           "--train.max_steps", "50", "--eval.steps", "1000", "--eval.max_samples", "4",
           "--algo.dynamic_filtering_max_num_gen_batches", "2", "--reward.remote_url", str(tmp_path / "reward.py"),
           "--rollout.unbiased_early_stop", "--runs_dir", str(runs), "--run_name", "solved", "--no-progress"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"the run ended in {time.perf_counter() - start:.0f} s")
    run_dir = runs / "solved"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert 1 <= len(steps) < 10, "the run went on long after the task was solved"
    assert "the run ends before step" in done.stdout and "groups were flat" in done.stdout, done.stdout[-2000:]
    assert os.path.isfile(run_dir / "final_hf" / "model.safetensors")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == len(steps) == summary["stopped_early"]["last_step"], summary
    assert "groups were flat" in summary["stopped_early"]["reason"]
    assert f"after {len(steps)} steps of 50 (" in done.stdout, done.stdout[-2000:]
    for key in ("rollout/starved_batches", "rollout/groups_flat_filled", "rollout/groups_started"):
        assert all(key in m for m in steps), key


@pytest.fixture(scope="module")
def prompts(tiny_model_path):
    return tokenized_prompts(tiny_model_path, 64, seed=7)


@pytest.mark.parametrize("mode,action,train", [
    ("sync", "stop", {}),
    ("sync", "fill", {}),
    ("async", "partial", {"async_queue_size": 2}),
    ("fully_async", "partial", {"partial_rollout_enable": True, "trigger_parameter_sync_step": 2}),
])
def test_each_mode_ends_in_bounded_time_when_the_task_is_solved(restore_weights, mode, action, train, engines,
                                                                policy, weight_sync, prompts, stack_cfg, tmp_path):
    agent = tmp_path / "agent.py"
    _write(agent, SOLVED_AGENT, solved_after=24)
    cfg = copy.deepcopy(stack_cfg)
    cfg.mode, cfg.train.max_steps, cfg.agent.func_path = mode, 5, str(agent)
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.vllm_generate_batch_size = 2, 4, 4
    cfg.algo.dynamic_filtering_max_num_gen_batches, cfg.algo.dynamic_filtering_on_starved = 2, action
    cfg.rollout.unbiased_early_stop = True  # a batch is a prefix of the start order, whichever group finished first
    for key, value in train.items():
        setattr(cfg.train, key, value)
    logged = []
    start = time.perf_counter()
    summary = PPOTrainerAsync(cfg, engines, policy, weight_sync, prompts, []).run(logged.append)
    steps = [m for m in logged if m["step"] > 0]
    print(f"{mode} {action}: {len(steps)} steps in {time.perf_counter() - start:.0f} s, "
          f"stopped early: {summary['stopped_early']}")
    # Bounded by steps, not by the clock: at most --train.max_steps, each of at most 2 generation batches.
    if action == "fill":  # the run trains to its last step on batches topped up with flat groups
        assert summary["stopped_early"] is None and [m["step"] for m in steps] == [1, 2, 3, 4, 5]
        assert summary["groups_flat_filled"] > 0
    else:
        stop = summary["stopped_early"]
        assert stop is not None and stop["step"] == len(steps) + 1 <= 5, summary
        # "the task is solved" once every flat group scores 1; flat groups from before the switch (all 0 or all 1 at
        # random) make it "the policy's scores no longer vary": either way the reason counts the flat groups.
        assert "groups were flat" in stop["reason"], stop
    assert all(m["rollout/groups_accepted"] >= 1 and "rollout/starved_batches" in m for m in steps)
    # The run driver saves the model once the pipeline returns: the policy is whole and can be saved.
    import ray

    ray.get(policy.call("save_hf", str(tmp_path / "final_hf")))
    assert os.path.isfile(tmp_path / "final_hf" / "model.safetensors")
    for engine in engines:  # nothing left running on the engines
        deadline = time.time() + 30
        while unfinished(engine)["vllm"] and time.time() < deadline:
            time.sleep(0.2)
        assert unfinished(engine) == {"vllm": 0, "actor": 0}
