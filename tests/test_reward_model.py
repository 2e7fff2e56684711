"""Reward models (--reward.model_name_or_path): the tiny one the package ships, trained to prefer right answers,
scored by actors that batch the episodes arriving together, equal to a plain transformers forward of the same
checkpoint, behind OpenRLHF's serve_rm protocol too; an actor that dies or hangs is a counted reward error."""

import asyncio
import json
import os
import threading

import pytest
import torch

from conftest import preset_config
from test_hybrid import inputs  # noqa: F401 (the scripts' local files, a fixture)


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_model_path):
    from openrlhf_async.config import default_cache_dir
    from openrlhf_async.models.tiny import build_tiny_reward_model

    return build_tiny_reward_model(default_cache_dir())


def _texts(tokenizer, rows, wrong: bool):
    from openrlhf_async.data.synthetic import carry_slip_answer
    from openrlhf_async.models.tiny import prompt_text

    out = []
    for r in rows:
        answer = (carry_slip_answer(r["prompt"]) or str(int(r["label"]) + 3)) if wrong else r["label"]
        out.append(prompt_text(tokenizer, r["prompt"]) + answer + tokenizer.eos_token)
    return out


def _actor(path, normalize=True, micro_batch_size=64):
    from openrlhf_async.reward.model import RewardModelActor

    return RewardModelActor(path, "score", "fp32", "cpu", normalize, 256, micro_batch_size)


def test_the_tiny_reward_model_prefers_the_right_answer_on_held_out_questions(tiny_reward_model):
    from transformers import AutoTokenizer

    from openrlhf_async.data.synthetic import make_arithmetic_rows, split_size

    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model)
    rows = make_arithmetic_rows(split_size("eval"), seed=1, split="eval")  # every held-out question, once
    actor = _actor(tiny_reward_model)
    right, wrong = (asyncio.run(actor.score(_texts(tokenizer, rows, w))) for w in (False, True))
    wins = sum(r > w for r, w in zip(right, wrong))  # a tie is no preference
    # The shipped files are the model on every machine (a deterministic fp32 forward): what it measures is fixed, and
    # the bar says what "prefers" means. A scorer that cannot tell right from wrong wins half the pairs, with a
    # binomial standard error of 0.5 / sqrt(182) = 0.037; the bar is 3 of those above chance (0.61: 112 of 182), which
    # such a scorer reaches with a chance of 0.11% (exact binomial). The shipped model (3000 steps at lr 3e-4) wins 182
    # of 182; the first one shipped (1000 steps at lr 1e-3) won 84 (28 ties) and this test refused it.
    bar = 0.5 + 3 * 0.5 / len(rows) ** 0.5
    assert wins / len(rows) >= bar, f"the reward model prefers the right answer in {wins} of {len(rows)} pairs"


