"""LoRA (--ds.lora.*): peft's adapter alone trains, the reference model is the policy with its adapter disabled, the
engines get the merged weights through the usual weight sync, and every sync is checked: the engines' log-probs of a
fixed probe must equal the trainer's, so an adapter that never reached them stops the run."""

import json
import os
import pytest
import ray
import torch

from conftest import preset_config
from test_hybrid import inputs  # noqa: F401 (the scripts' local files, a fixture)
from openrlhf_async.config import ConfigError

LORA = ("--ds.lora.rank", "8", "--ds.lora.alpha", "16")


# ---- flags ------------------------------------------------------------------------------------------------------

def test_openrlhfs_lora_flags_are_taken_in_both_spellings_all_linear_as_peft_reads_it():
    cfg = preset_config(*LORA, "--ds.lora.dropout", "0.05")
    assert (cfg.ds.lora_rank, cfg.ds.lora_alpha, cfg.ds.lora_dropout) == (8, 16, 0.05)
    assert cfg.ds.lora_target_modules == "all-linear"  # peft's shorthand, not a module named all-linear
    old = preset_config("--lora_rank", "4", "--lora_alpha", "8", "--target_modules", "q_proj", "v_proj")
    assert (old.ds.lora_rank, old.ds.lora_alpha, list(old.ds.lora_target_modules)) == (4, 8, ["q_proj", "v_proj"])


@pytest.mark.parametrize("flags, message", [
    (("--ds.load_in_4bit", *LORA), "--ds.load_in_4bit True: not supported here: QLoRA needs bitsandbytes' CUDA "
                                   "kernels; on cpu it cannot run"),
    ((*LORA, "--ds.lora.target_modules", "q_proj", "lm_head"), "--ds.lora.target_modules lm_head: an adapter on"),
    (("--ds.lora.rank", "-1"), "--ds.lora.rank -1"),
])
def test_a_refused_lora_setting_is_one_line(flags, message):
    with pytest.raises(ConfigError) as e:
        preset_config(*flags)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_memory_plan_counts_the_adapter_alone_for_gradients_and_optimizer_and_no_reference_copy():
    from openrlhf_async.trainer import memory_plan

    shape = memory_plan.model_shape(os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs",
                                                 "Qwen2.5-Math-7B"))
    full = preset_config("--algo.kl.init_coef", "0.01", "--ds.param_dtype", "bf16")
    lora = preset_config("--algo.kl.init_coef", "0.01", "--ds.param_dtype", "bf16", "--ds.lora.rank", "16")
    f, l = (memory_plan.rank_bytes(shape, memory_plan.setup_of(c)) for c in (full, lora))
    adapter = shape.lora_params(16, "all-linear")
    assert 0.003 < adapter / shape.params < 0.01  # rank 16 on every linear layer of a 7B model: about 0.5%
    assert l["optimizer"] == 12 * adapter / 2 and f["optimizer"] == 12 * shape.params / 2
    states = ("weights", "gradients", "optimizer", "reference")
    assert l["reference"] == 0 < f["reference"] and sum(map(l.get, states)) < sum(map(f.get, states)) / 3


# ---- the adapter and the weights the engines load (no Ray) ----------------------------------------------------------

def test_the_engines_weights_are_the_base_names_with_each_adapted_layer_merged(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from openrlhf_async.trainer.policy import _with_adapter
    from openrlhf_async.trainer.weight_export import source_value, weight_sources

    names = [n for n, _ in AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters()]
    torch.manual_seed(0)
    model = _with_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                          {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}, False)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)  # B starts at zero: give the adapter an effect
    sources = weight_sources(model, lora=True)
    assert [source.name for source in sources] == names, "the engines would not know these names"
    merged = {source.name: source_value(source).clone() for source in sources}
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        plain.load_state_dict(merged, strict=False)
        diff = (plain(input_ids=ids).logits - adapted).abs().max()
        assert diff < 1e-4, diff
        with model.disable_adapter():
            assert (model(input_ids=ids).logits - adapted).abs().max() > 1e-2, "the adapter had no effect to merge"


