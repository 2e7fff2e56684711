"""ZeRO-3 on 2 gloo ranks computes the same gradient as plain PyTorch in one process."""

import os

import ray
import torch

from openrlhf_async.trainer.losses import policy_loss, token_logprobs


def _reference_grad_norm(model_path, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    global_tokens = sum(len(s["response_ids"]) for s in samples)
    total = 0.0
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        logp = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        mask = torch.zeros_like(logp)
        mask[0, p - 1 : p + r - 1] = 1
        old = torch.zeros_like(logp)
        old[0, p - 1 : p + r - 1] = torch.tensor(s["logprobs"])
        out = policy_loss(logp, logp.detach(), old, mask * s["advantage"], mask, (0.2, 0.28))
        total = total + (out["token_loss"] * mask).sum() / global_tokens
    total.backward()
    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()


def test_zero3_gradients_match_a_single_process_reference(ray_cluster, stack_cfg, tiny_model_path, tmp_path):
    # DeepSpeed 0.19.6 waits on only the last of several asynchronous collectives; on gloo that gave a gradient
    # norm of 1e18 on a fresh group's first step, and a different one on every run. The policy makes collectives
    # synchronous on CPU. A fresh group, because the shared one has been through steps that hide the race.
    from openrlhf_async.trainer.policy import PolicyGroup, loss_settings

    assert stack_cfg.ds.zero_stage == 3 and stack_cfg.actor.world_size == 2
    policy = PolicyGroup(stack_cfg, tiny_model_path)
    samples = [{"prompt_ids": [3, 20 + i, 21, 4], "response_ids": [20, 21, 22], "logprobs": [-3.0] * 3,
                "advantage": 1.0 - 2 * (i % 2)} for i in range(6)]
    try:
        weights = tiny_model_path
        for micro_batch_size in (64, 2, 1):  # one micro batch, then accumulation over several
            expected = _reference_grad_norm(weights, samples)
            stats = policy.train_step(samples, micro_batch_size, loss_settings(stack_cfg, correction={"level": "off"}))
            assert abs(stats["grad_norm"] - expected) <= 1e-4 * expected, (micro_batch_size, stats, expected)
            weights = str(tmp_path / f"after-{micro_batch_size}")
            ray.get(policy.call("save_hf", weights))
    finally:
        for actor in policy.actors:
            ray.kill(actor)


def test_a_checkpoint_restores_weights_and_optimizer_exactly(restore_weights, policy, stack_cfg, tmp_path):
    import os

    from openrlhf_async.trainer import checkpoint
    from openrlhf_async.trainer.policy import loss_settings
    from openrlhf_async.utils.ray_utils import get_all

    samples = [{"prompt_ids": [1, 2, 3], "response_ids": [4 + i, 5, 6], "logprobs": [-1.0] * 3, "advantage": a,
                "action_mask": [1, 1, 1]} for i, a in enumerate((1.0, -1.0, 0.5, -0.5))]
    settings = loss_settings(stack_cfg)

    def weight():
        return get_all(policy.call("read_weight", "model.layers.0.mlp.down_proj.weight"))[0]

    root = str(tmp_path / "ckpt")
    policy.train_step(samples, 4, settings)  # the optimizer holds moments worth restoring
    checkpoint.save(root, 1, policy, {"note": "test"}, keep=2)
    saved = weight()
    policy.train_step(samples, 4, settings)
    one_step_on = weight()
    assert not torch.equal(saved, one_step_on)
    checkpoint.load(os.path.join(root, "step_1"), policy)
    assert torch.equal(weight(), saved)
    policy.train_step(samples, 4, settings)
    assert torch.equal(weight(), one_step_on), "the same step from the checkpoint must give the same weights"

    for step in (2, 3):
        checkpoint.save(root, step, policy, {}, keep=2)
    os.makedirs(os.path.join(root, "step_4.partial"))  # a save cut short by a kill
    assert [step for step, _ in checkpoint.complete_checkpoints(root)] == [2, 3]


def test_checkpoints_with_hf_weights_and_without_deepspeed_state(policy, stack_cfg, tmp_path):
    """--ckpt.save_hf adds an HF model to a checkpoint; --ckpt.disable_ds leaves the DeepSpeed state out, and such a
    checkpoint is refused for resuming, naming its HF folder."""
    import json

    import pytest

    from openrlhf_async.config import ConfigError, config_with
    from openrlhf_async.trainer import checkpoint

    root = str(tmp_path / "ckpt")
    both = checkpoint.save(root, 1, policy, {}, keep=3, hf=True)
    assert os.path.isfile(os.path.join(both, "hf", "config.json")) and os.path.isdir(os.path.join(both, "deepspeed"))
    hf_only = checkpoint.save(root, 2, policy, {}, keep=3, deepspeed=False, hf=True)
    assert os.listdir(hf_only) and not os.path.exists(os.path.join(hf_only, "deepspeed"))
    assert json.load(open(os.path.join(hf_only, checkpoint.STATE_FILE)))["deepspeed"] is False
    state = json.load(open(os.path.join(both, checkpoint.STATE_FILE)))
    state.update(weight_version=1, eval_start=None, data_position={"frontier": 0}, data={"num_prompts": 4, "seed": 1})
    with open(os.path.join(hf_only, checkpoint.STATE_FILE), "w") as f:
        json.dump({**state, "step": 2, "deepspeed": False}, f)
    cfg = config_with(stack_cfg, ckpt={"path": root, "load_enable": True})
    with pytest.raises(ConfigError, match="was saved with --ckpt.disable_ds"):
        checkpoint.find_resume(cfg)


def test_the_clip_acts_from_the_second_mini_batch_update_against_the_recomputed_proximal_policy(
        restore_weights, policy, stack_cfg, tmp_path):
    """PPO's updates on one rollout batch: 8 samples in mini batches of 4, two epochs (4 optimizer steps), each
    clipped against the weights before the first. The first update's ratio is 1 (nothing clipped); later ones move
    away from it, so a tight clip range clips tokens and changes where the weights end, and a loose one clips none."""
    from openrlhf_async.trainer.policy import loss_settings
    from openrlhf_async.utils.ray_utils import get_all

    samples = [{"prompt_ids": [3, 20 + i, 21, 4], "response_ids": [20 + i % 3, 21, 22, 23], "logprobs": [-2.0] * 4,
                "advantage": 5.0 - 10 * (i % 2), "action_mask": [1, 1, 1, 1]} for i in range(8)]
    start = str(tmp_path / "start")
    get_all(policy.call("save_checkpoint", start))

    def run(clip):
        get_all(policy.call("load_checkpoint", start))
        stats = policy.train_batch(samples, 4, loss_settings(stack_cfg, clip=clip), mini_batch_size=4, epochs=2)
        return stats, get_all(policy.call("read_weight", "model.layers.0.mlp.down_proj.weight"))[0]

    tight, tight_weights = run((0.001, 0.001))
    loose, loose_weights = run((100.0, 100.0))
    assert tight["updates"] == loose["updates"] == 4
    assert tight["clip_ratio"] > 0 and loose["clip_ratio"] == 0
    assert not torch.equal(tight_weights, loose_weights)
    # One update per batch: the proximal policy is the current one and nothing is clipped, whatever the range.
    get_all(policy.call("load_checkpoint", start))
    single = policy.train_batch(samples, 4, loss_settings(stack_cfg, clip=(0.001, 0.001)), mini_batch_size=8, epochs=1)
    assert single["updates"] == 1 and single["clip_ratio"] == 0
    # Clipped against the rollout's own log-probs (a stale batch's sampler), the clip bounds even a single update.
    get_all(policy.call("load_checkpoint", start))
    bypass = policy.train_batch(samples, 4, loss_settings(stack_cfg, clip=(0.2, 0.2), proximal="rollout"),
                                mini_batch_size=8, epochs=1)
    assert bypass["updates"] == 1 and bypass["clip_ratio"] > 0
