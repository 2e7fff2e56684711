"""LoRA against full fine-tuning on the same task, cores and steps, as a user runs them (the CLI, a preset): per run the
trainer ranks' peak memory (PSS of the PolicyActor processes, sampled every second), the bytes and seconds of a
weight sync, the step time, and the held-out accuracy at the start and the end (the preset's eval set). LoRA's
engines get the merged weights, so a sync moves the whole model either way; the adapter's effect shows in the
trainer's memory (no gradients or optimizer states for the base, no reference copy) and in what it learns.

    python benchmarks/lora_vs_full.py --model SMOLLM2.gguf --preset smollm2_cpu --steps 8
    python benchmarks/lora_vs_full.py                       # the embedded tiny model, 5 steps each

Prints a final JSON line."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

RUNS = {"full": [], "lora": ["--ds.lora.rank", "16", "--ds.lora.alpha", "32"]}


def peak_rank_pss(pid: int, stop: threading.Event, out: dict) -> None:
    """The largest PSS of one PolicyActor process of the run (the ranks are alike)."""
    import psutil

    root = psutil.Process(pid)
    while not stop.is_set():
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in children:
            try:
                if "PolicyActor" in " ".join(p.cmdline()):
                    out["peak"] = max(out.get("peak", 0), p.memory_full_info().pss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        stop.wait(1.0)


def run(name: str, args, out_dir: str) -> dict:
    from openrlhf_async.config import preset_path

    runs = os.path.join(out_dir, "runs")
    model = ["--actor.model_name_or_path", args.model] if args.model else []
    lr = ["--actor.adam.lr", args.lora_lr] if name == "lora" and args.lora_lr else []
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path(args.preset), *model,
           *RUNS[name], *lr, "--train.max_steps", str(args.steps), "--ckpt.save_steps", "-1", "--runs_dir", runs,
           "--run_name", name, "--overwrite", "--no-progress"]
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""})
    memory, stop = {}, threading.Event()
    sampler = threading.Thread(target=peak_rank_pss, args=(proc.pid, stop, memory), daemon=True)
    sampler.start()
    _, err = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run failed (exit {proc.returncode}):\n{err[-3000:]}")
    with open(os.path.join(runs, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [m for m in records if m.get("step")]
    evals = [m for m in records if any(k.startswith("eval/mean@") for k in m)]
    key = next(k for k in evals[0] if k.startswith("eval/mean@"))

    def mean(k):
        values = [m[k] for m in steps[1:] if m.get(k) is not None]
        return round(statistics.mean(values), 3) if values else None

    return {"rank_peak_pss_gb": round(memory.get("peak", 0) / 2**30, 2), "step_s": mean("timing/step_s") or round(
            sum(mean(k) or 0 for k in ("timing/wait_s", "timing/train_s", "timing/sync_s")), 3),
            "train_s": mean("timing/train_s"), "sync_s": mean("timing/sync_s"),
            "eval_start": evals[0][key], "eval_end": evals[-1][key], "eval_metric": key,
            "probe_logprob_diff_max": max((m.get("sync/probe_logprob_diff") or 0) for m in steps),
            "wall_s": round(time.time() - start, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an HF folder or GGUF file (default: the preset's model)")
    parser.add_argument("--preset", default="tiny_cpu", help="the preset whose settings both runs take")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    parser.add_argument("--lora_lr", default=None, help="LoRA's learning rate (default: the preset's)")
    args = parser.parse_args(argv)
    from openrlhf_async.trainer.memory_plan import model_shape

    out_dir = tempfile.mkdtemp(prefix="lora-bench-")
    shape = model_shape(args.model)
    result = {"preset": args.preset, "model": args.model or "tiny", "steps": args.steps,
              "adapter_params": shape.lora_params(16, "all-linear") if shape else None,
              "params": shape.params if shape else None}
    for name in RUNS:
        result[name] = run(name, args, out_dir)
        print(name, result[name], file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
