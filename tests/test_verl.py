"""veRL users' files run unchanged: a reward file defining `compute_score(data_source, solution_str, ground_truth,
extra_info=None)` and veRL-format Parquet rows (a chat-message prompt, reward_model.ground_truth, data_source,
extra_info), read with a dotted --data.label_key."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openrlhf_async.agent import AgentFileError, load_agent
from openrlhf_async.cli.train_async import main
from openrlhf_async.config import ConfigError, preset_path
from openrlhf_async.data.prompts import load_prompts, tokenize_prompts
from openrlhf_async.reward.sources import RewardError, make_reward
from openrlhf_async.rollout.episode import Episode
from openrlhf_async.rollout.group_runner import rescored

# Scores as the math agent never would (it gives 0 or 1), so that a run's logged scores show whose they are; each call
# is recorded beside the file, from whichever process (thread or reward worker) made it.
SCORE_FILE = """
import json, os

RIGHT, WRONG = 1.0, 0.125


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                            "extra_info": extra_info}) + "\\n")
    score = RIGHT if solution_str.strip() == ground_truth else WRONG
    return {"score": score, "verl_marker": 7.0, "note": "not a number: left out of the logs"}
"""


def _write(folder, name: str, text: str) -> str:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _verl_rows(pairs) -> list:
    """veRL's data format (its gsm8k preprocessing's), one row per "a+b=" prompt."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{a}+{b}="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i, "answer": str(a + b)}} for i, (a, b) in enumerate(pairs)]


def _parquet(folder, pairs) -> str:
    path = str(folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_verl_rows(pairs)), path)
    return path


def _calls(folder) -> list:
    return [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_compute_score_file_scores_each_sample_with_its_row_data_source_and_extra_info(tmp_path, workers):
    reward = make_reward(_write(tmp_path, "score.py", SCORE_FILE), workers=workers)
    info = {"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": 3}}
    try:
        results = asyncio.run(reward.score(["q 72", "q 7"], ["q", "q"], ["72", "8"], responses=["72", "7"],
                                           infos=[info, None]))
    finally:
        asyncio.run(reward.close())
    assert [r["reward"] for r in results] == [1.0, 0.125] and [r["score"] for r in results] == [1.0, 0.125]
    assert all(r["extra"] == {"verl_marker": 7.0} for r in results)  # numbers logged, the text left out
    assert _calls(tmp_path) == [
        {"data_source": "openai/gsm8k", "solution_str": "72", "ground_truth": "72", "extra_info": info["extra_info"]},
        {"data_source": "unknown", "solution_str": "7", "ground_truth": "8", "extra_info": {}}]


def test_a_compute_score_returning_a_number_or_an_async_one_is_the_reward_and_a_dict_needs_a_score(tmp_path):
    plain = make_reward(_write(tmp_path, "plain.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.5 if solution_str == ground_truth else -0.5
    """), workers=0)
    waiting = make_reward(_write(tmp_path, "waiting.py", """
        async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return len(data_source)
    """))
    unscored = make_reward(_write(tmp_path, "unscored.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"acc": 1.0}
    """), workers=0)
    # Without the response text (a reward service's call), it is the query less its prompt.
    assert [r["reward"] for r in asyncio.run(plain.score(["q 4", "q 5"], ["q ", "q "], ["4", "4"]))] == [0.5, -0.5]
    scored = asyncio.run(waiting.score(["q"], ["q"], ["1"], responses=["1"], infos=[{"data_source": "abc"}]))
    assert scored[0]["reward"] == 3.0
    with pytest.raises(RewardError) as e:
        asyncio.run(unscored.score(["q"], ["q"], ["1"], responses=["1"], infos=[{}]))
    assert "returned a dict without 'score' (keys: acc)" in str(e.value) and "\n" not in str(e.value)


