"""The hybrid engine (OpenRLHF's colocate_all_models in sync mode): the layouts it accepts and refuses, the order of a
step's sleep, train, sync and wake, and weights exact after a sync through shared memory."""

import json
import os
import subprocess
import sys

import pytest

from conftest import dry_run_in_process, preset_config
from openrlhf_async.config import ConfigError

HYBRID = ("--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep", "--vllm.num_engines", "2",
          "--actor.num_gpus_per_node", "2")


def test_the_hybrid_layout_is_accepted_in_sync_mode_with_openrlhfs_old_spellings_too(capsys):
    cfg = preset_config(*HYBRID)
    assert cfg.hybrid and cfg.mode == "sync" and cfg.vllm.enable_sleep and cfg.ds.enable_sleep
    old = preset_config("--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep",
                        "--colocate_actor_ref", "--vllm_num_engines", "2", "--actor_num_gpus_per_node", "2")
    assert old.hybrid and old.vllm.enable_sleep and old.ds.enable_sleep and old.train.colocate_actor_ref
    # In the async modes --train.colocate_all keeps its meaning there (the DeepSpeed models only): no hybrid engine.
    assert not preset_config("--train.colocate_all", "--train.async_enable").hybrid


def test_openrlhf_0_10_spelling_of_the_correction_switch_is_translated():
    cfg = preset_config("--vllm_enable_is_correction", "--vllm_is_correction_type", "icepop")
    assert (cfg.algo.is_correction_level, cfg.algo.is_correction_mode) == ("token", "mask")


@pytest.mark.parametrize("flags, message", [
    (("--train.colocate_all", "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "2"),
     "--train.colocate_all: --vllm.num_engines 1 x --vllm.tensor_parallel_size 1 (1) must equal --actor.num_nodes 1 "
     "x --actor.num_gpus_per_node 2 (2)"),
    (("--train.async_enable", "--vllm.enable_sleep"),
     "--vllm.enable_sleep with --mode async: the asynchronous modes keep the engines on devices of their own"),
    (("--mode", "fully_async", "--vllm.enable_sleep"), "--vllm.enable_sleep with --mode fully_async"),
    (HYBRID + ("--ds.zero_stage", "0"), "--ds.enable_sleep with --ds.zero_stage 0: DeepSpeed offloads the states of "
                                        "a ZeRO optimizer only"),
    (HYBRID + ("--vllm.max_num_engines", "3"), "--vllm.max_num_engines 3 with --train.colocate_all"),
])
def test_a_refused_hybrid_layout_is_one_line_naming_the_flags_and_the_fix(flags, message):
    with pytest.raises(ConfigError) as e:
        preset_config(*flags)
    text = str(e.value)
    assert text.startswith(message) and "\n" not in text, text
    assert "drop" in text or "use" in text or "change" in text, text


@pytest.mark.parametrize("flags, message", [
    (("--vllm.enable_sleep", "--ds.enable_sleep"),
     "--vllm.enable_sleep and --ds.enable_sleep has no effect without --train.colocate_all"),
    (HYBRID + ("--ds.adam_offload",), "--ds.enable_sleep has no effect with --ds.adam_offload"),
])
def test_sleep_flags_without_anything_to_free_run_with_one_notice(flags, message, capsys):
    preset_config(*flags)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: ")]
    assert len(notices) == 1 and notices[0].startswith("notice: " + message), notices


def test_the_hybrid_engine_counts_the_trainers_gpus_once():
    from openrlhf_async.cli.train_async import resources

    cfg = preset_config(*HYBRID)
    cfg.device = "cuda"
    assert resources(cfg)["gpus"] == 2
    cfg.train.colocate_all = False
    assert resources(cfg)["gpus"] == 4


# ---- the shared-memory transport, inside a vLLM worker's weight-transfer engine (no engine started) ----------------

class _KeepingModel:
    """A model whose load_weights keeps the tensors it is given, as vLLM's layerwise reload does until a layer is
    complete."""

    def __init__(self):
        self.loaded = {}

    def load_weights(self, weights):
        self.loaded.update(weights)


def test_the_shm_transport_loads_each_bucket_as_a_copy_so_the_next_bucket_cannot_overwrite_it(tmp_path):
    import torch

    from openrlhf_async.rollout.weight_transfer import (
        BroadcastInitInfo,
        BroadcastUpdateInfo,
        BroadcastWeightTransferEngine,
    )

    path, size = str(tmp_path / "weights"), 64
    with open(path, "wb") as f:
        f.truncate(size)
    trainer_side = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    worker = object.__new__(BroadcastWeightTransferEngine)  # its vLLM parts are not used by the shm transport
    worker.group, worker.model, worker.device = None, _KeepingModel(), torch.device("cpu")
    worker.init_transfer_engine(BroadcastInitInfo(transport="shm", path=path, bucket_bytes=size))

    first = torch.arange(6, dtype=torch.float32)
    trainer_side[: first.numel() * 4].view(torch.float32).copy_(first)
    worker.receive_weights(BroadcastUpdateInfo(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[2, 2], [2]]))
    trainer_side[:32].view(torch.float32).fill_(-1.0)  # the next bucket, written over the file
    worker.receive_weights(BroadcastUpdateInfo(names=["c"], dtype_names=["float32"], shapes=[[8]]))

    loaded = worker.model.loaded
    assert torch.equal(loaded["a"], first[:4].view(2, 2)) and torch.equal(loaded["b"], first[4:])
    assert torch.equal(loaded["c"], torch.full((8,), -1.0))
    with pytest.raises(ValueError, match="does not fit"):
        worker.receive_weights(BroadcastUpdateInfo(names=["d"], dtype_names=["float32"], shapes=[[17]]))


