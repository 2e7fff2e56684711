"""Evaluation on the held-out split: k episodes per problem on the engines, scored as mean@k and pass@k."""

from openrlhf_async.config import config_with
from openrlhf_async.rollout.controller import RolloutController, turn_sampling


def evaluate(cfg, engines: list, eval_prompts: list) -> tuple:
    """k = --eval.n_samples_per_prompt episodes per held-out problem (at --eval.temperature; 0 is greedy).
    Returns (scores, groups):
    scores {"eval/mean@k": share of correct samples, "eval/pass@k": share of problems with a correct sample,
    "eval/accuracy": mean@k}, or None without prompts; groups: each problem's k episodes. A sample is correct when
    the agent reports accuracy 1 (the math agents do), else when it scored."""
    if not eval_prompts:
        return None, []
    k = cfg.eval.n_samples_per_prompt
    budget = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    settings = config_with(cfg, rollout={"n_samples_per_prompt": k, "max_new_tokens": budget, "early_stop": False},
                           algo={"dynamic_filtering_enable": False}, agent={"max_error_ratio": 1.0},
                           reward={"overlong_buffer_len": 0, "max_error_ratio": 1.0})
    controller = RolloutController(settings, engines,
                                   sampling=turn_sampling(cfg.rollout, cfg.eval.temperature, cfg.eval.top_p))
    groups, _ = controller.run(iter(eval_prompts).__next__, len(eval_prompts))
    return eval_scores([[float(ep.extra_info.get("accuracy", ep.score > 0)) for ep in g] for g in groups]), groups


def eval_scores(correct: list) -> dict:
    """correct: per problem, k values in {0, 1}. mean@k averages all samples; pass@k counts the problems solved at
    least once."""
    k = len(correct[0])
    mean_at_k = sum(map(sum, correct)) / (k * len(correct))
    return {f"eval/mean@{k}": mean_at_k, f"eval/pass@{k}": sum(max(c) for c in correct) / len(correct),
            "eval/accuracy": mean_at_k}