def test_a_bf16_merge_keeps_an_adapters_updates_below_half_an_ulp_in_expectation():
    """bf16(W + s B A) rounded to nearest drops every update below half a unit in the last place of W, so an
    adapter's first steps never reached bf16 engines. Rounded stochastically (seeded: the same on every rank and
    call), the merged weights equal W + s B A in expectation: their mean moves by the update, a layer's output
    follows it, and only an adapter that changed draws again."""
    from openrlhf_async.trainer.weight_export import Source, source_value

    torch.manual_seed(0)
    rows, cols = 256, 256
    weight = (0.016 + 0.015 * torch.rand(rows, cols)).to(torch.bfloat16)  # one binade: ulp 2^-13
    ulp = 2.0**-13
    update = 0.1 * ulp
    a, b = torch.ones(1, cols), torch.full((rows, 1), update)
    params = [weight, a, b]
    nearest = (weight.float() + b @ a).to(torch.bfloat16)
    assert torch.equal(nearest, weight), "round to nearest keeps the update (the premise is wrong)"

    merged = source_value(Source("layers.0.mlp.up_proj.weight", params, 1.0))
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, source_value(Source("layers.0.mlp.up_proj.weight", params, 1.0))), "not reproducible"
    steps = (merged.float() - weight.float()) / ulp
    assert set(steps.unique().tolist()) <= {0.0, 1.0}, "not one of the two neighbours"
    # Each element moves one ulp with probability 0.1: the mean's standard deviation is sqrt(0.09 / n) ulp.
    sd = (0.09 / (rows * cols)) ** 0.5
    assert abs(float(steps.mean()) - 0.1) < 5 * sd
    x = torch.rand(8, cols)  # a layer's output: the update's effect x @ (s B A)^T survives
    exact, expected_effect = x @ (weight.float() + b @ a).T, float((x @ (b @ a).T).abs().mean())
    assert float((x @ merged.float().T - exact).abs().mean()) < 0.2 * expected_effect
    assert float((x @ nearest.float().T - exact).abs().mean()) > 0.99 * expected_effect
    other = source_value(Source("layers.0.mlp.up_proj.weight", [weight, a, b * 1.5], 1.0))
    assert not torch.equal((other.float() - weight.float()) > 0, steps > 0), "a new adapter drew the same"
    merged32 = source_value(Source("", [weight.float(), a, b], 1.0))
    assert torch.equal(merged32, weight.float() + b @ a), "fp32 is merged exactly"


@pytest.mark.parametrize("case", ["lost", "healthy", "too_early_to_tell"])
def test_the_sync_check_finds_an_engine_without_the_adapter_even_below_its_tolerance(monkeypatch, case):
    """The probe's log-probs from an engine that lost the adapter sit at the base model's, however small the
    adapter's effect beside the absolute tolerance (an adapter's first steps): four times nearer the base than the
    trained policy, it stops the run; kernels that round apart (1e-6 here) neither stop a healthy engine nor, with
    an adapter that has not moved yet, tell anything."""
    from openrlhf_async.trainer import weight_sync
    from openrlhf_async.trainer.weight_sync import SyncCheckFailed, WeightSync

    effect = {"lost": 3e-4, "healthy": 3e-4, "too_early_to_tell": 1e-6}[case]
    base, noise = [-2.0, -1.5, -0.7], 1e-6
    trained = [v + effect for v in base]
    engine = [v + noise for v in (base if case == "lost" else trained)]

    class Call:
        def __init__(self, result):
            self.result = result

        def remote(self, *args):
            return self.result

    class Engine:
        generate = Call({"response_ids": [1, 2, 3], "logprobs": engine, "token_versions": [4, 4, 4]})

    class Policy:
        @staticmethod
        def call(method, outs, temperature=1.0, adapter=True):
            return [[{"logprobs": trained if adapter else base} for _ in outs]]

    monkeypatch.setattr(weight_sync, "get_all", lambda refs, timeout_s=None: refs)
    sync = object.__new__(WeightSync)
    sync.policy, sync.probe, sync.tolerance, sync.timeout = Policy(), [[5, 6], [7]], 1e-3, 1.0
    if case == "lost":
        with pytest.raises(SyncCheckFailed) as e:
            sync.check_engines({0: Engine()}, 4)
        assert str(e.value).startswith("weight sync check: engine 0 runs the base model without the adapter after "
                                       "version 4"), str(e.value)
    else:
        sync.check_engines({0: Engine()}, 4)
        assert sync.probe_diff < sync.tolerance