# ---- the order of a step's calls, with the engines and ranks faked (no Ray) -------------------------------------

def _recording_sync(fail_update_at=None, cuda=False, tp=1):
    """A HybridWeightSync over two fake engines and fake ranks (tp each) recording every call in one list; the
    engines' update of bucket fail_update_at raises once. On cuda each rank beside an engine's worker shares its
    GPU's handles, named by its rank."""
    from openrlhf_async.rollout.sync_group import plan_buckets
    from openrlhf_async.trainer.hybrid import HybridWeightSync

    log, failures = [], [fail_update_at]

    class Recording(HybridWeightSync):
        def _call(self, members, method, *args):
            log.append(("engines", method, *args))
            if method == "update_weights" and failures[0] is not None and sum(
                    1 for e in log if e[1] == "update_weights") == failures[0] + 1:
                failures[0] = None
                return [("error", RuntimeError("update failed"))] + [("ok", None)] * (len(members) - 1)
            return [("ok", None)] * len(members)

        def _ranks(self, method, *args):
            log.append(("ranks", method))

        def _connect(self, members):
            self.bundles, self.grouped = {i: tuple(range(i * tp, (i + 1) * tp)) for i in members}, set(members)
            return members

        def _begin_attempt(self):
            pass

        def _begin_check(self, members, version):
            log.append(("engines", "check", version))

        def _ranks_each(self, method, bucket, owners):
            log.append(("ranks", method, sorted(owners)))
            return [[{f"gpu{r}": ("handle", name)} for name, _, _ in bucket] if r in owners else None
                    for r in range(2 * tp)]

    sync = object.__new__(Recording)
    sync.policy, sync.fleet, sync.tp, sync.cuda, sync.timeout = None, None, tp, cuda, 1.0
    sync.engine_sleep = sync.trainer_sleep = True
    sync.sleeping, sync.calls, sync.grouped, sync.check, sync.pending = set(), [], None, False, None
    sync.buckets = plan_buckets([("a", "float32", (4,)), ("b", "float32", (4,)), ("c", "float32", (4,))], 16)
    sync.members = {0: "engine 0", 1: "engine 1"}
    sync.version = sync.engine_version = sync.engines_dropped = sync.drain_frozen = sync.broadcasts_failed = 0
    return sync, log


def test_a_hybrid_step_sleeps_reloads_trains_offloads_wakes_the_weights_transfers_finishes_and_wakes_the_cache():
    sync, log = _recording_sync()
    sync.to_train()
    log.append(("ranks", "train"))
    sync.sync()
    steps = [(who, method) for who, method, *_ in log]
    assert steps == [("engines", "sleep"), ("ranks", "reload_states"), ("ranks", "train"),
                     ("ranks", "offload_states"), ("engines", "wake_up"), ("engines", "start_weight_update"),
                     *[("ranks", "write_bucket"), ("engines", "update_weights")] * 3,
                     ("engines", "finish_weight_update"), ("engines", "wake_up"), ("engines", "check")]
    wakes = [args for who, method, *args in log if method == "wake_up"]
    assert wakes == [[["weights"]], [["kv_cache"]]], "the weights wake before they are written, the cache after"
    assert ("engines", "finish_weight_update", 1) in log and sync.version == 1 and not sync.sleeping
    assert sync.calls == ["sleep", "reload", "offload", "wake weights", "start", "update", "update", "update",
                          "finish 1", "wake kv_cache"]


def test_the_version_moves_only_once_every_bucket_arrived_a_failed_transfer_is_made_again_whole():
    sync, log = _recording_sync(fail_update_at=1)
    sync.to_train()
    sync.sync()
    methods = [method for _, method, *_ in log]
    first_finish = methods.index("finish_weight_update")
    assert methods.count("start_weight_update") == 2 and methods.count("finish_weight_update") == 1
    assert methods[:first_finish].count("update_weights") == 2 + 3, "the failed transfer stopped, then all again"
    assert sync.broadcasts_failed == 1 and sync.version == 1
    assert methods[-2:] == ["wake_up", "check"] and not sync.sleeping


