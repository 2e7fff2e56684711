"""The memory plan: parameter counts from the model's shape, ZeRO partitioning, checkpointing and token budgets in a
trainer rank's peak, a refusal naming only the flags that make a run fit, and the plan in a dry run's report."""

import dataclasses
import json
import os

import pytest

from openrlhf_async.cli.train_async import main
from openrlhf_async.config import preset_path
from openrlhf_async.trainer.memory_plan import GB, ModelShape, Setup, model_shape, plan, rank_bytes, refusal

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")
QWEN25_7B = model_shape(os.path.join(CONFIGS, "Qwen2.5-Math-7B"))  # Qwen2.5-7B's shape with a 4096-token context


def gpu_setup(**changes) -> Setup:
    """A 7-8B recipe's rank: 8 ZeRO-3 ranks in bf16, packed micro batches of 20k tokens under sdpa."""
    base = Setup(ranks=8, zero_stage=3, dtype_bytes=2, adam_offload=False, reference=False, ref_offload=False,
                 checkpointing=False, train_tokens=20480, logprob_tokens=20480, chunk=1024, longest=4096,
                 packed=True, masked=True, tensor_parallel=1, gpu_memory_utilization=0.85, cpu_kvcache_gb=1,
                 device="cuda")
    return dataclasses.replace(base, **changes)


def test_the_parameter_count_from_the_shape_is_the_real_models(tiny_model_path, smollm2):
    from transformers import AutoModelForCausalLM

    for path in (tiny_model_path, smollm2):
        model = AutoModelForCausalLM.from_pretrained(path)
        assert model_shape(path).params == model.num_parameters(), path
    # The published counts of the 7-8B models the launch scripts train (their config.json, kept in tests/).
    assert QWEN25_7B.params == 7_615_616_512
    assert model_shape(os.path.join(CONFIGS, "Qwen3-8B")).params == 8_190_735_360


def test_zero_3_over_8_ranks_holds_an_eighth_of_the_states():
    one, eight = (rank_bytes(QWEN25_7B, gpu_setup(ranks=n)) for n in (1, 8))
    for part in ("weights", "gradients", "optimizer"):
        assert eight[part] == pytest.approx(one[part] / 8, rel=1e-6), part
    assert one["optimizer"] == pytest.approx(12 * QWEN25_7B.params, rel=1e-6)  # fp32 master and two moments


def test_lower_stages_keep_what_they_do_not_partition():
    stage = {z: rank_bytes(QWEN25_7B, gpu_setup(zero_stage=z)) for z in (1, 2, 3)}
    assert stage[1]["weights"] == stage[2]["weights"] == 8 * stage[3]["weights"]
    assert stage[1]["gradients"] == 8 * stage[2]["gradients"]
    assert rank_bytes(QWEN25_7B, gpu_setup(adam_offload=True))["optimizer"] == 0


def test_gradient_checkpointing_shrinks_the_activations_and_the_reference_model_adds_weights():
    plain, checkpointed = (rank_bytes(QWEN25_7B, gpu_setup(checkpointing=c)) for c in (False, True))
    assert checkpointed["activations"] < plain["activations"] / 5
    with_reference = rank_bytes(QWEN25_7B, gpu_setup(reference=True))
    assert with_reference["reference"] == with_reference["weights"]
    assert rank_bytes(QWEN25_7B, gpu_setup(reference=True, ref_offload=True))["reference"] == 0


def test_a_7b_model_at_a_20k_token_micro_batch_needs_checkpointing_to_fit_80_gb():
    s = gpu_setup()
    p = plan(QWEN25_7B, s, 80 * GB, checked=True)
    why = refusal(p, QWEN25_7B, s, dynamic=True, longest=4096)
    assert why.startswith(f"memory plan: trainer rank needs {p['trainer_rank']['total'] / GB:.1f} GB of 80.0 GB; try ")
    fixes = why.split("; try ", 1)[1].split(" / ")
    assert fixes[0] == "--actor.gradient_checkpointing_enable"
    # Offloading the optimizer alone would not fit; a budget that does is named with its size, and fits.
    assert "--ds.adam_offload" not in why and fixes[1].startswith("--train.max_tokens_per_gpu ")
    budget = int(fixes[1].split()[-1])
    assert 4096 <= budget < 20480
    assert rank_bytes(QWEN25_7B, gpu_setup(train_tokens=budget))["total"] <= 80 * GB
    assert rank_bytes(QWEN25_7B, gpu_setup(train_tokens=budget + 1))["total"] > 80 * GB
    fitted = gpu_setup(checkpointing=True)
    assert refusal(plan(QWEN25_7B, fitted, 80 * GB, checked=True), QWEN25_7B, fitted, True, 4096) is None


def test_a_plan_that_is_not_checked_never_refuses():
    s = gpu_setup()
    assert refusal(plan(QWEN25_7B, s, 80 * GB, checked=False), QWEN25_7B, s, True, 4096) is None


def test_engine_weights_over_their_share_are_refused_until_tensor_parallelism_splits_them():
    s = gpu_setup(ranks=64, checkpointing=True, train_tokens=4096, logprob_tokens=4096)
    p = plan(QWEN25_7B, s, 16 * GB, checked=True)
    assert p["trainer_rank"]["total"] <= 16 * GB
    assert refusal(p, QWEN25_7B, s, True, 4096) == (
        "memory plan: a vLLM engine's weights need 14.2 GB of its 13.6 GB share; raise --vllm.tensor_parallel_size "
        "or --vllm.gpu_memory_utilization")
    split = dataclasses.replace(s, tensor_parallel=2)
    assert refusal(plan(QWEN25_7B, split, 16 * GB, checked=True), QWEN25_7B, split, True, 4096) is None


