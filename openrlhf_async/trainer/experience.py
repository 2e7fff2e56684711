"""From a rollout batch's groups to the samples the ranks train on (OpenRLHF's experience maker): the trainer's
penalty of truncated responses, one advantage per episode (or per seat's sequence, seats.py) from its group, or with
a critic GAE's per-token advantages and returns. The rewards arrive shaped (reward/shaping.py: guarded, overlong
shaping); --reward.clip_range bounds the group advantages (losses.group_advantages) or, with a critic, the rewards
(gae_samples).
Plain Python and torch: the ranks' passes (the critic's values, the reference's and the policy's log-probs) are the
trainer's (pipeline.py), and their results come in as lists."""

import torch

from openrlhf_async.trainer.losses import approx_kl, gae, token_rewards, whiten
from openrlhf_async.trainer.seats import episode_parts, part_advantages, part_rewards


def stop_properly_penalty(episode, coef) -> float:
    """An episode's reward after ProRL's penalty of truncated responses (--reward.stop_properly_penalty_coef): in
    [0, 1] it scales the reward, below 0 it replaces it; None: unchanged."""
    if coef is None or episode.finish_reason != "length":
        return episode.reward
    return episode.reward * coef if coef >= 0 else coef


def batch_rewards(groups: list, stop_properly_coef) -> torch.Tensor:
    """[groups, n] the episodes' rewards the advantages start from (stop_properly_penalty applied)."""
    return torch.tensor([[stop_properly_penalty(ep, stop_properly_coef) for ep in g] for g in groups],
                        dtype=torch.float64)


def rollout_figures(groups: list, rewards: torch.Tensor) -> dict:
    """The batch's reward and length figures."""
    lengths = torch.tensor([[sum(ep.action_mask) for ep in g] for g in groups])
    return {"reward/mean": rewards.mean().item(),
            "rollout/response_len_mean": lengths.double().mean().item(),
            # tokens the environment wrote (multi-turn observations): masked out of the loss
            "rollout/observation_len_mean": sum(len(ep.response_ids) - sum(ep.action_mask)
                                                for g in groups for ep in g) / max(1, rewards.numel()),
            "rollout/truncated_ratio": sum(ep.finish_reason == "length" for g in groups for ep in g)
            / max(1, rewards.numel())}


def training_sample(episode, advantage) -> dict:
    """What the policy ranks train on from an episode of one segment: its tokens, which of them the model wrote,
    their rollout logprobs, the episode's advantage, and (a mixture of experts') the experts vLLM routed its tokens
    to."""
    sample = {"prompt_ids": episode.prompt_ids, "response_ids": episode.response_ids, "logprobs": episode.logprobs,
              "action_mask": episode.action_mask, "advantage": advantage}
    if episode.routes is not None:
        sample["routes"] = episode.routes
    return sample


def training_samples(episode, advantage) -> list:
    """training_sample of each segment of an episode (Episode.segments), each with the episode's advantage, or its
    own where `advantage` is a list of one per segment (seats.py)."""
    parts = episode_parts(episode)
    shares = advantage if isinstance(advantage, list) else [advantage] * len(parts)
    return [training_sample(part, share) for part, share in zip(parts, shares)]


def group_samples(groups: list, rewards: torch.Tensor, algo, clip_range) -> list:
    """The samples of a batch trained without a critic: one advantage per episode from its group's rewards
    (--algo.advantage.estimator), or per seat's sequence (seats.py). algo: the config's algo section."""
    lengths = torch.tensor([[sum(ep.action_mask) for ep in g] for g in groups])
    advantages = part_advantages(groups, rewards, algo.advantage_estimator, algo.advantage_no_std_norm, clip_range,
                                 lengths)
    return [s for g, row in zip(groups, advantages) for ep, adv in zip(g, row) for s in training_samples(ep, adv)]


def critic_parts(groups: list, rewards: torch.Tensor) -> tuple:
    """For GAE: (every episode's parts, as episodes of one segment each; [parts] their rewards) from the groups and
    their rewards ([groups, n], batch_rewards)."""
    parts = [p for g in groups for ep in g for p in episode_parts(ep)]
    per_part = [r for g, row in zip(groups, rewards.tolist()) for ep, reward in zip(g, row)
                for r in part_rewards(ep, reward)]
    return parts, torch.tensor(per_part, dtype=torch.float64)


def _rows(lists: list) -> torch.Tensor:
    """Per-sample lists -> [B, T], right-padded with zeros."""
    out = torch.zeros(len(lists), max(1, max(len(x) for x in lists)), dtype=torch.float64)
    for i, x in enumerate(lists):
        out[i, : len(x)] = torch.tensor(x, dtype=torch.float64)
    return out


def gae_samples(samples: list, rewards: torch.Tensor, values: list, old_logprobs: list, algo, kl_coef: float,
                clip_range=None) -> tuple:
    """PPO with a critic, as OpenRLHF 0.11.2 makes its experience. samples: training_sample of each part
    (critic_parts), with the reference's log-probs ("ref_logprobs") where the KL counts; rewards: [parts] theirs;
    values, old_logprobs: per sample the critic's values and the policy's log-probs before the updates. Per-token
    rewards (the KL penalty at each token unless --algo.kl.use_loss, the reward, clipped to clip_range, at the last),
    GAE's advantages (whitened over the batch's tokens) and returns. Returns (the samples with "advantage",
    "returns", "values" and "old_logprobs", the batch's mean KL per sequence)."""
    if clip_range is not None:
        rewards = rewards.clamp(*clip_range)
    mask = _rows([s["action_mask"] for s in samples])
    kl = (approx_kl(_rows(old_logprobs), _rows([s["ref_logprobs"] for s in samples]), algo.kl_estimator).double()
          * mask if "ref_logprobs" in samples[0] else torch.zeros_like(mask))
    per_token = token_rewards(rewards, kl, mask, 0.0 if algo.kl_use_loss else kl_coef)
    advantages, returns = gae(_rows(values), per_token, mask, algo.advantage_gamma, algo.advantage_lambd)
    advantages = whiten(advantages, mask, algo.advantage_no_std_norm)
    samples = [{**s, "advantage": advantages[i, :n].tolist(), "returns": returns[i, :n].tolist(),
                "values": values[i], "old_logprobs": old_logprobs[i]}
               for i, (s, n) in enumerate(zip(samples, (len(s["response_ids"]) for s in samples)))]
    return samples, float((kl * mask).sum(-1).div(mask.sum(-1).clamp(min=1)).mean())