# ---- on the session's engines and a LoRA policy of 2 ZeRO-3 ranks --------------------------------------------------

@pytest.fixture(scope="module")
def lora(ray_cluster, tiny_model_path):
    from openrlhf_async.trainer.ranks import PolicyGroup

    # LoRA's learning rates are higher than full fine-tuning's: the adapter must move the probe well past the
    # check's tolerance within a few steps (B starts at zero).
    cfg = preset_config(*LORA, "--algo.kl.init_coef", "0.01", "--vllm.num_engines", "2", "--actor.adam.lr", "1e-2")
    policy = PolicyGroup(cfg, tiny_model_path)
    yield cfg, policy
    policy.shutdown()


def _train(policy, cfg, prompts, scale=1.0):
    from openrlhf_async.trainer.ranks import loss_settings

    samples = [{"prompt_ids": p, "response_ids": [20, 21, 22], "logprobs": [-3.0] * 3,
                "advantage": scale * (1.0 - 2 * (i % 2))} for i, p in enumerate(prompts)]
    return policy.train_step(samples, 2, loss_settings(cfg, correction={"level": "off"}))


def test_only_the_adapter_trains_and_the_reference_is_the_base_model(lora, tiny_model_path):
    from test_weight_sync import _prompt_ids

    cfg, policy = lora
    prompts = _prompt_ids(tiny_model_path, 4)
    samples = [{"prompt_ids": p, "response_ids": [20, 21, 22]} for p in prompts]
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    adapter = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    before = policy.logprobs(samples, 1.0)
    assert policy.logprobs(samples, 1.0, reference=True) == before  # B = 0: the adapter does nothing yet
    base_before, adapter_before = (ray.get(policy.call("read_parameter", n))[0] for n in (base, adapter))
    stats = _train(policy, cfg, prompts, scale=5.0)
    assert stats["grad_norm"] > 0
    assert ray.get(policy.call("read_parameter", base))[0].equal(base_before), "a frozen base weight moved"
    assert not ray.get(policy.call("read_parameter", adapter))[0].equal(adapter_before)
    assert policy.logprobs(samples, 1.0, reference=True) == before, "the reference moved with the adapter"
    assert policy.logprobs(samples, 1.0) != before


def test_under_zero_2_openrlhfs_default_stage_the_adapter_alone_trains_and_resumes_exactly(
        ray_cluster, tiny_model_path, tmp_path):
    from test_weight_sync import _prompt_ids

    from openrlhf_async.trainer.ranks import PolicyGroup

    cfg = preset_config(*LORA, "--ds.zero_stage", "2", "--algo.kl.init_coef", "0.01", "--actor.adam.lr", "1e-2")
    policy = PolicyGroup(cfg, tiny_model_path)
    try:
        prompts = _prompt_ids(tiny_model_path, 4)
        samples = [{"prompt_ids": p, "response_ids": [20, 21, 22]} for p in prompts]
        base = "base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"
        adapter = "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight"
        before, base_before = policy.logprobs(samples, 1.0), ray.get(policy.call("read_parameter", base))[0]
        ray.get(policy.call("save_checkpoint", str(tmp_path / "ckpt")))
        first = _train(policy, cfg, prompts, scale=5.0)
        assert first["grad_norm"] > 0 and policy.logprobs(samples, 1.0) != before
        assert ray.get(policy.call("read_parameter", base))[0].equal(base_before), "a frozen base weight moved"
        assert policy.logprobs(samples, 1.0, reference=True) == before, "the reference moved with the adapter"
        trained = ray.get(policy.call("read_parameter", adapter))[0]
        ray.get(policy.call("load_checkpoint", str(tmp_path / "ckpt")))
        assert policy.logprobs(samples, 1.0) == before
        again = _train(policy, cfg, prompts, scale=5.0)
        assert (again["loss"], again["grad_norm"]) == (first["loss"], first["grad_norm"])
        assert ray.get(policy.call("read_parameter", adapter))[0].equal(trained)
    finally:
        policy.shutdown()