class _Tokenizer:
    """Token i is chr(i); id 0 is a special token (the end of a turn)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<eos>" if i == 0 else chr(i) for i in ids if i or not skip_special_tokens)


def test_an_episode_is_rescored_with_its_response_text_and_its_rows_info(tmp_path):
    reward = make_reward(_write(tmp_path, "score.py", SCORE_FILE), workers=0)

    async def episode():
        return Episode(request_id="r", prompt_ids=[ord(c) for c in "1+2="], response_ids=[ord("3"), 0],
                       logprobs=[0.0, 0.0], action_mask=[1, 1], reward=0.0, raw_reward=0.0, score=0.0)

    info = {"data_source": "openai/gsm8k", "extra_info": {"index": 5}}
    ep = asyncio.run(rescored(episode(), reward, _Tokenizer(), "1+2=", "3", info))
    assert (ep.score, ep.raw_reward, ep.error) == (1.0, 1.0, None)
    assert ep.extra_info["verl_marker"] == 7.0
    assert _calls(tmp_path) == [{"data_source": "openai/gsm8k", "solution_str": "3", "ground_truth": "3",
                                 "extra_info": {"index": 5}}]


class _ChatTokenizer:
    def apply_chat_template(self, messages, **kwargs):
        return [ord(c) for m in messages for c in m["content"]]


def test_verl_parquet_rows_give_chat_prompts_nested_labels_and_their_info(tmp_path):
    path = _parquet(tmp_path, [(1, 2), (30, 42)])
    rows = load_prompts(path, "prompt", "reward_model.ground_truth", "--data.prompt_dataset")
    assert [(r["prompt"], r["label"]) for r in rows] == [([{"role": "user", "content": "1+2="}], "3"),
                                                         ([{"role": "user", "content": "30+42="}], "72")]
    assert rows[1]["info"] == {"data_source": "openai/gsm8k",
                               "extra_info": {"split": "train", "index": 1, "answer": "72"}}
    # Dotted input keys too, and the info stays with the tokenised prompt, which the controller sends the engine.
    nested = tmp_path / "nested.jsonl"
    nested.write_text(json.dumps({"question": {"text": "5+5="}, "answer": {"value": 10}}) + "\n")
    (row,) = load_prompts(str(nested), "question.text", "answer.value", "--data.prompt_dataset")
    assert (row["prompt"], row["label"], "info" in row) == ("5+5=", "10", False)
    (tokenised,) = tokenize_prompts(_ChatTokenizer(), rows[1:], apply_chat_template=True)
    assert tokenised["info"] == rows[1]["info"] and tokenised["label"] == "72"


def test_a_missing_dotted_key_is_one_line_at_the_dry_run_naming_the_flag_the_file_and_the_rows_fields(tmp_path,
                                                                                                     capsys):
    path = _parquet(tmp_path, [(1, 2), (3, 4)])
    flags = ["@" + preset_path("tiny_cpu"), "--runs_dir", str(tmp_path / "runs"), "--no-progress", "--dry_run",
             "--data.prompt_dataset", path, "--data.input_key", "prompt"]
    assert main([*flags, "--data.label_key", "reward_model.ground_truht"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: --data.prompt_dataset {path}: row 0 has no "), err
    assert "no --data.label_key reward_model.ground_truht: the row has data_source, prompt, ability, reward_model, " \
           "extra_info; reward_model has style, ground_truth" in err, err
    assert main([*flags, "--data.label_key", "reward_model.ground_truth"]) == 0
    with pytest.raises(ConfigError):  # the same refusal, wherever the rows are read
        load_prompts(path, "question", "reward_model.ground_truth", "--eval.dataset")


def test_a_reward_file_given_as_the_agent_says_which_flag_takes_it(tmp_path):
    path = _write(tmp_path, "score.py", SCORE_FILE)
    with pytest.raises(AgentFileError) as e:
        load_agent(path)
    assert str(e.value) == (f"--train.agent_func_path {path}: is a reward file (compute_score or reward_func), not an "
                            f"agent; pass it as --reward.remote_url {path}")


def test_a_verl_parquet_file_and_compute_score_file_train_two_steps_through_the_cli(tmp_path):
    pairs = [(a, b) for a in range(10, 30) for b in range(1, 4)]
    data, reward = _parquet(tmp_path, pairs), _write(tmp_path, "score.py", SCORE_FILE)
    command = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"), "--mode", "sync",
               "--data.prompt_dataset", data, "--data.input_key", "prompt",
               "--data.label_key", "reward_model.ground_truth", "--reward.remote_url", reward, "--train.seed", "7",
               "--train.max_steps", "2", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4",
               "--train.batch_size", "16", "--train.micro_batch_size", "16", "--no-algo.dynamic_filtering_enable",
               "--runs_dir", str(tmp_path / "runs"), "--run_name", "verl", "--no-progress"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=400, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "verl"
    steps = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["rollout/extra/verl_marker"] == 7.0 for m in steps), steps  # compute_score's own extra metric
    samples = [s for s in map(json.loads, (run / "samples.jsonl").read_text().splitlines()) if s["kind"] == "train"]
    assert samples and all(s["score"] in (1.0, 0.125) for s in samples), samples  # its scores, not the agent's 0/1
    calls = _calls(tmp_path)
    assert len(calls) >= 2 * 16
    truths = {i: str(a + b) for i, (a, b) in enumerate(pairs)}
    for call in calls:  # each call got its own row's data_source and extra_info, and the response without specials
        assert call["data_source"] == "openai/gsm8k" and call["extra_info"]["split"] == "train", call
        assert truths[call["extra_info"]["index"]] == call["ground_truth"] == call["extra_info"]["answer"], call
        assert "<|" not in call["solution_str"], call
