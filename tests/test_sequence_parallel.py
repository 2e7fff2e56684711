"""Sequence parallelism (--ds.ring_attn_size, trainer/sequence_parallel.py): a packed row split across N gloo
processes gives the log-probs, entropies, loss and gradients of the row in one process, for head counts that split
evenly, that need their key/value heads repeated, and that need padding; and the flag's checks. The DeepSpeed ranks'
steps with it are in test_policy.py and test_critic.py, OpenRLHF's script trains with it in
test_openrlhf_scripts.py."""

import json
import os

import pytest
import torch

from conftest import preset_config
from openrlhf_async.config import ConfigError
from openrlhf_async.utils.ports import free_port

LAYERS = 2
UNIT_ROUNDOFF = 2.0**-53  # float64


def _model(attention: str, heads: int, kv_heads: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=50, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128)
    return Qwen2ForCausalLM._from_config(config, attn_implementation=attention, dtype=torch.float64)


def _samples() -> list:
    """Three samples of 10, 7 and 13 tokens: one packed row of 30, which no N here divides but 2."""
    g = torch.Generator().manual_seed(1)
    return [{"prompt_ids": torch.randint(1, 50, (p,), generator=g).tolist(),
             "response_ids": torch.randint(1, 50, (r,), generator=g).tolist()} for p, r in ((3, 7), (5, 2), (4, 9))]


def _loss_and_gradient(model, sequence) -> tuple:
    """A loss of every target's log-prob (weights of both signs) and entropy, as the policy loss reads them."""
    from openrlhf_async.trainer.batching import Layout, target_logprobs

    layout = Layout.of(_samples(), packed=True)
    logp, entropy = target_logprobs(model, layout, 1.0, chunk=0, entropy=True, sequence=sequence)
    weights = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)
    loss = ((logp * weights + 0.1 * entropy) * layout.valid).sum()
    loss.backward()
    return logp.detach(), loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


# (query heads, key/value heads) per group size: heads that split evenly, key/value heads repeated to the query heads
# (the tiny model's one), an odd count padded with a zero head, more ranks than heads.
HEAD_LAYOUTS = {2: [(2, 1), (3, 3), (4, 2)], 4: [(2, 1), (8, 4)]}


def _rank(rank: int, size: int, port: int, results) -> None:
    import torch.distributed as dist

    from openrlhf_async.trainer.sequence_parallel import SequenceGroup, register

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    group, attention = SequenceGroup(rank, size, size), register("sdpa")
    for heads, kv_heads in HEAD_LAYOUTS[size]:
        logp, loss, gradient = _loss_and_gradient(_model(attention, heads, kv_heads), group)
        dist.all_reduce(gradient)  # each rank holds its tokens' share of the gradient, as DeepSpeed then sums them
        if rank == 0:
            results.put((logp.tolist(), float(loss), gradient.tolist()))
    dist.destroy_process_group()


@pytest.mark.parametrize("size", sorted(HEAD_LAYOUTS))
def test_a_row_split_across_ranks_gives_the_one_process_log_probs_loss_and_gradients(size):
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = mp.spawn(_rank, args=(size, free_port(), results), nprocs=size, join=False)
    split = [results.get(timeout=300) for _ in HEAD_LAYOUTS[size]]
    ranks.join()
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in _samples())
    # The same sums in another order (attention over at most the row's 30 positions, a weight's gradient summed over
    # them in N parts): each result is off by at most about T unit roundoffs per layer of its magnitude. A wrong
    # slice, a lost exchange or a gradient counted twice is off by its own size.
    bound = UNIT_ROUNDOFF * tokens * (LAYERS + 2)
    for (heads, kv_heads), (split_logp, split_loss, split_gradient) in zip(HEAD_LAYOUTS[size], split):
        logp, loss, gradient = _loss_and_gradient(_model("sdpa", heads, kv_heads), None)
        layout = f"{heads} heads, {kv_heads} key/value heads"
        assert (torch.tensor(split_logp, dtype=torch.float64) - logp).abs().max() <= bound * logp.abs().max(), layout
        # The loss sums the row's terms, each at most the largest |log-prob| (weights in [-1, 1]; entropies 0.1).
        assert abs(split_loss - float(loss)) <= bound * tokens * float(logp.abs().max()), layout
        assert (torch.tensor(split_gradient, dtype=torch.float64) - gradient).abs().max() <= \
            bound * gradient.abs().max(), layout
        assert gradient.abs().max() > 0.1


