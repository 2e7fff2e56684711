"""How samples become forward passes (trainer/batching.py): token budgets hold, every rank runs as many micro
batches, and packed rows give each sample the log-probs it has alone."""

import pytest
import torch

from openrlhf_async.trainer.batching import Layout, micro_batches, plan, shard, target_logprobs


def _samples(lengths: list) -> list:
    return [{"prompt_ids": [1] * 3, "response_ids": [2] * (n - 3)} for n in lengths]


def test_fixed_size_micro_batches_keep_the_sample_order():
    assert micro_batches([5, 9, 2, 7, 3], size=2) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("packed", [True, False])
def test_a_token_budget_is_never_exceeded_except_by_a_sample_alone(packed):
    torch.manual_seed(0)
    lengths = [int(x) for x in torch.distributions.LogNormal(3.9, 1.0).sample((200,)).clamp(4, 512).round()]
    budget = 256
    batches = micro_batches(lengths, size=1, max_tokens=budget, packed=packed)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        cost = sum(lengths[i] for i in b) if packed else len(b) * max(lengths[i] for i in b)
        assert cost <= budget or len(b) == 1
    # First-fit decreasing fills the budget: few batches beyond the lower bound of total tokens / budget.
    if packed:
        assert len(batches) <= sum(lengths) / budget * 1.15 + 1 + sum(n > budget for n in lengths)


def test_every_rank_gets_as_many_micro_batches_and_balanced_tokens():
    samples = _samples([400, 30, 30, 30, 30, 30, 30, 300, 20, 20])
    per_rank = plan(samples, ranks=2, size=1, max_tokens=128, packed=True)
    assert len(per_rank[0]) == len(per_rank[1])
    assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(10))
    loads = [sum(len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"]) for b in batches for i in b)
             for batches in per_rank]
    assert max(loads) - min(loads) <= 100, loads
    # Without a budget: round robin, as many samples per micro batch as asked.
    assert shard([1] * 5, 2, balanced=False) == [[0, 2, 4], [1, 3]]
    assert plan(_samples([5] * 5), 2, 2, None, False) == [[[0, 2], [4]], [[1, 3], []]]


def test_a_packed_row_restarts_positions_and_maps_back_to_one_row_per_sample():
    samples = [{"prompt_ids": [5, 6], "response_ids": [7, 8, 9]}, {"prompt_ids": [10], "response_ids": [11, 12]}]
    layout = Layout.of(samples, packed=True)
    assert layout.ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert layout.attention_mask is None
    # The targets of the packed row, as their own token ids: each sample's row holds its own next tokens.
    per_sample = layout.per_sample(layout.ids[:, 1:].float())
    assert per_sample.tolist() == [[6, 7, 8, 9], [11, 12, 0, 0]]


@pytest.mark.parametrize("packed,chunk", [(False, 3), (True, 0), (True, 5)])
def test_packed_and_chunked_log_probs_and_gradients_equal_the_padded_whole_logits_ones(tiny_model_path, packed,
                                                                                       chunk):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    samples = [{"prompt_ids": [3, 20, 21, 4], "response_ids": [22, 23, 24, 25, 26, 1]},
               {"prompt_ids": [3, 27, 4], "response_ids": [28, 29]},
               {"prompt_ids": [3, 30, 31, 32, 4], "response_ids": [33]}]

    def run(packed, chunk):
        model.zero_grad()
        logp, entropy = target_logprobs(model, Layout.of(samples, packed), 0.7, chunk, entropy=True)
        (logp.sum() + entropy.sum()).backward()
        return logp.detach(), entropy.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    reference, got = run(False, 0), run(packed, chunk)
    assert (got[0] - reference[0]).abs().max() < 1e-5
    assert (got[1] - reference[1]).abs().max() < 1e-5
    assert (got[2] - reference[2]).norm() / reference[2].norm() < 1e-5


def test_token_budgets_turn_packing_on_and_give_the_log_prob_passes_their_budget_as_openrlhf_does(capsys):
    from openrlhf_async.config import preset_config, validate

    cfg = validate(preset_config("tiny_cpu", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096"))
    assert cfg.ds.packing_samples and cfg.rollout.max_tokens_per_gpu == 4096
    assert "--train.dynamic_batch_enable turns on --ds.packing_samples" in capsys.readouterr().err
    cfg = validate(preset_config("tiny_cpu", "--train.dynamic_batch_enable", "--ds.packing_samples",
                                 "--rollout.max_tokens_per_gpu", "900"))
    assert cfg.rollout.max_tokens_per_gpu == 900 and "packing" not in capsys.readouterr().err