def test_lora_syncs_are_exact_and_checked_and_a_skipped_adapter_stops_the_run(
        lora, restore_weights, engines, weight_sync, tiny_model_path, tmp_path):
    from test_weight_sync import _greedy, _prompt_ids

    from openrlhf_async.trainer.weight_sync import SyncCheckFailed, WeightSync

    cfg, policy = lora
    prompts = _prompt_ids(tiny_model_path, 4)
    name = "model.layers.0.self_attn.q_proj.weight"  # adapted: the engines get it merged
    try:
        sync = WeightSync(policy, engines, cfg)
        for _ in range(3):  # several syncs, each checked inside sync()
            _train(policy, cfg, prompts, scale=5.0)
            sync.sync()
            assert sync.probe_diff <= 1e-3, sync.probe_diff
        assert sync.probe_adapter_effect > 10 * sync.tolerance, "the adapter barely moved: the check would be blind"
        merged = ray.get(policy.call("read_weight", name))[0]
        for engine in engines:
            assert ray.get(engine.get_weight_version.remote()) == sync.version == 3
            outs = _greedy(engine, prompts)
            teacher = ray.get(policy.call("forward_logprobs", outs))[0]
            for out, ref in zip(outs, teacher):
                assert out["response_ids"] == ref["greedy_ids"]
                assert max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"])) <= 1e-4

        # The field's failure: the trainer sends the base weights without the adapter (as a sync of peft's names
        # that the engines ignore would leave them). The check stops it at once.
        ray.get([a.__ray_call__.remote(lambda actor: setattr(actor, "kept", actor.weights.sources))
                 for a in policy.actors])
        ray.get([a.__ray_call__.remote(lambda actor: setattr(
            actor.weights, "sources", [s._replace(params=s.params[:1], scaling=None) for s in actor.weights.sources]))
            for a in policy.actors])
        with pytest.raises(SyncCheckFailed) as e:
            sync.sync()
        line = str(e.value)
        assert line.startswith("weight sync check: engine ") and line.endswith("the engines do not run the trained weights")
        assert "\n" not in line
    finally:
        ray.get([a.__ray_call__.remote(
            lambda actor: setattr(actor.weights, "sources", getattr(actor, "kept", actor.weights.sources)))
            for a in policy.actors])
        weight_sync.grouped = None  # the engines joined the LoRA policy's group: form the shared one again


def test_a_partial_rollout_across_a_lora_sync_keeps_the_version_each_token_was_sampled_on(
        lora, restore_weights, engines, weight_sync, tiny_model_path):
    from test_weight_sync import _prompt_ids, check_partial_rollout_across_a_sync

    from openrlhf_async.trainer.weight_sync import WeightSync

    cfg, policy = lora
    prompt = _prompt_ids(tiny_model_path, 1)[0]
    try:
        sync = WeightSync(policy, engines, cfg)
        sync.sync()  # the engines on this policy's merged weights first
        _train(policy, cfg, [prompt] * 4, scale=5.0)  # then the adapter moves well away from them
        check_partial_rollout_across_a_sync(engines[0], policy, sync, prompt)
        assert sync.probe_diff <= 1e-3  # checked after the frozen episode resumed
    finally:
        weight_sync.grouped = None  # the engines joined the LoRA policy's group: form the shared one again


