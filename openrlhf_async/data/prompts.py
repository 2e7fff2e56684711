"""Prompt datasets: JSONL or Parquet rows with a prompt field and a label field."""

import json
import os
import random

from openrlhf_async.config import ConfigError


def read_rows(path: str, flag: str) -> list:
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:
            raise ConfigError(f"{flag} {path}: not a readable Parquet file ({e})") from None
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag} {path}: line {line_no} is not valid JSON ({e.msg})") from None
    return rows


def load_prompts(path: str, input_key: str, label_key: str, flag: str, max_samples: int = 100_000_000) -> list:
    """Return [{"prompt": str, "label": str}], failing with a one-line error on a missing, empty or malformed file."""
    rows = read_rows(path, flag)
    if not rows:
        raise ConfigError(f"{flag} {path}: the dataset is empty")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or input_key not in row or label_key not in row:
            raise ConfigError(
                f"{flag} {path}: row {i} has no {input_key!r} or {label_key!r} field "
                f"(set --data.input_key / --data.label_key to the dataset's field names)"
            )
        prompt = row[input_key]
        if isinstance(prompt, list):  # chat messages: keep the last user turn's text
            prompt = next((m.get("content") for m in reversed(prompt) if m.get("role") == "user"), None)
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{flag} {path}: row {i} field {input_key!r} is not text")
        out.append({"prompt": prompt, "label": str(row[label_key])})
        if len(out) >= max_samples:
            break
    return out


class PromptSampler:
    """Endless shuffled pass over the prompts, epoch by epoch, reproducible from a seed."""

    def __init__(self, rows: list, seed: int):
        self.rows = rows
        self.rng = random.Random(seed)
        self.order: list = []
        self.consumed = 0

    def next_batch(self, size: int) -> list:
        batch = []
        while len(batch) < size:
            if not self.order:
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
            batch.append(self.rows[self.order.pop()])
            self.consumed += 1
        return batch