def test_a_reward_model_scores_as_a_plain_transformers_forward_normalised_by_its_stored_mean_and_std(
        tiny_reward_model):
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    from openrlhf_async.data.synthetic import make_arithmetic_rows

    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model)
    texts = _texts(tokenizer, make_arithmetic_rows(6, seed=2, split="eval"), False)
    texts[1] = texts[1] + "123456"  # different lengths in one batch: padding must not move the reward
    plain = Qwen2ForSequenceClassification.from_pretrained(tiny_reward_model, num_labels=1).eval()
    config = json.load(open(os.path.join(tiny_reward_model, "config.json")))
    with torch.no_grad():
        expected = [(plain(**tokenizer(t, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
                     - config["mean"]) / config["std"] for t in texts]
    got = asyncio.run(_actor(tiny_reward_model).score(texts))
    assert got == pytest.approx(expected, abs=1e-4)
    raw = asyncio.run(_actor(tiny_reward_model, normalize=False).score(texts))
    assert raw == pytest.approx([e * config["std"] + config["mean"] for e in expected], abs=1e-4)


def test_a_critic_or_reward_model_from_smollm2s_body_saves_in_openrlhfs_format_and_scores_as_transformers(
        smollm2, tmp_path):
    """A value model built from a real model's body (SmolLM2-135M, a Llama): its random head as OpenRLHF starts a
    critic's, saved as OpenRLHF saves one, read back by transformers' LlamaForSequenceClassification and by the
    reward-model actor alike."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from openrlhf_async.models.value import build_value_model

    model = build_value_model(smollm2, {"dtype": torch.float32})
    assert 0 < model.score.weight.std().item() < 2 / (model.config.hidden_size + 1) ** 0.5
    model.save(str(tmp_path), model.state_dict())
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(tmp_path)
    assert torch.equal(build_value_model(str(tmp_path), {"dtype": torch.float32}).score.weight, model.score.weight)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["What is 12+7? The answer is 19.", "What is 12+7? The answer is 91, surely."]
    plain = LlamaForSequenceClassification.from_pretrained(tmp_path, num_labels=1).eval()
    with torch.no_grad():
        expected = [plain(**tokenizer(t, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
                    for t in texts]
    assert asyncio.run(_actor(str(tmp_path), normalize=False).score(texts)) == pytest.approx(expected, abs=1e-4)


def test_calls_arriving_together_share_one_forward(tiny_reward_model):
    from transformers import AutoTokenizer

    from openrlhf_async.data.synthetic import make_arithmetic_rows

    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model)
    texts = _texts(tokenizer, make_arithmetic_rows(12, seed=3, split="eval"), False)
    actor = _actor(tiny_reward_model, micro_batch_size=8)
    alone = [asyncio.run(actor.score([t]))[0] for t in texts]
    before = actor.stats()["forwards"]

    async def together():
        return await asyncio.gather(*(actor.score([t]) for t in texts))

    results = asyncio.run(together())
    assert [r[0] for r in results] == pytest.approx(alone, abs=1e-5)
    assert actor.stats()["forwards"] - before == 2  # 12 episodes: one batch, in micro batches of 8


def test_openrlhfs_serve_rm_protocol_works_as_a_remote_url(tiny_reward_model):
    """A server answering as OpenRLHF's serve_rm does (POST /get_reward {"query": [...]} -> {"rewards", "scores",
    "extra_logs"}), backed by the tiny reward model, scores through --reward.remote_url."""
    from aiohttp import web
    from transformers import AutoTokenizer

    from openrlhf_async.data.synthetic import make_arithmetic_rows
    from openrlhf_async.reward.sources import make_reward
    from openrlhf_async.utils.ports import free_port

    actor = _actor(tiny_reward_model)

    async def get_reward(request):
        body = await request.json()
        rewards = await actor.score(body["query"])
        return web.json_response({"rewards": rewards, "scores": rewards, "extra_logs": {"dummy_scores": rewards}})

    port, started = free_port(), threading.Event()
    loop = asyncio.new_event_loop()

    def serve():
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_post("/get_reward", get_reward)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert started.wait(30)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model)
        texts = _texts(tokenizer, make_arithmetic_rows(4, seed=4, split="eval"), False)
        source = make_reward(remote_url=f"http://127.0.0.1:{port}/get_reward", timeout=30.0)

        async def scored():
            try:
                return [(await source.score([t], [""], [""]))[0] for t in texts]
            finally:
                await source.close()

        results = asyncio.run(scored())
        direct = asyncio.run(_actor(tiny_reward_model).score(texts))
        assert [r["reward"] for r in results] == pytest.approx(direct, abs=1e-5)
        assert all(r["extra"]["dummy_scores"] == pytest.approx(r["reward"]) for r in results)
    finally:
        loop.call_soon_threadsafe(loop.stop)


# ---- on Ray: the actors the engines reach -------------------------------------------------------------------------

def test_colocated_reward_models_sit_in_their_hosts_bundles_one_each_and_a_restart_starts_only_the_missing(
        ray_cluster, tiny_reward_model):
    """--train.colocate_critic_reward: reward model actor i in bundle i of the critic's placement group; started
    again (a trainer restart), only an actor that died is replaced."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from openrlhf_async.reward.model import reward_model_names, start_reward_models
    from openrlhf_async.reward.sources import NAMESPACE

    cfg = preset_config("--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "2",
                        "--reward.model_name_or_path", tiny_reward_model, "--reward.num_gpus_per_node", "2",
                        "--train.colocate_critic_reward")
    assert cfg.placement == {"critic": "own", "rewards": "critic"}
    group, names = placement_group([{"CPU": 0.001}] * 2), ()
    ray.get(group.ready())
    try:
        cfg.reward.models = reward_model_names(cfg)
        start_reward_models(cfg, group)
        names = cfg.reward.models[0]

        def placed():  # each actor's placement group, as it sees it
            def where(_):
                return ray.get_runtime_context().get_placement_group_id()

            return {name: ray.get(ray.get_actor(name, namespace=NAMESPACE).__ray_call__.remote(where)) for name in names}

        first = {name: ray.get_actor(name, namespace=NAMESPACE)._actor_id for name in names}
        assert placed() == {name: group.id.hex() for name in names}
        ray.kill(ray.get_actor(names[1], namespace=NAMESPACE), no_restart=True)
        start_reward_models(cfg, group)
        again = {name: ray.get_actor(name, namespace=NAMESPACE)._actor_id for name in names}
        assert again[names[0]] == first[names[0]] and again[names[1]] != first[names[1]]
        assert placed() == {name: group.id.hex() for name in names}
    finally:
        for name in names:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        remove_placement_group(group)


