"""A batch's hand-over from the generator to the trainer at DAPO-like size, on random tokens: 512 prompts x 16 samples,
prompts of 200-500 tokens, responses uniform up to 8k tokens (single turn; logprobs float32 values as vLLM gives).

- old: the QueuedBatch with its episodes as Python lists through a ray.util.queue.Queue (pickled into the queue's
  actor and out again);
- new: through handover.BatchQueue: the episodes packed into flat arrays in Ray's object store (owned by the queue's
  actor), only the reference through the queue, unpacked to the same lists on the trainer's side.

Both put and get from the driver, each path in a fresh process with a Ray of its own (so the peak RSS is its own).
Per path: bytes serialized (the pickled item for old; the packed arrays and fields plus the queued item for new),
seconds to put (new: pack included) and to get (new: unpack included) after a warm-up hand-over of one group, the
driver's RSS before the hand-over (the episodes themselves) and its peak (the driver also holds what it got back),
and the queue actor's RSS before and its peak (VmHWM). --fraction runs that share of the prompts. Prints a final
JSON line."""

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import time


def _episodes(prompts: int, n: int, max_response: int, seed: int) -> list:
    import numpy as np

    from openrlhf_async.rollout.episode import Episode

    rng, groups = np.random.default_rng(seed), []
    for p in range(prompts):
        prompt = rng.integers(0, 151_000, rng.integers(200, 501)).tolist()
        group = []
        for s in range(n):
            length = int(rng.integers(0, max_response + 1))
            group.append(Episode(f"b0-{p}-{s}", list(prompt), response_ids=rng.integers(0, 151_000, length).tolist(),
                                 logprobs=rng.uniform(-10, 0, length).astype(np.float32).tolist(),
                                 action_mask=[1] * length, token_versions=[7] * length,
                                 finish_reason="length" if length == max_response else "stop", score=1.0,
                                 raw_reward=1.0, reward=1.0, turns=1))
        groups.append(group)
    return groups


def _rss_mb(pid="self", key="VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def _one_path(path: str, args) -> dict:
    import ray
    from ray.util.queue import Queue

    from openrlhf_async.trainer import handover
    from openrlhf_async.trainer.pipeline import QueuedBatch

    prompts = max(1, round(args.prompts * args.fraction))
    groups = _episodes(prompts, args.n, args.max_response, args.seed)
    item = QueuedBatch(0, 7, groups, {}, [], [], [])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        queue = Queue(maxsize=1) if path == "old" else handover.BatchQueue(1, {})
        actor = queue.actor if path == "old" else queue.queue.actor
        actor_pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        queue.put(QueuedBatch(0, 7, groups[:1], {}, [], [], []))  # warm-up: the first calls' one-time costs
        queue.get()
        driver_before, actor_before = _rss_mb(), _rss_mb(actor_pid)
        start = time.perf_counter()
        queue.put(item, timeout=600)
        put_s = time.perf_counter() - start
        got = queue.get(timeout=600)
        get_s = time.perf_counter() - start - put_s
        driver_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        actor_peak = _rss_mb(actor_pid, "VmHWM")
        if path == "old":
            nbytes = len(pickle.dumps(item, protocol=5))
        else:
            packed = handover.pack(groups)
            nbytes = sum(len(pickle.dumps(v, protocol=5)) for v in packed.values())
            nbytes += len(pickle.dumps(QueuedBatch(0, 7, ray.put(0), {}, [], [], []), protocol=5))
        exact = got.groups == groups
    finally:
        ray.shutdown()
    tokens = sum(len(ep.prompt_ids) + len(ep.response_ids) for g in groups for ep in g)
    return {"path": path, "prompts": prompts, "samples": prompts * args.n, "tokens": tokens,
            "bytes_serialized": nbytes, "put_s": round(put_s, 3), "get_s": round(get_s, 3),
            "put_get_s": round(put_s + get_s, 3), "driver_rss_before_mb": round(driver_before),
            "driver_rss_peak_mb": round(driver_peak), "queue_actor_rss_before_mb": round(actor_before),
            "queue_actor_rss_peak_mb": round(actor_peak), "exact": exact}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--max_response", type=int, default=8192, help="responses are uniform in 0..max_response")
    parser.add_argument("--fraction", type=float, default=1.0, help="run this share of the prompts")
    parser.add_argument("--paths", default="old,new", help="which hand-overs, comma separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", choices=["old", "new"], help=argparse.SUPPRESS)  # a child process: one path
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one_path(args.one, args)))
        return 0
    runs = []
    for path in args.paths.split(","):
        flags = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("paths", "one")]
        out = subprocess.run([sys.executable, os.path.abspath(__file__), *flags, f"--one={path}"], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), flush=True)
    result = {"fraction": args.fraction, "runs": runs}
    if len(runs) == 2:
        old, new = runs
        result["speedup_put_get"] = round(old["put_get_s"] / max(1e-9, new["put_get_s"]), 2)
        result["bytes_ratio"] = round(old["bytes_serialized"] / new["bytes_serialized"], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
