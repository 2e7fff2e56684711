"""Prompt datasets in JSONL and Parquet, their tokenisation, and the sampler's epoch order."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openrlhf_async.config import ConfigError
from openrlhf_async.data.prompts import PromptSampler, StreamProgress, load_prompts, tokenize_prompts


def test_parquet_chat_messages_are_kept_whole_with_their_system_turn(tmp_path):
    path = tmp_path / "train.parquet"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
    pq.write_table(pa.table({"prompt": [messages], "answer": ["3"]}), path)
    assert load_prompts(str(path), "prompt", "answer", "--data.prompt_dataset") == [{"prompt": messages, "label": "3"}]


def test_jsonl_labels_become_text_and_max_samples_applies(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1=", "a": i + 1}) + "\n" for i in range(5)))
    rows = load_prompts(str(path), "q", "a", "--data.prompt_dataset", max_samples=3)
    assert rows == [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(3)]


def test_bad_rows_are_skipped_and_reported_once(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"},
            {"prompt": "2+2="},  # no label
            {"prompt": [{"role": "user", "content": None}], "label": "5"},  # not text
            {"prompt": [{"role": "system", "content": "only a system turn"}], "label": "5"},
            {"prompt": "3+3=", "label": None},
            {"prompt": "4+4=", "label": 8}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = load_prompts(str(path), "prompt", "label", "--data.prompt_dataset")
    assert out == [{"prompt": "1+1=", "label": "2"}, {"prompt": "4+4=", "label": "8"}]
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--data.prompt_dataset {path}: skipped 4 rows" in err and "the first is row 1" in err, err


def test_a_dataset_without_one_usable_row_is_an_error_naming_the_fields_and_flags(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError) as e:
        load_prompts(str(path), "prompt", "label", "--eval.dataset")
    message = str(e.value)
    assert message.startswith(f"--eval.dataset {path}: row 0 has no 'prompt' or 'label' field"), message
    assert "--data.input_key / --data.label_key" in message and "\n" not in message


class RecordingTokenizer:
    """Stands in for a HF tokenizer: one id per character, the chat template marks each turn's role."""

    def __init__(self):
        self.chats = []

    def encode(self, text):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict
        self.chats.append(messages)
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


def test_tokenize_text_and_message_prompts_with_and_without_the_chat_template():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    rows = [{"prompt": "P", "label": "1"}, {"prompt": messages, "label": "2"}]
    tok = RecordingTokenizer()
    templated = tokenize_prompts(tok, rows, apply_chat_template=True)
    assert [bytes(p["prompt_ids"]).decode() for p in templated] == ["<user>P<assistant>",
                                                                   "<system>S<user>Q<assistant>"]
    assert tok.chats[1] is messages and [p["label"] for p in templated] == ["1", "2"]
    plain = tokenize_prompts(RecordingTokenizer(), rows, apply_chat_template=False)
    assert [bytes(p["prompt_ids"]).decode() for p in plain] == ["P", "S\nQ"]


def test_sampler_visits_every_prompt_once_per_epoch_reproducibly():
    rows = [{"prompt": str(i)} for i in range(10)]
    sampler = PromptSampler(rows, seed=1)
    drawn = [sampler.next() for _ in range(20)]
    assert [d["position"] for d in drawn] == list(range(20))
    for epoch in (drawn[:10], drawn[10:]):
        assert sorted(d["prompt"] for d in epoch) == sorted(r["prompt"] for r in rows)
    assert [d["prompt"] for d in drawn[:10]] != [d["prompt"] for d in drawn[10:]], "epochs are shuffled anew"
    assert all(rows[d["id"]]["prompt"] == d["prompt"] for d in drawn)
    again = PromptSampler(rows, seed=1)
    assert [again.next()["id"] for _ in range(20)] == [d["id"] for d in drawn]


def test_a_resumed_sampler_continues_the_stream_skipping_only_what_was_used():
    rows = [{"prompt": str(i)} for i in range(7)]
    # Positions 0-4 and 7 were used (7 finished while 5 and 6 still ran); 5, 6 and 8 on must still come.
    progress = StreamProgress()
    progress.add([1, 0, 7])
    progress.add([2, 4, 3])
    assert progress.state() == {"frontier": 5, "done": [7], "flat": []}
    resumed = PromptSampler(rows, 3, **progress.state())
    rest = [resumed.next() for _ in range(5)]
    assert [r["position"] for r in rest] == [5, 6, 8, 9, 10]
    fresh = PromptSampler(rows, seed=3)
    expected = {}
    for _ in range(11):
        d = fresh.next()
        expected[d["position"]] = d["id"]
    assert all(r["id"] == expected[r["position"]] for r in rest), "a position names the same prompt after resume"


def test_flat_prompts_are_skipped_at_their_rate_and_come_back_once_they_vary():
    rows = [{"prompt": str(i)} for i in range(20)]
    sampler = PromptSampler(rows, seed=4, skip_flat=0.75)
    sampler.record([(i, True) for i in range(10)] + [(3, False)])  # rows 0-9 flat, then 3 varied after all
    assert sampler.flat == set(range(10)) - {3}
    drawn = [sampler.next() for _ in range(20 * 40)]
    skipped = sampler.take_skipped()
    assert sampler.take_skipped() == []
    # Nothing is lost: every position up to the last drawn is either drawn or passed over, once.
    positions = sorted([d["position"] for d in drawn] + [p for p, _ in skipped])
    assert positions == list(range(positions[-1] + 1))
    assert all(rows[i]["prompt"] == str(i) for _, i in skipped)
    assert {i for _, i in skipped} == set(range(10)) - {3}, "only prompts whose last group was flat are skipped"
    epochs = (positions[-1] + 1) / len(rows)
    for row in range(20):
        share = sum(d["id"] == row for d in drawn) / epochs
        assert (0.1 < share < 0.45) if row in sampler.flat else abs(share - 1) < 0.05, (row, share)
    # A resumed sampler with the same record of flat prompts decides the same way.
    progress = StreamProgress()
    progress.add(range(100), [(i, True) for i in range(10)] + [(3, False)])
    resumed = PromptSampler(rows, 4, skip_flat=0.75, **progress.state())
    expected = [d["position"] for d in drawn if d["position"] >= 100][:50]
    assert [resumed.next()["position"] for _ in range(50)] == expected
