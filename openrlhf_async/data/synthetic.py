"""Built-in tasks (--data.builtin_task), used without --data.prompt_dataset:

- arithmetic: small integer sums and differences written as "57+8=", for the embedded character-level model;
- boxed_addition: "What is 3 + 5? Put your final answer within \\boxed{}.", the 100 sums of two single digits, for
  a small pretrained chat model: SmolLM2-135M-Instruct answers about 8% of them right at temperature 1 (mostly
  for want of the box), so its groups' rewards vary and RL has something to teach.

Rows use the same schema as real datasets: ``{"prompt": <user text>, "label": <answer>}``.
"""

from __future__ import annotations

import json
import os
import random
import re
import zlib

DEFAULT_OPS = "+-"
# Two-digit first operand, one-digit second: fixed-width prompts and a single carry/borrow keep
# the task learnable by a 2-layer char-level model within a short warm start.
DEFAULT_A_RANGE = (10, 99)
DEFAULT_B_RANGE = (0, 9)
HELDOUT_MOD = 10  # ~1/10 of all questions form the held-out pool
BUILTIN_TASKS = ("arithmetic", "boxed_addition")
BOXED_ADDITION_HELDOUT = 20  # of the 100 boxed additions, held out for evaluation


def _question(a: int, op: str, b: int) -> tuple[str, str]:
    value = a + b if op == "+" else a - b
    return f"{a}{op}{b}=", str(value)


def _all_questions(a_range, b_range, ops: str) -> list[tuple[str, str]]:
    out = []
    for op in ops:
        for a in range(a_range[0], a_range[1] + 1):
            for b in range(b_range[0], b_range[1] + 1):
                if op == "-" and b > a:  # keep answers non-negative
                    continue
                out.append(_question(a, op, b))
    return out


def carry_slip_answer(prompt: str) -> str | None:
    """The answer a solver that forgets every carry/borrow would give, or None if none is needed.

    Each digit is added/subtracted mod 10 with nothing carried: "57+8=" -> "55", "52-8=" -> "54".
    """
    m = re.fullmatch(r"(\d+)([+-])(\d+)=", prompt)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    sign = 1 if op == "+" else -1
    slip, place = 0, 1
    while a // place or b // place:
        slip += ((a // place % 10 + sign * (b // place % 10)) % 10) * place
        place *= 10
    right = a + sign * b
    return str(slip) if slip != right else None


def _is_heldout(prompt: str) -> bool:
    # Decided by the question text alone, so the held-out pool never depends on the seed:
    # the warm start and RL can use any seed without touching eval questions.
    return zlib.crc32(prompt.encode()) % HELDOUT_MOD == 0


def _split_pool(split: str, a_range, b_range, ops: str) -> list[tuple[str, str]]:
    """Every (question, answer) of the split, in a fixed order."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}")
    return [q for q in _all_questions(a_range, b_range, ops) if _is_heldout(q[0]) == (split == "eval")]


def make_arithmetic_rows(
    n: int,
    seed: int,
    split: str = "train",
    a_range: tuple[int, int] = DEFAULT_A_RANGE,
    b_range: tuple[int, int] = DEFAULT_B_RANGE,
    ops: str = DEFAULT_OPS,
) -> list[dict]:
    """``n`` distinct questions from the ``split`` ("train" or "eval") pool, shuffled by ``seed``."""
    pool = _split_pool(split, a_range, b_range, ops)
    if n > len(pool):
        raise ValueError(f"asked for {n} {split} rows but only {len(pool)} exist")
    rng = random.Random(seed)
    return [{"prompt": p, "label": a} for p, a in rng.sample(pool, n)]


def split_size(
    split: str, a_range=DEFAULT_A_RANGE, b_range=DEFAULT_B_RANGE, ops: str = DEFAULT_OPS
) -> int:
    """How many distinct questions the ``split`` pool holds."""
    return len(_split_pool(split, a_range, b_range, ops))


def train_pool(
    a_range: tuple[int, int] = DEFAULT_A_RANGE, b_range: tuple[int, int] = DEFAULT_B_RANGE, ops: str = DEFAULT_OPS
) -> list[dict]:
    """Every non-held-out question, in a fixed order."""
    return [{"prompt": p, "label": a} for p, a in _split_pool("train", a_range, b_range, ops)]


def write_arithmetic_dataset(
    out_dir: str,
    n_train: int | None = None,
    n_eval: int | None = None,
    seed: int = 0,
    a_range: tuple[int, int] = DEFAULT_A_RANGE,
    b_range: tuple[int, int] = DEFAULT_B_RANGE,
    ops: str = DEFAULT_OPS,
) -> tuple[str, str]:
    """Write ``train.jsonl`` / ``eval.jsonl`` (disjoint question sets) and return their paths.

    ``n_train`` / ``n_eval`` default to every question of that split (~1620 / ~180 with default ranges).
    """
    sizes = {"train": n_train, "eval": n_eval}
    return _write_splits(out_dir, lambda split: make_arithmetic_rows(
        split_size(split, a_range, b_range, ops) if sizes[split] is None else sizes[split], seed, split, a_range,
        b_range, ops))


def _write_splits(out_dir: str, rows_of) -> tuple[str, str]:
    """Write rows_of("train") and rows_of("eval") as ``train.jsonl`` / ``eval.jsonl``, each whole or not at all
    (written aside, then renamed); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split in ("train", "eval"):
        path = os.path.join(out_dir, f"{split}.jsonl")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows_of(split))
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]


def boxed_addition_rows(split: str, seed: int = 0) -> list[dict]:
    """The split's boxed additions: BOXED_ADDITION_HELDOUT of the 100 for "eval", the rest for "train"."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:BOXED_ADDITION_HELDOUT] if split == "eval" else pairs[BOXED_ADDITION_HELDOUT:]
    return [{"prompt": f"What is {a} + {b}? Put your final answer within \\boxed{{}}.", "label": str(a + b)}
            for a, b in chosen]


def write_builtin_task(task: str, out_dir: str) -> tuple[str, str]:
    """Write the task's ``train.jsonl`` / ``eval.jsonl`` (disjoint questions) and return their paths."""
    if task == "arithmetic":
        return write_arithmetic_dataset(out_dir)
    if task != "boxed_addition":
        raise ValueError(f"unknown built-in task {task!r}; choose from {', '.join(BUILTIN_TASKS)}")
    return _write_splits(out_dir, boxed_addition_rows)
