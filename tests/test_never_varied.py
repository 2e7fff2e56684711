"""A run whose scores never vary learns nothing (every advantage is 0), and says so in those words with the likely
causes, rather than ending as if it had trained or calling the task learned: here every label is one no answer
matches, so math-verify scores every sample 0."""

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

from openrlhf_async.config import preset_path


@pytest.fixture(scope="module")
def unmatched_labels(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "unmatched.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": "no answer"}) + "\n"
                            for a in range(10, 40) for b in range(3)))
    return str(path)


def run(runs_dir, dataset: str, filtering: bool):
    command = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"), "--mode", "sync",
               "--data.prompt_dataset", dataset, "--train.max_steps", "2", "--rollout.batch_size", "4",
               "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16", "--train.micro_batch_size", "16",
               "--algo.dynamic_filtering_max_num_gen_batches", "2", "--runs_dir", str(runs_dir), "--run_name", "flat",
               "--no-progress"]
    if not filtering:
        command.append("--no-algo.dynamic_filtering_enable")
    return subprocess.run(command, capture_output=True, text=True, timeout=400, env={**os.environ, "RAY_ADDRESS": ""})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, unmatched_labels):
    """Both runs, side by side (a CLI run uses about 70% of 2 cores): {filtering: (its runs folder, its process)}."""
    folders = {filtering: tmp_path_factory.mktemp(f"filtering_{filtering}") for filtering in (False, True)}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {f: pool.submit(run, folder, unmatched_labels, f) for f, folder in folders.items()}
        yield {f: (folders[f], future) for f, future in futures.items()}


@pytest.mark.parametrize("filtering", [False, True])
def test_a_run_whose_scores_never_vary_says_so(runs, filtering):
    tmp_path, proc = runs[filtering][0], runs[filtering][1].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = "the scores have never varied in this run: all "
    causes = "check the prompt template (--data.apply_chat_template, --data.input_template), the labels"
    if filtering:  # dynamic sampling finds no group to keep: the run stops at once, with the reason
        assert "the run ends before step 1 of 2: " + said in proc.stdout, proc.stdout[-2000:]
        assert "samples scored 0" in proc.stdout and causes in proc.stdout
    else:  # it trains both steps on zero advantages, then says why nothing was learned
        assert "warning: " + said + "32 samples scored 0" in proc.stdout, proc.stdout[-2000:]
        assert causes in proc.stdout
        records = [json.loads(line) for line in (tmp_path / "flat" / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in records if "loss" in m]
        assert [m["step"] for m in steps] == [1, 2] and all(m["loss"] == 0 for m in steps)
