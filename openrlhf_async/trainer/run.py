"""The run driver: prompts tokenised, the engine fleet, policy ranks and the weight-sync group started, then the
pipeline (trainer/pipeline.py) run in the configured mode (and restarted from the newest checkpoint when an actor of
the trainer side dies), the run's pictures drawn and its summary written."""

import json
import os
import time

from openrlhf_async.data.prompts import tokenize_prompts
from openrlhf_async.utils.ray_utils import get_all


def train(cfg, model_path: str, train_rows: list, eval_rows: list, resume=None) -> dict:
    """Run the whole training in the configured mode; returns the summary written to <run dir>/summary.json.
    resume: (checkpoint folder, its trainer state) to continue from (checkpoint.find_resume)."""
    import ray
    from transformers import AutoTokenizer

    from openrlhf_async.rollout.fleet import start_fleet
    from openrlhf_async.trainer.policy import PolicyGroup

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=not cfg.data.disable_fast_tokenizer)
    train_prompts = tokenize_prompts(tokenizer, train_rows, cfg.data.apply_chat_template, cfg.data.input_template)
    eval_prompts = tokenize_prompts(tokenizer, eval_rows, cfg.data.apply_chat_template, cfg.data.input_template)
    too_long = [i for i, p in enumerate(train_prompts) if cfg.budget(len(p["prompt_ids"])) < 1]
    if too_long:
        raise ValueError(f"--data.max_len {cfg.data.max_len}: prompt {too_long[0]} leaves no room for a response "
                         f"(--rollout.max_new_tokens {cfg.rollout.max_new_tokens}); raise --data.max_len or drop "
                         "long prompts")

    fleet = start_fleet(cfg, model_path)  # engines and ranks start side by side
    policy = PolicyGroup(cfg, model_path)
    try:
        ray.get(fleet.wait_ready.remote())
        setup_s = time.perf_counter() - start
        result, resumed, policy = _run_pipeline(cfg, model_path, fleet, policy, tokenizer, train_prompts,
                                                eval_prompts, resume)
        output_dir = cfg.output_dir
        get_all(policy.call("save_hf", output_dir))
    finally:
        ray.get(fleet.shutdown.remote())
        ray.kill(fleet)
    pictures = _report(cfg.run_dir)

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
        "auto_resumes": result["auto_resumes"],
        "pictures": pictures,
    }
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _run_pipeline(cfg, model_path: str, fleet, policy, tokenizer, train_prompts: list, eval_prompts: list,
                  resume) -> tuple:
    """The pipeline from the start or from `resume`; when a policy rank, the trainer or the generator dies, again
    from the newest complete checkpoint with new ranks (the engines are kept), up to --ckpt.max_auto_resumes times.
    Returns (the trainer's summary, the trainer state it last resumed from, the policy)."""
    from openrlhf_async.trainer import checkpoint
    from openrlhf_async.trainer.pipeline import PPOTrainerAsync
    from openrlhf_async.trainer.policy import PolicyGroup
    from openrlhf_async.trainer.weight_sync import WeightSync
    from openrlhf_async.utils.metrics import MetricsLog
    from openrlhf_async.utils.samples import SampleText

    auto_resumes = 0
    while True:
        weight_sync = WeightSync(policy, None, cfg, fleet=fleet)
        resumed = None
        if resume is not None:
            path, resumed = resume
            checkpoint.load(path, policy)
            weight_sync.sync(version=resumed["weight_version"])  # the engines start from the checkpoint's weights
            print(f"resumed from {path}: step {resumed['step']}, weight version {resumed['weight_version']}",
                  flush=True)
        log = MetricsLog(cfg.run_dir, cfg.train.max_steps, progress=cfg.progress, logger=cfg.logger, config=cfg,
                         resume_step=resumed and resumed["step"],
                         samples=SampleText(tokenizer, train_prompts + eval_prompts))
        try:
            result = PPOTrainerAsync(cfg, None, policy, weight_sync, train_prompts, eval_prompts, resumed).run(log.log)
            return {**result, "auto_resumes": auto_resumes}, resumed, policy
        except Exception as error:
            resume = _auto_resume(cfg, error, auto_resumes)
            if resume is None:
                raise
            auto_resumes += 1
        finally:
            log.close()
        policy.shutdown()
        policy = PolicyGroup(cfg, model_path)


def _auto_resume(cfg, error: Exception, done: int):
    """(checkpoint folder, its trainer state) to restart the trainer side from after this failure, or None: the
    failure is no actor's death, the run has resumed --ckpt.max_auto_resumes times, or it has no checkpoint."""
    from openrlhf_async.trainer import checkpoint
    from openrlhf_async.utils.metrics import one_line, warn
    from openrlhf_async.utils.ray_utils import actor_died

    if not actor_died(error) or done >= cfg.ckpt.max_auto_resumes:
        return None
    found = checkpoint.complete_checkpoints(cfg.ckpt_path) if cfg.ckpt.save_steps > 0 else []
    if not found:
        return None
    path = found[-1][1]
    state = checkpoint.read_state(path)
    if not state.get("deepspeed", True):
        return None
    warn(f"an actor of the trainer died ({one_line(error)}): restarting the trainer from {path} (step "
         f"{state['step']}), automatic resume {done + 1} of {cfg.ckpt.max_auto_resumes}")
    return path, state


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
