"""The launch scripts in examples/scripts: each passes its dry run on data prepared from the published formats,
and the CPU demo, submitted with `ray job submit` to a Ray head started on loopback, succeeds and writes metrics."""

import json
import os
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import free_port
from openrlhf_async.utils.cluster import network_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "examples", "scripts")
BIN = os.path.dirname(sys.executable)


def _verl_rows(problems: list) -> dict:
    """Columns of a verl-style Parquet file (DAPO-Math-17k, AIME-2024 from the same authors)."""
    return {
        "data_source": ["math_dapo"] * len(problems),
        "prompt": [[{"role": "user", "content": f"Solve the following math problem step by step. The last line of "
                     f"your response should be of the form Answer: $Answer (without quotes) where $Answer is the "
                     f"answer to the problem.\n\n{q}\n\nRemember to put your answer on its own line after "
                     f"\"Answer:\"."}] for q, _ in problems],
        "ability": ["MATH"] * len(problems),
        "reward_model": [{"ground_truth": a, "style": "rule-lean"} for _, a in problems],
        "extra_info": [{"index": str(i)} for i in range(len(problems))],
    }


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    raw, out = tmp_path_factory.mktemp("raw"), tmp_path_factory.mktemp("data")
    pq.write_table(pa.table(_verl_rows([("What is $2+3$?", "5"), ("What is $7 \\times 6$?", "42")] * 3)),
                   raw / "dapo.parquet")
    pq.write_table(pa.table({"id": [60, 61], "problem": ["Find $x$ if $x+1=3$.", "Find $y$ if $2y=10$."],
                             "solution": ["x=2", "y=5"], "answer": ["2", "5"], "url": ["", ""],
                             "year": ["2024", "2024"]}), raw / "aime.parquet")
    for dataset, path in (("dapo-math-17k", "dapo.parquet"), ("aime24", "aime.parquet")):
        subprocess.run([sys.executable, "-m", "openrlhf_async.cli.prepare_data", "--dataset", dataset,
                        "--input", str(raw / path), "--output", str(out)], check=True, capture_output=True)
    return str(out)


# The hub models' config.json, kept in tests/ so that the dry runs plan their memory offline (Qwen3-8B-Base has
# Qwen3-8B's shape).
MODEL_CONFIGS = {"train_dapo_qwen3_8b_async.sh": "Qwen3-8B", "train_fully_async_qwen25_math_7b.sh": "Qwen2.5-Math-7B",
                 "train_tool_agent_qwen3_8b.sh": "Qwen3-8B"}


def _dry_run(script, data_dir, *flags):
    env = {**os.environ, "PYTHON": sys.executable, "DATA_DIR": data_dir, "PATH": f"{BIN}:{os.environ['PATH']}"}
    if script in MODEL_CONFIGS:
        env["MODEL"] = os.path.join(REPO, "tests", "model_configs", MODEL_CONFIGS[script])
    return subprocess.run(["bash", os.path.join(SCRIPTS, script), "--dry_run", *flags], capture_output=True,
                          text=True, env=env, timeout=120)


GPU_SCRIPTS = ["train_dapo_qwen3_8b_async.sh", "train_fully_async_qwen25_math_7b.sh", "train_tool_agent_qwen3_8b.sh"]


def _memory(tokens: int) -> dict:
    """What a GPU recipe needs to fit and to survive: activations recomputed, micro batches of a token budget
    (packed), a resumable checkpoint every 20 steps."""
    return {"actor.gradient_checkpointing_enable": True, "train.dynamic_batch_enable": True,
            "train.max_tokens_per_gpu": tokens, "rollout.max_tokens_per_gpu": tokens, "ds.packing_samples": True,
            "ckpt.save_steps": 20}


