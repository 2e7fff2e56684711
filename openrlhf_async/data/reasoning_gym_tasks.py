"""Prompts from reasoning-gym's task generators (--data.reasoning_gym): each task's questions made locally from a
seed (nothing is downloaded), the entry kept whole as the label so that the task's own scorer can judge an answer
(reward/reasoning_gym_reward.py). The eval questions come from another seed, less any that is also a training one."""

import json
import os

INSTRUCTION = "Put your final answer within \\boxed{}."
EVAL_PER_TASK = 100
EVAL_SEED_OFFSET = 1_000_003


def task_names(spec: str) -> list:
    """The comma-separated task names, checked against reasoning-gym's registry (ValueError names the unknown)."""
    from reasoning_gym.factory import DATASETS

    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in DATASETS]
    if not names or unknown:
        raise ValueError(f"--data.reasoning_gym {spec!r}: unknown task(s) {', '.join(unknown) or '(none given)'}; "
                         f"reasoning-gym has {', '.join(sorted(DATASETS))}")
    return names


def task_settings(names: list, text: str) -> dict:
    """--data.reasoning_gym_args: {task: {setting: value}} for tasks among names (ValueError otherwise)."""
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--data.reasoning_gym_args is not JSON ({e}); expected an object such as "
                         '\'{"chain_sum": {"max_terms": 2}}\'') from None
    if not isinstance(settings, dict) or not all(isinstance(v, dict) for v in settings.values()):
        raise ValueError("--data.reasoning_gym_args: expected a JSON object of objects, by task name")
    unknown = [name for name in settings if name not in names]
    if unknown:
        raise ValueError(f"--data.reasoning_gym_args names {', '.join(unknown)}, not among --data.reasoning_gym's "
                         f"tasks ({', '.join(names)})")
    return settings


def rows(names: list, size: int, seed: int, settings: dict = None) -> list:
    """[{"prompt", "label"}] of size questions per task, the label being the task's entry as JSON."""
    import reasoning_gym

    out = []
    for name in names:
        try:
            dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **(settings or {}).get(name, {}))
        except (TypeError, AssertionError, ValueError) as e:
            raise ValueError(f"--data.reasoning_gym_args for {name}: reasoning-gym refused them "
                             f"({type(e).__name__}: {e})") from None
        for entry in dataset:
            out.append({"prompt": f"{entry['question']}\n{INSTRUCTION}", "label": json.dumps(entry, default=str)})
    return out


def write_tasks(spec: str, size: int, seed: int, out_dir: str, args: str = "{}") -> tuple:
    """Write train.jsonl and eval.jsonl of the tasks under out_dir; their paths."""
    names = task_names(spec)
    settings = task_settings(names, args)
    train = rows(names, size, seed, settings)
    seen = {row["prompt"] for row in train}
    held_out = [row for row in rows(names, EVAL_PER_TASK, seed + EVAL_SEED_OFFSET, settings)
                if row["prompt"] not in seen]
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, split_rows in (("train", train), ("eval", held_out)):
        path = os.path.join(out_dir, f"reasoning_gym_{split}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in split_rows)
        paths.append(path)
    return tuple(paths)
