"""veRL's custom reward function: a file defining `compute_score(data_source, solution_str, ground_truth,
extra_info=None)`, which --reward.remote_url loads as it is (reward/sources.py: ScoreReward).

It is called once per sample, by keyword as veRL calls it: data_source and extra_info are the dataset row's fields
of those names (data/prompts.py carries them with the prompt, as its "info"), solution_str the model's response text
(special tokens left out), ground_truth the label. It returns the reward, a number, or a dict whose "score" is the
reward and whose other numeric entries are logged like a reward_func's extra_logs (rollout/extra/<key>)."""

import asyncio

DEFAULT_DATA_SOURCE = "unknown"  # for a row without a data_source field


def arguments(label, response: str, info: dict) -> dict:
    """compute_score's keyword arguments for one sample."""
    return {"data_source": info.get("data_source") or DEFAULT_DATA_SOURCE, "solution_str": response,
            "ground_truth": label, "extra_info": info.get("extra_info") or {}}


def score_rows(compute_score, labels: list, responses: list, infos: list) -> list:
    """A plain def compute_score's answers, one per sample (what a thread or a worker process runs)."""
    return [compute_score(**arguments(*sample)) for sample in zip(labels, responses, infos)]


async def score_rows_async(compute_score, labels: list, responses: list, infos: list) -> list:
    """An async def compute_score's answers, one per sample, awaited together."""
    return await asyncio.gather(*(compute_score(**arguments(*sample)) for sample in zip(labels, responses, infos)))


def as_reward_output(answers: list, path: str) -> dict:
    """compute_score's answers as a reward_func's {"rewards", "extra_logs"}; ValueError for a dict without "score"."""
    rewards, logs = [], {}
    for i, answer in enumerate(answers):
        if isinstance(answer, dict):
            if "score" not in answer:
                raise ValueError(f"compute_score in {path} returned a dict without 'score' (keys: "
                                 f"{', '.join(map(str, answer))[:200]}); expected a number or a dict with 'score'")
            for key, value in answer.items():
                if key != "score":
                    logs.setdefault(str(key), [None] * len(answers))[i] = value
            answer = answer["score"]
        rewards.append(answer)
    return {"rewards": rewards, "extra_logs": logs}