def test_a_dead_or_hung_reward_model_is_a_counted_reward_error_not_a_hung_episode(ray_cluster, tiny_reward_model):
    import ray

    class _Hanging:  # defined here: Ray sends it by value (the workers cannot import the tests)
        async def score(self, texts):
            await asyncio.sleep(3600)

    from openrlhf_async.reward.sources import NAMESPACE, ModelReward
    from openrlhf_async.rollout.episode import Episode
    from openrlhf_async.rollout.group_runner import rescored

    hanging = ray.remote(_Hanging).options(name="test-hanging-rm", namespace=NAMESPACE).remote()
    gone = ray.remote(_Hanging).options(name="test-dead-rm", namespace=NAMESPACE).remote()
    ray.get([hanging.__ray_ready__.remote(), gone.__ray_ready__.remote()])
    ray.kill(gone)

    class Tok:
        def decode(self, ids):
            return "x" * len(ids)

    async def episode():
        return Episode(request_id="r", prompt_ids=[1, 2], response_ids=[3], logprobs=[0.0], action_mask=[1],
                       reward=1.0, raw_reward=1.0, score=1.0)

    hung = ModelReward((("test-hanging-rm",),), timeout=0.0)
    hung.timeout = 1.0  # the engines' allowance is --reward.timeout + 60 s: shortened here
    dead = ModelReward((("test-dead-rm",),), timeout=1.0)
    for source, kind in ((hung, "reward_timeout"), (dead, "reward_error")):
        ep = asyncio.run(rescored(episode(), source, Tok(), "", ""))
        assert ep.error[0] == kind and ep.raw_reward == 0.0, ep.error


# ---- OpenRLHF's PPO command line (0.11, its slurm example: critic, reward model, reference, 4 GPUs each) ------------

PPO_SCRIPT = """
    --ref.num_nodes 1 --ref.num_gpus_per_node 4 --reward.num_nodes 1 --reward.num_gpus_per_node 4
    --critic.num_nodes 1 --critic.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4
    --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_critic_reward --train.colocate_actor_ref
    --actor.model_name_or_path {model} --reward.model_name_or_path {reward_model} --ckpt.output_dir {save}
    --ckpt.path {save}/ckpt --ckpt.save_hf --train.micro_batch_size 8 --train.batch_size 128
    --rollout.micro_batch_size 16 --rollout.batch_size 1024 --train.max_epochs 1 --data.max_len 2048
    --rollout.max_new_tokens 1024 --data.max_samples 100000 --ds.zero_stage 3 --ds.param_dtype bf16
    --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset {data}
    --data.input_key context_messages --data.apply_chat_template --reward.normalize_enable --ds.adam_offload
    --actor.gradient_checkpointing_enable --ds.packing_samples"""


def _trained_steps(run_dir) -> list:
    """A CLI run's metrics records of its training steps (step 0, the evaluation before training, left out)."""
    return [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m.get("step")]


def _ppo_flags(inputs, model, reward_model) -> list:
    files = {"model": model, "reward_model": reward_model, "data": inputs / "prompts.jsonl", "save": inputs / "exp"}
    return PPO_SCRIPT.format(**{k: str(v) for k, v in files.items()}).split()


def test_openrlhfs_ppo_command_line_passes_the_dry_run_counting_the_critics_and_reward_models_gpus(inputs):
    from conftest import dry_run_in_process
    from test_hybrid import MODEL_CONFIGS

    llama = os.path.join(MODEL_CONFIGS, "Llama-3-8B")
    proc = dry_run_in_process([*_ppo_flags(inputs, llama, llama), "--device", "cuda", "--plan.device_memory_gb", "80",
                               "--dry_run"], inputs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout[: proc.stdout.rindex("\ndry run:")])
    assert report["config"]["algo"]["advantage_estimator"] == "gae"  # OpenRLHF's default: PPO with a critic
    r = report["resources"]
    # --train.colocate_critic_reward: the reward models' actors share the critic's 4 GPUs, as OpenRLHF places them.
    assert r["placement"] == {"critic": "own", "rewards": "critic"}
    assert (r["trainer_ranks"], r["critic_ranks"], r["reward_model_actors"], r["gpus"]) == (4, 4, 4, 4 + 8 + 4)
    # Without the flag each has devices of its own; with unequal counts the flag is refused in one line.
    flags = [*_ppo_flags(inputs, llama, llama), "--device", "cuda", "--plan.device_memory_gb", "80", "--dry_run"]
    apart = dry_run_in_process([f for f in flags if f != "--train.colocate_critic_reward"], inputs)
    assert json.loads(apart.stdout[: apart.stdout.rindex("\ndry run:")])["resources"]["gpus"] == 4 + 8 + 4 + 4
    unequal = dry_run_in_process([*flags, "--reward.num_gpus_per_node", "2"], inputs)
    assert unequal.returncode == 2 and "Traceback" not in unequal.stderr
    assert unequal.stderr.strip().splitlines()[-1] == (
        "error: --train.colocate_critic_reward puts --reward's models on --critic's devices, one to one: "
        "--reward.num_nodes 1 x --reward.num_gpus_per_node 2 must equal --critic.num_nodes 1 x "
        "--critic.num_gpus_per_node 4; make them equal or drop --train.colocate_critic_reward")


