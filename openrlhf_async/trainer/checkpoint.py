"""Resumable checkpoints: <ckpt path>/step_<N>/ holds every rank's DeepSpeed state (model shards, optimizer, torch
random state) and trainer_state.json (the step, the weight version, the data position, the first evaluation).

A checkpoint is written under step_<N>.partial and renamed when complete, so a run killed at any moment (or a rank
dying while saving) leaves the previous checkpoints intact, and resuming only ever sees complete ones. A fresh run
refuses a run folder that holds an earlier run's records or checkpoints, unless told to delete them (--overwrite)."""

import json
import os
import re
import shutil

from openrlhf_async.config import ConfigError, notice
from openrlhf_async.utils.ray_utils import get_all

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"step_(\d+)$")


def complete_checkpoints(root: str) -> list:
    """[(step, folder)] of the complete checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def save(root: str, step: int, policy, state: dict, keep: int, deepspeed: bool = True, hf: bool = False,
         critic=None) -> str:
    """Save every rank's DeepSpeed state (unless --ckpt.disable_ds), an HF-format model in hf/ (--ckpt.save_hf) and
    the trainer's state as step_<step>; keep the newest `keep`. critic: PPO's critic (its CriticGroup), saved beside
    the policy in critic/ (and hf/critic/)."""
    final = os.path.join(root, f"step_{step}")
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
    os.makedirs(partial)
    if deepspeed:
        get_all(policy.call("save_checkpoint", partial))
        if critic is not None:  # PPO's critic beside the policy, in critic/
            get_all(critic.call("save_checkpoint", os.path.join(partial, "critic")))
    if hf:
        get_all(policy.call("save_hf", os.path.join(partial, "hf")))
        if critic is not None:
            get_all(critic.call("save_hf", os.path.join(partial, "hf", "critic")))
    with open(os.path.join(partial, STATE_FILE), "w") as f:
        json.dump({**state, "step": step, "deepspeed": deepspeed}, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)  # a resumed run passing a step saved before
    os.replace(partial, final)
    for _, old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# What a run leaves in its run folder that a fresh run would truncate, mix with or replace (data/ and config.json
# are rewritten the same way by any run).
RECORDS = ("metrics.jsonl", "used_prompts.jsonl", "timeline.jsonl", "samples.jsonl", "summary.json", "tensorboard",
           "final_hf")


def _uses_ckpt_path(cfg) -> bool:
    """Whether this run touches --ckpt.path: one in its run folder, or one it saves to or resumes from."""
    return bool(cfg.ckpt.save_steps > 0 or cfg.ckpt.load_enable or "{run_dir}" in cfg.ckpt.path)


def earlier_records(cfg) -> list:
    """The names of an earlier run's records that a fresh run with this config would replace: files in the run
    folder and the final model folder (--ckpt.output_dir when it holds a model)."""
    found = [name for name in RECORDS if os.path.exists(os.path.join(cfg.run_dir, name))]
    if any(os.path.isfile(os.path.join(cfg.output_dir, f)) for f in ("config.json", "adapter_config.json")):
        found.append(cfg.output_dir)
    return found


def remove_records(cfg) -> None:
    """--overwrite: delete the earlier run's records and checkpoints (the final model in --ckpt.output_dir is only
    overwritten, file by file, when this run saves its own)."""
    for name in RECORDS:
        path = os.path.join(cfg.run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    root = cfg.ckpt_path
    for name in os.listdir(root) if _uses_ckpt_path(cfg) and os.path.isdir(root) else []:
        if _STEP_DIR.match(name.removesuffix(".partial")):
            shutil.rmtree(os.path.join(root, name))


def find_resume(cfg):
    """What --ckpt.load_enable continues from: (folder, trainer state) of the newest checkpoint, or None for a
    fresh start (also with --ckpt.load_enable when there is no checkpoint, as in OpenRLHF, with a notice). Refuses,
    before any actor starts: a fresh run where an earlier run left its records or checkpoints (unless --overwrite),
    and a checkpoint whose state is unreadable. check_resume_data then compares the datasets and the steps."""
    root = cfg.ckpt_path
    found = complete_checkpoints(root) if _uses_ckpt_path(cfg) else []
    if cfg.ckpt.load_enable and found:
        path = found[-1][1]
        state = read_state(path)
        if not state.get("deepspeed", True):
            raise ConfigError(f"--ckpt.load_enable: {path} was saved with --ckpt.disable_ds (weights in HF format only) "
                              "and cannot be resumed; start a new run from its hf/ folder with "
                              "--actor.model_name_or_path, or pass --overwrite")
        return path, state
    records = earlier_records(cfg)
    if (records or found) and not cfg.overwrite:
        if not records:
            where = f"--ckpt.path {root} holds checkpoints of an earlier run (newest: step {found[-1][0]})"
        elif found:
            where = (f"{cfg.run_dir} holds an earlier run's records ({', '.join(records)}; newest checkpoint: "
                     f"step {found[-1][0]})")
        else:
            where = f"{cfg.run_dir} holds an earlier run's records ({', '.join(records)}) and no checkpoint"
        resume = "pass --ckpt.load_enable to continue it, " if found else ""
        raise ConfigError(f"{where}: {resume}choose another --run_name or --ckpt.path / --ckpt.output_dir, or pass "
                          "--overwrite to delete them and start again")
    if cfg.ckpt.load_enable:
        notice(f"--ckpt.load_enable: no checkpoint in {root}; starting a new run")
    return None


def check_resume_data(cfg, resume, num_prompts: int) -> None:
    """A resumed run must continue the same prompt stream (the same dataset size and seed) and have steps left."""
    if resume is None:
        return
    path, state = resume
    data = state["data"]
    if data["num_prompts"] != num_prompts or data["seed"] != cfg.train.seed:
        raise ConfigError(f"--ckpt.load_enable: {path} was trained on {data['num_prompts']} prompts with "
                          f"--train.seed {data['seed']}, this run has {num_prompts} and {cfg.train.seed}; resume with "
                          "the same --data.prompt_dataset and --train.seed, or start a new run")
    if state["step"] >= cfg.train.max_steps:
        raise ConfigError(f"--ckpt.load_enable: {path} has trained {state['step']} steps already; raise "
                          f"--train.max_steps (now {cfg.train.max_steps}) or --train.num_episodes to train more")


def read_state(path: str) -> dict:
    """A checkpoint's trainer state, checked field by field (a ConfigError naming the file when it is broken)."""
    state_file = os.path.join(path, STATE_FILE)
    try:
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        problem = f"cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
    else:
        problem = _state_problem(state)
    if problem:
        raise ConfigError(f"--ckpt.load_enable: {state_file} {problem}; delete {path} to resume from the checkpoint "
                          "before it, or start a new run")
    return state


