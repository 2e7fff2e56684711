"""Mixture-of-experts policies: the shipped tiny Qwen3-MoE (4 experts, 2 routed per token) trained and synced on the
real stack, its experts sent under the checkpoint's per-expert names, and the memory plan of Qwen3-30B-A3B."""

import json
import os

import pytest
import ray
import torch

from conftest import engine_and_policy, preset_config
from openrlhf_async.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_30B_A3B = os.path.join(REPO, "tests", "model_configs", "Qwen3-30B-A3B")
# lr 1e-6 moves a few per cent of the bf16 elements a step: the syncs after the second send patches
BF16 = ("--actor.model_name_or_path", "tiny-qwen3-moe", "--ds.param_dtype", "bf16", "--vllm.num_engines", "1",
        "--actor.adam.lr", "1e-6", "--actor.lr_scheduler", "constant")


@pytest.fixture(scope="module")
def moe_path():
    from openrlhf_async.models.tiny import embedded_model

    return embedded_model("tiny-qwen3-moe")


def test_the_experts_are_sent_as_the_checkpoint_names_and_holds_them(moe_path):
    """transformers fuses each layer's experts into two tensors; what the engines load is the checkpoint's weights,
    one per expert and projection, with the saved values."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from openrlhf_async.trainer.weight_export import source_value, weight_sources

    model = AutoModelForCausalLM.from_pretrained(moe_path)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 512, 128)  # fused: [experts, 2 x 256, hidden]
    saved = load_file(os.path.join(moe_path, "model.safetensors"))
    sent = {source.name: source_value(source) for source in weight_sources(model, lora=False)}
    assert sorted(sent) == sorted(saved)  # the tied head is in neither
    for name, value in sent.items():
        assert torch.equal(value, saved[name]), name
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in sent


def test_the_memory_plan_counts_every_expert_and_the_active_ones(moe_path):
    from transformers import AutoModelForCausalLM

    from openrlhf_async.trainer.memory_plan import model_shape

    tiny = model_shape(moe_path)
    assert tiny.params == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(moe_path).parameters())
    # Active: 2 of the 4 experts' MLPs in each of the 2 layers, 3 x 128 x 256 each
    assert tiny.params - tiny.active_params == 2 * 2 * 3 * 128 * 256
    big = model_shape(QWEN3_30B_A3B)  # the published 30.5B parameters, 3.3B active
    assert (big.params, big.active_params) == (30_532_122_624, 3_353_032_704)
    # ZeRO-3 gathers a whole layer at once: its 128 experts
    assert big.layer_params == 623_120_640


def test_lora_on_a_mixture_of_experts_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        preset_config("--actor.model_name_or_path", "tiny-qwen3-moe", "--ds.lora.rank", "8")
    assert str(refused.value).startswith("--ds.lora.rank 8: ") and "mixture of experts (4 per layer)" in str(
        refused.value) and "\n" not in str(refused.value)


def test_routing_replay_under_sequence_parallelism_is_refused_in_one_line_before_anything_starts():
    """A split row's routes are not replayed (trainer/policy.py): refused, not silently off with eager engines."""
    flags = ("--actor.model_name_or_path", "tiny-qwen3-moe", "--ds.ring_attn_size", "2")
    with pytest.raises(ConfigError) as refused:
        preset_config(*flags)
    assert str(refused.value).startswith("--ds.ring_attn_size 2 with --actor.routing_replay: ") and "\n" not in str(
        refused.value), str(refused.value)
    assert preset_config(*flags, "--no-actor.routing_replay").ds.ring_attn_size == 2
    assert preset_config("--ds.ring_attn_size", "2").actor.routing_replay  # a dense model: nothing to replay


