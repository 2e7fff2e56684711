"""Advantages and the clipped policy-gradient loss (plain torch, no distributed state)."""

import torch


def group_advantages(rewards: torch.Tensor, estimator: str = "group_norm", no_std_norm: bool = False) -> torch.Tensor:
    """rewards: [groups, n]. Returns one advantage per sample, same shape.

    group_norm (GRPO): (r - group mean) / group std; dr_grpo: r - group mean (no std, no length bias);
    reinforce_baseline (REINFORCE++ with baseline): r - group mean, then whitened over the whole batch."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "group_norm":
        if no_std_norm:
            return centred
        return centred / (rewards.std(dim=1, keepdim=True) + 1e-6)
    if estimator == "dr_grpo":
        return centred
    if estimator == "reinforce_baseline":
        return (centred - centred.mean()) / (centred.std() + 1e-6)
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token: logits [B, T, V] predict tokens [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def clipped_policy_loss(logp, old_logp, advantages, mask, eps_low: float, eps_high: float):
    """PPO/GRPO surrogate per token; returns (sum of token losses over the mask, number of clipped tokens)."""
    ratio = torch.exp(logp - old_logp)
    surrogate = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    token_loss = -torch.minimum(surrogate, clipped)
    clipped_tokens = ((surrogate != clipped) & mask.bool()).sum()
    return (token_loss * mask).sum(), clipped_tokens
