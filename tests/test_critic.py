"""PPO with a critic (--algo.advantage.estimator gae): GAE, returns, the value loss and the KL controller against
numbers worked by hand from OpenRLHF 0.11.2's formulas; the value model against a plain transformers forward; a
2-rank ZeRO-3 critic step against the same step in one process; the critic's checkpoint; a gae run on the CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import preset_config

GAE = ("--algo.advantage.estimator", "gae", "--algo.advantage.gamma", "0.9", "--algo.advantage.lambd", "0.8",
       "--critic.num_gpus_per_node", "2")


# ---- formulas (openrlhf/trainer/ppo_utils/experience_maker.py: get_advantages_and_returns; openrlhf/models/utils.py:
# compute_reward; openrlhf/models/loss.py: ValueLoss; openrlhf/trainer/ppo_utils/kl_controller.py) ---------------------

def test_gae_and_returns_equal_the_numbers_worked_by_hand_masked_observation_tokens_skipped():
    from openrlhf_async.trainer.losses import gae

    values = torch.tensor([[0.5, 0.2, -0.1, 0.0], [0.3, 0.7, 0.1, 0.4]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0]])
    # Row 2: token 1 is an observation (the environment wrote it), token 3 padding.
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    advantages, returns = gae(values, rewards, mask, gamma=0.9, lambd=0.8)
    # Row 1, back to front: delta_2 = 1 - (-0.1) = 1.1; delta_1 = 0.9 x -0.1 - 0.2 = -0.29, A_1 = -0.29 + 0.72 x 1.1;
    # delta_0 = 0.9 x 0.2 - 0.5 = -0.32, A_0 = -0.32 + 0.72 x 0.502. Row 2: A_2 = 2 - 0.1 = 1.9; token 0's next model
    # token is 2, two positions on: delta_0 = 0.81 x 0.1 - 0.3 = -0.219, A_0 = -0.219 + 0.81 x 0.8 x 1.9 = 1.0122.
    expected = torch.tensor([[0.04144, 0.502, 1.1, 0.0], [1.0122, 0.0, 1.9, 0.0]], dtype=torch.float64)
    assert torch.allclose(advantages, expected, atol=1e-9)
    assert torch.allclose(returns, torch.tensor([[0.54144, 0.702, 1.0, 0.0], [1.3122, 0.0, 2.0, 0.0]],
                                                dtype=torch.float64), atol=1e-9)


def test_at_lambda_1_gae_equals_openrlhfs_own_function_on_the_models_tokens_of_a_multi_turn_row():
    """The numbers OpenRLHF 0.11.2's get_advantages_and_returns gives for a row whose second token is an observation
    (its compute_reward with reward 1 and coefficient 0.1), at lambda 1, where skipping the observation changes
    nothing (below 1 OpenRLHF's take it as a step of value 0: test_a_tool_output_between_two_turns_...)."""
    from openrlhf_async.trainer.losses import gae, token_rewards

    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0]])
    values = torch.tensor([[0.9, 0.5, 0.7, 0.2, 0.4]])
    rewards = token_rewards(torch.tensor([1.0]), torch.tensor([[0.3, 0.1, 0.2, -0.1, 0.05]]), mask, 0.1)
    a, r = gae(values, rewards, mask, 1.0, 1.0)
    model = mask[0].bool()
    assert torch.allclose(a[0][model].float(), torch.tensor([0.495, 0.805, 0.595]), atol=1e-4), a
    assert torch.allclose(r[0][model].float(), torch.tensor([0.995, 1.005, 0.995]), atol=1e-4), r


def _plain_gae(values: list, rewards: list, gamma: float, lambd: float) -> list:
    """Textbook GAE over consecutive steps, the last followed by nothing."""
    out, running = [0.0] * len(values), 0.0
    for t in reversed(range(len(values))):
        following = values[t + 1] if t + 1 < len(values) else 0.0
        running = rewards[t] + gamma * following - values[t] + gamma * lambd * running
        out[t] = running
    return out


