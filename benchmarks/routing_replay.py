"""Routing replay on the tiny mixture of experts (the shipped Qwen3-MoE, 4 experts, 2 routed per token): vLLM-CPU
generates rollouts at temperature 1 and records the experts it routed each token to (rollout/routes.py); the
trainer (2 ZeRO-3 ranks) then computes the same samples' log-probs twice on the same weights, routing each token
itself and replaying vLLM's routes. Per dtype (fp32, bf16): the share of routed tokens (every layer, prompt and
response) the trainer's own routing sends to another expert set than vLLM did, and |vLLM's log-prob - the
trainer's| over the response tokens (mean, max), without and with replay. Prints a final JSON line."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(path: str, dtype: str, prompts: int, n: int, max_tokens: int) -> dict:
    import ray

    from openrlhf_async.config import preset_config, validate
    from openrlhf_async.data.prompts import tokenize_prompts
    from openrlhf_async.data.synthetic import make_arithmetic_rows
    from openrlhf_async.rollout.engine import create_engines
    from openrlhf_async.trainer.experience import training_sample
    from openrlhf_async.trainer.ranks import PolicyGroup

    cfg = validate(preset_config("tiny_cpu", "--actor.model_name_or_path", path, "--ds.param_dtype", dtype,
                                 "--vllm.num_engines", "1"))
    engine = create_engines(cfg, path)[0]
    policy = PolicyGroup(cfg, path)
    from transformers import AutoTokenizer

    rows = make_arithmetic_rows(prompts, seed=7, split="eval")
    tokenized = tokenize_prompts(AutoTokenizer.from_pretrained(path), rows, apply_chat_template=True)
    sampling = {"temperature": 1.0, "max_tokens": max_tokens, "seed": 11}
    groups = ray.get([engine.generate_group.remote(p["prompt_ids"], row["label"], n, sampling, f"g{i}", max_tokens)
                      for i, (p, row) in enumerate(zip(tokenized, rows))])
    samples = [training_sample(ep, 0.0) for group in groups for ep in group]
    with_routes = [s for s in samples if s.get("routes") is not None]
    plain = [{k: v for k, v in s.items() if k != "routes"} for s in with_routes]

    def gaps(batch) -> dict:
        ray.get(policy.call("routing_counts"))  # from this pass on
        trainer = policy.logprobs(batch, 1.0)
        known, differ = map(sum, zip(*ray.get(policy.call("routing_counts"))))
        diffs = [abs(a - b) for s, lp in zip(batch, trainer) for a, b in zip(s["logprobs"], lp)]
        return {"gap_mean": sum(diffs) / len(diffs), "gap_max": max(diffs), "routed_tokens": known,
                "routed_apart": differ}

    replayed, own = gaps(with_routes), gaps(plain)  # the replayed pass counts the routes it changed
    policy.shutdown()
    ray.kill(engine)
    return {"samples": len(samples), "with_routes": len(with_routes),
            "differ_share": replayed["routed_apart"] / max(1, replayed["routed_tokens"]),
            "without_replay": {k: own[k] for k in ("gap_mean", "gap_max")},
            "with_replay": {k: replayed[k] for k in ("gap_mean", "gap_max")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=8)
    args = parser.parse_args()
    import ray

    from openrlhf_async.models.tiny import embedded_model

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    path = embedded_model("tiny-qwen3-moe")
    results = {dtype: measure(path, dtype, args.prompts, args.n, args.max_tokens) for dtype in ("fp32", "bf16")}
    for dtype, r in results.items():
        print(f"{dtype}: {r['with_routes']} of {r['samples']} samples with routes; tokens routed apart "
              f"{100 * r['differ_share']:.2f}%; |vLLM - trainer| log-prob mean/max without replay "
              f"{r['without_replay']['gap_mean']:.2e}/{r['without_replay']['gap_max']:.3f}, with "
              f"{r['with_replay']['gap_mean']:.2e}/{r['with_replay']['gap_max']:.3f}", flush=True)
    print(json.dumps({"benchmark": "routing_replay", **args.__dict__, **results}))


if __name__ == "__main__":
    main()