def test_on_cuda_each_tensor_parallel_worker_gets_the_handles_of_the_rank_on_its_own_gpu():
    """Two engines of tensor parallel 2 on four ranks' GPUs: every rank shares each bucket, and each parameter's
    handles name all four GPUs, so every worker finds its own (vLLM's IPC engine looks up its GPU's UUID)."""
    sync, log = _recording_sync(cuda=True, tp=2)
    sync.to_train()
    sync.sync()
    assert [args for who, method, *args in log if method == "share_bucket"] == [[[0, 1, 2, 3]]] * 3
    updates = [args[0] for who, method, *args in log if method == "update_weights"]
    assert [u["names"] for u in updates] == [["a"], ["b"], ["c"]]
    assert updates[0]["ipc_handles"] == [{f"gpu{r}": ("handle", "a") for r in range(4)}]
    assert sync.version == 1
    # The ranks drop each bucket's copies once the engines' call that loads it returned (a whole model's copy per GPU
    # otherwise), and collect what vLLM kept until its finish before the engines wake the KV cache.
    steps = [(who, method) for who, method, *_ in log]
    shares = [k for k, step in enumerate(steps) if step == ("ranks", "share_bucket")]
    for k in shares:
        assert steps[k + 1: k + 3] == [("engines", "update_weights"), ("ranks", "release_shared")], steps
    finish, wake = steps.index(("engines", "finish_weight_update")), len(steps) - 2  # the check comes last
    assert steps[finish + 1] == ("ranks", "release_shared") and log[wake] == ("engines", "wake_up", ["kv_cache"])
    assert sync.calls[-7:] == ["update", "release", "update", "release", "finish 1", "release", "wake kv_cache"]


def test_a_step_without_a_sync_wakes_the_engines_whole_on_their_old_weights():
    sync, log = _recording_sync()
    sync.to_train()
    sync.to_generate()
    assert [m for _, m, *_ in log] == ["sleep", "reload_states", "offload_states", "wake_up"]
    assert log[-1] == ("engines", "wake_up", None) and sync.version == 0


def test_a_replacement_engine_finishes_starting_before_the_ranks_take_the_device_back_and_sleeps_with_the_others():
    """An engine died in the last step and its replacement is loading in its bundle: vLLM sizes the KV cache from
    the free memory as it starts, so the ranks reload their states only once it is up; it then sleeps with the
    others, and wakes for the transfer that gives it the weights."""
    sync, log = _recording_sync()
    starting = ["replacement 2 loading"]

    def await_starting():
        if starting:
            log.append(("fleet", "await starting"))
            sync.calls.append("await starting")
            starting.clear()

    sync._await_starting = await_starting
    sync._joining = lambda: {} if starting else {2: "engine 2"}
    sync.to_train()
    steps = [(who, method) for who, method, *_ in log]
    assert steps[:3] == [("fleet", "await starting"), ("engines", "sleep"), ("ranks", "reload_states")], steps
    assert sync.sleeping == {0, 1, 2} and set(sync.members) == {0, 1}
    sync.to_generate()  # a step without a sync: the joining engine wakes too, for the catch-up that gives it weights
    assert sync.sleeping == set() and sync.calls[-1] == "wake"

    # With a sync the joining engine is among the members the transfer wakes, feeds and wakes whole.
    sync, log = _recording_sync()
    sync._joining = lambda: {2: "engine 2"}
    sync.to_train()
    assert sync.sleeping == {0, 1, 2}
    sync.sync()
    assert sync.sleeping == set() and sync.version == 1


def test_tensor_parallel_engines_take_bundles_of_one_node_whatever_order_ray_placed_them_in():
    """Ray numbers a placement group's bundles in the order asked, not by node: engine k in bundles k x TP on could
    span two nodes. Each engine's bundles are one node's, and its vLLM workers are told them."""
    from openrlhf_async.errors import ConfigError
    from openrlhf_async.rollout.engine import engine_env, hybrid_engine_bundles

    nodes = {0: "a", 1: "b", 2: "a", 3: "b", 4: "a", 5: "a", 6: "b", 7: "b"}
    placed = hybrid_engine_bundles(nodes, 2, 4)
    assert placed == [(0, 2), (4, 5), (1, 3), (6, 7)]
    assert all(len({nodes[b] for b in bundles}) == 1 for bundles in placed)
    assert hybrid_engine_bundles({i: "a" for i in range(4)}, 1, 4) == [(0,), (1,), (2,), (3,)]
    with pytest.raises(ConfigError, match="--vllm.tensor_parallel_size 2: Ray placed the trainer's bundles 3, 1 a "):
        hybrid_engine_bundles({0: "a", 1: "a", 2: "a", 3: "b"}, 2, 2)
    cfg = preset_config(*HYBRID, "--device", "cuda", "--vllm.tensor_parallel_size", "2", "--plan.device_memory_gb",
                        "80", validated=False)
    assert engine_env(cfg, placed[2])["VLLM_RAY_BUNDLE_INDICES"] == "1,3"
    assert engine_env(cfg)["VLLM_RAY_BUNDLE_INDICES"] == "0,1"  # an engine in a group of its own


def test_a_hybrid_replacement_waits_for_the_training_states_to_leave_its_gpu():
    """The engine's wait before vLLM's start-up check (rollout/engine.py) covers the hybrid engine too, bounded by a
    training step rather than a killed process's exit; tensor-parallel engines' GPUs are their workers'."""
    from openrlhf_async.rollout.engine import HYBRID_START_WAIT_S, memory_wait_s

    cfg = preset_config(*HYBRID, "--device", "cuda", "--plan.device_memory_gb", "80", validated=False)
    assert memory_wait_s(cfg.vllm, "cuda") == HYBRID_START_WAIT_S >= 600
    assert memory_wait_s(cfg.vllm, "") == 120.0
    cfg.vllm.tensor_parallel_size = 2
    assert memory_wait_s(cfg.vllm, "cuda") == 0.0


