"""An OpenRLHF user's launch script, with only the module name swapped: OpenRLHF 0.11's asynchronous multi-turn
agent recipe (train_reinforce_baseline_ray_agent_async.sh), its flags kept and only engines, ranks and sizes scaled
to 2 CPU cores, validated with --dry_run and then trained for 2 steps on the real stack."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import dry_run_in_process

# An AgentExecutor as OpenRLHF 0.11's example writes one: a random environment of 1 to 3 turns whose last turn
# rewards 0 or 1 at random, and extra_logs.
AGENT = '''
import random

import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = random.randint(1, 3)

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        done = self.step_idx >= self.max_steps
        reward = torch.randint(0, 2, (1,)).float() if done else torch.tensor(0)
        feedback = "\\n=ok\\n" if done else "\\n=no, again\\n"
        self.step_idx += 1
        return {"rewards": reward, "scores": reward, "environment_feedback": feedback, "done": done,
                "sampling_params": states.get("sampling_params", None), "extra_logs": {"dummy_scores": reward}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


# The script's sizes as written, and as scaled to 2 CPU cores.
WRITTEN = {"max_len": 74240, "max_new_tokens": 64000, "rollout_batch": 128, "n": 8, "train_batch": 1024, "ranks": 4,
           "engines": 2, "engine_tp": 2}
SCALED = {"max_len": 256, "max_new_tokens": 48, "rollout_batch": 4, "n": 4, "train_batch": 16, "ranks": 2,
          "engines": 1, "engine_tp": 1}


def openrlhf_script_flags(model: str, dataset: str, agent: str, save: str, size: dict = SCALED) -> list:
    """The script's flags in its order, at its own sizes (WRITTEN) or scaled (SCALED: 4 + 4 GPUs and 2 engines of
    tensor parallel 2 become 2 CPU ranks each and 1 engine)."""
    return [str(flag) for flag in [
        # CKPT_ARGS
        "--actor.model_name_or_path", model, "--ckpt.load_enable", "--ckpt.output_dir", save,
        "--ckpt.path", f"{save}/ckpt", "--ckpt.save_hf", "--ckpt.max_num", "3", "--ckpt.save_steps", "10",
        # ROLLOUT_ARGS
        "--train.agent_func_path", agent, "--data.prompt_dataset", dataset, "--data.input_key", "prompt",
        "--data.label_key", "label", "--data.max_len", size["max_len"], "--rollout.max_new_tokens",
        size["max_new_tokens"], "--data.apply_chat_template", "--ds.packing_samples", "--rollout.batch_size",
        size["rollout_batch"], "--rollout.n_samples_per_prompt", size["n"], "--train.batch_size", size["train_batch"],
        "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.0", "1.0",
        "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "16192", "--rollout.max_tokens_per_gpu",
        "32768", "--train.micro_batch_size", "1", "--rollout.micro_batch_size", "8", "--data.max_samples", "128000",
        "--train.max_epochs", "1", "--train.num_episodes", "1",
        # ENGINE_ARGS
        "--train.async_enable", "--train.partial_rollout_enable", "--ref.num_nodes", "1", "--ref.num_gpus_per_node",
        size["ranks"], "--actor.num_nodes", "1", "--actor.num_gpus_per_node", size["ranks"], "--vllm.num_engines",
        size["engines"], "--vllm.tensor_parallel_size", size["engine_tp"], "--vllm.gpu_memory_utilization", "0.95",
        "--train.colocate_all", "--ds.enable_sleep", "--vllm.sync_backend", "nccl", "--vllm.enforce_eager",
        "--ds.zero_stage", "3", "--actor.gradient_checkpointing_enable", "--ds.ring_attn_size", "2",
        "--ds.ring_attn_head_stride", "2", "--ds.param_dtype", "bf16",
        # OPTIMIZER_ARGS
        "--algo.advantage.estimator", "reinforce_baseline", "--actor.adam.lr", "5e-7", "--actor.entropy_coef", "0.0",
        "--algo.kl.init_coef", "1e-5", "--algo.kl.use_loss", "--algo.kl.estimator", "k2",
        "--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "icepop",
        # LOG_ARGS
        "--logger.tensorboard_dir", f"{save}/runs", "--logger.logging_steps", "1", "--eval.steps", "-1",
    ]]


@pytest.fixture
def workspace(tmp_path, tiny_model_path):
    """The script's inputs as local copies: 8 prompts (2 steps of 4), the agent file, a save folder."""
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for a in range(8):
            f.write(json.dumps({"prompt": f"{a}+{a + 1}=", "label": str(2 * a + 1)}) + "\n")
    (tmp_path / "agent_func.py").write_text(AGENT)
    flags = openrlhf_script_flags(tiny_model_path, str(tmp_path / "prompts.jsonl"), str(tmp_path / "agent_func.py"),
                                  str(tmp_path / "exp"))
    return tmp_path, flags


