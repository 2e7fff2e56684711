"""The policy's ranks: ZeRO-3 on 2 gloo ranks takes the same step as one process would, checkpoints restore it
exactly, and PPO's mini-batch updates clip against the proximal policy."""

import os

import pytest
import ray
import torch

# The distributed step's settings: token-level TIS against the rollout's log-probs, a k3 KL loss against the
# reference model, no gradient clipping. Adam with betas 0 and an epsilon of 1 moves each weight by
# lr * g / (|g| + 1): a step whose every coordinate tells its gradient, where the usual Adam's first step is
# lr * sign(g) and would hide a wrong scale. The rest is the tests' preset.
EXACT_STEP = ("--algo.kl.init_coef", "0.05", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
              "--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
              "--algo.advantage.is_correction_threshold", "0", "2", "--actor.eps_clip_low_high", "0.2", "0.28",
              "--actor.adam.betas", "0", "0", "--actor.adam.eps", "1", "--actor.adam.lr", "1",
              "--actor.adam.weight_decay", "0", "--actor.max_norm", "0", "--actor.lr_scheduler", "constant")
KL_COEF, TIS_HIGH = 0.05, 2.0


def _uneven_samples() -> list:
    """Rank 0 gets the even samples: long responses of two model turns around 7 observation tokens (masked out of
    the loss); rank 1 the odd ones: 2-token answers. Per-rank token counts 3 x 13 against 3 x 2, so a rank that
    normalised by its own count would scale its gradient by 45 / 39 and 45 / 6. Rollout log-probs spread over
    [-6, -1] so TIS weights vary and some clip at 2; advantages of both signs."""
    g = torch.Generator().manual_seed(7)
    samples = []
    for i in range(6):
        prompt = [3] + [20 + (i + k) % 10 for k in range(2 + i)] + [4]
        if i % 2 == 0:
            mask = [1] * 4 + [0] * 7 + [1] * 9
        else:
            mask = [1, 1]
        response = [20 + int(x) for x in torch.randint(0, 10, (len(mask),), generator=g)]
        logprobs = [(-1.0 - 5.0 * float(x)) * m for x, m in zip(torch.rand(len(mask), generator=g), mask)]
        samples.append({"prompt_ids": prompt, "response_ids": response, "logprobs": logprobs, "action_mask": mask,
                        "advantage": (1.5, -0.5, -1.0, 2.0, 0.25, -0.75)[i]})
    return samples