# ---- the session's engines and ranks as a hybrid engine (2 engines on 2 ranks' bundles) ----------------------------

def _spans(handles) -> dict:
    import ray

    out = {}
    for spans in ray.get([h.take_spans.remote() for h in handles]):
        for s in spans:
            out.setdefault(s["actor"], []).append(s)
    return out


def _first(spans: list, kind: str, nth: int = 0) -> dict:
    found = [s for s in spans if s["kind"] == kind]
    assert len(found) > nth, (kind, [s["kind"] for s in spans])
    return found[nth]


def test_a_hybrid_step_sleeps_trains_and_syncs_by_shared_memory_in_order_and_vllm_then_matches_the_trainer(
        restore_weights, engines, policy, weight_sync, tiny_model_path):
    import ray

    from openrlhf_async.trainer.hybrid import HybridWeightSync
    from openrlhf_async.trainer.ranks import loss_settings
    from test_weight_sync import _greedy, _prompt_ids

    name = "model.embed_tokens.weight"
    before = ray.get(engines[0].read_weight.remote(name))[:100]
    _spans(engines + policy.actors)  # start the record here
    hybrid = HybridWeightSync(policy, engines, preset_config(*HYBRID))
    try:
        hybrid.version = weight_sync.version
        prompts = _prompt_ids(tiny_model_path, 6)
        hybrid.to_train()
        assert all(ray.get([e.is_sleeping.remote() for e in engines])), "the engines did not go to sleep"
        samples = [{"prompt_ids": p, "response_ids": [20, 21, 22], "logprobs": [-3.0] * 3,
                    "advantage": 1.0 - 2 * (i % 2)} for i, p in enumerate(prompts)]
        policy.train_step(samples, 2, loss_settings(preset_config(validated=False), correction={"level": "off"}))
        hybrid.sync()

        version, buckets = hybrid.version, len(hybrid.buckets)
        assert hybrid.calls == ["sleep", "reload", "offload", "wake weights", "start", *["update"] * buckets,
                                f"finish {version}", "wake kv_cache"]
        spans = _spans(engines + policy.actors)
        rank0 = spans["rank 0"]
        reload = _first(rank0, "reload")
        offload = [s for s in rank0 if s["kind"] == "offload"][-1]  # the first: at the start, before the engines slept
        train = [s for s in rank0 if s["kind"] == "train"]
        for engine in ("engine 0", "engine 1"):
            sleep, wake_weights, load, wake_kv = (_first(spans[engine], "sleep"), _first(spans[engine], "wake"),
                                                  _first(spans[engine], "load"), _first(spans[engine], "wake", 1))
            order = [sleep, reload, *train, offload, wake_weights, load, wake_kv]
            assert all(a["end"] <= b["start"] for a, b in zip(order, order[1:])), [s["kind"] for s in order]
        assert not any(ray.get([e.is_sleeping.remote() for e in engines])), "an engine still sleeps"

        trainer_weight = ray.get(policy.call("read_weight", name))[0]
        for engine in engines:
            engine_weight = ray.get(engine.read_weight.remote(name))[: trainer_weight.shape[0]]
            assert (engine_weight[:100] - before).abs().max() > 1e-4, "the engine still holds the old weights"
            assert (engine_weight - trainer_weight).abs().max() < 1e-6
            assert ray.get(engine.get_weight_version.remote()) == version
            outs = _greedy(engine, prompts)
            teacher = ray.get(policy.call("forward_logprobs", outs))[0]
            for out, ref in zip(outs, teacher):
                assert out["response_ids"] == ref["greedy_ids"], "vLLM's greedy tokens differ from the trainer's"
                diff = max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"]))
                assert diff <= 1e-4, f"log-prob mismatch {diff}"
    finally:
        ray.get(policy.call("reload_states"))  # the session's ranks train on after this test
        weight_sync.grouped = None  # the engines left the broadcast group: it forms again at the next sync
        weight_sync.version = max(weight_sync.version, hybrid.version)


# ---- OpenRLHF's own hybrid-engine command lines, with only the module swapped and paths pointed at local files -------
# Their flags as OpenRLHF's examples/scripts/ give them ({...}: local files; $NUM_GPUS = 8), in 0.11's dotted and
# 0.10's flat spellings.

