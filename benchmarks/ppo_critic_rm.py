"""PPO with a critic and a learned reward model on the built-in arithmetic task, as a user runs it (the CLI, the tiny
preset): the tiny reward model (models/tiny.py, trained here to prefer right answers) scores every episode, a critic
started from it gives GAE's values, in sync and in fully asynchronous mode. Per mode: the held-out accuracy at the
start and the end (math-verified, not the reward model's opinion), the reward model's and the critic's seconds per
step beside the step's, the wall time; the learning pictures are in each run's folder.

    python benchmarks/ppo_critic_rm.py --steps 30

Prints a final JSON line."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODES = {"sync": [], "fully_async": ["--mode", "fully_async", "--train.partial_rollout_enable"]}


def run(mode: str, args, reward_model: str, out_dir: str) -> dict:
    from openrlhf_async.config import preset_path

    runs = os.path.join(out_dir, "runs")
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"), *MODES[mode],
           "--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "1", "--critic.adam.lr", args.critic_lr,
           "--reward.model_name_or_path", reward_model, "--reward.num_gpus_per_node", "1",
           "--reward.normalize_enable", "--train.max_steps", str(args.steps), "--eval.steps", str(args.steps),
           "--ckpt.save_steps", "-1", "--runs_dir", runs, "--run_name", mode, "--overwrite", "--no-progress"]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "RAY_ADDRESS": ""})
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    folder = os.path.join(runs, mode)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if m.get("step")]
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)

    def mean(key):
        values = [m[key] for m in steps[1:] if m.get(key) is not None]
        return round(statistics.mean(values), 3) if values else None

    return {"eval_accuracy_start": summary["eval_accuracy_start"], "eval_accuracy_end": summary["eval_accuracy_end"],
            "reward_model_mean_first": round(steps[0]["reward/mean"], 3),
            "reward_model_mean_last": round(steps[-1]["reward/mean"], 3),
            "critic_value_loss_first": round(steps[0]["critic/value_loss"], 4),
            "critic_value_loss_last": round(steps[-1]["critic/value_loss"], 4),
            "train_s": mean("timing/train_s"), "critic_s": mean("timing/critic_s"),
            "reward_model_s": mean("timing/reward_model_s"), "generate_s": mean("timing/generate_s"),
            "wall_s": summary["wall_s"], "pictures": summary["pictures"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--critic_lr", default="1e-4", help="the critic's learning rate")
    parser.add_argument("--modes", default="sync,fully_async", help="comma-separated: sync, fully_async")
    args = parser.parse_args(argv)
    from openrlhf_async.config import default_cache_dir
    from openrlhf_async.models.tiny import build_tiny_reward_model

    reward_model = build_tiny_reward_model(default_cache_dir())
    out_dir = tempfile.mkdtemp(prefix="ppo-bench-")
    result = {"steps": args.steps, "reward_model": reward_model, "runs": out_dir}
    for mode in args.modes.split(","):
        result[mode] = run(mode, args, reward_model, out_dir)
        print(mode, result[mode], file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