def test_a_mixture_of_experts_whose_experts_are_not_mapped_is_refused_in_one_line(tmp_path):
    """Mixtral's experts load in vLLM under other names (block_sparse_moe...w1/w2/w3): refused, not sent wrong."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8,
                                                      "max_position_embeddings": 32768}))
    with pytest.raises(ConfigError) as refused:
        preset_config("--actor.model_name_or_path", str(tmp_path))
    assert str(refused.value) == (f"--actor.model_name_or_path {tmp_path}: a mixture of experts of type mixtral, whose "
                                  "experts' weights this project does not map to vLLM's names; the types built: "
                                  "qwen2_moe, qwen3_moe")


def test_routing_replay_turns_on_eager_engines_which_record_the_routes(capsys):
    """Compiled graphs (CUDA graphs, vLLM-CPU's torch.compile) run vLLM's routers without the hook that records the
    routes (measured on CPU: no route reached the trainer): routing replay turns --vllm.enforce_eager on, saying so;
    turned off, the engines keep their graphs."""
    for device in ("cuda", "cpu"):
        flags = ("--actor.model_name_or_path", QWEN3_30B_A3B, "--device", device, "--no-vllm.enforce_eager")
        assert preset_config(*flags).vllm.enforce_eager
        assert "notice: --actor.routing_replay turns on --vllm.enforce_eager: " in capsys.readouterr().err
        assert not preset_config(*flags, "--no-actor.routing_replay").vllm.enforce_eager
    assert not preset_config("--no-vllm.enforce_eager").vllm.enforce_eager  # a dense model: untouched


def test_the_moe_script_passes_its_dry_run_within_80_gb(tmp_path):
    """examples/scripts/train_fully_async_qwen3_30b_a3b.sh on Qwen3-30B-A3B's published config."""
    import subprocess
    import sys

    for name in ("dapo-math-17k.jsonl", "aime24.jsonl"):
        (tmp_path / name).write_text(json.dumps({"prompt": "What is 2+3?", "label": "5"}) + "\n")
    env = {**os.environ, "PYTHON": sys.executable, "DATA_DIR": str(tmp_path), "MODEL": QWEN3_30B_A3B,
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "scripts", "train_fully_async_qwen3_30b_a3b.sh"),
                           "--dry_run", "--plan.device_memory_gb", "80"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run: configuration valid; would start 8 vLLM engine(s) "
                                                           "x tensor parallel 2 and 16 trainer rank(s) on cuda (32 GPUs)")
    report = json.loads(proc.stdout[: proc.stdout.rindex("\ndry run:")])
    plan = report["memory_plan"]
    assert plan["params"] == 30_532_122_624 and plan["active_params"] == 3_353_032_704
    assert report["config"]["mode"] == "fully_async"
    assert plan["trainer_rank"]["total"] <= plan["device_memory"] == 80 * 2**30
    assert plan["vllm_engine"]["total"] <= 80 * 2**30
    assert "memory plan (30.532B parameters, 3.353B active; device 80.00 GB)" in proc.stdout + proc.stderr


def test_through_the_command_line_every_sync_leaves_vllm_with_the_trainers_weights(tmp_path):
    """Three steps of the demo's settings on the tiny MoE: each step's samples come from the engines synced after
    the step before, so vLLM's log-probs of them are the trainer's (fp32, the same weights: rounding). Before vLLM's
    experts were packed again after a sync, the second step's gap was 1.2. The routes vLLM recorded reach the
    trainer, filed at the right positions: in fp32 the trainer's own routing sends every token where vLLM did (a
    route filed one position off would differ for most tokens)."""
    from openrlhf_async.cli.train_async import main
    from openrlhf_async.config import preset_path

    assert main(["@" + preset_path("tiny_cpu"), "--runs_dir", str(tmp_path / "runs"), "--no-progress",
                 "--actor.model_name_or_path", "tiny-qwen3-moe", "--train.max_steps", "3", "--eval.steps", "-1",
                 "--rollout.batch_size", "8", "--train.batch_size", "64",
                 "--rollout.vllm_generate_batch_size", "16"]) == 0
    steps = [json.loads(line) for line in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "vllm_kl" in s] == [1, 2, 3]
    for s in steps:
        if "vllm_kl" in s:
            assert abs(s["vllm_kl"]) < 1e-5 and s["staleness/max"] == 0, s
            assert s["vllm_logprob_gap_max"] < 1e-4 and s["routing/differ_share"] == 0.0, s
            assert 0.85 < s["routing/recorded_share"] < 1.0, s  # every token but each sample's last


def test_after_a_step_and_a_sync_vllms_greedy_tokens_and_log_probs_are_the_trainers(ray_cluster, moe_path):
    """fp32: the engine's greedy continuations after a training step and a sync are the trainer's argmax, their
    log-probs the trainer's to rounding, and the experts' weights the trainer's bit for bit."""
    from test_sparse_sync import _train
    from test_weight_sync import _greedy, _prompt_ids

    from openrlhf_async.trainer.weight_sync import WeightSync

    cfg = preset_config("--actor.model_name_or_path", "tiny-qwen3-moe", "--vllm.num_engines", "1")
    with engine_and_policy(cfg, moe_path) as (engine, policy):
        prompts = _prompt_ids(moe_path, 6)
        sync = WeightSync(policy, [engine], cfg)
        before = _greedy(engine, prompts)
        _train(policy, cfg, prompts, scale=5.0)
        sync.sync()
        name = "model.layers.0.mlp.experts.2.down_proj.weight"
        held = ray.get(engine.read_weight.remote("model.layers.0.mlp.experts.routed_experts.w2_weight"))[2]
        assert torch.equal(held, ray.get(policy.call("read_weight", name))[0])
        outs = _greedy(engine, prompts)
        assert [o["logprobs"] for o in outs] != [o["logprobs"] for o in before], "the engine runs the old weights"
        refs = ray.get(policy.call("forward_logprobs", outs))[0]
        for out, ref in zip(outs, refs):
            assert out["response_ids"] == ref["greedy_ids"], "vLLM's greedy tokens differ from the trainer's argmax"
            assert max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"])) <= 1e-4


