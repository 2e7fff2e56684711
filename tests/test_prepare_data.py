"""prepare_data on small files in the published schemas (DAPO-Math-17k, AIME 2024 x3, Skywork-OR1), run as the
real command; then the training loader and tokenizer read what it wrote."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openrlhf_async.data.prompts import load_prompts, tokenize_prompts

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def dapo_text(problem):
    """The user turn exactly as DAPO-Math-17k publishes it."""
    return ("Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n" + problem +
            '\n\nRemember to put your answer on its own line after "Answer:".')


def verl_row(content, truth, index, source="math_dapo", ability="MATH"):
    return {"data_source": source, "prompt": [{"content": content, "role": "user"}], "ability": ability,
            "reward_model": {"ground_truth": truth, "style": "rule-lean"}, "extra_info": {"index": index}}


# Rows 2, 6, 7 repeat earlier problems; row 3 has no ground truth; row 5's prompt is not text.
DAPO_ROWS = [verl_row(dapo_text("Find x if 2x = 4."), "2", "id-a"),
             verl_row(dapo_text("What is 3 squared?"), "9", "id-b"),
             verl_row(dapo_text("Find x if 2x = 4."), "2", "id-a"),
             verl_row(dapo_text("Unanswered problem."), None, "id-d"),
             verl_row(dapo_text("Compute 10 - 3."), "7", "id-c"),
             verl_row(None, "1", "id-e"),
             verl_row(dapo_text("Find x if 2x = 4."), "2", "id-a"),
             verl_row(dapo_text("What is 3 squared?"), "9", "id-b")]
DAPO_PROBLEMS = ["Find x if 2x = 4.", "What is 3 squared?", "Compute 10 - 3."]


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def prepare(*flags):
    proc = subprocess.run([sys.executable, "-m", "openrlhf_async.cli.prepare_data", *map(str, flags)],
                          capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    return proc, report


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_dapo_is_deduplicated_and_bad_rows_are_counted(tmp_path):
    src = write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS)
    proc, report = prepare("--dataset", "dapo-math-17k", "--input", src, "--output", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out" / "dapo-math-17k.jsonl"
    assert report == {"dataset": "dapo-math-17k", "rows_read": 8, "written": 3, "duplicates_dropped": 3,
                      "label_conflicts": 0, "bad_rows_skipped": 2, "first_bad_row": 3, "non_math_dropped": 0,
                      "files_skipped": 0, "output": str(out)}
    assert read_jsonl(out) == [
        {"prompt": dapo_text(p), "label": label, "id": i, "source": "math_dapo"}
        for p, label, i in zip(DAPO_PROBLEMS, ["2", "9", "7"], ["id-a", "id-b", "id-c"])]
    assert "first is row 3, which has no ground truth" in proc.stdout


def test_dapo_instruction_system_prompt_no_dedup_and_max_samples(tmp_path):
    src = write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS)
    proc, report = prepare("--dataset", "dapo-math-17k", "--input", src, "--output", tmp_path / "a",
                           "--instruction", INSTRUCTION, "--system_prompt", "You are a careful mathematician.")
    assert proc.returncode == 0, proc.stderr
    prompts = [r["prompt"] for r in read_jsonl(tmp_path / "a" / "dapo-math-17k.jsonl")]
    assert prompts == [[{"role": "system", "content": "You are a careful mathematician."},
                        {"role": "user", "content": f"{p}\n\n{INSTRUCTION}"}] for p in DAPO_PROBLEMS]

    proc, report = prepare("--dataset", "dapo-math-17k", "--input", src, "--output", tmp_path / "b", "--no-dedup")
    assert (report["written"], report["duplicates_dropped"], report["bad_rows_skipped"]) == (6, 0, 2)

    proc, report = prepare("--dataset", "dapo-math-17k", "--input", src, "--output", tmp_path / "c",
                           "--max_samples", "2")
    assert (report["rows_read"], report["written"]) == (2, 2)
    assert len(read_jsonl(tmp_path / "c" / "dapo-math-17k.jsonl")) == 2


def test_another_preparation_never_replaces_the_file_unasked_the_same_one_is_no_change(tmp_path):
    src = write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS)
    out = tmp_path / "out" / "dapo-math-17k.jsonl"
    assert prepare("--dataset", "dapo-math-17k", "--input", src, "--output", tmp_path / "out")[0].returncode == 0
    first = out.read_bytes()
    assert prepare("--dataset", "dapo-math-17k", "--input", src, "--output", tmp_path / "out")[0].returncode == 0
    flags = ("--dataset", "dapo-math-17k", "--input", src, "--output", tmp_path / "out", "--instruction", INSTRUCTION)
    proc, _ = prepare(*flags)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {out} exists and holds another preparation (other flags or input): pass --overwrite to replace it, "
        "or write this one to another --output folder"]
    assert out.read_bytes() == first and sorted(p.name for p in out.parent.iterdir()) == ["dapo-math-17k.jsonl"]
    proc, report = prepare(*flags, "--overwrite")
    assert proc.returncode == 0 and INSTRUCTION in read_jsonl(out)[0]["prompt"]


def test_a_snapshot_folder_is_read_in_file_order_and_deduplicated_across_files(tmp_path):
    snapshot = tmp_path / "DAPO-Math-17k"
    write_parquet(snapshot / "data" / "train-00001-of-00002.parquet", DAPO_ROWS[4:])
    write_parquet(snapshot / "data" / "train-00000-of-00002.parquet", DAPO_ROWS[:4])
    (snapshot / "README.md").write_text("# DAPO")
    (snapshot / ".cache").mkdir()
    (snapshot / ".cache" / "meta.json").write_text("{}")
    proc, report = prepare("--dataset", "dapo-math-17k", "--input", snapshot, "--output", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    counts = report["rows_read"], report["written"], report["duplicates_dropped"], report["first_bad_row"]
    assert counts == (8, 3, 3, 3)
    assert [r["id"] for r in read_jsonl(tmp_path / "out" / "dapo-math-17k.jsonl")] == ["id-a", "id-b", "id-c"]


def test_aime24_in_each_published_layout(tmp_path):
    problem = "Find the number of ordered pairs."
    verl = write_parquet(tmp_path / "verl" / "aime-2024.parquet",
                         [verl_row(dapo_text(problem), "33", 0, source="math_dapo")])
    h4 = tmp_path / "h4.json"  # HuggingFaceH4/aime_2024 as a JSON array
    h4.write_text(json.dumps([{"id": 60, "problem": problem, "solution": "...", "answer": "033",
                               "url": "https://artofproblemsolving.com/", "year": "2024"},
                              {"id": 61, "problem": "No answer.", "solution": "", "answer": "", "url": "",
                               "year": "2024"}]))
    maxwell = tmp_path / "maxwell.jsonl"  # Maxwell-Jia/AIME_2024 as JSON lines; Answer is an integer
    maxwell.write_text(json.dumps({"ID": "2024-I-1", "Problem": problem, "Solution": "...", "Answer": 33}) + "\n")

    expected = {verl: {"prompt": dapo_text(problem), "label": "33", "id": "0", "source": "math_dapo"},
                h4: {"prompt": problem, "label": "033", "id": "60", "source": "HuggingFaceH4/aime_2024"},
                maxwell: {"prompt": problem, "label": "33", "id": "2024-I-1", "source": "Maxwell-Jia/AIME_2024"}}
    for i, (src, row) in enumerate(expected.items()):
        proc, report = prepare("--dataset", "aime24", "--input", src, "--output", tmp_path / f"out{i}")
        assert proc.returncode == 0, proc.stderr
        assert read_jsonl(tmp_path / f"out{i}" / "aime24.jsonl") == [row]
    assert report["written"] == 1
    proc, report = prepare("--dataset", "aime24", "--input", h4, "--output", tmp_path / "h4",
                           "--instruction", INSTRUCTION)
    assert (report["bad_rows_skipped"], report["first_bad_row"]) == (1, 1)
    assert read_jsonl(tmp_path / "h4" / "aime24.jsonl")[0]["prompt"] == f"{problem}\n\n{INSTRUCTION}"


def test_skywork_keeps_math_and_the_first_of_its_answers(tmp_path):
    rows = [verl_row("Compute 6+6.", '["12", "12.0"]', 0, source="train-math-deepscaler", ability="math"),
            verl_row("Write a sort.", '{"inputs": [], "outputs": []}', 1, source="train-code-taco", ability="code"),
            verl_row("Compute 2+2.", '["4"]', 2, source="train-math-still3", ability="math")]
    src = write_parquet(tmp_path / "skywork" / "data" / "math-00000-of-00001.parquet", rows)
    proc, report = prepare("--dataset", "skywork-or1", "--input", src, "--output", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert (report["written"], report["non_math_dropped"], report["bad_rows_skipped"]) == (2, 1, 0)
    assert read_jsonl(tmp_path / "out" / "skywork-or1.jsonl") == [
        {"prompt": "Compute 6+6.", "label": "12", "id": "0", "source": "train-math-deepscaler",
         "answers": ["12", "12.0"]},
        {"prompt": "Compute 2+2.", "label": "4", "id": "2", "source": "train-math-still3", "answers": ["4"]}]


@pytest.mark.parametrize("dataset, expected", [
    ("dapo-math-17k", "expected verl-style Parquet (prompt, reward_model)"),
    ("aime24", "or HuggingFaceH4/aime_2024 (problem, answer) or Maxwell-Jia/AIME_2024 (Problem, Answer)"),
])
def test_an_unknown_schema_is_a_one_line_error_listing_expected_and_found_columns(tmp_path, dataset, expected):
    src = write_parquet(tmp_path / "gsm8k.parquet", [{"question": "1+1?", "solution": "2"}])
    proc, _ = prepare("--dataset", dataset, "--input", src, "--output", tmp_path / "out")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and err.startswith("error: --input ") and len(err.splitlines()) == 1, err
    assert "columns ['question', 'solution']" in err and expected in err, err
    assert not (tmp_path / "out" / f"{dataset}.jsonl").exists()


def test_a_missing_input_is_a_one_line_error(tmp_path):
    proc, _ = prepare("--dataset", "aime24", "--input", tmp_path / "nope", "--output", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: --input {tmp_path / 'nope'}: no such file or folder"


def test_the_loader_and_tokenizer_read_the_prepared_file(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    src = write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS)
    proc, report = prepare("--dataset", "dapo-math-17k", "--input", src, "--output", tmp_path / "out",
                           "--instruction", "Answer:", "--system_prompt", "Be brief.")
    rows = load_prompts(report["output"], "prompt", "label", "--data.prompt_dataset")
    assert [r["label"] for r in rows] == ["2", "9", "7"]
    assert rows[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Find x if 2x = 4.\n\nAnswer:"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = tokenize_prompts(tokenizer, rows, apply_chat_template=True)
    # The tiny template has no system role: it renders the system turn as a user turn; its alphabet is printable ASCII,
    # so the newlines are dropped and the spaces kept.
    assert tokenizer.decode(prompts[0]["prompt_ids"]) == "<|user|>Be brief.<|user|>Find x if 2x = 4.Answer:<|assistant|>"
    plain = tokenize_prompts(tokenizer, rows, apply_chat_template=False)
    assert tokenizer.decode(plain[0]["prompt_ids"]) == "Be brief.Find x if 2x = 4.Answer:"


def test_bad_jsonl_lines_are_skipped_and_counted_not_fatal(tmp_path):
    good = [{"problem": "What is 2+2?", "answer": "4"}, {"problem": "What is 3+3?", "answer": "6"}]
    src = tmp_path / "aime.jsonl"
    src.write_bytes(b"\n".join([json.dumps(good[0]).encode(), b"{not json", b'{"problem": "\xff\xfe", "answer": 1}',
                                b"[" * 100_000 + b"]" * 100_000, json.dumps(good[1]).encode()]) + b"\n")
    proc, report = prepare("--dataset", "aime24", "--input", src, "--output", tmp_path / "out")
    assert proc.returncode == 0 and (report["written"], report["bad_rows_skipped"], report["first_bad_row"]) == (2, 3, 1)
    assert "skipped 3 bad rows (the first is row 1, which is not valid JSON" in proc.stdout


def test_every_supported_file_in_a_folder_is_converted(tmp_path):
    snapshot = tmp_path / "DAPO-Math-17k"
    write_parquet(snapshot / "data" / "train-00000-of-00001.parquet", DAPO_ROWS[:4])
    (snapshot / "extra").mkdir()
    (snapshot / "extra" / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DAPO_ROWS[4:]))
    proc, report = prepare("--dataset", "dapo-math-17k", "--input", snapshot, "--output", tmp_path / "out")
    assert proc.returncode == 0 and (report["rows_read"], report["written"]) == (8, 3), proc.stderr