def _run(cwd, flags, timeout):
    return subprocess.run([sys.executable, "-m", "openrlhf_async.cli.train_async", *flags], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "RAY_ADDRESS": ""})


def test_openrlhfs_async_agent_script_passes_a_dry_run_as_written_with_its_sequence_parallelism(workspace):
    """--ds.ring_attn_size 2 splits each packed row across 2 ranks (trainer/sequence_parallel.py); the dry run passes
    with a notice for each flag that has no effect here."""
    cwd, flags = workspace
    proc = dry_run_in_process([*flags, "--dry_run"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notices = [line for line in proc.stderr.splitlines() if line.startswith("notice: ")]
    for flag in ("--ds.ring_attn_head_stride", "--ds.enable_sleep", "--ref.num_gpus_per_node",
                 "importance-sampling correction icepop"):
        assert any(flag in line for line in notices), (flag, notices)
    report = json.loads(proc.stdout[: proc.stdout.rindex("\ndry run:")])
    # Its packed token-budget batches are built here: taken as they are, without a notice.
    assert not any("packing" in line or "dynamic_batch" in line for line in notices), notices
    config = report["config"]
    assert config["ds"]["packing_samples"] and config["train"]["dynamic_batch_enable"]
    assert config["ds"]["ring_attn_size"] == 2
    assert (config["train"]["max_tokens_per_gpu"], config["rollout"]["max_tokens_per_gpu"]) == (16192, 32768)
    assert report["config"]["mode"] == "fully_async" and report["config"]["algo"]["is_correction_mode"] == "mask"
    assert report["datasets"]["train_rows"] == 8


def test_the_scripts_74k_token_context_on_80_gb_gpus_with_and_without_sequence_parallelism(workspace):
    """The script at its own sizes (Qwen3-4B-Thinking-2507's shape, 74,240-token rows, 4 ranks, 80 GB GPUs): with
    --ds.ring_attn_size 2 each rank holds half of the longest row, and no [T, T] attention mask."""
    cwd, _ = workspace
    model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs", "Qwen3-4B-Thinking-2507")
    flags = openrlhf_script_flags(model, str(cwd / "prompts.jsonl"), str(cwd / "agent_func.py"), str(cwd / "exp"),
                                  WRITTEN)
    plans = {}
    for n in (1, 2):
        proc = dry_run_in_process([*flags, "--ds.ring_attn_size", str(n), "--dry_run", "--device", "cuda",
                                   "--plan.device_memory_gb", "80"], cwd)
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans[n] = json.loads(proc.stdout[: proc.stdout.rindex("\ndry run:")])["memory_plan"]
    one, two = plans[1]["trainer_rank"], plans[2]["trainer_rank"]
    assert plans[1]["setup"]["train_tokens"] == 74240 and plans[2]["setup"]["train_tokens"] == 37120
    assert one["attention_mask"] > 10 * 2**30 and two["attention_mask"] == 0
    assert two["activations"] < 0.6 * one["activations"]
    for part in ("weights", "gradients", "optimizer", "reference"):
        assert one[part] == two[part], part
    assert two["total"] < one["total"] <= 80 * 2**30


@pytest.mark.long  # 100 s: make test-long; make test dry-runs the script and trains agents through the same executor
def test_openrlhfs_async_agent_script_trains_two_steps_on_cpu(workspace):
    cwd, flags = workspace
    proc = _run(cwd, flags, 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = cwd / "runs" / "run"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]  # 8 prompts / 4 per step, one episode; --eval.steps -1: no eval
    for m in steps:
        assert all(math.isfinite(m[k]) for k in ("loss", "kl", "entropy", "grad_norm", "lr"))
        assert "rollout/extra/dummy_scores" in m  # the agent's extra_logs
    # The agent's later turns: environment tokens in the responses, masked out of the loss.
    assert sum(m["rollout/observation_len_mean"] for m in steps) > 0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert any(len(row["turns"]) > 1 for row in samples)
    assert (cwd / "exp" / "config.json").is_file()  # the final model in --ckpt.output_dir
    assert any((cwd / "exp" / "runs").iterdir())  # TensorBoard events in --logger.tensorboard_dir


def test_a_command_line_in_openrlhfs_older_spellings_reads_as_todays_flags_with_one_notice_per_old_flag(
        tmp_path, tiny_model_path):
    """OpenRLHF before 0.10.2 spelled its flags flat (--pretrain, --prompt_data, ...); OpenRLHF 0.11 refuses them,
    this project reads them as today's flags (a dry run: the settings it resolves; every other CLI test trains on
    today's spellings)."""
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for a in range(4):
            f.write(json.dumps({"question": f"{a}+{a}=", "answer": str(2 * a)}) + "\n")
    old = ["--pretrain", tiny_model_path, "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "question",
           "--label_key", "answer", "--apply_chat_template", "--max_len", "256", "--max_new_tokens", "8",
           "--rollout_batch_size", "4", "--n_samples_per_prompt", "4", "--train_batch_size", "16",
           "--micro_train_batch_size", "8", "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
           "--actor_learning_rate", "1e-5", "--vllm_num_engines", "1", "--actor_num_gpus_per_node", "2",
           "--zero_stage", "3", "--param_dtype", "fp32", "--enforce_eager", "--save_path", str(tmp_path / "out"),
           "--ckpt_path", str(tmp_path / "ckpt"), "--eval_steps", "-1", "--async_train",
           "--use_tensorboard", str(tmp_path / "tb"), "--packing_samples", "--ring_attn_size", "2",
           "--ring_head_stride", "2"]
    proc = dry_run_in_process([*old, "--dry_run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notices = [line for line in proc.stderr.splitlines() if line.startswith("notice: ")]
    spelled = [arg for arg in old if arg.startswith("--")]
    assert [line.split()[1] for line in notices if "old spelling" in line] == spelled, notices
    report = json.loads(proc.stdout[: proc.stdout.rindex("\ndry run:")])
    c = report["config"]
    assert c["mode"] == "async" and c["actor"]["model_name_or_path"] == tiny_model_path
    assert (c["data"]["prompt_dataset"], c["data"]["input_key"], c["data"]["label_key"]) == (
        str(tmp_path / "prompts.jsonl"), "question", "answer")
    assert (c["rollout"]["batch_size"], c["rollout"]["n_samples_per_prompt"], c["train"]["batch_size"],
            c["train"]["micro_batch_size"], c["rollout"]["max_new_tokens"]) == (4, 4, 16, 8, 8)
    assert (c["actor"]["adam_lr"], c["algo"]["kl_init_coef"], c["ds"]["zero_stage"]) == (1e-5, 0, 3)
    assert c["ds"]["ring_attn_size"] == 2 and c["ds"]["packing_samples"]
    assert (c["ckpt"]["output_dir"], c["ckpt"]["path"], c["logger"]["tensorboard_dir"]) == (
        str(tmp_path / "out"), str(tmp_path / "ckpt"), str(tmp_path / "tb"))
    assert report["datasets"]["train_rows"] == 4
