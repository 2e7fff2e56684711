"""The run driver: prompts tokenised, the engine fleet, policy ranks and the weight-sync group started, then the
pipeline (trainer/pipeline.py) run in the configured mode (and restarted from the newest checkpoint when an actor of
the trainer side dies), the model saved (also when the run stops on an error after training), the run's pictures drawn
and its summary written."""

import json
import os
import time

from openrlhf_async.data.prompts import tokenize_prompts
from openrlhf_async.utils.ray_utils import get_all

RANKS_ANSWER_S = 120  # how long a stopped run waits for its policy ranks before giving up keeping its model


def train(cfg, model_path: str, train_rows: list, eval_rows: list, resume=None) -> dict:
    """Run the whole training in the configured mode; returns the summary written to <run dir>/summary.json.
    resume: (checkpoint folder, its trainer state) to continue from (checkpoint.find_resume)."""
    import ray
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=not cfg.data.disable_fast_tokenizer)
    encoding = cfg.data.apply_chat_template, cfg.data.input_template, cfg.data.parse_special_tokens
    train_prompts = tokenize_prompts(tokenizer, train_rows, *encoding, where="--data.prompt_dataset")
    eval_prompts = tokenize_prompts(tokenizer, eval_rows, *encoding, where="--eval.dataset")
    from openrlhf_async.data.prompts import skip_unfit_prompts

    # Prompts too long for a response are skipped and counted (all of them: a one-line error); the training ones
    # stay in the stream, marked, so a checkpoint's prompt count is the dataset's.
    train_prompts = skip_unfit_prompts(train_prompts, cfg.data.max_len, "--data.prompt_dataset", mark=True)
    eval_prompts = skip_unfit_prompts(eval_prompts, cfg.data.max_len, "--eval.dataset", mark=False)

    fleet, policy, critic = start_actors(cfg, model_path)
    try:
        ray.get(fleet.wait_ready.remote())
        setup_s = time.perf_counter() - start
        result, resumed, policy, critic = _run_pipeline(cfg, model_path, fleet, policy, critic, tokenizer,
                                                        train_prompts, eval_prompts, resume)
        output_dir = save_model(cfg, policy, critic)
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
        "steps": result["stopped_early"]["last_step"] if result.get("stopped_early") else cfg.train.max_steps,
        "stopped_early": result.get("stopped_early"),  # {step, last_step, reason} when dynamic sampling ended it
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


def start_actors(cfg, model_path: str) -> tuple:
    """(engine fleet, policy ranks, PPO's critic or None), loading side by side. The ranks' placement group is placed
    before any engine's, so PACK puts the ranks on as few nodes as hold them (started together, the engines' groups
    could take part of a node first and split the ranks), and the folders they write are checked to be the driver's
    (utils/cluster.py) before anything loads."""
    from concurrent.futures import ThreadPoolExecutor

    from openrlhf_async.rollout.fleet import start_fleet
    from openrlhf_async.trainer.critic import start_critic
    from openrlhf_async.trainer.ranks import PolicyGroup, trainer_placement_group
    from openrlhf_async.utils.cluster import check_shared_folders, group_nodes

    group = trainer_placement_group(cfg)
    # With --train.colocate_critic_reward the critic's group is placed here too: the reward models share it.
    critic_group = trainer_placement_group(cfg, cfg.critic.world_size) if cfg.placement["rewards"] == "critic" \
        else None
    check_shared_folders(cfg, group_nodes(group))
    if cfg.reward.model_name_or_path:
        from openrlhf_async.reward.model import start_reward_models

        if not cfg.hybrid:  # the hybrid engine starts them while its engines sleep
            start_reward_models(cfg, critic_group or (group if cfg.placement["rewards"] == "policy" else None))
    if cfg.hybrid:  # the engines first, in the ranks' bundles (trainer/hybrid.py)
        import ray

        from openrlhf_async.trainer.hybrid import start_hybrid

        fleet = start_fleet(cfg, model_path, group)
        ray.get(fleet.wait_ready.remote())
        return (fleet, *start_hybrid(cfg, model_path, group, fleet))
    with ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(PolicyGroup, cfg, model_path, group)
        fleet = start_fleet(cfg, model_path)
        policy = ranks.result()
        return fleet, policy, start_critic(cfg, model_path, policy, critic_group)


