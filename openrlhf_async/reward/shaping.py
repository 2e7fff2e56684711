"""The reward the trainer sees: an episode's reward, guarded, plus DAPO's soft overlong punishment; its score (what
the dynamic-sampling filter reads) is guarded alike and left unshaped."""

from openrlhf_async.reward.sources import RewardError, check_reward


def overlong_penalty(length: int, budget: int, buffer: int, factor: float) -> float:
    """0 up to budget - buffer tokens, then down linearly to -factor at the budget."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -factor * min(1.0, (length - (budget - buffer)) / buffer)


def shape_rewards(group: list, budget, buffer: int, factor: float) -> None:
    """Set each episode's reward: its raw reward (its score when it has none) plus overlong shaping of the tokens the
    model wrote (an environment's observations are not the model's length) against the episode's own budget
    (budget: one for the group, or one per episode). Whatever scored it, a score or reward that is no valid reward
    makes both 0 and a reward error first, so that neither the filter nor the trainer gets it."""
    budgets = list(budget) if isinstance(budget, (list, tuple)) else [budget] * len(group)
    for ep, ep_budget in zip(group, budgets):
        try:
            score = check_reward(ep.score, "the episode's score")
            raw = score if ep.raw_reward is None else check_reward(ep.raw_reward, "the episode's reward")
        except RewardError as e:
            score, raw, ep.error = 0.0, 0.0, ep.error or ("reward_error", f"{type(e).__name__}: {e}")
        ep.score, ep.raw_reward = score, raw
        ep.reward = raw + overlong_penalty(sum(ep.action_mask), ep_budget, buffer, factor)
