"""Advantages, the policy loss, the mismatch correction and the KL terms against values computed by hand from
OpenRLHF 0.11.2's definitions: the estimators from `openrlhf/trainer/ppo_utils/experience_maker.py`
(RemoteExperienceMaker.compute_advantages_and_returns: the group baselines, then the token-level whitening of
reinforce / reinforce_baseline), the KL from `openrlhf/models/utils.py` (compute_approx_kl, compute_reward), the
loss from `openrlhf/models/loss.py` (PolicyLoss: clip, dual clip, GSPO, the TIS / ICEPOP / sequence-mask
correction)."""

import math

import pytest
import torch

from openrlhf_async.trainer.losses import (
    aggregate,
    approx_kl,
    correction_weights,
    group_advantages,
    kl_reward_advantages,
    policy_loss,
    token_entropy,
    token_logprobs,
)

OFF = {"level": "off"}


def test_grpo_advantages_are_group_normalised():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards, "group_norm")
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-9))
    assert torch.equal(adv[1], torch.zeros(4))  # a group whose rewards are all equal teaches nothing


def test_dr_grpo_rloo_and_flash_reinforce_baselines():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert torch.equal(group_advantages(rewards, "dr_grpo"), torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    assert torch.equal(group_advantages(rewards, "rloo"), torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    assert torch.equal(group_advantages(rewards, "flash_reinforce"), torch.tensor([[0.75, -0.25], [-0.25, -0.25]]))


def test_reinforce_baseline_whitens_over_tokens_not_samples():
    # Rewards [1, 0] with 10 and 90 response tokens: centred (0.5, -0.5), then whitened with each sample weighted by
    # its tokens: mean -0.4, std 0.3, so (0.9 / 0.3, -0.1 / 0.3) = (3, -1/3).
    adv = group_advantages(torch.tensor([[1.0, 0.0]]), "reinforce_baseline", lengths=torch.tensor([[10, 90]]))
    assert torch.allclose(adv, torch.tensor([[3.0, -1 / 3]]), atol=1e-5)
    centred = group_advantages(torch.tensor([[1.0, 0.0]]), "reinforce_baseline", no_std_norm=True,
                               lengths=torch.tensor([[10, 90]]))
    assert torch.allclose(centred, torch.tensor([[0.9, -0.1]]), atol=1e-6)
    # no_std_norm means OpenRLHF's: it leaves group_norm's division alone
    assert torch.equal(group_advantages(torch.tensor([[1.0, 0.0]]), "group_norm", no_std_norm=True),
                       group_advantages(torch.tensor([[1.0, 0.0]]), "group_norm"))


def test_reward_clip_range_bounds_the_advantage_before_whitening():
    adv = group_advantages(torch.tensor([[30.0, 0.0]]), "rloo", clip_range=(-10.0, 10.0))
    assert torch.equal(adv, torch.tensor([[10.0, -10.0]]))


def test_clip_higher_matches_hand_computation():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))  # ratios 1.0, 1.8, 0.2
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    out = policy_loss(logp, old, old, adv, mask, (0.2, 0.28))
    # token losses: -1.0; -min(1.8, 1.28) = -1.28; -min(-0.2, -0.8) = 0.8
    assert out["token_loss"].sum().item() == pytest.approx(-1.0 - 1.28 + 0.8, abs=1e-5)
    assert out["clipped"] == 2 and out["corrected"] == 0 and out["weight"] == pytest.approx(3.0)
    masked = policy_loss(logp, old, old, adv, torch.tensor([[1.0, 0.0, 0.0]]), (0.2, 0.28))
    assert aggregate(masked["token_loss"], torch.tensor([[1.0, 0.0, 0.0]]), "token-mean", 1, 1).item() == \
        pytest.approx(-1.0, abs=1e-6)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logp, old = torch.log(torch.tensor([[0.9]])), torch.log(torch.tensor([[0.1]]))  # ratio 9
    adv, mask = torch.tensor([[-1.0]]), torch.ones(1, 1)
    assert policy_loss(logp, old, old, adv, mask, (0.2, 0.2))["token_loss"].item() == pytest.approx(9.0, rel=1e-5)
    assert policy_loss(logp, old, old, adv, mask, (0.2, 0.2), dual_clip=3.0)["token_loss"].item() == \
        pytest.approx(3.0)