def _tool_row(seed: int, observation: int = 200):
    """Two model turns of 3 and 4 tokens around a tool's output of `observation` tokens, with random values (the
    critic's at observation tokens too, which must not count) and random per-token rewards."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([1.0] * 3 + [0.0] * observation + [1.0] * 4)
    values = torch.rand(len(mask), generator=g, dtype=torch.float64)
    rewards = torch.rand(len(mask), generator=g, dtype=torch.float64) * mask
    return values.unsqueeze(0), rewards.unsqueeze(0), mask.unsqueeze(0)


def test_a_tool_output_between_two_turns_is_skipped_by_gae_not_taken_as_steps_of_value_0():
    """Below lambda 1 a 200-token tool output taken as steps of value 0 gives the token before the call delta = -V_t
    and a future scaled by 0.95^200: its advantage about -V_t. Over the model's own tokens only (veRL's rule) it is
    GAE on the row with the observation cut out (gamma 1: no distance to count). float64 over 207 steps: 1e-12."""
    from openrlhf_async.trainer.losses import gae

    values, rewards, mask = _tool_row(0)
    a, r = gae(values, rewards, mask, gamma=1.0, lambd=0.95)
    model = mask[0].bool()
    want = _plain_gae(values[0][model].tolist(), rewards[0][model].tolist(), 1.0, 0.95)
    assert torch.allclose(a[0][model], torch.tensor(want, dtype=torch.float64), atol=1e-12), (a[0][model], want)
    assert torch.allclose(r[0][model], a[0][model] + values[0][model], atol=1e-12)
    calling = 2  # the last token before the call: its advantage stays near the future's, not near -V
    assert a[0, calling] > -values[0, calling] + 0.1, float(a[0, calling])


@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_at_lambda_1_skipping_a_tool_output_leaves_gae_as_it_was(gamma):
    """At lambda 1 the advantage is the reward to come, discounted by position, minus V_t (what taking observation
    tokens as steps of value and reward 0 gives too: their values cancel in the telescoping sum)."""
    from openrlhf_async.trainer.losses import gae

    values, rewards, mask = _tool_row(1)
    a, r = gae(values, rewards, mask, gamma=gamma, lambd=1.0)
    n, model = mask.shape[1], mask[0].bool()
    to_come = torch.tensor([sum(gamma ** (k - t) * float(rewards[0, k]) for k in range(t, n)) for t in range(n)],
                           dtype=torch.float64)
    assert torch.allclose(a[0][model], (to_come - values[0])[model], atol=1e-12)
    assert torch.allclose(r[0][model], to_come[model], atol=1e-12)


def test_token_rewards_put_the_reward_at_the_last_token_the_model_wrote_and_the_kl_penalty_on_each():
    from openrlhf_async.trainer.losses import token_rewards

    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = token_rewards(torch.tensor([1.0, -1.0]), kl, mask, kl_coef=0.5)
    assert torch.allclose(out, torch.tensor([[-0.05, -0.1 + 1.0, 0.0], [-0.2, 0.0, -0.1 - 1.0]]))
    assert torch.equal(token_rewards(torch.tensor([1.0, -1.0]), kl, mask, kl_coef=-1.0),
                       torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, -1.0]]))  # a negative coefficient counts as 0


def test_the_value_loss_takes_the_worse_of_the_new_and_the_clipped_value_halved():
    from openrlhf_async.trainer.losses import value_loss

    values, old, returns = torch.tensor([0.4, 0.9, 0.6]), torch.tensor([1.2, 0.0, 0.5]), torch.tensor([1.0, 1.0, 0.5])
    # (0.4 - 1)^2 = 0.36 beats the clipped 0.7's 0.09; the clipped 0.5's (0.5 - 1)^2 = 0.25 beats 0.01; inside the
    # clip both are 0.01.
    assert torch.allclose(value_loss(values, old, returns, clip=0.5), torch.tensor([0.18, 0.125, 0.005]))
    assert torch.allclose(value_loss(values, old, returns, clip=None), torch.tensor([0.18, 0.005, 0.005]))


def test_the_adaptive_kl_controller_moves_the_coefficient_by_the_clipped_error_and_the_fixed_one_stays():
    from openrlhf_async.trainer.losses import KLController

    adaptive = KLController(0.1, target=0.05, horizon=100)
    assert adaptive.update(0.1, 10) == pytest.approx(0.1 * 1.02)  # error 1.0 clipped to 0.2, x 10 / 100
    assert adaptive.update(0.045, 10) == pytest.approx(0.1 * 1.02 * 0.99)  # error -0.1
    assert KLController(0.1).update(5.0, 10) == 0.1


def test_the_critics_ranks_count_among_the_gpus_a_gae_run_needs():
    from openrlhf_async.cli.train_async import resources

    cfg = preset_config(*GAE)
    cfg.device = "cuda"
    assert resources(cfg)["gpus"] == 1 + 2 + 2  # the engine, the policy's ranks, the critic's
    cfg.algo.advantage_estimator = "group_norm"
    assert resources(cfg)["gpus"] == 3


def test_gae_is_accepted_with_openrlhfs_critic_flags_in_both_spellings():
    cfg = preset_config(*GAE, "--critic.adam.lr", "5e-6", "--critic.value_clip", "0.2", "--critic.freezing_steps",
                        "3", "--algo.kl.target", "0.05", "--algo.kl.horizon", "500")
    assert (cfg.algo.advantage_gamma, cfg.algo.advantage_lambd) == (0.9, 0.8)
    assert (cfg.critic.adam_lr, cfg.critic.value_clip, cfg.critic.freezing_steps) == (5e-6, 0.2, 3)
    assert (cfg.algo.kl_target, cfg.algo.kl_horizon) == (0.05, 500)
    old = preset_config("--advantage_estimator", "gae", "--critic_learning_rate", "7e-6", "--lambd", "0.95",
                        "--value_clip", "0.3", "--freezing_actor_steps", "2")
    assert (old.critic.adam_lr, old.algo.advantage_lambd, old.critic.value_clip, old.critic.freezing_steps) == \
        (7e-6, 0.95, 0.3, 2)


# ---- the value model (no Ray) ----------------------------------------------------------------------------------------

def test_the_value_model_is_the_causal_lms_body_and_a_head_saved_and_loaded_in_openrlhfs_format(tiny_model_path,
                                                                                              tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModel

    from openrlhf_async.models.value import build_value_model

    torch.manual_seed(0)
    model = build_value_model(tiny_model_path, {"dtype": torch.float32})
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(tiny_model_path)(input_ids=ids).last_hidden_state
        assert torch.allclose(model(ids), (hidden @ model.score.weight.T).squeeze(-1), atol=1e-5)
        assert 0 < model.score.weight.std() < 2 / model.config.hidden_size  # OpenRLHF's init: std 1 / (hidden + 1)
    model.save(str(tmp_path / "critic"), dict(model.named_parameters()))
    saved = load_file(str(tmp_path / "critic" / "model.safetensors"))
    assert "score.weight" in saved and any(k.startswith("model.layers.0.") for k in saved)
    again = build_value_model(str(tmp_path / "critic"), {"dtype": torch.float32})
    with torch.no_grad():
        assert torch.equal(again.score.weight, model.score.weight) and torch.allclose(again(ids), model(ids))


# ---- a 2-rank ZeRO-3 critic group ----------------------------------------------------------------------------------

# The critic's step in a form whose every coordinate tells its gradient: Adam with betas 0 and an epsilon of 1, learning
# rate 1, no weight decay, no clipping, a constant schedule moves each weight by -g / (|g| + 1), smooth in g. The usual
# first Adam step, lr * sign(g), is not: a near-zero gradient summed in another order on 2 ranks flips its sign and
# moves the weight the whole learning rate the other way (what a per-weight atol after an lr 1e-3 step once hit).
EXACT_STEP = ("--critic.adam.betas", "0", "0", "--critic.adam.eps", "1", "--critic.adam.lr", "1",
              "--critic.adam.weight_decay", "0", "--critic.max_norm", "0", "--critic.lr_scheduler", "constant")


def _samples(tiny_model_path):
    from test_weight_sync import _prompt_ids

    prompts = _prompt_ids(tiny_model_path, 4)
    return [{"prompt_ids": p, "response_ids": [20 + i, 21, 22, 23], "action_mask": [1, 1, 0, 1],
             "values": [0.1, -0.2, 0.0, 0.3], "returns": [1.0, 0.5, 0.0, -1.0]} for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def critic(ray_cluster, tiny_model_path):
    from openrlhf_async.trainer.critic import CriticGroup

    cfg = preset_config(*GAE, *EXACT_STEP)
    group = CriticGroup(cfg, tiny_model_path)
    yield cfg, group
    group.shutdown()


@pytest.fixture
def critic_sequence_parallel(ray_cluster, tiny_model_path):
    """Both ranks share each packed row (--ds.ring_attn_size 2, trainer/sequence_parallel.py)."""
    from openrlhf_async.trainer.critic import CriticGroup

    cfg = preset_config(*GAE, *EXACT_STEP, "--ds.ring_attn_size", "2")
    group = CriticGroup(cfg, tiny_model_path)
    yield cfg, group
    group.shutdown()


@pytest.mark.parametrize("ranks", ["critic", "critic_sequence_parallel"])
def test_a_two_rank_zero3_critic_step_moves_every_weight_as_one_process_would(ranks, ray_cluster, tiny_model_path,
                                                                              tmp_path, request):
    """ray_cluster named here: the test then runs among the shared Ray's tests (conftest sorts by it)."""
    import ray
    from safetensors.torch import load_file

    from openrlhf_async.trainer.batching import Layout
    from openrlhf_async.models.value import build_value_model
    from openrlhf_async.trainer.losses import value_loss

    cfg, group = request.getfixturevalue(ranks)
    samples = _samples(tiny_model_path)
    ray.get(group.call("save_hf", str(tmp_path / "before")))
    model = build_value_model(str(tmp_path / "before"), {"dtype": torch.float32})
    values = group.values(samples)
    with torch.no_grad():  # the group's values are the model's at each response position
        for s, v in zip(samples, values):
            p = len(s["prompt_ids"])
            own = model(torch.tensor([s["prompt_ids"] + s["response_ids"]]))[0, p - 1 : -1]
            assert torch.allclose(torch.tensor(v), own, atol=1e-5)

    c = cfg.critic
    assert (c.adam_betas, c.adam_eps, c.adam_lr, c.adam_weight_decay, c.max_norm, c.lr_scheduler) == \
        ((0.0, 0.0), 1.0, 1.0, 0.0, 0.0, "constant")
    stats = group.train_step(samples, 2, {"value_clip": 0.5})
    assert stats["critic/lr"] == 1.0
    # The same step in one process: the clipped value loss over the batch's 12 trained tokens, its gradient g, and
    # the move -g / (|g| + 1) the settings above give (torch's AdamW: m = g, v = g^2, no bias correction left).
    layout = Layout.of(samples, packed=False)
    out = layout.per_sample(model(layout.ids, attention_mask=layout.attention_mask)[:, :-1])
    rows = {key: torch.zeros_like(out) for key in ("mask", "values", "returns")}
    for i, s in enumerate(samples):
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        for key, field in (("mask", "action_mask"), ("values", "values"), ("returns", "returns")):
            rows[key][i, p - 1 : p + r - 1] = torch.tensor(s[field], dtype=torch.float32)
    loss = (value_loss(out, rows["values"], rows["returns"], 0.5) * rows["mask"]).sum() / rows["mask"].sum()
    assert stats["critic/value_loss"] == pytest.approx(float(loss.detach()), rel=1e-4)
    loss.backward()
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    ray.get(group.call("save_hf", str(tmp_path / "after")))
    before, after = load_file(str(tmp_path / "before" / "model.safetensors")), \
        load_file(str(tmp_path / "after" / "model.safetensors"))
    assert set(after) == set(grads)
    # Both sides compute g in fp32 and differ only in summation order (2 ranks' micro batches reduced by gloo, ZeRO's
    # partitions): a relative error of order 1e-6 in each sum (measured: at most 4e-6 of a tensor's move), so 1e-3 in
    # norm is far above that and far below what a wrong loss normalisation, a lost micro batch or rank, or a wrong
    # scale of g gives (10% or more of the move). Storing w - u in fp32 rounds each weight by at most half an ulp of the
    # result: one ulp of every stored weight, in norm, bounds that (measured: 7e-5 of the move of the layer norms'
    # weights, which sit near 1 and move little). Every tensor is checked on its own, so a tensor with small gradients
    # cannot hide behind the big ones.
    for name, g in grads.items():
        moved, expected = after[name] - before[name], -g / (g.abs() + 1.0)
        if not expected.any():
            assert not moved.any(), f"{name} moved where one process leaves it"
            continue
        ulps = (torch.nextafter(after[name].abs(), torch.tensor(float("inf"))) - after[name].abs()).norm()
        error = (moved - expected).norm()
        assert error <= 1e-3 * expected.norm() + ulps, \
            f"{name} moved {error / expected.norm():.2%} away from the one-process step (rounding: {ulps:.2e})"


