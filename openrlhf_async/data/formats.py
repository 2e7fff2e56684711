"""Published math RL datasets converted to the project's rows:
{"prompt": str | [{"role", "content"}], "label": str, "id": str, "source": str}, plus "answers" for Skywork.

The published schemas, one row each:

verl style, used by BytedTsinghua-SIA/DAPO-Math-17k, BytedTsinghua-SIA/AIME-2024 and Skywork/Skywork-OR1-RL-Data
    data_source   str        "math_dapo", "train-math-deepscaler", "train-code-taco", ...
    prompt        list       [{"role": "user", "content": str}]
    ability       str        "MATH" (DAPO), "math" or "code" (Skywork)
    reward_model  struct     {"ground_truth": str, "style": "rule" | "rule-lean"}
    extra_info    struct     {"index": str | int, ...} (Skywork adds model_difficulty)
  DAPO's user content wraps the problem as DAPO_HEAD + "\\n\\n" + problem + "\\n\\n" + DAPO_TAIL, and
  DAPO-Math-17k repeats each problem (~1.79M rows for ~17k problems). Skywork's ground_truth is a JSON list of
  acceptable answers ('["12"]'), and its code split (ability "code") has test cases instead.
HuggingFaceH4/aime_2024: id, problem, solution, answer, url, year (plain table, bare problem text).
Maxwell-Jia/AIME_2024:   ID, Problem, Solution, Answer (plain table, Answer an integer).

Only the fields named in SCHEMAS are required; the others are read when present.
"""

import json
from dataclasses import dataclass
from typing import Optional

from openrlhf_async.data.prompts import BadLine, as_prompt, label_problem, label_text

DATASETS = ("dapo-math-17k", "aime24", "skywork-or1")

DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
DAPO_TAIL = 'Remember to put your answer on its own line after "Answer:".'
# Trailing instructions other releases append to the problem; stripped too when --instruction replaces them.
KNOWN_SUFFIXES = ("Let's think step by step and output the final answer within \\boxed{}.",
                  "Please reason step by step, and put your final answer within \\boxed{}.")

# schema name -> (required columns, where it is published)
SCHEMAS = {
    "verl": (("prompt", "reward_model"), "verl-style Parquet"),
    "h4": (("problem", "answer"), "HuggingFaceH4/aime_2024"),
    "maxwell": (("Problem", "Answer"), "Maxwell-Jia/AIME_2024"),
}
PLAIN_ID = {"h4": "id", "maxwell": "ID"}
DATASET_SCHEMAS = {"dapo-math-17k": ("verl",), "aime24": ("verl", "h4", "maxwell"), "skywork-or1": ("verl",)}


class FormatError(ValueError):
    """Input whose columns match none of the chosen dataset's published schemas."""


def detect_schema(dataset: str, columns) -> str:
    for name in DATASET_SCHEMAS[dataset]:
        if all(c in columns for c in SCHEMAS[name][0]):
            return name
    expected = " or ".join(f"{SCHEMAS[n][1]} ({', '.join(SCHEMAS[n][0])})" for n in DATASET_SCHEMAS[dataset])
    raise FormatError(f"columns {sorted(columns)} match no {dataset} schema; expected {expected}")


def bare_problem(text: str) -> str:
    """The problem without the instruction its release wrapped it in."""
    text = text.strip()
    if text.startswith(DAPO_HEAD):
        text = text[len(DAPO_HEAD):].lstrip()
    for suffix in (DAPO_TAIL, *KNOWN_SUFFIXES):
        if text.endswith(suffix):
            text = text[: -len(suffix)].rstrip()
    return text


def _skywork_answers(ground_truth) -> list:
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            return [ground_truth]
    return list(ground_truth) if isinstance(ground_truth, list) else [ground_truth]


@dataclass
class Counts:
    rows_read: int = 0
    written: int = 0
    duplicates_dropped: int = 0
    label_conflicts: int = 0  # duplicates whose label differs from the kept row's
    bad_rows_skipped: int = 0
    first_bad_row: Optional[int] = None
    first_bad_reason: str = ""
    non_math_dropped: int = 0
    files_skipped: int = 0  # files of a folder in no schema of the dataset, or unreadable
    first_skipped_file: str = ""  # the first of them and why