def _state_problem(state):
    """What is wrong with a trainer state (as _save_checkpoint in trainer/pipeline.py writes it), or None."""
    def whole(value, least=None):
        return isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least)

    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not isinstance(state, dict):
        return "is not a JSON object"
    position, data, scores = state.get("data_position"), state.get("data"), state.get("eval_start")
    fields = {
        "step": whole(state.get("step"), 1),
        "weight_version": whole(state.get("weight_version"), 0),
        "eval_start": "eval_start" in state and (scores is None or isinstance(scores, dict)
                                                 and all(map(number, scores.values()))),
        "data_position": isinstance(position, dict) and set(position) <= {"frontier", "done", "flat"}
                         and whole(position.get("frontier"), 0)
                         and all(isinstance(position.get(k, []), list) and all(whole(i, 0) for i in position.get(k, []))
                                 for k in ("done", "flat")),
        "data": isinstance(data, dict) and whole(data.get("num_prompts"), 1) and whole(data.get("seed")),
    }
    bad = [name for name, ok in fields.items() if not ok]
    return f"has a missing or malformed {', '.join(bad)} field" if bad else None


def load(path: str, policy, critic=None) -> None:
    """Restore every rank's DeepSpeed state (weights, optimizer, random state) from a checkpoint folder, the
    critic's too (critic: its CriticGroup)."""
    get_all(policy.call("load_checkpoint", path))
    if critic is not None:
        critic_path = os.path.join(path, "critic")
        if not os.path.isdir(critic_path):
            raise RuntimeError(f"{path} holds no critic (critic/): it was saved by a run without "
                               "--algo.advantage.estimator gae")
        get_all(critic.call("load_checkpoint", critic_path))
