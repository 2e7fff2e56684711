"""PPO with a critic and a learned reward model on the built-in arithmetic task, as a user runs it (the CLI, the tiny
preset): the tiny reward model (models/tiny.py, trained here to prefer right answers) scores every episode, a critic
started from it gives GAE's values, in sync and in fully asynchronous mode. Per mode: the held-out accuracy at the
start and the end (math-verified, not the reward model's opinion), the reward model's and the critic's seconds per
step beside the step's, the wall time; the learning pictures are in each run's folder. The actor's learning rate
and the KL penalty are a PPO run's (1e-4, 0.05 in the per-token rewards), not the demo preset's GRPO 3e-4 without
KL: with those, the policy learns the tiny reward model's mistakes (docs/BENCHMARKS.md).

    python benchmarks/ppo_critic_rm.py          # 30 steps a mode, evaluated every 10: about 22 minutes on 2 cores

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
           "--reward.normalize_enable", "--algo.kl.init_coef", args.kl, "--actor.adam.lr", args.lr,
           "--train.max_steps", str(args.steps), "--eval.steps", str(args.eval_steps or args.steps),
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
            "eval_accuracy": [round(m["eval/accuracy"], 3) for m in steps if "eval/accuracy" in m],
            "train_accuracy_first": round(steps[0]["rollout/extra/accuracy"], 3),
            "train_accuracy_last": round(steps[-1]["rollout/extra/accuracy"], 3),
            "reward_model_mean_first": round(steps[0]["reward/mean"], 3),
            "reward_model_mean_last": round(steps[-1]["reward/mean"], 3),
            "critic_value_loss_first": round(steps[0]["critic/value_loss"], 4),
            "critic_value_loss_last": round(steps[-1]["critic/value_loss"], 4),
            "train_s": mean("timing/train_s"), "critic_s": mean("timing/critic_s"),
            "reward_model_s": mean("timing/reward_model_s"), "generate_s": mean("timing/generate_s"),
            "wall_s": summary["wall_s"], "pictures": summary["pictures"]}


def reward_model_accuracy(reward_model: str, policy: str, questions: int = 300, samples: int = 8) -> dict:
    """How often the reward model scores a question's right answer above a wrong one: the tiny policy's own mistakes
    (sampled at temperature 1 with plain transformers, on train-pool questions) and the carry slip."""
    import random

    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from openrlhf_async.data.synthetic import carry_slip_answer, train_pool
    from openrlhf_async.models.tiny import prompt_text
    from openrlhf_async.models.value import build_value_model

    rows = random.Random(1).sample(train_pool(), questions)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(policy, padding_side="left")
    model = Qwen2ForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    scorer = build_value_model(reward_model, {"dtype": torch.float32}).eval()
    torch.manual_seed(7)

    def score(row, answer) -> float:
        ids = tokenizer.encode(prompt_text(tokenizer, row["prompt"]) + answer) + [tokenizer.eos_token_id]
        with torch.no_grad():
            return float(scorer(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, -1])

    wins = {"policy_mistakes": [], "carry_slips": []}
    for start in range(0, len(rows), 50):
        chunk = rows[start:start + 50]
        batch = tokenizer([prompt_text(tokenizer, r["prompt"]) for r in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=6,
                                 num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, row in enumerate(chunk):
            right = score(row, row["label"])
            for wrong in {a.strip() for a in answers[i * samples:(i + 1) * samples]} - {row["label"], ""}:
                wins["policy_mistakes"].append(right > score(row, wrong))
            slip = carry_slip_answer(row["prompt"])
            if slip is not None:
                wins["carry_slips"].append(right > score(row, slip))
    return {kind: {"pairs": len(w), "right_scored_higher": round(sum(w) / max(len(w), 1), 3)} for kind, w in wins.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--critic_lr", default="1e-4", help="the critic's learning rate")
    parser.add_argument("--lr", default="1e-4", help="the actor's learning rate (the demo preset's: 3e-4)")
    parser.add_argument("--kl", default="0.05", help="--algo.kl.init_coef: the KL penalty in the per-token rewards")
    parser.add_argument("--eval_steps", type=int, default=10, help="evaluate every this many steps (0: start and end)")
    parser.add_argument("--modes", default="sync,fully_async", help="comma-separated: sync, fully_async")
    args = parser.parse_args(argv)
    from openrlhf_async.config import default_cache_dir
    from openrlhf_async.models.tiny import build_tiny_model, build_tiny_reward_model

    reward_model = build_tiny_reward_model(default_cache_dir())
    out_dir = tempfile.mkdtemp(prefix="ppo-bench-")
    result = {"steps": args.steps, "lr": args.lr, "kl": args.kl, "reward_model": reward_model, "runs": out_dir,
              "reward_model_accuracy": reward_model_accuracy(reward_model, build_tiny_model(default_cache_dir()))}
    print("reward model", result["reward_model_accuracy"], file=sys.stderr, flush=True)
    for mode in args.modes.split(","):
        result[mode] = run(mode, args, reward_model, out_dir)
        print(mode, result[mode], file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