def test_gspo_uses_the_sequences_mean_log_ratio():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 1.0]]))  # log-ratios log 2 and log 0.5: mean 0, sequence ratio 1
    out = policy_loss(logp, old, old, torch.ones(1, 2), torch.ones(1, 2), (0.2, 0.2), loss_type="gspo")
    assert torch.allclose(out["token_loss"], -torch.ones(1, 2))


def test_token_correction_clip_is_tis_and_mask_is_icepop():
    old = torch.log(torch.tensor([[0.6, 0.6, 0.6, 0.6]]))
    rollout = torch.log(torch.tensor([[0.6, 0.4, 0.2, 0.1]]))  # pi_train / pi_rollout: 1, 1.5, 3, 6
    mask = torch.ones(1, 4)
    tis, clipped = correction_weights(old, rollout, mask, "token", "clip", "ratio", (0.0, 2.0))
    assert torch.allclose(tis, torch.tensor([[1.0, 1.5, 2.0, 2.0]])) and clipped.tolist() == [[0, 0, 1, 1]]
    icepop, masked = correction_weights(old, rollout, mask, "token", "mask", "ratio", (0.5, 2.0))
    assert torch.allclose(icepop, torch.tensor([[1.0, 1.5, 0.0, 0.0]])) and masked.tolist() == [[0, 0, 1, 1]]


def test_sequence_correction_masks_whole_sequences_by_their_geometric_mean():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.1]]))  # geometric means sqrt(2) and 5
    weights, dropped = correction_weights(old, rollout, torch.ones(2, 2), "seq", "mask", "ratio", (0.5, 2.0))
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0], [0.0, 0.0]])) and dropped.tolist() == [[0, 0], [1, 1]]
    tv, _ = correction_weights(old, rollout, torch.ones(2, 2), "token", "mask", "tv", (0.0, 0.3))
    assert torch.allclose(tv, torch.tensor([[1.0, 2.0], [0.0, 0.0]]))  # |p - q|: 0, 0.25 kept; 0.4, 0.4 dropped


def test_off_policy_loss_weights_each_token_and_its_gradient():
    # One update per batch: the proximal policy is the current one, so the ratio is 1 and the gradient of a
    # token's loss is -w * A * grad(log pi), with w the clipped importance weight.
    logits = torch.zeros(1, 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :2]  # two tokens, each with probability 1/3
    rollout = torch.log(torch.tensor([[1 / 3, 1 / 12]]))  # weights 1 and 4 (clipped to 2)
    adv, mask = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    tis = {"level": "token", "mode": "clip", "gating": "ratio", "threshold": (0.0, 2.0)}
    out = policy_loss(logp, logp.detach(), rollout, adv, mask, (0.2, 0.28), correction=tis)
    loss = aggregate(out["token_loss"], mask, "token-mean", 1, 1)
    assert loss.item() == pytest.approx(-3.0) and out["corrected"] == 1 and out["clipped"] == 0
    loss.backward()
    # d/dlogits of -(1 * logp0 + 2 * logp1), with softmax probabilities 1/3: -(e0 + 2 e1) + 3 * (1/3, 1/3, 1/3)
    assert torch.allclose(logits.grad, torch.tensor([[0.0, -1.0, 1.0]]), atol=1e-6)


def test_sequence_mean_aggregation_weighs_every_sequence_the_same():
    values = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(values, mask, "token-mean", 4, 2).item() == pytest.approx(7 / 4)
    assert aggregate(values, mask, "seq-mean-token-mean", 4, 2).item() == pytest.approx((1 + 4) / 2)


def test_kl_estimators_and_their_clamp():
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    log_ratio = math.log(2)
    assert approx_kl(logp, ref, "k1").item() == pytest.approx(log_ratio)
    assert approx_kl(logp, ref, "k2").item() == pytest.approx(log_ratio**2 / 2)
    assert approx_kl(logp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1)
    # The case: a masked prompt position with ref - logp of 95 stays finite, and k3 is capped at 10.
    far = approx_kl(torch.tensor([[-1.0, -100.0]]), torch.tensor([[-1.2, -5.0]]), "k3")
    assert torch.isfinite(far).all() and far[0, 1].item() == 10.0
    assert aggregate(far, torch.tensor([[1.0, 0.0]]), "token-mean", 1, 1).isfinite()


