"""Advantages and the clipped policy loss against hand-computed values."""

import math

import torch

from openrlhf_async.trainer.losses import clipped_policy_loss, group_advantages, token_logprobs


def test_grpo_advantages_are_group_normalised():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards, "group_norm")
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))  # a group whose rewards are all equal teaches nothing


def test_dr_grpo_and_reinforce_baseline():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert torch.equal(group_advantages(rewards, "dr_grpo"), torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    rb = group_advantages(rewards, "reinforce_baseline")
    assert abs(rb.mean().item()) < 1e-6 and abs(rb.std().item() - 1) < 1e-4


def test_clipped_loss_matches_hand_computation():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))  # ratios 1.0, 1.8, 0.2
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    loss, clipped = clipped_policy_loss(logp, old, adv, mask, 0.2, 0.28)
    # token losses: -1.0; -min(1.8, 1.28) = -1.28; -min(-0.2, -0.8) = 0.8
    assert abs(loss.item() - (-1.0 - 1.28 + 0.8)) < 1e-5
    assert clipped.item() == 2
    masked, _ = clipped_policy_loss(logp, old, adv, torch.tensor([[1.0, 0.0, 0.0]]), 0.2, 0.28)
    assert abs(masked.item() + 1.0) < 1e-6


def test_token_logprobs_use_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    tokens = torch.tensor([[0]])
    assert abs(token_logprobs(logits, tokens).item() - math.log(math.e**2 / (math.e**2 + 1))) < 1e-6
    assert abs(token_logprobs(logits, tokens, 2.0).item() - math.log(math.e / (math.e + 1))) < 1e-6
