"""A command line's refusals come together, one line each in the order the checks run, so that a user fixes them in
one go instead of meeting them one rerun at a time; a single fault is still one line."""

import os
import subprocess
import sys

import pytest

from openrlhf_async.config import ConfigError, check_local_cores, preset_config, preset_path, validate

STOP = "--rollout.stop '': an empty string would end every turn at once; give non-empty strings"
THRESHOLD = "--algo.advantage.is_correction_threshold 2.0 1.0: give HIGH or LOW HIGH with LOW <= HIGH"


def refusals(*flags) -> list:
    with pytest.raises(ConfigError) as e:
        validate(preset_config("tiny_cpu", *flags))
    return str(e.value).splitlines()


def test_faults_in_two_sections_are_refused_in_one_error():
    assert refusals("--rollout.stop", "", "--algo.advantage.is_correction_threshold", "2", "1") == [STOP, THRESHOLD]


def test_two_values_out_of_their_range_are_refused_in_one_error():
    assert refusals("--rollout.batch_size", "0", "--algo.kl.init_coef", "-1") == [
        "--rollout.batch_size 0: must be at least 1", "--algo.kl.init_coef -1.0: must not be negative"]


@pytest.mark.parametrize("flags, expected", [
    (["--rollout.stop", ""], STOP),
    (["--algo.advantage.is_correction_threshold", "2", "1"], THRESHOLD),
    (["--rollout.batch_size", "0"], "--rollout.batch_size 0: must be at least 1"),
])
def test_a_single_fault_is_one_line(flags, expected):
    assert refusals(*flags) == [expected]


def test_a_bad_device_stops_the_checks_there(monkeypatch):
    monkeypatch.setenv("DEVICE", "tpu")  # the checks below it read the device: their refusals would only confuse
    assert refusals("--rollout.stop", "") == ["DEVICE='tpu' (the environment default of --device): use cpu or cuda"]


def test_trainer_and_critic_ranks_past_the_cores_are_refused_together(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", None)  # no Ray running in this process
    ranks = ("--device", "cpu", "--actor.num_gpus_per_node", "8")
    with pytest.raises(ConfigError) as e:
        check_local_cores(validate(preset_config("tiny_cpu", *ranks, "--algo.advantage.estimator", "gae")))
    assert [line.split(": ", 1)[0] for line in str(e.value).splitlines()] == [
        "--actor.num_nodes 1 x --actor.num_gpus_per_node 8", "--critic.num_nodes 1 x --critic.num_gpus_per_node 8"]
    with pytest.raises(ConfigError) as e:
        check_local_cores(validate(preset_config("tiny_cpu", *ranks)))  # group_norm: no critic
    assert "\n" not in str(e.value) and str(e.value).startswith("--actor.num_nodes 1 x")


def test_the_dry_run_prints_each_refusal_on_an_error_line(tmp_path):
    # The real command in a process of its own (no Ray in it): 16 x 64 ranks, more than any machine here has.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
                           "--dry_run", "--device", "cpu", "--runs_dir", str(tmp_path / "runs"), "--rollout.stop", "",
                           "--algo.advantage.estimator", "gae", "--actor.num_nodes", "16",
                           "--actor.num_gpus_per_node", "64", "--critic.num_nodes", "16",
                           "--critic.num_gpus_per_node", "64"], capture_output=True, text=True, timeout=120, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 3, proc.stderr
    assert lines[0] == f"error: {STOP}"
    assert lines[1].startswith("error: --actor.num_nodes 16 x --actor.num_gpus_per_node 64: 1024 trainer ranks")
    assert lines[2].startswith("error: --critic.num_nodes 16 x --critic.num_gpus_per_node 64: 1024 critic ranks")


def test_gloo_weight_sync_on_cuda_is_refused_unless_the_engines_take_the_weights_by_ipc(capsys):
    """vLLM's gloo group (distributed/utils.py init_gloo_process_group) is registered for host tensors: a broadcast
    of the engines' GPU buffers over it fails at the first sync. The hybrid engine on cuda takes the weights by CUDA
    IPC, where the flag changes nothing."""
    cuda = ("--device", "cuda", "--plan.device_memory_gb", "80", "--vllm.sync_backend", "gloo")
    assert refusals(*cuda) == ["--vllm.sync_backend gloo with --device cuda: the weight-sync group's gloo carries host "
                               "tensors only, and the engines take the weights on their GPUs; use "
                               "--vllm.sync_backend nccl (the default)"]
    hybrid = validate(preset_config("tiny_cpu", *cuda, "--train.colocate_all", "--vllm.num_engines", "2"))
    notices = capsys.readouterr().err
    assert hybrid.hybrid and "--vllm.sync_backend gloo has no effect with --train.colocate_all" in notices
    assert validate(preset_config("tiny_cpu", "--vllm.sync_backend", "gloo")).backend == "gloo"  # cpu: gloo is it