def test_k3_kl_cannot_give_a_huge_gradient_or_a_nan():
    # A sampled token with pi = 1e-4 and pi_ref = 0.5 at coefficient 1e-3: unclamped, k3 = 4990 and the token's
    # gradient coefficient is coef * (1 - pi_ref / pi) = -5, some 5000 times a typical token's. Clamped at 10 as
    # OpenRLHF and veRL clamp it, the estimate stops there and gives that token no gradient; a token within the
    # clamp keeps k3's own gradient, coef * (1 - pi_ref / pi).
    logp = torch.log(torch.tensor([[1e-4, 0.1]])).requires_grad_()
    kl = approx_kl(logp, torch.log(torch.tensor([[0.5, 0.5]])), "k3")
    (1e-3 * kl.sum()).backward()
    assert kl[0, 0].item() == 10.0 and logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(1e-3 * (1 - 0.5 / 0.1))
    # The NaN: a masked position where ref - logp = 95 once overflowed exp and gave inf * 0 = nan in the loss
    # and in every gradient of the step.
    logp = torch.tensor([[-1.0, -100.0]], requires_grad=True)
    loss = 1e-3 * aggregate(approx_kl(logp, torch.tensor([[-1.2, -5.0]]), "k3"), torch.tensor([[1.0, 0.0]]),
                            "token-mean", 1, 1)
    loss.backward()
    assert loss.isfinite() and torch.isfinite(logp.grad).all() and logp.grad[0, 1].item() == 0.0


def test_unbiased_kl_gradient_is_the_same_for_every_estimator():
    grads = []
    for estimator in ("k1", "k2", "k3"):
        logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
        approx_kl(logp, torch.log(torch.tensor([[0.25]])), estimator, logp.detach(), unbiased_gradient=True).sum().backward()
        grads.append(logp.grad.item())
    assert grads == pytest.approx([math.log(2)] * 3)


def test_kl_in_the_reward_sums_each_tokens_later_penalties():
    kl = torch.tensor([[1.0, 2.0, 3.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.allclose(kl_reward_advantages(kl, mask, 0.1), torch.tensor([[-0.6, -0.5, -0.3, 0.0]]))


def test_token_logprobs_and_entropy_use_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    tokens = torch.tensor([[0]])
    assert abs(token_logprobs(logits, tokens).item() - math.log(math.e**2 / (math.e**2 + 1))) < 1e-6
    assert abs(token_logprobs(logits, tokens, 2.0).item() - math.log(math.e / (math.e + 1))) < 1e-6
    assert token_entropy(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))


# ---- log-probs of the nucleus distribution the rollout sampled from (--rollout.top_p < 1) ---------------------------

def _nucleus_logprob(logits_row, token: int, temperature: float, top_p: float) -> float:
    """Directly, one position at a time: vLLM's rule (drop, least likely first, while the dropped mass stays at or
    below 1 - top_p; never the most likely), the chosen token kept, then renormalised over what is kept."""
    probs = torch.softmax(logits_row.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: probs[i])
    kept, dropped_mass = set(range(len(probs))), 0.0
    for i in order[:-1]:
        if dropped_mass + probs[i] > 1 - top_p:
            break
        dropped_mass += probs[i]
        kept.discard(i)
    kept.add(token)
    return math.log(probs[token] / sum(probs[i] for i in kept))


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.98])
def test_the_trainers_log_probs_under_top_p_are_the_nucleus_distributions_computed_directly(top_p):
    from openrlhf_async.trainer.losses import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 6, 40) * 3
    tokens = torch.randint(0, 40, (2, 6))
    got = token_logprobs(logits, tokens, 0.7, top_p)
    for b in range(2):
        for t in range(6):
            want = _nucleus_logprob(logits[b, t], int(tokens[b, t]), 0.7, top_p)
            assert abs(float(got[b, t]) - want) < 1e-5, (b, t, float(got[b, t]), want)
    whole = token_logprobs(logits, tokens, 0.7)
    assert (got >= whole - 1e-6).all() and (got > whole + 1e-3).any(), "the nucleus renormalises upwards"
    assert torch.equal(token_logprobs(logits, tokens, 0.7, 1.0), whole)


