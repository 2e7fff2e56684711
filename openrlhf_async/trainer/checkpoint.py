"""Resumable checkpoints: <ckpt path>/step_<N>/ holds every rank's DeepSpeed state (model shards, optimizer, torch
random state) and trainer_state.json (the step, the weight version, the data position, the first evaluation).

A checkpoint is written under step_<N>.partial and renamed when complete, so a run killed at any moment (or a rank
dying while saving) leaves the previous checkpoints intact, and resuming only ever sees complete ones."""

import json
import os
import re
import shutil

from openrlhf_async.config import ConfigError
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


def save(root: str, step: int, policy, state: dict, keep: int) -> str:
    """Save every rank's DeepSpeed state and the trainer's state as step_<step>; keep the newest `keep`."""
    final = os.path.join(root, f"step_{step}")
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
    os.makedirs(partial)
    get_all(policy.call("save_checkpoint", partial))
    with open(os.path.join(partial, STATE_FILE), "w") as f:
        json.dump({**state, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)  # a resumed run passing a step saved before
    os.replace(partial, final)
    for _, old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_resume(cfg, num_prompts: int):
    """What --ckpt.resume continues from: (folder, trainer state) of the newest checkpoint, or None for a fresh
    start. Also refuses, before any actor starts, a checkpoint that cannot continue this run, and a fresh run
    that would mix its checkpoints with an earlier run's."""
    root = cfg.ckpt_path
    found = complete_checkpoints(root)
    if not cfg.ckpt.resume:
        if found and cfg.ckpt.save_steps:
            raise ConfigError(f"--ckpt.path {root} holds checkpoints of an earlier run (newest: step {found[-1][0]}): "
                              "pass --ckpt.resume to continue it, or choose another --run_name or --ckpt.path")
        return None
    if not found:
        print(f"--ckpt.resume: no checkpoint in {root}; starting from scratch", flush=True)
        return None
    path = found[-1][1]
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    if state["step"] >= cfg.train.max_steps:
        raise ConfigError(f"--ckpt.resume: {path} has trained {state['step']} steps already; raise "
                          f"--train.max_steps (now {cfg.train.max_steps}) to train more")
    data = state["data"]
    if data["num_prompts"] != num_prompts or data["seed"] != cfg.train.seed:
        raise ConfigError(f"--ckpt.resume: {path} was trained on {data['num_prompts']} prompts with --train.seed "
                          f"{data['seed']}, this run has {num_prompts} and {cfg.train.seed}; resume with the same "
                          "--data.prompt_dataset and --train.seed, or start a new run")
    return path, state


def load(path: str, policy) -> None:
    """Restore every rank's DeepSpeed state (weights, optimizer, random state) from a checkpoint folder."""
    get_all(policy.call("load_checkpoint", path))
