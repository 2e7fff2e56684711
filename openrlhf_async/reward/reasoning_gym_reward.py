"""An OpenRLHF reward_func for reasoning-gym's tasks (--data.reasoning_gym uses it unless an agent file or
--reward.remote_url is given; pass it as --reward.remote_url with other data made by reasoning-gym): the label is the
task's entry as JSON, the answer the response's last \\boxed{...} (else its <answer> tag, else its last line, from its
last "=" on when it has one: "5 + 3 = 8." answers 8), and the reward the task's own scorer's, between 0 and 1.
The label keeps the entry's tuples (data/reasoning_gym_tasks.py entry_label): ARC's scorers compare grids as tuples, which a list never equals."""

import functools
import re

from openrlhf_async.data.reasoning_gym_tasks import entry_of

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_END_TOKENS = re.compile(r"(\s*(<\|[^|<>]*\|>|</s>))+\s*$")  # the chat template's end of turn after the answer


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
