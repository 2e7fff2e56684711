"""Prompts from reasoning-gym's task generators (--data.reasoning_gym): each task's questions made locally from a
seed (nothing is downloaded), the entry kept whole as the label so that the task's own scorer can judge an answer
(reward/reasoning_gym_reward.py). The eval questions come from another seed, less any that is also a training one.
The generators run in a child process under a time and a memory limit (utils/user_files.py run_child), a few
questions of each task first: settings that make questions huge or slow are refused in one line, not a hung start."""

import json
import os
import time

INSTRUCTION = "Put your final answer within \\boxed{}."
EVAL_PER_TASK = 100
EVAL_SEED_OFFSET = 1_000_003
SIZE_MAX = 100_000  # questions per task (--data.reasoning_gym_size's most); a larger set is a dataset made once
PROBE_QUESTIONS = 3  # made of each task first, to refuse a set too slow or too large before making it
PROBE_TIMEOUT_S = 60.0  # the probe's child process, reasoning-gym's import included
GENERATE_TIMEOUT_S = 300.0  # the whole set's child process
GENERATE_MEMORY = 4 * 2**30  # both children's address space (RLIMIT_AS), and what the set's rows may take
_TUPLE, _ITEMS = "__tuple__", "__items__"  # JSON has no tuples and no keys but text: these mark them in a label
_CHILD = """
from openrlhf_async.data.reasoning_gym_tasks import _generate
_generate(report, *json.loads(args[0]))
"""


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
    from openrlhf_async.utils.json_text import loads

    try:
        settings = loads(text, "--data.reasoning_gym_args", ValueError)
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



def entry_label(entry: dict) -> str:
    """The entry as JSON, its tuples and its dicts with keys other than text marked, so that entry_of gives back an
    equal entry."""
    return json.dumps(_marked(entry), default=str)


def entry_of(label: str) -> dict:
    """The entry entry_label wrote (a plain JSON entry as it reads)."""
    return json.loads(label, object_hook=_unmarked)


def _marked(value):
    if isinstance(value, tuple):
        return {_TUPLE: [_marked(v) for v in value]}
    if isinstance(value, list):
        return [_marked(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _marked(v) for k, v in value.items()}
    if isinstance(value, dict):
        return {_ITEMS: [[_marked(k), _marked(v)] for k, v in value.items()]}
    return value


def _unmarked(obj: dict):
    if len(obj) == 1 and _TUPLE in obj:
        return tuple(obj[_TUPLE])
    if len(obj) == 1 and _ITEMS in obj:
        return {k: v for k, v in obj[_ITEMS]}
    return obj


def rows(names: list, size: int, seed: int, settings: dict = None) -> list:
    """[{"prompt", "label"}] of size questions per task, the label being the task's entry as JSON (its tuples kept:
    entry_label)."""
    import reasoning_gym

    out = []
    for name in names:
        try:
            dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **(settings or {}).get(name, {}))
        except (TypeError, AssertionError, ValueError) as e:
            raise ValueError(f"--data.reasoning_gym_args for {name}: reasoning-gym refused them "
                             f"({type(e).__name__}: {e})") from None
        for entry in dataset:
            out.append({"prompt": f"{entry['question']}\n{INSTRUCTION}", "label": entry_label(entry)})
    return out


def write_tasks(spec: str, size: int, seed: int, out_dir: str, args: str = "{}") -> tuple:
    """Write train.jsonl and eval.jsonl of the tasks under out_dir, in child processes (ValueError for settings
    whose questions are too slow or too large to make); their paths."""
    names = task_names(spec)
    settings = task_settings(names, args)
    flags = f"--data.reasoning_gym_size {size} / --data.reasoning_gym_args"
    fix = ("; lower them, or make the set once in a job of its own (openrlhf_async.data.reasoning_gym_tasks.rows, "
           "as JSON lines) and pass it as --data.prompt_dataset")
    costs = json.loads(_in_child([names, size, seed, settings, None], PROBE_TIMEOUT_S, flags, fix))
    count = size + EVAL_PER_TASK  # per task
    need = {"time": sum(setup + each * count for setup, each, _ in costs.values()),
            "memory": sum(size_each * count for _, _, size_each in costs.values())}
    seconds = "{:.3g} s".format
    for what, index, bound, shown in (("memory", 2, GENERATE_MEMORY, _bytes), ("time", 1, GENERATE_TIMEOUT_S, seconds)):
        if need[what] > bound:  # the whole set's estimate, from the probe
            name = max(costs, key=lambda n: costs[n][index])
            raise ValueError(f"{flags}: {name}'s questions take {shown(costs[name][index])} each, so "
                             f"{count * len(names)} of them need about {shown(need[what])}, past the {shown(bound)} "
                             f"bound{fix}")
    _in_child([names, size, seed, settings, out_dir], GENERATE_TIMEOUT_S, flags, fix)
    return tuple(os.path.join(out_dir, f"reasoning_gym_{split}.jsonl") for split in ("train", "eval"))