def dry_run(tmp_path, *flags):
    return main(["@" + preset_path("tiny_cpu"), "--runs_dir", str(tmp_path / "runs"), "--no-progress", "--dry_run",
                 "--device", "cpu", *flags])


def test_a_dry_run_reports_the_plan_and_refuses_what_cannot_fit(tmp_path, capsys):
    assert dry_run(tmp_path) == 0
    out, err = capsys.readouterr()
    report = json.loads(out.rsplit("\ndry run:", 1)[0])
    p = report["memory_plan"]
    assert p["params"] == model_shape(None).params and not p["checked"]  # cpu, no --plan.device_memory_gb
    assert "memory plan (" in err and "trainer rank:" in err and "per trainer rank" in out.splitlines()[-1]
    # The preset's padded micro batches of 64 x 256 tokens on a 0.1 GB "device": checkpointing alone leaves their
    # attention masks and logits over it, a smaller micro batch fits.
    assert dry_run(tmp_path, "--plan.device_memory_gb", "0.1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: memory plan: trainer rank needs "), err
    flag, size = err.split("; try ")[1].split()
    assert flag == "--train.micro_batch_size" and 1 <= int(size) < 64
    assert dry_run(tmp_path, "--plan.device_memory_gb", "0.1", "--train.micro_batch_size", size) == 0


def test_the_nucleus_of_top_p_adds_its_sort_to_the_logits_of_each_chunk():
    """Under --rollout.top_p < 1 the trainer picks each position's nucleus from a sorted copy of its logits
    (losses.top_p_logits): its values, their int64 order, the cumulative probabilities and the masked copy."""
    whole, nucleus = (rank_bytes(QWEN25_7B, gpu_setup(top_p=p)) for p in (1.0, 0.98))
    assert nucleus["logits"] - whole["logits"] == 1024 * QWEN25_7B.vocab * 20  # the chunk's positions
    assert nucleus["total"] > whole["total"]


def test_a_row_split_across_two_ranks_halves_a_ranks_activations_and_builds_no_mask():
    """--ds.ring_attn_size 2: a rank holds half of the 20k-token row (its share, train_tokens), attends without a
    [T, T] mask, and adds the all-to-alls' buffers of one layer; states are unchanged."""
    from openrlhf_async.trainer.memory_plan import sequence_exchange_bytes, split_heads

    whole, split = rank_bytes(QWEN25_7B, gpu_setup()), rank_bytes(QWEN25_7B, gpu_setup(train_tokens=10240,
                                                                                          sequence_parallel=2))
    assert whole["attention_mask"] > 0 and split["attention_mask"] == 0
    exchange = sequence_exchange_bytes(QWEN25_7B, gpu_setup(sequence_parallel=2), 10240)
    assert split["activations"] - exchange == pytest.approx(whole["activations"] / 2, rel=1e-6)
    for part in ("weights", "gradients", "optimizer", "buffers"):
        assert split[part] == whole[part], part
    # SmolLM2's 9 heads and 3 key/value heads: padded to 10, the key/value heads repeated to them.
    shape = split_heads(ModelShape(576, 30, 9, 3, 64, 1536, 49152, True), 2)
    assert (shape.heads, shape.kv_heads) == (10, 10)
    assert (split_heads(QWEN25_7B, 2).heads, split_heads(QWEN25_7B, 2).kv_heads) == (28, 4)


def test_the_hybrid_transfer_and_the_generation_after_it_count_the_largest_module_the_engines_reload_materialised(
        monkeypatch):
    """vLLM's layerwise reload materialises one module at a time outside its sleep allocator's pools; the blocks stay
    in the engine's caching allocator until its next sleep empties it (memory_plan.reload_cache_bytes): the largest
    module's shard, in bf16 Qwen2.5-7B's embedding (its 152,064 x 3,584), in Qwen3-30B-A3B the fused experts of a
    layer (128 experts' gate, up and down). Counted in the transfer and the generation after it; in training as well
    where the engine never sleeps."""
    from openrlhf_async.trainer import memory_plan

    assert memory_plan.reload_cache_bytes(QWEN25_7B, gpu_setup()) == 2 * 152064 * 3584
    assert memory_plan.reload_cache_bytes(QWEN25_7B, gpu_setup(tensor_parallel=2)) == 152064 * 3584
    moe = model_shape(os.path.join(CONFIGS, "Qwen3-30B-A3B"))
    assert moe.largest_module_params == 3 * 128 * 2048 * 768 > moe.vocab * moe.hidden
    # A vocabulary padded to 64 rows, as vLLM's VocabParallelEmbedding pads it.
    assert ModelShape(576, 30, 9, 3, 64, 1536, 49153, True).largest_module_params == 49216 * 576

    def phases(sleep: bool, reload: bool) -> dict:
        if not reload:
            monkeypatch.setattr(memory_plan, "reload_cache_bytes", lambda m, s: 0)
        s = gpu_setup(hybrid=True, engine_sleep=sleep, trainer_sleep=True)
        p = plan(QWEN25_7B, s, 141 * GB, True)["hybrid"]
        monkeypatch.undo()
        return p

    layer = 2 * 152064 * 3584
    for sleep in (True, False):
        counted, not_counted = phases(sleep, True), phases(sleep, False)
        assert counted["transfer"] - not_counted["transfer"] == layer
        assert counted["generate"] - not_counted["generate"] == layer
        assert counted["train"] - not_counted["train"] == (0 if sleep else layer)  # the sleep's empty_cache
