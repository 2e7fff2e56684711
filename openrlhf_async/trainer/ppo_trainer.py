"""The training loop: rollout on the vLLM engines, group advantages, a policy update on the DeepSpeed ranks,
weight sync; greedy evaluation on the held-out split at the start, every eval.steps and at the end."""

import json
import os
import time

import torch

from openrlhf_async.data.prompts import PromptSampler
from openrlhf_async.rollout.controller import RolloutController
from openrlhf_async.trainer.losses import group_advantages
from openrlhf_async.utils.ray_utils import get_all


def tokenize_prompts(tokenizer, rows: list, apply_chat_template: bool) -> list:
    out = []
    for row in rows:
        if apply_chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = tokenizer.encode(row["prompt"])
        out.append({"prompt_ids": list(ids), "label": row["label"]})
    return out


def evaluate(cfg, engines: list, eval_prompts: list):
    """Greedy accuracy (mean agent score, one episode per prompt) on the held-out prompts; None without them."""
    if not eval_prompts:
        return None
    controller = RolloutController.from_config(cfg, engines, n=1, sampling={"temperature": 0.0}, filter_rule=None,
                                               early_stop=False, overlong_buffer=0, max_error_ratio=1.0)
    groups, _ = controller.run(iter(eval_prompts).__next__, len(eval_prompts))
    return sum(g[0]["score"] for g in groups) / len(groups)


def train(cfg, model_path: str, train_rows: list, eval_rows: list) -> dict:
    """Run the whole training; returns the summary written to <run dir>/summary.json."""
    from transformers import AutoTokenizer

    from openrlhf_async.rollout.engine import create_engines
    from openrlhf_async.trainer.policy import PolicyGroup
    from openrlhf_async.trainer.weight_sync import WeightSync
    from openrlhf_async.utils.metrics import MetricsLog

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_prompts = tokenize_prompts(tokenizer, train_rows, cfg.data.apply_chat_template)
    eval_prompts = tokenize_prompts(tokenizer, eval_rows, cfg.data.apply_chat_template)
    too_long = [i for i, p in enumerate(train_prompts) if len(p["prompt_ids"]) + cfg.rollout.max_new_tokens > cfg.data.max_len]
    if too_long:
        raise ValueError(f"--data.max_len {cfg.data.max_len}: prompt {too_long[0]} plus --rollout.max_new_tokens "
                         f"does not fit; raise --data.max_len or drop long prompts")

    engines = create_engines(cfg, model_path, wait=False)
    policy = PolicyGroup(cfg, model_path)
    get_all([e.ready.remote() for e in engines])
    weight_sync = WeightSync(policy, engines, cfg)
    log = MetricsLog(cfg.run_dir, cfg.train.max_steps, progress=cfg.progress)
    sampler = PromptSampler(train_prompts, cfg.train.seed)
    rollout = RolloutController.from_config(cfg, engines)

    accuracy_start = evaluate(cfg, engines, eval_prompts)
    if accuracy_start is not None:
        log.log({"step": 0, "eval/accuracy": accuracy_start, "weight_version": 0})
    accuracy = accuracy_start
    setup_s = time.perf_counter() - start
    try:
        for step in range(1, cfg.train.max_steps + 1):
            t0 = time.perf_counter()
            groups, rollout_metrics = rollout.run(lambda: sampler.next_batch(1)[0], cfg.rollout.batch_size)
            t1 = time.perf_counter()
            rewards = torch.tensor([[s["reward"] for s in g] for g in groups])
            advantages = group_advantages(rewards, cfg.algo.advantage_estimator, cfg.algo.advantage_no_std_norm)
            samples = []
            for g, adv in zip(groups, advantages):
                for s, a in zip(g, adv.tolist()):
                    samples.append({**s, "advantage": a})
            stats = policy.train_step(samples, cfg.train.micro_batch_size, cfg.actor.eps_clip, cfg.rollout.temperature)
            t2 = time.perf_counter()
            sync_s = weight_sync.sync()
            tokens = sum(sum(s["action_mask"]) for s in samples)
            metrics = {
                "step": step,
                "reward/mean": rewards.mean().item(),
                "loss": stats["loss"],
                "clip_ratio": stats["clip_ratio"],
                "grad_norm": stats["grad_norm"],
                "rollout/tokens_per_s": rollout_metrics["rollout/tokens_generated"] / max(t1 - t0, 1e-9),
                "rollout/response_len_mean": tokens / len(samples),
                **rollout_metrics,
                "timing/generate_s": t1 - t0,
                "timing/train_s": t2 - t1,
                "timing/sync_s": sync_s,
                "weight_version": weight_sync.version,
                "engine_weight_version": weight_sync.engine_version,
            }
            if eval_prompts and (step % cfg.eval.steps == 0 or step == cfg.train.max_steps):
                t3 = time.perf_counter()
                accuracy = evaluate(cfg, engines, eval_prompts)
                metrics["eval/accuracy"] = accuracy
                metrics["timing/eval_s"] = time.perf_counter() - t3
            log.log(metrics)
    finally:
        log.close()

    output_dir = cfg.ckpt.output_dir or os.path.join(cfg.run_dir, "final_hf")
    get_all(policy.call("save_hf", output_dir))
    summary = {
        "eval_accuracy_start": accuracy_start,
        "eval_accuracy_end": accuracy,
        "steps": cfg.train.max_steps,
        "wall_s": round(time.perf_counter() - start, 1),
        "setup_s": round(setup_s, 1),
        "checkpoint": output_dir,
    }
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