class Converter:
    """Published rows in, project rows out; rows may come in batches (files, Parquet record batches), so
    deduplication, row indices and counts run across calls."""

    def __init__(self, dataset: str, instruction: str = "", system_prompt: str = "", dedup: bool = True,
                 max_samples: Optional[int] = None):
        self.dataset, self.instruction, self.system_prompt = dataset, instruction, system_prompt
        self.dedup, self.max_samples = dedup, max_samples
        self.counts = Counts()
        self.seen: dict = {}  # prompt key -> label of the row kept

    @property
    def full(self) -> bool:
        return self.max_samples is not None and self.counts.written >= self.max_samples

    def convert(self, schema: str, rows) -> list:
        out = []
        for row in rows:
            if self.full:
                break
            index = self.counts.rows_read
            self.counts.rows_read += 1
            try:
                converted = self._convert_row(schema, row, index)
            except RecursionError:  # a value nested too deeply to turn into text
                converted = "holds a value nested too deeply"
            except ValueError as e:  # e.g. an integer too long to turn into text
                converted = f"holds a value that cannot be converted ({e})"
            if isinstance(converted, str):
                self._bad(index, converted)
            elif converted is not None and self._keep(converted):
                out.append(converted)
                self.counts.written += 1
        return out

    def _bad(self, index: int, reason: str):
        self.counts.bad_rows_skipped += 1
        if self.counts.first_bad_row is None:
            self.counts.first_bad_row, self.counts.first_bad_reason = index, reason

    def _keep(self, row: dict) -> bool:
        if not self.dedup:
            return True
        key = json.dumps(row["prompt"], ensure_ascii=False)
        if key in self.seen:
            self.counts.duplicates_dropped += 1
            self.counts.label_conflicts += self.seen[key] != row["label"]
            return False
        self.seen[key] = row["label"]
        return True

    def _convert_row(self, schema: str, row, index: int):
        """A project row, None for a row this dataset leaves out, or the reason a row is bad."""
        if isinstance(row, BadLine):
            return row.reason
        if not isinstance(row, dict):
            return "is not a record"
        extra = {}
        if schema == "verl":
            if self.dataset == "skywork-or1" and not _is_math(row):
                self.counts.non_math_dropped += 1
                return None
            reward = row.get("reward_model")
            truth = reward.get("ground_truth") if isinstance(reward, dict) else None
            answers = _skywork_answers(truth) if self.dataset == "skywork-or1" and truth is not None else [truth]
            if self.dataset == "skywork-or1":
                extra["answers"] = [label_text(a) for a in answers if label_problem(a) is None]
            prompt, label = row.get("prompt"), answers[0] if answers else None
            info = row.get("extra_info")
            row_id = info.get("index") if isinstance(info, dict) else None
            source = row.get("data_source") or self.dataset
        else:
            problem_key, answer_key = SCHEMAS[schema][0]
            prompt, label, row_id = row.get(problem_key), row.get(answer_key), row.get(PLAIN_ID[schema])
            source = SCHEMAS[schema][1]
        problem = label_problem(label)
        if problem == "empty":
            return "has no ground truth answer"
        if problem:
            return f"has a ground truth answer that is {problem}"
        prompt = as_prompt(prompt)
        if prompt is None:
            return "has a prompt that is neither text nor chat messages with a user turn"
        return {"prompt": self._render(prompt), "label": label_text(label).strip(),
                "id": str(row_id) if row_id is not None else f"{self.dataset}-{index}", "source": str(source), **extra}

    def _render(self, prompt):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.instruction:
            last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
            problem = bare_problem(messages[last_user]["content"])
            messages[last_user] = {"role": "user", "content": f"{problem}\n\n{self.instruction}"}
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt},
                        *(m for m in messages if m["role"] != "system")]
        if len(messages) == 1:
            return messages[0]["content"]
        return messages


def _is_math(row: dict) -> bool:
    ability = row.get("ability")
    if isinstance(ability, str) and ability:
        return ability.lower() == "math"
    return "math" in str(row.get("data_source", "")).lower()