def _bytes(n: float) -> str:
    unit = next(u for u in range(3, -1, -1) if n >= 1024**u or not u)
    return f"{n / 1024**unit:.3g} {('bytes', 'KiB', 'MiB', 'GiB')[unit]}"


def _in_child(job: list, timeout: float, flags: str, fix: str) -> str:
    """_generate(job) in a child process under the limits; what it reported last (ValueError when it failed)."""
    from openrlhf_async.utils.user_files import run_child

    text, code = run_child(_CHILD, [json.dumps(job)], timeout, GENERATE_MEMORY)
    lines = text.splitlines()
    kind, _, rest = (lines[-1] if lines else "").partition(" ")
    name = next((line.split(" ", 1)[1] for line in reversed(lines) if line.startswith("task ")), job[0][0])
    limits = f"within {timeout:g} s (under a {_bytes(GENERATE_MEMORY)} memory limit)"
    if code is None and job[-1] is None:
        raise ValueError(f"--data.reasoning_gym_args: {name} made no {PROBE_QUESTIONS} questions {limits}: its "
                         "settings make each question huge or slow; lower them")
    if code is None or kind == "memory":
        raise ValueError(f"{flags}: making {name}'s questions did not finish {limits}{fix}")
    if kind == "error":
        raise ValueError(rest)
    if kind not in ("ok", "costs"):  # ended without a word: a crash in a generator
        raise ValueError(f"--data.reasoning_gym_args: reasoning-gym's {name} ended its process (exit code {code}) "
                         "making questions; change its settings")
    return rest


def _generate(report, names: list, size: int, seed: int, settings: dict, out_dir) -> None:
    """In the child process: with out_dir None, the probe, reported as "costs" {name: [seconds to set the task up,
    seconds and bytes per question]}; else the set written under out_dir, then "ok". Each task is reported as it
    starts ("task NAME"), so that a hang or a crash names it; a refusal is "error MESSAGE"."""
    name = names[0]
    try:
        costs, seen = {}, set()
        for i, name in enumerate(names):
            report(f"task {name}\n")
            if out_dir is None:  # one question, then PROBE_QUESTIONS more: the setup apart from the questions
                started = time.perf_counter()
                rows([name], 1, seed, settings)
                first = time.perf_counter() - started
                made = rows([name], 1 + PROBE_QUESTIONS, seed, settings)
                each = max(time.perf_counter() - started - 2 * first, 0) / PROBE_QUESTIONS
                costs[name] = [first, each, sum(len(r["prompt"]) + len(r["label"]) for r in made) / len(made)]
            else:
                made = rows([name], size, seed, settings)
                seen.update(row["prompt"] for row in made)
                _write(out_dir, "train", made, "a" if i else "w")
        if out_dir is None:
            report(f"costs {json.dumps(costs)}\n")
            return
        held_out = [row for row in rows(names, EVAL_PER_TASK, seed + EVAL_SEED_OFFSET, settings)
                    if row["prompt"] not in seen]
        _write(out_dir, "eval", held_out, "w")
        report("ok\n")
    except MemoryError:
        report(f"memory {name}\n")
    except ValueError as e:  # rows' refusal of the settings, one line already
        report(f"error {' '.join(str(e).splitlines())}\n")
    except Exception as e:  # a generator failing on these settings
        report(f"error --data.reasoning_gym_args for {name}: reasoning-gym failed making its questions "
               f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})\n")


def _write(out_dir: str, split: str, split_rows: list, mode: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"reasoning_gym_{split}.jsonl"), mode) as f:
        f.writelines(json.dumps(row) + "\n" for row in split_rows)