@pytest.mark.parametrize("script, gpus, expected", [
    ("train_dapo_qwen3_8b_async.sh", 16, {"rollout.n_samples_per_prompt": 16, "actor.eps_clip_low_high": [0.2, 0.28],
                                           "reward.overlong_buffer_len": 4096, "rollout.max_new_tokens": 20480,
                                           "actor.adam_lr": 1e-6, "mode": "async",
                                           "rollout.batch_size": 512, "train.batch_size": 512, **_memory(24576)}),
    ("train_fully_async_qwen25_math_7b.sh", 16, {"train.staleness_threshold": 0.5, "train.partial_rollout_enable": True,
                                                  "train.trigger_parameter_sync_step": 4,
                                                  "train.require_batches": 4, "mode": "fully_async",
                                                  **_memory(16384)}),
    ("train_tool_agent_qwen3_8b.sh", 8, {"agent.func_path": "agents/python_tool_multi_turn.py",
                                         "agent.max_steps": 4, **_memory(16384)}),
    ("train_cpu_demo.sh", 0, {"device": "cpu", "mode": "fully_async", "train.partial_rollout_enable": True}),
])
def test_every_script_passes_its_dry_run_with_a_memory_plan_that_fits_80_gb(data_dir, script, gpus, expected):
    proc = _dry_run(script, data_dir, "--plan.device_memory_gb", "80")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("dry run: configuration valid"), proc.stdout[-2000:]
    report = json.loads(proc.stdout[: proc.stdout.rindex("\ndry run:")])
    assert report["resources"]["gpus"] == gpus
    for key, value in expected.items():
        section = report["config"]
        for part in key.split("."):
            section = section[part]
        assert section == value, key
    if script != "train_cpu_demo.sh":  # the GPU recipes train on DAPO-Math and evaluate on AIME, as prepared
        assert report["datasets"] == {"train_rows": 2, "eval_rows": 2}
        assert report["memory_plan"]["params"] > 7e9
    plan = report["memory_plan"]
    assert plan["checked"] and plan["trainer_rank"]["total"] <= plan["device_memory"] == 80 * 2**30


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_a_submitted_job_carries_the_network_variables_to_every_node(tmp_path, script):
    """Without --dry_run the script runs `ray job submit` (here a stand-in `ray` that prints its arguments): the
    job's runtime_env holds the repo and the network variables exported where it is submitted."""
    fake = tmp_path / "ray"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    network = {"NCCL_SOCKET_IFNAME": "ens5", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "GLOO_SOCKET_IFNAME": "ens5",
               "NCCL_DEBUG": "WARN"}
    env = {**{k: v for k, v in os.environ.items() if k not in network_env()}, **network,
           "PYTHON": sys.executable, "PATH": f"{tmp_path}:{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, script), "--train.max_steps", "3"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    assert runtime_env["working_dir"] == REPO and runtime_env["env_vars"] == network
    assert argv[argv.index("--") + 1:][:3] == ["python3", "-m", "openrlhf_async.cli.train_async"]
    assert argv[-2:] == ["--train.max_steps", "3"]


def test_a_dry_run_rejects_a_bad_override_with_one_line(data_dir):
    proc = _dry_run("train_dapo_qwen3_8b_async.sh", data_dir, "--rollout.max_new_tokens", "30000")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --rollout.max_new_tokens 30000 must be below --data.max_len 22528"


@pytest.mark.long  # 3 minutes (a Ray head of its own): make test-long; make test checks submit.sh's runtime_env
def test_the_cpu_demo_submitted_as_a_ray_job_succeeds(tmp_path):
    gcs, dashboard, *agents = (free_port() for _ in range(6))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    # --block ties the cluster's life to this process: terminating it stops only this cluster, not the test
    # session's own.
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--num-cpus", "2",
         "--disable-usage-stats", "--temp-dir", tempfile.mkdtemp(prefix="ray", dir="/tmp"),  # its own address file
         # Ports of their own: the test session's cluster, or any other on the machine, holds the defaults.
         *(f"--{flag}={port}" for flag, port in zip(
             ["dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
              "metrics-export-port"], agents))], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 180
        while True:  # ready once the head's job agent takes a trivial job
            probe = subprocess.run(["ray", "job", "submit", "--address", address, "--", "true"], env=env,
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
            assert head.poll() is None and time.time() < deadline, probe.stderr[-2000:]
            time.sleep(2)
        runs = tmp_path / "runs"
        proc = subprocess.run(
            ["bash", os.path.join(SCRIPTS, "train_cpu_demo.sh"), "--run_name", "job", "--train.max_steps", "2",
             "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16",
             "--rollout.vllm_generate_batch_size", "8", "--eval.max_samples", "16",
             "--eval.n_samples_per_prompt", "2", "--eval.temperature", "1.0"],
            env={**env, "RAY_ADDRESS": address, "RUNS_DIR": str(runs)}, capture_output=True, text=True,
            timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert "succeeded" in proc.stdout + proc.stderr
        steps = [json.loads(line) for line in (runs / "job" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps] == [0, 1, 2] and "reward/mean" in steps[-1]
        for evaluated in (steps[0], steps[-1]):  # at start and at the end, on all 16 problems, 2 samples each
            for key, count in (("eval/mean@2", 32), ("eval/pass@2", 16)):  # a share of that many
                assert evaluated[key] * count == pytest.approx(round(evaluated[key] * count), abs=1e-6), key
        summary = json.loads((runs / "job" / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["mode"] == "fully_async"
    finally:
        head.terminate()
        head.wait(timeout=60)
