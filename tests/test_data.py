"""Prompt datasets in JSONL and Parquet, and the sampler's epoch order."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from openrlhf_async.data.prompts import PromptSampler, load_prompts


def test_parquet_with_chat_messages(tmp_path):
    path = tmp_path / "train.parquet"
    table = pa.table({"prompt": [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]],
                      "answer": ["3"]})
    pq.write_table(table, path)
    assert load_prompts(str(path), "prompt", "answer", "--data.prompt_dataset") == [{"prompt": "1+2=", "label": "3"}]


def test_jsonl_labels_become_text_and_max_samples_applies(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1=", "a": i + 1}) + "\n" for i in range(5)))
    rows = load_prompts(str(path), "q", "a", "--data.prompt_dataset", max_samples=3)
    assert rows == [{"prompt": "0+1=", "label": "1"}, {"prompt": "1+1=", "label": "2"}, {"prompt": "2+1=", "label": "3"}]


def test_sampler_visits_every_prompt_once_per_epoch():
    rows = [{"prompt": str(i)} for i in range(10)]
    sampler = PromptSampler(rows, seed=1)
    first = [r["prompt"] for r in sampler.next_batch(4) + sampler.next_batch(6)]
    assert sorted(first) == sorted(r["prompt"] for r in rows)
    assert sampler.consumed == 10
    assert PromptSampler(rows, seed=1).next_batch(10) == [{"prompt": p} for p in first]