def _run_pipeline(cfg, model_path: str, fleet, policy, critic, tokenizer, train_prompts: list, eval_prompts: list,
                  resume) -> tuple:
    """The pipeline from the start or from `resume`; when a policy rank, the trainer or the generator dies, again
    from the newest complete checkpoint with new ranks (the engines are kept), up to --ckpt.max_auto_resumes times.
    critic: PPO's critic beside the policy, or None. Returns (the trainer's summary, the trainer state it last
    resumed from, the policy, the critic)."""
    from openrlhf_async.trainer import checkpoint
    from openrlhf_async.trainer.pipeline import PPOTrainerAsync
    from openrlhf_async.trainer.weight_sync import WeightSync
    from openrlhf_async.utils.cluster import check_shared_folders, group_nodes
    from openrlhf_async.utils.metrics import MetricsLog
    from openrlhf_async.utils.samples import SampleText

    from openrlhf_async.trainer.hybrid import HybridWeightSync

    auto_resumes = 0
    while True:
        weight_sync = HybridWeightSync(policy, None, cfg, fleet=fleet, critic=critic) if cfg.hybrid else \
            WeightSync(policy, None, cfg, fleet=fleet)
        resumed = None
        if resume is not None:
            path, resumed = resume
            checkpoint.load(path, policy, critic)
            weight_sync.sync(version=resumed["weight_version"])  # the engines start from the checkpoint's weights
            print(f"resumed from {path}: step {resumed['step']}, weight version {resumed['weight_version']}",
                  flush=True)
        log = MetricsLog(cfg.run_dir, cfg.train.max_steps, progress=cfg.progress, logger=cfg.logger, config=cfg,
                         resume_step=resumed and resumed["step"],
                         samples=SampleText(tokenizer, train_prompts + eval_prompts))
        pipeline = None
        try:
            pipeline = PPOTrainerAsync(cfg, None, policy, weight_sync, train_prompts, eval_prompts, resumed,
                                       critic=critic)
            result = pipeline.run(log.log)
            return {**result, "auto_resumes": auto_resumes}, resumed, policy, critic
        except Exception as error:
            resume = _auto_resume(cfg, error, auto_resumes)
            if resume is None:
                _keep_trained_model(cfg, policy, critic, pipeline, log, resumed)
                raise
            auto_resumes += 1
        finally:
            log.close()
        policy, critic = _restart_ranks(cfg, model_path, fleet, policy, critic)
        check_shared_folders(cfg, group_nodes(policy.group))  # the new ranks may sit on other nodes


def _restart_ranks(cfg, model_path: str, fleet, policy, critic) -> tuple:
    """Kill the policy's and the critic's ranks and start new ones: (policy, critic). Groups that other models share
    outlive the ranks: the new ranks take them again."""
    from openrlhf_async.trainer.critic import start_critic
    from openrlhf_async.trainer.hybrid import start_hybrid
    from openrlhf_async.trainer.ranks import PolicyGroup

    kept = None if policy.owns_group else policy.group
    critic_kept = critic.group if critic is not None and cfg.placement["rewards"] == "critic" else None
    if critic is not None:
        critic.shutdown()
    policy.shutdown()
    if cfg.hybrid:
        return start_hybrid(cfg, model_path, kept, fleet)
    policy = PolicyGroup(cfg, model_path, kept)
    return policy, start_critic(cfg, model_path, policy, critic_kept)


def save_model(cfg, policy, critic=None) -> str:
    """Save the policy in HF format to --ckpt.output_dir, or, when that fails (a full or read-only disk), to
    <run dir>/final_hf with a warning, rather than lose it; returns where it went. With --critic.save_value_network
    the critic too, beside it."""
    from openrlhf_async.utils.metrics import warn
    from openrlhf_async.utils.ray_utils import actor_died, root_cause

    if critic is not None and cfg.critic.save_value_network:  # beside the model, as OpenRLHF names it
        get_all(critic.call("save_hf", cfg.output_dir.rstrip("/") + "_critic"))
    try:
        get_all(policy.call("save_hf", cfg.output_dir, cfg.ds.lora_save_merged))
        return cfg.output_dir
    except Exception as error:
        fallback = os.path.join(cfg.run_dir, "final_hf")
        if actor_died(error) or os.path.abspath(fallback) == os.path.abspath(cfg.output_dir):
            raise
        warn(f"--ckpt.output_dir {cfg.output_dir}: the model could not be saved there ({root_cause(error)}; what it "
             f"wrote there is incomplete); saving it in the run folder instead: {fallback}")
    get_all(policy.call("save_hf", fallback, cfg.ds.lora_save_merged))
    return fallback


def _keep_trained_model(cfg, policy, critic, pipeline, log, resumed) -> None:
    """A run stopping on an error after it trained a step saves the policy as trained so far (save_model) when its
    ranks still answer, and says where and at which step."""
    from openrlhf_async.utils.metrics import warn
    from openrlhf_async.utils.ray_utils import root_cause

    if pipeline is not None:
        try:  # the records of the steps trained before the failure, still queued (the pipeline stopped on its error)
            pipeline._drain_metrics(log.log)
        except Exception:
            pass
    step = log.last_step
    if step <= (resumed["step"] if resumed else 0):
        return  # nothing trained since the start (or the checkpoint it resumed from holds it)
    try:
        # Ranks still busy with a step the stopped trainer gave them answer when it is done; a dead one fails at once.
        get_all([actor.ready.remote() for actor in policy.actors], timeout_s=RANKS_ANSWER_S)
        where = save_model(cfg, policy, critic)
    except Exception as error:
        warn(f"the run stopped on an error after step {step}; the model trained so far could not be saved "
             f"({root_cause(error)})")
        return
    warn(f"the run stopped on an error after step {step} of {cfg.train.max_steps}: the model as trained to step "
         f"{step} is saved in {where}")


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