def test_a_lora_checkpoint_resumes_exactly_and_the_adapter_saves_in_peft_format(lora, tiny_model_path, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from test_weight_sync import _prompt_ids

    cfg, policy = lora
    prompts = _prompt_ids(tiny_model_path, 4)
    adapter = "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"
    ray.get(policy.call("save_checkpoint", str(tmp_path / "ckpt")))
    saved = ray.get(policy.call("read_parameter", adapter))[0]
    first = _train(policy, cfg, prompts, scale=5.0)
    ray.get(policy.call("load_checkpoint", str(tmp_path / "ckpt")))
    assert ray.get(policy.call("read_parameter", adapter))[0].equal(saved)
    again = _train(policy, cfg, prompts, scale=5.0)
    assert again["loss"] == first["loss"] and again["grad_norm"] == first["grad_norm"]
    shards = [f for f in os.listdir(tmp_path / "ckpt" / "deepspeed") if "model_states" in f]
    assert shards and all(os.path.getsize(tmp_path / "ckpt" / "deepspeed" / f) < 2**20 for f in shards), \
        "the frozen base was written into the checkpoint"

    out = tmp_path / "final"
    ray.get(policy.call("save_hf", str(out), True))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    assert not os.path.exists(out / "config.json"), "a full model beside the adapter would load without it"
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    assert all(".lora_" in k for k in load_file(str(out / "adapter_model.safetensors")))
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                                str(out))(input_ids=ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(str(out / "merged"))(input_ids=ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-4


# ---- a LoRA command line on the CLI (a Ray of its own: runs before the session's stack) ------------------------------
# GRPO of Qwen2.5-14B-Instruct on one node of 8 GPUs in OpenRLHF 0.11's spellings, asynchronous with partial rollout:
# 4 ZeRO-3 ranks beside 2 engines of tensor parallel 2, an adapter of rank 64 on every linear layer.
SCRIPT_14B = """
    --actor.model_name_or_path {model} --ds.lora.rank 64 --ds.lora.alpha 128 --ds.lora.target_modules all-linear
    --train.async_enable --train.partial_rollout_enable --actor.num_nodes 1 --actor.num_gpus_per_node 4
    --vllm.num_engines 2 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.9 --vllm.sync_backend nccl
    --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable --ds.packing_samples
    --algo.advantage.estimator group_norm --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 1e-3
    --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1 --actor.adam.lr 5e-6
    --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --train.batch_size 1024 --train.micro_batch_size 2
    --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 --data.max_len 5120 --rollout.max_new_tokens 4096
    --data.prompt_dataset {data} --data.input_key prompt --data.label_key label --data.apply_chat_template
    --reward.remote_url {reward} --ckpt.output_dir {save} --ckpt.save_hf --ckpt.save_steps 10"""


def _script_14b(inputs, model=None) -> list:
    from test_hybrid import MODEL_CONFIGS

    files = {"model": model or os.path.join(MODEL_CONFIGS, "Qwen2.5-14B-Instruct"), "data": inputs / "prompts.jsonl",
             "reward": inputs / "reward_func.py", "save": inputs / "exp"}
    return SCRIPT_14B.format(**{k: str(v) for k, v in files.items()}).split()


def test_the_14b_grpo_lora_command_line_fits_80_gb_in_the_dry_run_where_full_fine_tuning_does_not(inputs):
    from conftest import dry_run_in_process

    flags = [*_script_14b(inputs), "--device", "cuda", "--plan.device_memory_gb", "80", "--dry_run"]
    proc = dry_run_in_process(flags, inputs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run: configuration valid"), proc.stdout[-2000:]
    plan = json.loads(proc.stdout[: proc.stdout.rindex("\ndry run:")])["memory_plan"]
    rank, adapter = plan["trainer_rank"], 275_251_200  # rank 64 x (in + out) of 7 linear layers x 48: 1.9%
    assert plan["params"] == 14_770_033_664 and plan["setup"]["lora_rank"] == 64
    assert rank["gradients"] == 2 * adapter / 4 and rank["optimizer"] == 12 * adapter / 4 and rank["reference"] == 0
    assert rank["total"] <= 80 * 2**30
    # The same line without the adapter: full states of 14.8B parameters on 4 ranks do not fit.
    at = flags.index("--ds.lora.rank")
    full = dry_run_in_process(flags[:at] + flags[at + 6:], inputs)
    assert full.returncode == 2 and full.stderr.strip().splitlines()[-1].startswith(
        "error: memory plan: trainer rank needs "), full.stderr[-2000:]


@pytest.mark.long  # 175 s in make test's company: make test-long
def test_the_14b_grpo_lora_command_line_scaled_down_trains_with_every_sync_checked_and_saves_its_adapter(
        inputs, tiny_model_path):
    from test_hybrid import SCALED, _cli

    flags = [*_script_14b(inputs, tiny_model_path), *SCALED, "--runs_dir", str(inputs / "runs"), "--run_name", "lora",
             "--no-progress"]
    done = _cli(flags, inputs, 900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = inputs / "runs" / "lora"
    trained = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m.get("step")]
    assert [m["weight_version"] for m in trained] == [1, 2]
    # bf16 (the script's --ds.param_dtype): the engines' and the trainer's kernels round apart by about 2e-2.
    assert all(m["sync/probe_logprob_diff"] <= 5e-2 for m in trained), trained
    assert trained[-1]["sync/probe_adapter_effect"] > 0
    assert (inputs / "exp" / "adapter_config.json").is_file()  # the final adapter in --ckpt.output_dir