def test_under_top_p_only_the_kept_logits_get_gradients_and_the_sampled_token_is_always_kept():
    from openrlhf_async.trainer.losses import token_logprobs

    logits = torch.tensor([[[4.0, 3.0, 0.0, -1.0, -9.0]]], requires_grad=True)
    unlikely = torch.tensor([[4]])  # far outside any nucleus at 0.9, yet vLLM drew it: kept, finite
    value = token_logprobs(logits, unlikely, 1.0, 0.9)
    assert torch.isfinite(value).all()
    value.sum().backward()
    grad = logits.grad[0, 0]
    assert grad[2] == 0 and grad[3] == 0 and grad[0] != 0 and grad[4] != 0, grad


@pytest.mark.parametrize("call", ["train_batch", "with_reference"])
def test_under_top_p_a_policy_equal_to_its_reference_has_a_kl_of_0(call):
    """The KL's two sides are of the same rule: the policy's log-probs of the nucleus vLLM sampled from, the
    reference's of its own (PolicyGroup.with_reference; the train step's and GAE's KL read those). Against the
    reference's whole distribution the KL of an unchanged policy would be -log(nucleus mass) > 0 per token. The two
    sides are one computation here, so the KL is exactly 0. A fake group's passes run a small seeded model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from openrlhf_async.trainer.batching import Layout, target_logprobs
    from openrlhf_async.trainer.ranks import PolicyGroup

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    samples = [{"prompt_ids": [1, 5, 9], "response_ids": [int(t) for t in torch.randint(0, 48, (6 + i,))],
                "action_mask": [1] * (6 + i), "logprobs": [0.0] * (6 + i)} for i in range(3)]

    class Group(PolicyGroup):
        def __init__(self):
            self.seen = []

        def logprobs(self, samples, temperature, reference=False, top_p=1.0):  # policy and reference: one model
            with torch.no_grad():
                logp, _ = target_logprobs(model, Layout.of(samples, packed=False), temperature, top_p=top_p)
            return [logp[i, len(s["prompt_ids"]) - 1: len(s["prompt_ids"]) + len(s["response_ids"]) - 1].tolist()
                    for i, s in enumerate(samples)]

        def _updates(self, samples, *args):
            self.seen = samples
            return [{"tokens": 1, "grad_norm": 0.0}]

    group, top_p, temperature = Group(), 0.7, 0.9
    loss_cfg = {"temperature": temperature, "top_p": top_p, "kl": {"coef": 0.01}, "proximal": "recompute"}
    if call == "train_batch":
        group.train_batch(samples, 4, loss_cfg, len(samples), 1)
        with_refs = group.seen
    else:  # GAE's (pipeline._with_critic)
        with_refs = group.with_reference(samples, temperature, 0.01, top_p)
    policy = group.logprobs(samples, temperature, top_p=top_p)
    whole = group.logprobs(samples, temperature)
    for s, logp, full in zip(with_refs, policy, whole):
        kl = approx_kl(torch.tensor(logp), torch.tensor(s["ref_logprobs"]), "k3")
        assert kl.abs().max() == 0, kl
        assert (torch.tensor(logp) > torch.tensor(full) + 1e-3).any(), "the nucleus dropped nothing: no test"


@pytest.mark.parametrize("flags, weights", [
    ((), [0.1, 1.0, 5.0]),  # TIS: min(w, 5); the mask band's 0.5 is no floor
    (("--algo.advantage.is_correction_threshold", "2"), [0.1, 1.0, 2.0]),
    (("--algo.advantage.is_correction_threshold", "0.5", "5"), [0.5, 1.0, 5.0]),  # a floor the user asked for
])
def test_the_clip_correction_is_one_sided_unless_a_floor_is_given(flags, weights):
    from openrlhf_async.config import parse_config, validate
    from openrlhf_async.trainer.ranks import loss_settings

    cfg = validate(parse_config(["--algo.advantage.is_correction_level", "token",
                                 "--algo.advantage.is_correction_mode", "clip", *flags]))
    c = loss_settings(cfg)["correction"]
    old = torch.zeros(1, 3)
    rollout = -torch.log(torch.tensor([[0.1, 1.0, 8.0]]))  # pi_train / pi_rollout: 0.1, 1 and 8
    got, _ = correction_weights(old, rollout, torch.ones(1, 3), c["level"], c["mode"], c["gating"], c["threshold"])
    assert torch.allclose(got, torch.tensor([weights]), rtol=1e-6), got  # float32's exp and log round to 1e-7
    mask = validate(parse_config(["--algo.advantage.is_correction_level", "token"]))
    assert mask.algo.is_correction_threshold == (0.5, 5.0)  # ICEPOP's band as before