def test_the_ring_size_must_divide_the_ranks_and_turns_packing_on(capsys):
    with pytest.raises(ConfigError) as e:
        preset_config("--ds.ring_attn_size", "4")
    assert str(e.value) == ("--ds.ring_attn_size 4 must divide the actor's ranks (--actor.num_nodes 1 x "
                            "--actor.num_gpus_per_node 2 = 2): each group of 4 ranks shares a packed row")
    with pytest.raises(ConfigError, match=r"^--ds.ring_attn_size 2 must divide the critic's ranks \(--critic"):
        preset_config("--ds.ring_attn_size", "2", "--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node",
                      "3")
    capsys.readouterr()
    cfg = preset_config("--ds.ring_attn_size", "2")
    assert cfg.ds.packing_samples
    assert "notice: --ds.ring_attn_size 2 turns on --ds.packing_samples" in capsys.readouterr().err


def test_a_cli_step_with_sequence_parallelism_and_top_p_matches_vllms_log_probs(tmp_path):
    """Through the command line: the preset's two ranks share each packed row, the rollout samples from top-p 0.98's
    nucleus, and the token-level correction compares vLLM's log-probs with the trainer's of the same nucleus (at the
    first step both hold the same fp32 weights, so they agree to rounding: no token is clipped, and their mean gap is
    far below the nucleus's dropped mass)."""
    from openrlhf_async.cli.train_async import main
    from openrlhf_async.config import preset_path

    assert main(["@" + preset_path("tiny_cpu"), "--runs_dir", str(tmp_path / "runs"), "--no-progress",
                 "--ds.ring_attn_size", "2", "--rollout.top_p", "0.98", "--train.max_steps", "1",
                 "--eval.steps", "-1", "--rollout.batch_size", "8", "--train.batch_size", "64",
                 "--rollout.vllm_generate_batch_size", "16"]) == 0
    step = json.loads((tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # vllm_kl: the mean of vLLM's log-prob minus the trainer's over the step's model tokens (measured 3e-8: fp32
    # rounding of the same weights). Scored under the whole distribution instead, each token's trainer log-prob
    # would be lower by the log of the nucleus's kept mass: 0.010 on average on this model at top-p 0.98 (above 1e-4
    # at each of 160 sampled tokens, at most 0.020), a thousand times this bound.
    assert abs(step["vllm_kl"]) < 1e-5, step["vllm_kl"]
    assert step["is_filter_ratio"] == 0 and step["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert step["rollout/tokens_accepted"] > 0


def test_a_model_with_sliding_window_attention_is_refused_before_anything_starts(tmp_path):
    """Mistral's config: a sliding window on every layer, which the split row's attention does not apply."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "sliding_window": 4096,
                                                      "max_position_embeddings": 32768}))
    with pytest.raises(ConfigError) as e:
        preset_config("--actor.model_name_or_path", str(tmp_path), "--ds.ring_attn_size", "2")
    assert str(e.value) == (f"--ds.ring_attn_size 2: {tmp_path} has sliding-window attention, which sequence "
                            "parallelism does not build here; drop --ds.ring_attn_size")
    # Qwen's configs name a window they do not use: accepted
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "sliding_window": 4096,
                                                      "use_sliding_window": False, "max_position_embeddings": 32768}))
    assert preset_config("--actor.model_name_or_path", str(tmp_path), "--ds.ring_attn_size", "2").ds.ring_attn_size == 2