ASK_AGAIN = """
async def step(state, action, label):
    if "#" not in state:  # the first answer: shown back with a mark, and answered again
        return 0.0, state + action + "#", False, {}
    right = float(action.strip() == label)
    return right, state + action, True, {"accuracy": right}
"""


def test_a_two_turn_episode_replays_the_routes_of_both_turns(tmp_path):
    """The second turn's request reads the first turn's tokens from vLLM's prefix cache: their routes come from the
    first turn's request, the rest from the second's, and in fp32 every one is where the trainer routes it."""
    from openrlhf_async.cli.train_async import main
    from openrlhf_async.config import preset_path

    agent = tmp_path / "ask_again.py"
    agent.write_text(ASK_AGAIN)
    assert main(["@" + preset_path("tiny_cpu"), "--runs_dir", str(tmp_path / "runs"), "--no-progress",
                 "--actor.model_name_or_path", "tiny-qwen3-moe", "--train.max_steps", "2", "--eval.steps", "-1",
                 "--rollout.batch_size", "8", "--train.batch_size", "64", "--rollout.vllm_generate_batch_size", "16",
                 "--train.agent_func_path", str(agent), "--agent.max_steps", "2",
                 "--no-algo.dynamic_filtering_enable"]) == 0
    steps = [json.loads(line) for line in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "vllm_kl" in s]
    assert len(trained) == 2
    for s in trained:
        assert s["rollout/observation_len_mean"] > 0  # episodes went on to a second turn after the "#"
        assert s["routing/differ_share"] == 0.0 and s["vllm_logprob_gap_max"] < 1e-4, s
        # every token but each sample's last has vLLM's routes (samples of 12 to 20 tokens)
        assert 0.9 < s["routing/recorded_share"] < 1.0, s


@pytest.fixture(scope="module")
def moe_bf16_stack(ray_cluster, moe_path):
    cfg = preset_config(*BF16)
    with engine_and_policy(cfg, moe_path) as (engine, policy):
        yield cfg, policy, engine


def test_sparse_syncs_of_the_experts_leave_the_engine_with_the_trainers_bf16_weights(moe_bf16_stack, moe_path):
    """vLLM-CPU packs the experts for its kernels; a sparse sync writes each changed element into the engine's copy
    in the checkpoint's layout and packs it again. Checked at every sync by the fingerprints (in the checkpoint's
    layout), and here by the experts' values."""
    from test_sparse_sync import _train
    from test_weight_sync import _prompt_ids

    from openrlhf_async.trainer.weight_sync import WeightSync

    cfg, policy, engine = moe_bf16_stack
    prompts = _prompt_ids(moe_path, 6)
    sync = WeightSync(policy, [engine], cfg)
    for step in range(5):
        if step:
            _train(policy, cfg, prompts)
        sync.sync()  # raises where the engine's fingerprint is not the trainer's
        assert sync.figures["sync/sparse"] == int(step >= 2), (step, sync.figures)
    held = ray.get(engine.read_weight.remote("model.layers.1.mlp.experts.routed_experts.w13_weight"))
    for e in range(4):
        for k, kind in enumerate(("gate", "up")):
            trainer = ray.get(policy.call("read_weight", f"model.layers.1.mlp.experts.{e}.{kind}_proj.weight"))[0]
            assert torch.equal(held[e, 256 * k : 256 * (k + 1)], trainer), (e, kind)



# ---- routing replay -------------------------------------------------------------------------------------------

def _own_routes(model, ids) -> torch.Tensor:
    """The experts the model routes each token of ids to: [tokens, layers, top_k]."""
    from openrlhf_async.trainer.routing_replay import routers

    seen = {}
    hooks = [router.register_forward_hook(lambda m, a, out, layer=layer: seen.__setitem__(layer, out[2]))
             for layer, router in routers(model)]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return torch.stack([seen[layer] for layer in sorted(seen)], 1)