def _reference_gradients(weights: str, reference: str, samples: list) -> dict:
    """The whole batch's gradient in one process, written out from the definitions (OpenRLHF 0.11.2's
    PolicyLoss and compute_approx_kl, token-mean over the batch's model tokens), one sample at a time, unpadded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    tokens = sum(sum(s["action_mask"]) for s in samples)
    total = 0.0
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        p = len(s["prompt_ids"])
        targets = ids[0, p:]
        logp = torch.log_softmax(model(input_ids=ids).logits[0, p - 1 : -1].float(), -1)[range(len(targets)), targets]
        with torch.no_grad():
            ref = torch.log_softmax(ref_model(input_ids=ids).logits[0, p - 1 : -1].float(), -1)
            ref = ref[range(len(targets)), targets]
        mask = torch.tensor(s["action_mask"], dtype=torch.float32)
        ratio = torch.exp(logp - logp.detach())  # one update: the proximal policy is the current one
        tis = torch.exp(logp.detach() - torch.tensor(s["logprobs"])).clamp(0, TIS_HIGH)
        a = s["advantage"]
        pg = -tis * torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
        kl = (torch.exp(ref - logp) - 1 + (logp - ref)).clamp(-10, 10)
        total = total + ((pg + KL_COEF * kl) * mask).sum() / tokens
    total.backward()
    return {name: param.grad.detach().clone() for name, param in model.named_parameters()}


def _weights(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("layout", [
    pytest.param((), id="padded-chunked-logprobs"),
    pytest.param(("--actor.logprobs_chunk_size", "0"), id="padded-whole-logits"),
    pytest.param(("--ds.packing_samples", "--actor.logprobs_chunk_size", "7"), id="packed"),
    pytest.param(("--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "40", "--rollout.max_tokens_per_gpu",
                  "30"), id="token-budget-packed"),
    # Both ranks share every packed row, each running the model on half its tokens (trainer/sequence_parallel.py).
    # make test runs the token-budget and two-group forms (N = 4 in fp64: test_sequence_parallel.py); the others are
    # in make test-long.
    pytest.param(("--ds.ring_attn_size", "2", "--actor.logprobs_chunk_size", "7"), id="sequence-parallel",
                 marks=pytest.mark.long),
    pytest.param(("--ds.ring_attn_size", "2", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "20",
                  "--actor.gradient_checkpointing_enable"), id="sequence-parallel-token-budget-checkpointed"),
    pytest.param(("--actor.num_gpus_per_node", "4", "--ds.ring_attn_size", "4"), id="sequence-parallel-4",
                 marks=pytest.mark.long),
    # Two data-parallel groups of 2, with uneven samples (the group of rank 0 gets the long ones).
    pytest.param(("--actor.num_gpus_per_node", "4", "--ds.ring_attn_size", "2"),
                 id="sequence-parallel-2x2"),
])
def test_a_zero3_step_on_uneven_masked_data_with_tis_and_kl_moves_every_weight_as_one_process_would(
        ray_cluster, tiny_model_path, tmp_path, layout):
    """Two steps on 2 ZeRO-3 ranks with uneven token counts, observation tokens, TIS and the KL loss, micro batches
    of 2 (uneven on each rank) accumulated: the weights after each step against the single-process gradient,
    every coordinate. The second step starts away from the reference model, so the KL term has a gradient too.
    DeepSpeed 0.19.6 on gloo once gave 1e18 gradients on a fresh group (the policy makes collectives synchronous on
    CPU): a fresh group for that reason too."""
    from conftest import preset_config
    from openrlhf_async.trainer.ranks import PolicyGroup, loss_settings

    cfg = preset_config(*EXACT_STEP, *layout)
    assert cfg.ds.zero_stage == 3 and cfg.actor.world_size in (2, 4)
    policy = PolicyGroup(cfg, tiny_model_path)
    samples = _uneven_samples()
    try:
        before = tiny_model_path
        ray.get(policy.call("save_hf", str(tmp_path / "w0")))
        start = _weights(str(tmp_path / "w0"))
        for step in (1, 2):
            expected_grads = _reference_gradients(before, tiny_model_path, samples)
            stats = policy.train_step(samples, 2, loss_settings(cfg))
            assert stats["lr"] == 1.0 and stats["is_filter_ratio"] > 0, "the TIS weights must clip somewhere"
            if step == 2:
                assert stats["kl"] > 0
            after = str(tmp_path / f"w{step}")
            ray.get(policy.call("save_hf", after))
            end = _weights(after)
            moved = torch.cat([(end[n] - start[n]).flatten() for n in expected_grads])
            g = torch.cat([expected_grads[n].flatten() for n in expected_grads])
            expected = -g / (g.abs() + 1.0)
            error = ((moved - expected).norm() / expected.norm()).item()
            assert error < 1e-3, f"step {step}: the weights moved {error:.2%} away from the one-process step"
            before, start = after, end
    finally:
        for actor in policy.actors:
            ray.kill(actor)


def test_a_checkpoint_restores_weights_and_optimizer_exactly(restore_weights, policy, stack_cfg, tmp_path):
    import os

    from openrlhf_async.trainer import checkpoint
    from openrlhf_async.trainer.ranks import loss_settings
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
    from openrlhf_async.trainer.ranks import loss_settings
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


def test_rendezvous_ports_are_free_and_outside_the_range_outbound_connections_take_ports_from():
    """A rank's TCPStore binds its port seconds after it was chosen; a port from the kernel's ephemeral range can be
    taken meanwhile as the source port of any outbound connection (a CI run failed with EADDRINUSE so)."""
    import socket

    from openrlhf_async.utils.ports import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # not one fixed number that two runs on a machine would both take
    for port in ports:
        assert 20000 <= port < low, (port, low, high)
        with socket.socket() as s:
            s.bind(("", port))  # free to listen on


def test_a_cpu_rank_builds_no_shared_memory_op_which_deepspeed_only_needs_for_inference(monkeypatch):
    """On gloo the ranks skip DeepSpeed's shared-memory all-reduce, a C++ build of about 25 s at a first run. The
    skip is set where DeepSpeed's backend looks it up: set on `deepspeed.comm.torch` read as an attribute (PyTorch
    itself), it left every fresh machine compiling the op."""
    import importlib

    from openrlhf_async.trainer.rank import skip_shared_memory_op

    comm_torch = importlib.import_module("deepspeed.comm.torch")
    original = comm_torch.build_shm_op
    monkeypatch.setattr(comm_torch, "build_shm_op", original)  # put back after the test
    skip_shared_memory_op()
    called = comm_torch.TorchBackend.__init__.__globals__["build_shm_op"]  # what init_distributed's backend calls
    assert called is not original and called() is None