SCRIPTS = {
    # 0.11 train_prorlv2_math_hybrid_engine.sh
    "prorl_v2": ("DeepSeek-R1-Distill-Qwen-1.5B", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
        --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.75
        --algo.kl.init_coef 1e-4 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2
        --algo.advantage.estimator reinforce_baseline --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1
        --actor.eps_clip_low_high 0.2 0.27 --actor.model_name_or_path {model} --reward.remote_url {reward}
        --ckpt.output_dir {save} --ckpt.path {save}/ckpt --ckpt.save_steps 5 --ckpt.save_hf --train.batch_size 1024
        --rollout.batch_size 512 --rollout.n_samples_per_prompt 16 --train.dynamic_batch_enable
        --train.num_episodes 100 --data.max_len 9216 --rollout.max_new_tokens 8192 --ds.zero_stage 3
        --ds.param_dtype bf16 --actor.adam.lr 1e-6 --data.prompt_dataset {data} --data.input_key prompt
        --data.label_key label --eval.dataset {eval} --eval.steps 5 --eval.temperature 1.0 --eval.n_samples_per_prompt 4
        --data.apply_chat_template --actor.gradient_checkpointing_enable --ds.packing_samples
        --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep
        --algo.advantage.is_correction_enable --algo.advantage.is_correction_threshold 0.5 5.0
        --algo.advantage.is_correction_type icepop --train.max_tokens_per_gpu 32768
        --reward.stop_properly_penalty_coef 0.0"""),
    # 0.11 train_dapo_ray_hybrid_engine.sh
    "dapo": ("Llama-3-8B", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
        --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.6
        --algo.kl.init_coef 1e-3 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k3
        --algo.advantage.estimator group_norm --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1
        --actor.eps_clip_low_high 0.2 0.27 --actor.model_name_or_path {model} --reward.remote_url {reward}
        --ckpt.output_dir {save} --ckpt.path {save}/ckpt --ckpt.save_steps 20 --ckpt.save_hf
        --train.micro_batch_size 8 --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size 128
        --rollout.n_samples_per_prompt 8 --train.max_epochs 1 --data.max_len 2048 --data.max_samples 20000
        --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --data.prompt_dataset {data}
        --data.input_key context_messages --data.apply_chat_template --actor.gradient_checkpointing_enable
        --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep
        --algo.advantage.is_correction_enable"""),
    # 0.10 train_dapo_ray_hybrid_engine.sh
    "dapo_flat": ("Llama-3-8B", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
        --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.6
        --init_kl_coef 1e-3 --gamma 1.0 --use_kl_loss --kl_estimator k3 --advantage_estimator group_norm
        --dynamic_filtering --dynamic_filtering_reward_range 0 1 --eps_clip_low_high 0.2 0.3 --pretrain {model}
        --remote_rm_url {reward} --save_path {save} --ckpt_path {save}/ckpt --save_steps 20 --save_hf_ckpt
        --micro_train_batch_size 8 --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 128
        --n_samples_per_prompt 8 --max_epochs 1 --prompt_max_len 1024 --max_samples 20000 --generate_max_len 1024
        --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --prompt_data {data} --input_key context_messages
        --apply_chat_template --gradient_checkpointing --packing_samples --vllm_sync_backend nccl --enforce_eager
        --vllm_enable_sleep --deepspeed_enable_sleep"""),
    # 0.10 train_grpo_ray_hybrid_engine_agent.sh
    "grpo_agent_flat": ("Llama-3-8B", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
        --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.6
        --init_kl_coef 1e-3 --gamma 1.0 --use_kl_loss --kl_estimator k3 --advantage_estimator group_norm
        --pretrain {model} --agent_func_path {agent} --save_path {save} --ckpt_path {save}/ckpt --save_hf_ckpt
        --micro_train_batch_size 8 --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 128
        --n_samples_per_prompt 8 --max_epochs 1 --prompt_max_len 1024 --max_samples 100000 --generate_max_len 1024
        --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --prompt_data {data}
        --input_key context_messages --apply_chat_template --normalize_reward --gradient_checkpointing
        --packing_samples --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep --deepspeed_enable_sleep"""),
    # 0.10 train_reinforce_baseline_ray_agent_multiturn.sh (a GEM environment there: an agent file of ours here)
    "multiturn_agent_flat": ("Qwen3-1.7B", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
        --vllm_num_engines 8 --vllm_tensor_parallel_size 1 --colocate_all_models --agent_func_path {agent}
        --pretrain {model} --save_path {save} --vllm_gpu_memory_utilization 0.8 --l2 0.01 --micro_train_batch_size 8
        --train_batch_size 256 --micro_rollout_batch_size 16 --rollout_batch_size 128 --n_samples_per_prompt 16
        --max_epochs 1 --prompt_max_len 1024 --max_samples 1000000 --num_episodes 1000000 --generate_max_len 10240
        --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --advantage_estimator reinforce_baseline --init_kl_coef 0
        --kl_estimator k2 --prompt_data {data} --input_key prompt --label_key label --normalize_reward
        --vllm_enable_sleep --use_dynamic_batch --deepspeed_enable_sleep --gradient_checkpointing --packing_samples
        --save_steps -1 --enforce_eager --eps_clip_low_high 0.2 0.28 --top_p 0.98 --enable_vllm_is_correction"""),
    # 0.10 train_grpo_ray_hybrid_engine.sh: a reward model on every GPU beside the engines and the ranks
    "grpo_flat": ("Llama-3-8B", """
        --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
        --actor_num_nodes 1 --actor_num_gpus_per_node 8 --vllm_num_engines 2 --vllm_tensor_parallel_size 4
        --colocate_all_models --vllm_gpu_memory_utilization 0.6 --init_kl_coef 1e-6 --gamma 1.0 --use_kl_loss
        --use_kl_estimator_k3 --advantage_estimator group_norm --pretrain {model} --reward_pretrain {model}
        --save_path {save} --ckpt_path {save}/ckpt --save_hf_ckpt --micro_train_batch_size 8 --train_batch_size 128
        --micro_rollout_batch_size 16 --rollout_batch_size 1024 --n_samples_per_prompt 1 --max_epochs 1
        --prompt_max_len 1024 --max_samples 100000 --generate_max_len 1024 --zero_stage 3 --bf16
        --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --prompt_data {data} --input_key context_messages
        --apply_chat_template --normalize_reward --adam_offload --gradient_checkpointing --packing_samples
        --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep"""),
    # 0.11 train_ppo_ray_hybrid_engine.sh: PPO (gae, OpenRLHF's default) with a critic started from the reward model,
    # both on the engines' and the ranks' GPUs
    "ppo": ("Llama-3-8B", """
        --ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
        --critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
        --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5
        --actor.model_name_or_path {model} --reward.model_name_or_path {model} --ckpt.output_dir {save}
        --ckpt.path {save}/ckpt --ckpt.save_hf --train.micro_batch_size 8 --train.batch_size 128
        --rollout.micro_batch_size 16 --rollout.batch_size 1024 --rollout.n_samples_per_prompt 1 --train.max_epochs 1
        --data.max_len 2048 --data.max_samples 100000 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7
        --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset {data} --data.input_key context_messages
        --data.apply_chat_template --reward.normalize_enable --actor.gradient_checkpointing_enable
        --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep
        --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384 --algo.advantage.is_correction_enable"""),
}
# Scaled to 2 CPU ranks (what a user changes to try one on a laptop): later flags override the script's.
SCALED = ["--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--vllm.num_engines", "2",
          "--vllm.tensor_parallel_size", "1", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4",
          "--train.batch_size", "16", "--train.micro_batch_size", "4", "--data.max_len", "256",
          "--rollout.max_new_tokens", "48", "--train.max_steps", "2", "--device", "cpu"]
# The hub models' config.json (tests/model_configs/), so that the dry runs plan their memory offline.
MODEL_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")
# OpenRLHF's reward_func contract; the reward varies within a group so that the dynamic filter keeps groups.
REWARD = "def reward_func(queries, prompts, labels, **kwargs):\n    return {'rewards': [float(len(q) % 2) for q in queries]}\n"


@pytest.fixture
def inputs(tmp_path):
    """The scripts' inputs as local files: prompts with labels and as messages (8: two steps of 4), two eval problems,
    the reward file, an OpenRLHF AgentExecutor of a few turns."""
    from test_openrlhf_scripts import AGENT

    with open(tmp_path / "prompts.jsonl", "w") as f:
        for a in range(8):
            f.write(json.dumps({"prompt": f"{a}+{a + 1}=", "label": str(2 * a + 1),
                                "context_messages": [{"role": "user", "content": f"{a}+{a + 1}="}]}) + "\n")
    with open(tmp_path / "aime.jsonl", "w") as f:
        for a in range(2):
            f.write(json.dumps({"prompt": f"{a}*3=", "label": str(3 * a)}) + "\n")
    (tmp_path / "reward_func.py").write_text(REWARD)
    (tmp_path / "agent_func.py").write_text(AGENT)
    return tmp_path


def script_flags(name: str, inputs, model: str = None) -> list:
    shape, text = SCRIPTS[name]
    files = {"model": model or os.path.join(MODEL_CONFIGS, shape), "data": inputs / "prompts.jsonl",
             "eval": inputs / "aime.jsonl", "reward": inputs / "reward_func.py", "agent": inputs / "agent_func.py",
             "save": inputs / "exp"}
    return text.format(**{k: str(v) for k, v in files.items()}).split()


def _cli(flags: list, cwd, timeout: int):
    return subprocess.run([sys.executable, "-m", "openrlhf_async.cli.train_async", *flags], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "RAY_ADDRESS": ""})


FIXED = {  # the flags of a script this project refuses, in the order it says so: what a user writes instead, and why
    # GRPO's group of 1 has no spread (OpenRLHF trains it with advantages of 0)
    "grpo_flat": [("--n_samples_per_prompt", ["--n_samples_per_prompt", "8"],
                   "--rollout.n_samples_per_prompt must be at least 2 (got 1)")],
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_openrlhfs_hybrid_scripts_pass_the_dry_run_with_a_memory_plan_of_each_phase_that_fits_80_gb(inputs, script):
    flags = [*script_flags(script, inputs), "--device", "cuda", "--plan.device_memory_gb", "80", "--dry_run"]
    for flag, instead, refusal in FIXED.get(script, []):
        refused = dry_run_in_process(flags, inputs)
        line = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert refusal in line, line
        at = flags.index(flag)
        flags[at: at + 2] = [f.format(reward=inputs / "reward_func.py") for f in instead]
    proc = dry_run_in_process(flags, inputs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run: configuration valid"), proc.stdout[-2000:]
    report = json.loads(proc.stdout[: proc.stdout.rindex("\ndry run:")])
    assert report["resources"]["hybrid"] and report["resources"]["gpus"] == 8  # engines on the ranks' 8 GPUs
    config = report["config"]
    assert config["mode"] == "sync" and config["vllm"]["enable_sleep"]
    plan, device = report["memory_plan"], 80 * 2**30
    if script in ("prorl_v2", "dapo"):  # the published parameter counts
        assert plan["params"] == {"prorl_v2": 1_777_088_000, "dapo": 8_030_261_248}[script]
    phases = plan["hybrid"]
    # Training holds the trainer's full states and, of the sleeping engine (eager: no CUDA graphs), its context
    # alone; generation the engine's share.
    from openrlhf_async.trainer.memory_plan import PROCESS_RESIDUAL

    assert phases["train"] == plan["trainer_rank"]["total"] + 2 * PROCESS_RESIDUAL
    assert phases["generate"] >= plan["vllm_engine"]["total"] > phases["transfer"] - phases["generate"]
    assert phases["peak"] == max(phases["generate"], phases["train"], phases["transfer"]) <= device
    assert "hybrid engine (engine + rank on one device)" in proc.stderr


def test_the_memory_plan_refuses_a_hybrid_engine_whose_engines_do_not_sleep_while_the_trainer_needs_the_device():
    from openrlhf_async.trainer import memory_plan

    cfg = preset_config(*HYBRID, "--vllm.gpu_memory_utilization", "0.6", "--plan.device_memory_gb", "24",
                        "--ds.param_dtype", "bf16", "--actor.gradient_checkpointing_enable")
    cfg.device, cfg.actor.model_name_or_path = "cuda", os.path.join(MODEL_CONFIGS, "DeepSeek-R1-Distill-Qwen-1.5B")
    phases = memory_plan.for_config(cfg)["hybrid"]  # asleep, the engine's 14.4 GB and the trainer's peak take turns
    assert max(phases["generate"], phases["train"]) < 24 * 2**30 < phases["generate"] + phases["train"]
    cfg.vllm.enable_sleep = False  # awake, the engine's share stays beside the trainer's training peak
    with pytest.raises(ConfigError) as e:
        memory_plan.for_config(cfg)
    assert str(e.value).startswith("memory plan: the hybrid engine's train phase needs ") and \
        str(e.value).endswith("try --vllm.enable_sleep"), str(e.value)


# ---- end to end: two of them scaled down on the CLI (a Ray of its own each: they run before the session's stack) -------

# Both marked long (about 100 s each): make test runs 0.11's PPO hybrid script scaled down instead (critic and reward
# model beside the sleeping engines: test_reward_model.py), the hybrid engine's fullest path.
@pytest.mark.parametrize("script", [pytest.param("prorl_v2", marks=pytest.mark.long),
                                    pytest.param("grpo_agent_flat", marks=pytest.mark.long)])
def test_openrlhfs_hybrid_scripts_scaled_down_train_two_steps_with_engines_sleeping_while_the_policy_trains(
        inputs, tiny_model_path, script):
    flags = [*script_flags(script, inputs, tiny_model_path), *SCALED, "--runs_dir", str(inputs / "runs"),
             "--run_name", "hybrid", "--no-progress"]
    done = _cli(flags, inputs, 900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = inputs / "runs" / "hybrid"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if m.get("step")]
    assert [m["weight_version"] for m in trained] == [1, 2]
    assert [m["engine_weight_version"] for m in trained] == [1, 2], "the engines did not load each version"
    assert all(0 < m["timing/sleep_s"] < m["timing/train_s"] + m["timing/sync_s"] for m in trained)
    if script == "prorl_v2":  # evaluated at the start and the end, on awake engines
        assert "eval/mean@4" in metrics[0] and "eval/mean@4" in trained[-1]
    else:  # the agent's later turns: environment tokens in the responses, masked out of the loss
        assert sum(m["rollout/observation_len_mean"] for m in trained) > 0
    assert (inputs / "exp" / "config.json").is_file()  # the final model in --ckpt.output_dir (--save_path)
    spans = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    for step in (1, 2):
        rank0 = sorted((s for s in spans if s["step"] == step and s["actor"] == "rank 0"), key=lambda s: s["start"])
        engine = sorted((s for s in spans if s["step"] == step and s["actor"] == "engine 0"),
                        key=lambda s: s["start"])
        # Step 1's record also holds the start: the engines slept while the ranks loaded, whose states then left.
        kinds = [s["kind"] for s in rank0 if s["kind"] in ("reload", "train", "offload")]
        kinds = kinds[kinds.index("reload"):]
        assert kinds[-1] == "offload" and set(kinds[1:-1]) == {"train"}, kinds
        engine_kinds = [s["kind"] for s in engine if s["kind"] in ("sleep", "wake", "load")]
        last_sleep = len(engine_kinds) - 1 - engine_kinds[::-1].index("sleep")
        assert engine_kinds[last_sleep:] == ["sleep", "wake", "load", "wake"], engine_kinds
        sleep = [s for s in engine if s["kind"] == "sleep"][-1]
        reload = next(s for s in rank0 if s["kind"] == "reload")
        offload = [s for s in rank0 if s["kind"] == "offload"][-1]
        wake = next(s for s in engine if s["kind"] == "wake" and s["start"] >= sleep["end"])
        assert sleep["end"] <= reload["start"] and offload["end"] <= wake["start"], "both full states at once"


def test_a_rank_gives_the_shared_copies_memory_back_to_the_device_once_the_engines_read_them(monkeypatch):
    """On cuda the copies the engines read by IPC stay reserved to the rank's caching allocator once dropped, out of
    reach of vLLM (another process), which wakes its KV cache next: the rank empties its cache after dropping them.
    (A stand-in for torch.cuda: no GPU here.)"""
    import torch

    from openrlhf_async.trainer.weight_export import WeightExport

    done = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: done.append(("ipc_collect", export.held)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: done.append(("empty_cache", export.held)))
    export = object.__new__(WeightExport)
    export.held = [torch.zeros(4)]
    export.release_shared()
    assert done == [("ipc_collect", None), ("empty_cache", None)]


def test_the_memory_plan_counts_the_ipc_copies_a_rank_holds_in_the_transfer():
    """On cuda a rank holds the copies it exports by IPC until the engines' call that loads them returns
    (weight_export.py, hybrid.py): two layer-aligned buckets at most and the embeddings vLLM may keep until its
    finish; once the whole model (16 GB for an 8B model in bf16), with one bucket counted before that."""
    from openrlhf_async.trainer import memory_plan

    cfg = preset_config(*HYBRID, "--plan.device_memory_gb", "80", "--ds.param_dtype", "bf16",
                        "--actor.gradient_checkpointing_enable", "--train.micro_batch_size", "1",
                        "--vllm.enforce_eager")
    cfg.device, cfg.actor.model_name_or_path = "cuda", os.path.join(MODEL_CONFIGS, "DeepSeek-R1-Distill-Qwen-1.5B")
    plan = memory_plan.for_config(cfg)
    phases, engine = plan["hybrid"], plan["vllm_engine"]
    shape = memory_plan.model_shape(cfg.actor.model_name_or_path)
    layer, embeddings = 2 * shape.layer_params, 2 * shape.vocab * shape.hidden * (1 if shape.tied else 2)
    copies = 2 * max(64 << 20, layer) + embeddings
    assert memory_plan.ipc_copies_bytes(shape, memory_plan.setup_of(cfg)) == copies < plan["params"]  # < half the model
    # The sleeping engine's weights (eager: no graph pool), the copies, and what the rank keeps in every phase
    # (generation: beside the engine's whole share).
    assert phases["transfer"] - engine["weights"] - copies == phases["generate"] - engine["total"]


def test_the_memory_plan_counts_what_a_sleeping_engine_and_both_processes_keep_on_the_device():
    """Sleep (level 1) releases the engine's weights and KV cache, not its CUDA context or its CUDA-graph pool, and
    the trainer rank's process has a context of its own: each phase counts them (a sleeping engine was 0 bytes)."""
    from openrlhf_async.trainer import memory_plan
    from openrlhf_async.trainer.memory_plan import CUDA_GRAPH_POOL, PROCESS_RESIDUAL

    def plan(*flags):
        cfg = preset_config(*HYBRID, "--plan.device_memory_gb", "80", "--ds.param_dtype", "bf16",
                            "--actor.gradient_checkpointing_enable", *flags)
        cfg.device, cfg.actor.model_name_or_path = "cuda", os.path.join(MODEL_CONFIGS, "DeepSeek-R1-Distill-Qwen-1.5B")
        return memory_plan.for_config(cfg)

    graphs, eager = plan("--no-vllm.enforce_eager"), plan("--vllm.enforce_eager")
    for p, asleep in ((graphs, CUDA_GRAPH_POOL + PROCESS_RESIDUAL), (eager, PROCESS_RESIDUAL)):
        assert p["hybrid"]["train"] == p["trainer_rank"]["total"] + PROCESS_RESIDUAL + asleep
    assert graphs["vllm_engine"]["kv_cache"] == eager["vllm_engine"]["kv_cache"] - CUDA_GRAPH_POOL
    assert 1 * 2**30 <= graphs["hybrid"]["train"] - graphs["trainer_rank"]["total"] <= 4 * 2**30  # the range


def test_an_engine_whose_sleep_failed_is_dropped_before_the_ranks_reload_and_never_woken():
    """vLLM's sleep asserts that its device's free memory did not fall across the call (every process's, so a rank
    reloading meanwhile would fail it): the ranks reload only after every sleep returned, and an engine whose sleep
    raised (its executor then thinks it awake, its weights in host memory) is dropped, not woken for the transfer."""
    sync, log = _recording_sync()
    recorded = sync._call

    def sleep_fails_on_engine_1(members, method, *args):
        outcomes = recorded(members, method, *args)
        if method == "sleep":
            return [("error", AssertionError("Memory usage increased after sleeping.")) if i == 1 else o
                    for i, o in zip(members, outcomes)]
        return outcomes

    sync._call = sleep_fails_on_engine_1
    sync._drop = lambda members, ids: log.append(("fleet", "drop", sorted(ids)))
    sync.to_train()
    assert log[:3] == [("engines", "sleep", 1), ("fleet", "drop", [1]), ("ranks", "reload_states")], log
    assert set(sync.members) == sync.sleeping == {0}
    sync._call = recorded
    sync.sync()
    assert sync.version == 1 and not sync.sleeping and set(sync.members) == {0}