@pytest.mark.long  # 140 s; make test trains OpenRLHF's PPO hybrid script (critic and reward model) scaled down instead
def test_openrlhfs_ppo_command_line_scaled_down_trains_on_the_tiny_reward_models_rewards_with_a_critic(
        inputs, tiny_model_path, tiny_reward_model):
    from test_hybrid import SCALED, _cli

    from openrlhf_async.models.value import build_value_model

    # Later flags override the script's: 2 CPU ranks, 1 critic rank, 1 reward-model actor; and what a user adds: an
    # adaptive KL coefficient, a checkpoint (at the last step), the critic saved at the end.
    flags = [*_ppo_flags(inputs, tiny_model_path, tiny_reward_model), *SCALED, "--critic.num_gpus_per_node", "1",
             "--reward.num_gpus_per_node", "1", "--no-ds.adam_offload", "--ds.param_dtype", "fp32",
             "--algo.kl.target", "0.01", "--ckpt.save_steps", "2", "--critic.save_value_network",
             "--runs_dir", str(inputs / "runs"), "--run_name", "ppo", "--no-progress"]
    done = _cli(flags, inputs, 900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = inputs / "runs" / "ppo"
    trained = _trained_steps(run_dir)
    assert [m["weight_version"] for m in trained] == [1, 2]
    for m in trained:  # the reward model's normalised rewards, not the math agent's 0 or 1
        assert "rollout/extra/reward_model_0" in m and m["reward/mean"] not in (0.0, 1.0), m
        assert m["critic/value_loss"] > 0 and m["critic/grad_norm"] > 0 and m["timing/critic_s"] > 0
        assert m["timing/reward_model_s"] > 0
    assert trained[1]["kl_coef"] != trained[0]["kl_coef"]  # the adaptive controller moved it
    spans = {s["actor"] for s in map(json.loads, (run_dir / "timeline.jsonl").read_text().splitlines())}
    assert {"critic 0", "reward model 0.0"} <= spans
    assert (inputs / "exp" / "config.json").is_file() and (inputs / "exp" / "ckpt" / "step_2" / "critic").is_dir()
    critic = build_value_model(str(inputs / "exp_critic"), {"dtype": torch.float32})  # OpenRLHF's <save_path>_critic
    reward_model = build_value_model(tiny_reward_model, {"dtype": torch.float32})
    assert not torch.equal(critic.score.weight, reward_model.score.weight)  # it started from the RM, and trained


def test_openrlhfs_ppo_hybrid_script_scaled_down_trains_with_critic_and_reward_model_beside_the_sleeping_engines(
        inputs, tiny_model_path, tiny_reward_model):
    """0.11's train_ppo_ray_hybrid_engine.sh (--train.colocate_all in sync mode): the critic's ranks and the reward
    models' actors share the policy's bundles with the engines; the critic's states leave with the policy's while the
    engines generate and come back with them to train."""
    from test_hybrid import SCALED, _cli, script_flags

    flags = script_flags("ppo", inputs, tiny_model_path)
    flags[flags.index("--reward.model_name_or_path") + 1] = tiny_reward_model
    flags += [*SCALED, "--critic.num_gpus_per_node", "2", "--reward.num_gpus_per_node", "2",
              "--runs_dir", str(inputs / "runs"), "--run_name", "ppo", "--no-progress"]
    done = _cli(flags, inputs, 900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = inputs / "runs" / "ppo"
    trained = _trained_steps(run_dir)
    assert [m["engine_weight_version"] for m in trained] == [1, 2]
    for m in trained:
        assert "rollout/extra/reward_model_0" in m and m["critic/value_loss"] > 0 and m["timing/critic_s"] > 0
    spans = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert {"reward model 0.0", "reward model 0.1"} <= {s["actor"] for s in spans}
    for step in (1, 2):
        def of(actor, kind):
            return sorted((s for s in spans if s["step"] == step and s["actor"] == actor and s["kind"] == kind),
                          key=lambda s: s["start"])
        sleep, wakes = of("engine 0", "sleep")[-1], of("engine 0", "wake")
        for actor in ("rank 0", "critic 0", "critic 1"):  # the critic's states follow the policy's
            reload, offload = of(actor, "reload")[-1], of(actor, "offload")[-1]
            assert sleep["end"] <= reload["start"] < offload["start"], (actor, step)
            assert any(offload["end"] <= w["start"] for w in wakes), f"{actor}: states kept while the engines woke"