def test_the_forward_runs_each_token_through_the_replayed_experts_and_the_router_still_learns(moe_path):
    from transformers import AutoModelForCausalLM

    from openrlhf_async.trainer.routing_replay import RoutingReplay

    model = AutoModelForCausalLM.from_pretrained(moe_path)
    ids = torch.tensor([[3, 22, 23, 16, 24, 34, 4, 25, 26, 1]])
    plain = model(input_ids=ids).logits.detach()
    own = _own_routes(model, ids)
    replay = RoutingReplay(model, replay=True)
    replay.set(own)  # its own routes: the same forward
    assert torch.allclose(model(input_ids=ids).logits, plain, atol=1e-6)
    assert replay.take_counts() == (2 * 10, 0)  # 10 tokens in each of 2 layers, none routed apart
    forced = torch.tensor([0, 1]).expand(10, 2, 2).clone()
    forced[-1] = -1  # unknown: routed by the model itself
    replay.set(forced)
    logits = model(input_ids=ids).logits
    assert not torch.allclose(logits[0, :-1], plain[0, :-1], atol=1e-3)
    apart = int((own[:-1].sort(-1).values != torch.tensor([0, 1])).any(-1).sum())
    assert replay.take_counts() == (2 * 9, apart) and apart > 0
    logits[0, :, 5].sum().backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0  # through the replayed experts' weights
    # Comparing only (--no-actor.routing_replay): the model's own routing, the mismatch still counted
    replay.replay = False
    assert torch.allclose(model(input_ids=ids).logits, plain, atol=1e-6)
    assert replay.take_counts() == (2 * 9, apart)


def test_routes_are_laid_out_as_the_forwards_tokens():
    import numpy as np

    from openrlhf_async.trainer.routing_replay import layout_routes

    def sample(n, value):
        return {"prompt_ids": [1] * 2, "response_ids": [2] * (n - 2),
                "routes": None if value is None else np.full((n, 2, 2), value, dtype=np.int16)}

    samples = [sample(4, 7), sample(3, None), sample(5, 9)]
    padded = layout_routes(samples, 5, packed=False, layers=2, top_k=2)
    assert padded.shape == (15, 2, 2)
    assert (padded[:4] == 7).all() and (padded[4:10] == -1).all() and (padded[10:15] == 9).all()
    packed = layout_routes(samples, 12, packed=True, layers=2, top_k=2)
    assert packed.shape == (12, 2, 2)
    assert (packed[:4] == 7).all() and (packed[4:7] == -1).all() and (packed[7:] == 9).all()
    assert layout_routes([sample(4, None)], 4, packed=False, layers=2, top_k=2) is None


def test_a_samples_routes_come_from_the_requests_that_computed_each_position():
    import numpy as np

    from openrlhf_async.rollout.routes import assemble

    def recorded(n, value, computed_from=0):
        r = np.full((n, 1, 2), -1, dtype=np.int16)
        r[computed_from:] = value
        return r

    prompt = [5, 6, 7]
    first = (prompt + [8, 9], recorded(4, 1))  # computed the prompt; its last token was never fed back
    sibling = (prompt + [10, 11], recorded(4, 2, computed_from=3))  # its prompt came from the prefix cache
    turn2 = (prompt + [8, 9, 12, 13], recorded(6, 3, computed_from=4))  # the episode's next turn, after [8, 9]
    other = ([4, 4, 4, 4], recorded(4, 4))  # another prompt's: not a prefix
    routes = assemble(prompt + [8, 9, 12, 13], [first, sibling, turn2, other])
    assert routes[:, 0, 0].tolist() == [1, 1, 1, 1, 3, 3, -1]
    assert assemble(prompt + [10, 11], [first, sibling])[:, 0, 0].tolist() == [1, 1, 1, 2, -1]
    assert assemble([1, 2], [other]) is None


def test_a_samples_own_routes_win_over_a_later_siblings_of_the_same_prompt():
    """Both computed the prompt (no prefix cache between them: across a sync, or another batch's kernels), the
    sibling's routes differ and it ended later: the sample keeps the routes that made its own cache; a sibling's only
    fill the positions its own requests did not compute."""
    import numpy as np

    from openrlhf_async.rollout.routes import assemble

    def recorded(n, value, computed_from=0):
        r = np.full((n, 1, 2), -1, dtype=np.int16)
        r[computed_from:] = value
        return r

    prompt = [5, 6, 7]
    own = (prompt + [8, 9], recorded(4, 1))
    sibling = (prompt + [10, 11], recorded(4, 2))
    assert assemble(prompt + [8, 9], [own, sibling])[:, 0, 0].tolist() == [1, 1, 1, 1, -1]
    from_cache = (prompt + [8, 9], recorded(4, 1, computed_from=3))  # its prompt read from the sibling's cache
    assert assemble(prompt + [8, 9], [from_cache, sibling])[:, 0, 0].tolist() == [2, 2, 2, 1, -1]
