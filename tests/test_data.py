"""Prompt datasets from files, dataset folders, the Hub and mixtures, their tokenisation, and the sampler's epoch
order."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openrlhf_async.config import ConfigError
from openrlhf_async.data.prompts import (
    PromptSampler,
    StreamProgress,
    check_input_template,
    load_prompts,
    tokenize_prompts,
)


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """datasets caches what it reads; each test keeps its cache to itself."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def rows_of(tag: str, n: int) -> list:
    return [{"input": f"{tag}{i}", "label": str(i)} for i in range(n)]


def write(path, rows: list) -> str:
    """rows into path in the format its extension names; returns the path as text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    return str(path)


def load(spec, **options) -> list:
    return load_prompts(spec, "input", "label", "--data.prompt_dataset", **options)


def as_prompts(rows: list) -> list:
    return [{"prompt": r["input"], "label": r["label"]} for r in rows]


@pytest.mark.parametrize("name", ["train.jsonl", "train.json", "train.parquet", "train.csv"])
def test_each_file_type_loads_its_rows_in_order(tmp_path, name):
    rows = rows_of("q", 3)
    assert load(write(tmp_path / name, rows)) == as_prompts(rows)


@pytest.mark.parametrize("layout", ["data/{}-00000-of-00001.parquet", "{}.jsonl"])
def test_a_folder_in_the_hubs_layout_gives_the_split_named_after_the_at(tmp_path, layout):
    folder = tmp_path / "dataset"
    write(folder / layout.format("train"), rows_of("train", 2))
    write(folder / layout.format("test"), rows_of("test", 3))
    assert load(str(folder)) == as_prompts(rows_of("train", 2))
    assert load(f"{folder}@test") == as_prompts(rows_of("test", 3))
    assert load(str(folder), split="test") == as_prompts(rows_of("test", 3))
    with pytest.raises(ConfigError) as e:
        load(f"{folder}@validation")
    assert str(e.value) == (f"--data.prompt_dataset {folder}: has no split 'validation', only train, test; "
                            "pick one as NAME@SPLIT")


def test_save_to_disk_folders_load_whole_or_by_split(tmp_path):
    datasets.Dataset.from_list(rows_of("a", 2)).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows_of("b", 1)),
                         test=datasets.Dataset.from_list(rows_of("c", 2))).save_to_disk(str(tmp_path / "splits"))
    assert load(str(tmp_path / "one")) == as_prompts(rows_of("a", 2))
    assert load(f"{tmp_path / 'splits'}@test") == as_prompts(rows_of("c", 2))


def test_a_mixture_samples_each_dataset_at_its_probability_as_openrlhf_does(tmp_path):
    a = write(tmp_path / "a.jsonl", rows_of("a", 150))
    b = write(tmp_path / "b.parquet", rows_of("b", 150))
    assert load(f"{a},{b}") == as_prompts(rows_of("a", 150) + rows_of("b", 150)), "no probs: concatenated"
    mixed = load(f"{a},{b}", probs="0.7,0.3", seed=5)
    share_a = sum(r["prompt"].startswith("a") for r in mixed) / len(mixed)
    assert 0.65 < share_a < 0.75, share_a
    assert {r["prompt"] for r in mixed} == {r["input"] for r in rows_of("a", 150) + rows_of("b", 150)}, \
        "sampled until every dataset is used up"
    # OpenRLHF interleaves the datasets themselves with the run's seed; the order must be the same.
    expected = datasets.interleave_datasets(
        [datasets.Dataset.from_list(rows_of("a", 150)), datasets.Dataset.from_list(rows_of("b", 150))],
        probabilities=[0.7, 0.3], seed=5, stopping_strategy="all_exhausted")
    assert mixed == as_prompts(expected.to_list())
    assert load(f"{a},{b}", probs="0.7,0.3", seed=6) != mixed
    assert len(load(f"{a},{b}", probs="0.7,0.3", seed=5, max_samples=50)) == 50, "max_samples caps the mixture"


@pytest.mark.parametrize("probs", ["0.7", "0.7,0.7", "0.7,x"])
def test_mixture_probabilities_must_match_the_datasets_and_sum_to_one(tmp_path, probs):
    a = write(tmp_path / "a.jsonl", rows_of("a", 2))
    with pytest.raises(ConfigError) as e:
        load(f"{a},{a}", probs=probs)
    assert str(e.value).startswith(f"--data.prompt_probs {probs}: give 2 probabilities summing to 1")


def test_a_hub_id_without_network_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # datasets reads the variable once, at import
    with pytest.raises(ConfigError) as e:
        load("zhuzilin/dapo-math-17k")
    message = str(e.value)
    assert message.startswith("--data.prompt_dataset zhuzilin/dapo-math-17k: is no local file or folder and could "
                              "not be fetched from the Hugging Face Hub"), message
    assert "give a local file or folder" in message and "\n" not in message, message


def test_a_missing_local_path_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(ConfigError, match=f"^--data.prompt_dataset {tmp_path}/nothing: no such file or folder$"):
        load(f"{tmp_path}/nothing")


def test_without_a_label_key_every_label_is_empty(tmp_path):
    path = write(tmp_path / "train.jsonl", [{"input": "1+1="}, {"input": "2+2=", "label": "4"}])
    assert load_prompts(path, "input", None, "--data.prompt_dataset") == [{"prompt": "1+1=", "label": ""},
                                                                         {"prompt": "2+2=", "label": ""}]


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


def test_input_template_wraps_the_text_only_without_the_chat_template():
    rows = [{"prompt": "1+1=", "label": "2"}]
    template = "Question: {}\nAnswer:"
    plain = tokenize_prompts(RecordingTokenizer(), rows, False, template)
    assert bytes(plain[0]["prompt_ids"]).decode() == "Question: 1+1=\nAnswer:"
    templated = tokenize_prompts(RecordingTokenizer(), rows, True, template)
    assert bytes(templated[0]["prompt_ids"]).decode() == "<user>1+1=<assistant>"


@pytest.mark.parametrize("template", ["Question:", "{} and {}", "{question}", "{"])
def test_an_input_template_without_one_place_for_the_prompt_is_an_error(template):
    check_input_template("Question: {}\nAnswer: {{curly}}")
    check_input_template(None)
    with pytest.raises(ConfigError, match=r"^--data.input_template .*: give one \{\} where the prompt goes"):
        check_input_template(template)


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