def test_a_critic_checkpoint_resumes_exactly(critic, tiny_model_path, tmp_path):
    import ray

    _, group = critic
    samples = _samples(tiny_model_path)
    ray.get(group.call("save_checkpoint", str(tmp_path / "ckpt")))
    first = group.train_step(samples, 2, {"value_clip": 0.5})
    ray.get(group.call("load_checkpoint", str(tmp_path / "ckpt")))
    again = group.train_step(samples, 2, {"value_clip": 0.5})
    assert again == first


# ---- the CLI (a Ray of its own: runs before the session's stack) ---------------------------------------------------

@pytest.mark.long  # 130 s; make test runs OpenRLHF's PPO command line with a critic instead (test_reward_model.py)
def test_a_gae_run_trains_the_critic_beside_the_policy_and_saves_it_in_openrlhfs_format(tmp_path, tiny_model_path):
    from openrlhf_async.config import preset_path
    from openrlhf_async.models.value import build_value_model

    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
           "--actor.model_name_or_path", tiny_model_path, *GAE, "--algo.kl.init_coef", "0.01",
           "--algo.kl.target", "0.01", "--critic.adam.lr", "1e-4", "--critic.save_value_network",
           "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "8",
           "--rollout.vllm_generate_batch_size", "8", "--train.max_steps", "2", "--eval.steps", "-1",
           "--ckpt.save_steps", "1", "--runs_dir", str(tmp_path / "runs"), "--run_name", "ppo", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "ppo"
    trained = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m.get("step")]
    assert [m["weight_version"] for m in trained] == [1, 2]
    for m in trained:
        assert m["critic/value_loss"] > 0 and m["critic/grad_norm"] > 0 and m["timing/critic_s"] > 0
        assert m["updates"] == 2  # two mini batches of 8 from 16 samples: the critic's too
    assert trained[1]["kl_coef"] != trained[0]["kl_coef"]  # the adaptive controller moved it
    spans = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert {"critic 0", "critic 1"} <= {s["actor"] for s in spans}
    assert os.path.isdir(run_dir / "ckpt" / "step_2" / "critic")
    saved = build_value_model(str(run_dir / "final_hf_critic"), {"dtype": torch.float32})
    assert saved.score.weight.abs().sum() > 0
