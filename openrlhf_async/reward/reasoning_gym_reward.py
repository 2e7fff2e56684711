"""An OpenRLHF reward_func for reasoning-gym's tasks (--data.reasoning_gym uses it unless an agent file or
--reward.remote_url is given; pass it as --reward.remote_url with other data made by reasoning-gym): the label is the
task's entry as JSON, the answer the response's last \\boxed{...} (else its <answer> tag, else its last line, from its
last "=" on when it has one: "5 + 3 = 8." answers 8), and the reward the task's own scorer's, between 0 and 1.
The label keeps the entry's tuples (entry_label): ARC's scorers compare grids as tuples, which a list never equals."""

import functools
import json
import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_END_TOKENS = re.compile(r"(\s*(<\|[^|<>]*\|>|</s>))+\s*$")  # the chat template's end of turn after the answer
_TUPLE, _ITEMS = "__tuple__", "__items__"  # JSON has no tuples and no keys but text: these mark them in a label


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


def last_boxed(text: str):
    """The content of the last \\boxed{...} in text, braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(response: str) -> str:
    response = _END_TOKENS.sub("", response)
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    tags = _ANSWER_TAG.findall(response)
    if tags:
        return tags[-1].strip()
    lines = [line for line in response.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last.rsplit("=", 1)[-1].strip().strip("*$").rstrip(".").strip()


@functools.lru_cache(maxsize=None)
def _scorer(task: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)  # builds the task's dataset (ARC's reads its files: half a second), once


def score(response: str, label: str) -> float:
    entry = entry_of(label)
    return float(_scorer(entry["metadata"]["source_dataset"])(extract_answer(response), entry))


def reward_func(queries, prompts, labels):
    # A query is the prompt followed by the response.
    rewards = [score(q[len(p):] if q.startswith(p) else q, label) for q, p, label in zip(queries, prompts, labels)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": [float(r == 1.0) for r in rewards]}}
