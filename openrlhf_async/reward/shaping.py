"""The reward the trainer sees: an episode's score, guarded, plus DAPO's soft overlong punishment."""

from openrlhf_async.reward.sources import RewardError, check_reward


def overlong_penalty(length: int, budget: int, buffer: int, factor: float) -> float:
    """0 up to budget - buffer tokens, then down linearly to -factor at the budget."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -factor * min(1.0, (length - (budget - buffer)) / buffer)


def shape_rewards(group: list, budget: int, buffer: int, factor: float) -> None:
    """Set each episode's reward: its score plus overlong shaping. Whatever scored it, a score that is no valid
    reward becomes 0 and a reward error first, so it reaches neither the filter nor the trainer."""
    for ep in group:
        try:
            check_reward(ep.score, "the episode's score")
        except RewardError as e:
            ep.score, ep.error = 0.0, ep.error or ("reward_error", f"{type(e).__name__}: {e}")
        ep.reward = ep.score + overlong_penalty(len(ep.response_ids), budget, buffer, factor)
