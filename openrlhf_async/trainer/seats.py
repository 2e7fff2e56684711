"""Advantages of episodes whose sequences carry rewards of their own (Episode.seat_reward: a verifiers environment's
traces, each seat of a game on its own payoff, each attempt on its own score). Such a sequence is compared with the
sequences of the same seat in its prompt's group: GRPO's group, one per seat (the two players of a zero-sum game
each against their own seat's outcomes). Batches without them keep one advantage per episode, shared by its
sequences, as group_advantages computes it."""

import torch

from openrlhf_async.trainer.losses import group_advantages


def episode_parts(episode) -> list:
    """An episode's segments as episodes of their own (sharing its reward and finish), the last being itself."""
    import dataclasses

    # An earlier segment's tokens are not the episode's: the routes recorded for the episode's are not its own.
    return [dataclasses.replace(episode, segments=[], routes=None, **segment) for segment in episode.segments] + [
        episode]


def part_rewards(episode, reward: float) -> list:
    """The reward of each of the episode's parts, given its own (shaped) reward: a seat's part gets its seat's
    reward plus the episode's shaping (what `reward` adds to the raw reward), any other part the episode's."""
    raw = episode.raw_reward if episode.raw_reward is not None else episode.score
    return [reward if p.seat_reward is None else p.seat_reward + reward - raw for p in episode_parts(episode)]


def part_advantages(groups: list, rewards: torch.Tensor, estimator: str, no_std_norm: bool = False,
                    clip_range: tuple = None, lengths: torch.Tensor = None) -> list:
    """groups: lists of Episode; rewards, lengths: [groups, n] their shaped rewards and the tokens the model wrote.
    [[[advantage of each part] per episode] per group]: per episode as group_advantages computes it, or, once any part
    has a seat, per part over the parts of its seat in its group (parts without a seat: the seat None's row)."""
    parts = [[episode_parts(ep) for ep in g] for g in groups]
    if not any(p.seat_reward is not None for g in parts for ps in g for p in ps):
        adv = group_advantages(rewards, estimator, no_std_norm, clip_range, lengths)
        return [[[a] * len(ps) for a, ps in zip(row.tolist(), g)] for row, g in zip(adv, parts)]
    rows = {}  # (group, seat) -> [(episode, part, reward, tokens the model wrote)]
    for gi, (group, group_parts) in enumerate(zip(groups, parts)):
        for ei, (ep, ps) in enumerate(zip(group, group_parts)):
            for pi, (p, r) in enumerate(zip(ps, part_rewards(ep, rewards[gi, ei].item()))):
                rows.setdefault((gi, p.seat), []).append((ei, pi, r, sum(p.action_mask)))
    entries = list(rows.values())
    width = max(len(row) for row in entries)
    padded = torch.zeros(len(entries), width, dtype=torch.float64)
    present = torch.zeros(len(entries), width, dtype=torch.bool)
    tokens = torch.zeros(len(entries), width, dtype=torch.float64)
    for i, row in enumerate(entries):
        padded[i, : len(row)] = torch.tensor([r for _, _, r, _ in row], dtype=torch.float64)
        tokens[i, : len(row)] = torch.tensor([t for _, _, _, t in row], dtype=torch.float64)
        present[i, : len(row)] = True
    adv = group_advantages(padded, estimator, no_std_norm, clip_range, tokens, present)
    out = [[[0.0] * len(ps) for ps in g] for g in parts]
    for ((gi, _), row), values in zip(rows.items(), adv.tolist()):
        for (ei, pi, _, _), value in zip(row, values):
            out[gi][ei][pi] = value
    return out
