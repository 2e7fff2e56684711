"""The hybrid engine against the split layout on the same cores, in sync mode, as a user runs them (the CLI): the
split layout's engine(s) on devices of their own beside the 2 trainer ranks, weights by a broadcast over gloo; the
hybrid engine's 2 engines on the ranks' devices, asleep while the policy trains, weights through shared memory.

Each run's steps after the first (warm-up) give the mean step time and its parts (timing/wait_s: generation,
timing/train_s, timing/sync_s, timing/sleep_s: the hand-over; weights_load_s: the weights' way alone, engine 0's span
from the first bucket to the last loaded), and the run's peak memory is the largest sum of the
proportional set sizes (PSS: shared pages counted once) of its processes, sampled every second. On cpu vLLM's sleep
frees nothing (vLLM-CPU ignores it), so the hybrid engine's memory here is what it costs, not what it saves on a
GPU. Prints a final JSON line.

    python benchmarks/hybrid_vs_split.py                               # the embedded tiny model, 5 steps each
    python benchmarks/hybrid_vs_split.py --model SMOLLM2.gguf --preset smollm2_cpu --steps 4"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

LAYOUTS = {
    "split": [],
    "hybrid": ["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep", "--vllm.num_engines", "2"],
}


def preset_flags(name: str) -> list:
    """The preset's flags in sync mode (its --train.async_enable dropped)."""
    from openrlhf_async.config import preset_path

    with open(preset_path(name)) as f:
        words = [w for line in f if not line.lstrip().startswith("#") for w in shlex.split(line)]
    return [w for w in words if w not in ("--train.async_enable", "--train.partial_rollout_enable")]


def peak_pss(pid: int, stop: threading.Event, out: dict) -> None:
    import psutil

    root = psutil.Process(pid)
    while not stop.is_set():
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
        except psutil.NoSuchProcess:
            return
        out["peak"] = max(out.get("peak", 0), total)
        stop.wait(1.0)


def run(layout: str, args, out_dir: str) -> dict:
    runs = os.path.join(out_dir, "runs")
    model = ["--actor.model_name_or_path", args.model] if args.model else []
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", *preset_flags(args.preset), *model,
           "--mode", "sync", *LAYOUTS[layout], "--train.max_steps", str(args.steps), "--eval.steps", "-1",
           "--ckpt.save_steps", "-1", "--runs_dir", runs, "--run_name", layout, "--overwrite", "--no-progress"]
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""})
    memory, stop = {}, threading.Event()
    sampler = threading.Thread(target=peak_pss, args=(proc.pid, stop, memory), daemon=True)
    sampler.start()
    _, err = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"the {layout} run failed (exit {proc.returncode}):\n{err[-3000:]}")
    with open(os.path.join(runs, layout, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if m.get("step")][1:]  # the first step warms up

    def mean(key):
        values = [m.get(key, 0.0) for m in steps]
        return round(statistics.mean(values), 3) if values else None

    parts = {k.split("/")[1]: mean(k) for k in ("timing/wait_s", "timing/train_s", "timing/sync_s",
                                                "timing/sleep_s")}
    # The weights' way alone (broadcast or shared memory), without the hand-over around it: engine 0's "load" span,
    # from start_weight_update to finish_weight_update.
    with open(os.path.join(runs, layout, "timeline.jsonl")) as f:
        loads = [s["end"] - s["start"] for s in map(json.loads, f)
                 if s["actor"] == "engine 0" and s["kind"] == "load" and s["step"] in {m["step"] for m in steps}]
    return {"step_s": round(sum(v for k, v in parts.items() if k != "sleep_s"), 3), **parts,
            "weights_load_s": round(statistics.mean(loads), 3) if loads else None,
            "peak_pss_gb": round(memory.get("peak", 0) / 2**30, 2), "wall_s": round(time.time() - start, 1),
            "reward_mean": mean("reward/mean")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an HF folder or GGUF file (default: the preset's model)")
    parser.add_argument("--preset", default="tiny_cpu", help="the preset whose settings both runs take")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first is left out)")
    args = parser.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="hybrid-bench-")
    result = {"preset": args.preset, "model": args.model or "tiny", "steps_timed": args.steps - 1}
    for layout in LAYOUTS:
        result[layout] = run(layout, args, out_dir)
        print(layout, result[layout], file=sys.stderr, flush=True)
    result["hybrid_over_split_step"] = round(result["hybrid"]["step_s"] / result["split"]["step_s"], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
