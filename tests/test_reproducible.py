"""Same seed, same run: two sync runs through the CLI with the same --train.seed and flags log the same metrics (their
timings aside) and end with the same weights; another seed samples other answers. Every vLLM request's seed derives
from the run's seed and the request's place (rollout/seeds.py), and without the first-to-finish early stop no batch
depends on which group finished first. The three runs go side by side (each its own Ray instance): no figure of a
sync run may depend on the timing, which running them beside each other also puts to the test."""

import concurrent.futures
import json
import os
import subprocess
import sys

from safetensors.torch import load_file

from openrlhf_async.config import preset_path

# What a step's record holds that measures time (or what time decides: the queue's depth) rather than the run.
TIMED = ("_s", "seconds", "per_s", "idle", "ratio", "tok_s", "time", "queue", "_wait")


def run(tmp_path, name: str, seed: int) -> tuple:
    command = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"), "--mode", "sync",
               "--no-rollout.early_stop", "--train.seed", str(seed), "--train.max_steps", "3",
               "--rollout.batch_size", "8", "--train.batch_size", "64", "--train.micro_batch_size", "16",
               "--eval.steps", "3", "--eval.max_samples", "48", "--runs_dir", str(tmp_path), "--run_name", name,
               "--no-progress"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=540, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    untimed = [{k: v for k, v in m.items() if not any(t in k for t in TIMED)} for m in steps]
    return untimed, load_file(str(tmp_path / name / "final_hf" / "model.safetensors"))


def test_two_sync_runs_with_one_seed_are_the_same_run_and_another_seed_is_not(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(run, tmp_path, name, seed) for name, seed in (("first", 7), ("again", 7), ("other", 8))]
        (first, weights), (again, weights_again), (other, weights_other) = [r.result() for r in runs]
    assert len(first) == 4 and "rollout/score_all_mean" in first[1] and "eval/accuracy" in first[-1]
    for step, (a, b) in enumerate(zip(first, again)):
        assert a == b, f"step {step}: " + ", ".join(f"{k} {a.get(k)} != {b.get(k)}" for k in sorted(set(a) | set(b))
                                                   if a.get(k) != b.get(k))
    assert weights.keys() == weights_again.keys()
    assert all(weights[k].equal(weights_again[k]) for k in weights)
    # Another seed: other prompts in another order, other samples, other weights.
    assert [m.get("rollout/score_all_mean") for m in other[1:]] != [m.get("rollout/score_all_mean") for m in first[1:]]
    assert not all(weights[k].equal(weights_other[k]) for k in weights)
