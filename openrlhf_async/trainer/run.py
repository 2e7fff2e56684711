"""The run driver: prompts tokenised, engines, policy ranks and the weight-sync group started, then the pipeline
(trainer/pipeline.py) run in the configured mode, the run's pictures drawn and its summary written."""

import json
import os
import time

from openrlhf_async.data.prompts import tokenize_prompts
from openrlhf_async.utils.ray_utils import get_all


def train(cfg, model_path: str, train_rows: list, eval_rows: list, resume=None) -> dict:
    """Run the whole training in the configured mode; returns the summary written to <run dir>/summary.json.
    resume: (checkpoint folder, its trainer state) to continue from (checkpoint.find_resume)."""
    from transformers import AutoTokenizer

    from openrlhf_async.rollout.engine import create_engines
    from openrlhf_async.trainer import checkpoint
    from openrlhf_async.trainer.pipeline import PPOTrainerAsync
    from openrlhf_async.trainer.policy import PolicyGroup
    from openrlhf_async.trainer.weight_sync import WeightSync
    from openrlhf_async.utils.metrics import MetricsLog
    from openrlhf_async.utils.samples import SampleText

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=not cfg.data.disable_fast_tokenizer)
    train_prompts = tokenize_prompts(tokenizer, train_rows, cfg.data.apply_chat_template, cfg.data.input_template)
    eval_prompts = tokenize_prompts(tokenizer, eval_rows, cfg.data.apply_chat_template, cfg.data.input_template)
    too_long = [i for i, p in enumerate(train_prompts) if cfg.budget(len(p["prompt_ids"])) < 1]
    if too_long:
        raise ValueError(f"--data.max_len {cfg.data.max_len}: prompt {too_long[0]} leaves no room for a response "
                         f"(--rollout.max_new_tokens {cfg.rollout.max_new_tokens}); raise --data.max_len or drop "
                         "long prompts")

    engines = create_engines(cfg, model_path, wait=False)
    policy = PolicyGroup(cfg, model_path)
    get_all([e.ready.remote() for e in engines])
    weight_sync = WeightSync(policy, engines, cfg)
    resumed = None
    if resume is not None:
        path, resumed = resume
        checkpoint.load(path, policy)
        weight_sync.sync(version=resumed["weight_version"])  # the engines start from the checkpoint's weights
        print(f"resumed from {path}: step {resumed['step']}, weight version {resumed['weight_version']}", flush=True)
    setup_s = time.perf_counter() - start
    log = MetricsLog(cfg.run_dir, cfg.train.max_steps, progress=cfg.progress, logger=cfg.logger, config=cfg,
                     resume_step=resumed and resumed["step"],
                     samples=SampleText(tokenizer, train_prompts + eval_prompts))
    try:
        result = PPOTrainerAsync(cfg, engines, policy, weight_sync, train_prompts, eval_prompts, resumed).run(log.log)
    finally:
        log.close()
    pictures = _report(cfg.run_dir)

    output_dir = cfg.output_dir
    get_all(policy.call("save_hf", output_dir))
    summary = {
        "mode": cfg.mode,
        "eval_accuracy_start": result["eval_start"] and result["eval_start"]["eval/accuracy"],
        "eval_accuracy_end": result["eval_end"] and result["eval_end"]["eval/accuracy"],
        "eval_start": result["eval_start"],
        "eval_end": result["eval_end"],
        "steps": cfg.train.max_steps,
        "wall_s": round(time.perf_counter() - start, 1),
        "setup_s": round(setup_s, 1),
        "trainer_idle_ratio": round(result["trainer_idle_ratio"], 3),
        "generator_idle_ratio": result["generator_idle_ratio"] and round(result["generator_idle_ratio"], 3),
        "max_staleness": result["max_staleness"],
        "staleness_limit": result["staleness_limit"],
        "stale_samples_trained": result["stale_samples_trained"],
        "stale_groups_dropped": result["stale_groups_dropped"],
        "checkpoint": output_dir,
        "resumed_from_step": resumed and resumed["step"],
        "pictures": pictures,
    }
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _report(run_dir: str) -> list:
    """Draw the run's pictures (learning curves, actor timeline) and return their paths; a failure here must not
    fail a finished run."""
    from openrlhf_async.trainer.report import write_report
    from openrlhf_async.utils.metrics import one_line, warn

    try:
        report = write_report(run_dir)
    except Exception as e:
        warn(f"the run's report could not be drawn ({one_line(e)}); retry with "
             f"python -m openrlhf_async.cli.report {run_dir}")
        return []
    return [p for p in (report["learning_png"], report["timeline_png"]) if p]
