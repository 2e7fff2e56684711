"""Advantages, the clipped policy loss and the off-policy corrections against hand-computed values."""

import math

import torch

import pytest

from openrlhf_async.trainer.losses import group_advantages, importance_weights, policy_loss, token_logprobs


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


def test_clip_higher_matches_hand_computation():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))  # ratios 1.0, 1.8, 0.2
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    out = policy_loss(logp, old, old, adv, mask, 0.2, 0.28)  # behaviour == old: importance weights 1
    # token losses: -1.0; -min(1.8, 1.28) = -1.28; -min(-0.2, -0.8) = 0.8
    assert out["loss"].item() == pytest.approx(-1.0 - 1.28 + 0.8, abs=1e-5)
    assert out["clipped"] == 2 and out["corrected"] == 0 and out["weight"] == pytest.approx(3.0)
    masked = policy_loss(logp, old, old, adv, torch.tensor([[1.0, 0.0, 0.0]]), 0.2, 0.28)
    assert masked["loss"].item() == pytest.approx(-1.0, abs=1e-6)


def test_importance_weights_truncate_or_mask_against_the_behaviour_policy():
    old = torch.log(torch.tensor([0.6, 0.6, 0.6, 0.6]))
    behaviour = torch.log(torch.tensor([0.6, 0.4, 0.2, 0.1]))  # pi_old / pi_behaviour: 1, 1.5, 3, 6
    tis, truncated = importance_weights(old, behaviour, "tis", clamp=2.0)
    assert torch.allclose(tis, torch.tensor([1.0, 1.5, 2.0, 2.0])) and truncated.tolist() == [False, False, True, True]
    icepop, masked = importance_weights(old, behaviour, "icepop", band=(0.5, 2.0))
    assert torch.allclose(icepop, torch.tensor([1.0, 1.5, 0.0, 0.0])) and masked.tolist() == [False, False, True, True]
    none, _ = importance_weights(old, behaviour, "none")
    assert torch.equal(none, torch.ones(4))


def test_off_policy_loss_weights_each_token_and_its_gradient():
    # One update per batch: the proximal policy is the current one, so the ratio is 1 and the gradient of a
    # token's loss is -w * A * grad(log pi), with w the truncated importance weight.
    logits = torch.zeros(1, 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :2]  # two tokens, each with probability 1/3
    behaviour = torch.log(torch.tensor([[1 / 3, 1 / 12]]))  # weights 1 and 4 (truncated to 2)
    adv, mask = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    out = policy_loss(logp, logp.detach(), behaviour, adv, mask, 0.2, 0.28, "tis", clamp=2.0)
    assert out["loss"].item() == pytest.approx(-3.0) and out["corrected"] == 1 and out["clipped"] == 0
    out["loss"].backward()
    # d/dlogits of -(1 * logp0 + 2 * logp1), with softmax probabilities 1/3: -(e0 + 2 e1) + 3 * (1/3, 1/3, 1/3)
    assert torch.allclose(logits.grad, torch.tensor([[0.0, -1.0, 1.0]]), atol=1e-6)


def test_k3_kl_penalty_against_the_reference():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))  # k3 = r - log r - 1 with r = pi_ref / pi = 0.5
    out = policy_loss(logp, logp, logp, torch.zeros(1, 1), torch.ones(1, 1), 0.2, 0.28, "none", ref_logp=ref,
                      kl_coef=0.1)
    k3 = 0.5 - math.log(0.5) - 1
    assert out["kl"] == pytest.approx(k3) and out["loss"].item() == pytest.approx(0.1 * k3)


def test_token_logprobs_use_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    tokens = torch.tensor([[0]])
    assert abs(token_logprobs(logits, tokens).item() - math.log(math.e**2 / (math.e**2 + 1))) < 1e-6
    assert abs(token_logprobs(logits, tokens, 2.0).item() - math.log(math.e / (math.e + 1))) < 1e-6
