"""The experience maker (trainer/experience.py) on plain episodes, no ranks: the penalty of truncated responses, the
samples of episodes with segments, group advantages, the batch's figures, and PPO's GAE experience from given values
and log-probs (the KL in the reward, the reward clip)."""

from types import SimpleNamespace

import pytest
import torch

from openrlhf_async.rollout.episode import Episode
from openrlhf_async.trainer import experience


def _episode(reward, response=3, finish="stop", observation=0, segments=()):
    """An episode of `response` tokens the model wrote then `observation` the environment did, with its reward."""
    n = response + observation
    return Episode(request_id="r", prompt_ids=[1, 2], response_ids=list(range(10, 10 + n)), logprobs=[-0.5] * n,
                   action_mask=[1] * response + [0] * observation, finish_reason=finish, score=reward,
                   raw_reward=reward, reward=reward, segments=list(segments))


def _algo(**changes):
    """The config's algo section, as much of it as the experience maker reads."""
    algo = dict(advantage_estimator="group_norm", advantage_no_std_norm=False, advantage_gamma=1.0,
                advantage_lambd=1.0, kl_estimator="k1", kl_use_loss=False)
    return SimpleNamespace(**{**algo, **changes})


def test_the_stop_properly_penalty_scales_or_replaces_only_a_truncated_responses_reward():
    truncated, stopped = _episode(0.8, finish="length"), _episode(0.8)
    assert experience.stop_properly_penalty(truncated, None) == 0.8
    assert experience.stop_properly_penalty(truncated, 0.5) == pytest.approx(0.4)
    assert experience.stop_properly_penalty(truncated, -1.0) == -1.0
    assert experience.stop_properly_penalty(stopped, -1.0) == 0.8
    rewards = experience.batch_rewards([[truncated, stopped]], 0.0)
    assert rewards.dtype == torch.float64 and rewards.tolist() == [[0.0, 0.8]]


def test_an_episode_with_segments_trains_as_a_sample_per_segment_with_its_own_or_the_shared_advantage():
    segment = {"prompt_ids": [7], "response_ids": [8, 9], "logprobs": [-1.0, -2.0], "action_mask": [1, 0]}
    ep = _episode(1.0, segments=[segment])
    shared = experience.training_samples(ep, 0.5)
    assert [s["response_ids"] for s in shared] == [[8, 9], ep.response_ids]  # the earlier segment first
    assert [s["advantage"] for s in shared] == [0.5, 0.5]
    assert shared[0] == {**segment, "advantage": 0.5}
    assert [s["advantage"] for s in experience.training_samples(ep, [0.1, 0.2])] == [0.1, 0.2]


def test_group_samples_carry_each_episodes_advantage_against_its_own_group():
    groups = [[_episode(1.0), _episode(0.0)], [_episode(1.0), _episode(1.0)]]
    rewards = experience.batch_rewards(groups, None)
    samples = experience.group_samples(groups, rewards, _algo(), clip_range=None)
    adv = [s["advantage"] for s in samples]
    assert adv[0] > 0 > adv[1] and adv[0] == pytest.approx(-adv[1])
    assert adv[2:] == [0.0, 0.0]  # a flat group teaches nothing
    clipped = experience.group_samples(groups, torch.tensor([[5.0, 0.0], [1.0, 1.0]], dtype=torch.float64),
                                       _algo(advantage_no_std_norm=True, advantage_estimator="dr_grpo"), (-1.0, 1.0))
    assert [s["advantage"] for s in clipped[:2]] == [1.0, -1.0]  # 5 - 2.5 and 0 - 2.5, each clipped


def test_the_batchs_figures_count_the_models_tokens_apart_from_the_environments():
    groups = [[_episode(1.0, response=4, observation=2), _episode(0.0, response=2, finish="length")]]
    figures = experience.rollout_figures(groups, experience.batch_rewards(groups, None))
    assert figures == {"reward/mean": 0.5, "rollout/response_len_mean": 3.0, "rollout/observation_len_mean": 1.0,
                       "rollout/truncated_ratio": 0.5}


def _gae(rewards, algo, kl_coef=0.0, clip_range=None, refs=None, values=None):
    episodes = [_episode(r, response=n) for r, n in zip(rewards, (2, 3))]
    parts, part_rewards = experience.critic_parts([episodes], torch.tensor([rewards], dtype=torch.float64))
    samples = [experience.training_sample(ep, 0.0) for ep in parts]
    if refs is not None:
        samples = [{**s, "ref_logprobs": ref} for s, ref in zip(samples, refs)]
    values = values or [[0.0] * len(s["response_ids"]) for s in samples]
    olds = [[-1.0] * len(s["response_ids"]) for s in samples]
    return experience.gae_samples(samples, part_rewards, values, olds, algo, kl_coef, clip_range)


def test_gae_returns_are_the_reward_and_its_advantages_are_whitened_over_the_batchs_tokens():
    samples, kl = _gae([1.0, 0.0], _algo(advantage_no_std_norm=True))
    assert [s["returns"] for s in samples] == [[1.0, 1.0], [0.0, 0.0, 0.0]]  # gamma 1: the reward at every token
    # Values 0: the advantages are the returns, centred over the 5 tokens (mean 0.4).
    assert samples[0]["advantage"] == pytest.approx([0.6, 0.6])
    assert samples[1]["advantage"] == pytest.approx([-0.4, -0.4, -0.4])
    assert samples[1]["old_logprobs"] == [-1.0] * 3 and samples[1]["values"] == [0.0] * 3 and kl == 0.0
    whitened, _ = _gae([1.0, 0.0], _algo())
    adv = torch.tensor([a for s in whitened for a in s["advantage"]])
    assert adv.mean() == pytest.approx(0.0, abs=1e-9) and adv.pow(2).mean() == pytest.approx(1.0)


def test_gae_discounts_against_the_critics_values():
    samples, _ = _gae([1.0, 0.0], _algo(advantage_no_std_norm=True, advantage_gamma=0.5, advantage_lambd=0.5),
                      values=[[0.2, 0.4], [0.0, 0.0, 0.0]])
    # delta_1 = 1 - 0.4; delta_0 = 0.5 x 0.4 - 0.2 = 0; A_0 = delta_0 + 0.25 delta_1; returns = A + V.
    assert samples[0]["returns"] == pytest.approx([0.15 + 0.2, 0.6 + 0.4])


def test_the_kl_penalty_goes_into_the_per_token_rewards_unless_it_is_a_loss_and_the_reward_is_clipped():
    refs = [[-1.5, -1.5], [-1.0, -1.0, -1.0]]  # k1 against the old log-probs (-1): 0.5 per token of the first
    samples, kl = _gae([1.0, 0.0], _algo(advantage_no_std_norm=True), kl_coef=0.1, refs=refs)
    assert samples[0]["returns"] == pytest.approx([1.0 - 0.1, 1.0 - 0.05])
    assert kl == pytest.approx((0.5 + 0.0) / 2)  # per sequence, its tokens' mean; then the batch's mean
    as_loss, kl_again = _gae([1.0, 0.0], _algo(advantage_no_std_norm=True, kl_use_loss=True), kl_coef=0.1, refs=refs)
    assert as_loss[0]["returns"] == [1.0, 1.0] and kl_again == kl
    clipped, _ = _gae([5.0, 0.0], _algo(advantage_no_std_norm=True), clip_range=(-1.0, 1.0))
    assert clipped[0]["returns"] == [1.0, 1.0]
