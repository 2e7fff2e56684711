"""One typed config for a run, built from OpenRLHF-style dotted flags and validated once at start."""

import argparse
import dataclasses
import math
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A bad flag, file or field; the message is one line naming it and the fix."""


@dataclass
class ActorConfig:
    model_name_or_path: str = ""  # empty: build the embedded tiny model
    num_nodes: int = 1
    num_gpus_per_node: int = 2  # DeepSpeed ranks per node (CPU processes on a CPU machine)
    eps_clip: float = 0.2  # the low side of the PPO clip range
    eps_clip_high: float = 0.28  # DAPO clip-higher
    adam_lr: float = 3e-4
    adam_betas: tuple = (0.9, 0.95)
    adam_weight_decay: float = 0.0
    max_norm: float = 1.0

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


@dataclass
class VLLMConfig:
    num_engines: int = 1
    tensor_parallel_size: int = 1
    sync_backend: str = ""  # empty: nccl on cuda, gloo on cpu
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_gib: int = 1
    max_num_seqs: int = 256
    max_concurrency: int = 256  # requests in flight per engine (the actor's asyncio semaphore)


@dataclass
class RolloutConfig:
    batch_size: int = 32  # prompts per training step
    n_samples_per_prompt: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_concurrent_prompts: int = 0  # prompt groups in flight; 0: twice the batch size
    early_stop: bool = True
    unbiased_early_stop: bool = False
    admission_margin: float = 0.0  # extra groups in flight beyond the expected need (speed for aborted tokens)
    skip_flat_prompts: float = 0.0  # chance to skip a prompt whose last group's rewards were all equal; 0: never
    screen_samples: int = 0  # run this many of a group's samples first; the rest only if their rewards vary; 0: off


@dataclass
class AgentConfig:
    func_path: str = ""  # empty: the built-in single-turn math agent
    workers: int = 0  # 0: agent steps run in the engine's process; N: in N worker processes per engine
    max_steps: int = 8
    step_timeout: float = 30.0
    max_error_ratio: float = 0.5
    sandbox: str = "bwrap"  # how model-written code (agent tools) is isolated: bwrap | unsafe


@dataclass
class TrainConfig:
    max_steps: int = 100
    micro_batch_size: int = 64  # samples per forward/backward on one rank
    seed: int = 42
    weight_sync_bucket_mb: int = 64
    async_queue_size: int = 1  # batches waiting between generator and trainer (env OPENRLHF_ASYNC_QUEUE_SIZE)
    max_staleness: int = -1  # versions a trained sample may lag the trainer; -1: what the mode's bounds allow
    staleness_threshold: float = 0.5  # fully_async: extra share of a sync window the generator may run ahead
    trigger_parameter_sync_step: int = 1  # fully_async: optimizer steps between weight syncs
    require_batches: int = 1  # fully_async: batches of --rollout.batch_size groups per optimizer step
    partial_rollout: bool = False  # fully_async: episodes in flight at a sync continue on the new weights


@dataclass
class DataConfig:
    prompt_dataset: str = ""  # empty: write and use the built-in arithmetic task
    input_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = True
    max_len: int = 256  # prompt + response tokens
    max_samples: int = 100_000_000


@dataclass
class EvalConfig:
    dataset: str = ""  # empty: the built-in task's held-out split
    steps: int = 10  # evaluate every this many steps (and at start and end)
    max_samples: int = 500
    n_samples_per_prompt: int = 1  # k: samples per problem, reported as mean@k and pass@k
    temperature: float = 0.0  # 0: greedy (only with k = 1)
    top_p: float = 1.0
    max_new_tokens: int = 0  # 0: --rollout.max_new_tokens


@dataclass
class AlgoConfig:
    advantage_estimator: str = "group_norm"  # GRPO
    advantage_no_std_norm: bool = False
    dynamic_filtering_enable: bool = True
    dynamic_filtering_rule: str = "std"  # std: keep groups whose scores vary; mean_range: OpenRLHF's rule
    dynamic_filtering_std_eps: float = 1e-6
    dynamic_filtering_range: tuple = (0.0, 1.0)
    off_policy_correction: str = "tis"  # tis | icepop | none
    tis_clamp: float = 2.0  # tis: importance weights above this are truncated
    icepop_band: tuple = (0.5, 2.0)  # icepop: tokens whose importance weight leaves this band are masked
    kl_coef: float = 0.0  # k3 KL penalty against the initial (reference) policy; 0: no reference model


@dataclass
class RewardConfig:
    remote_url: str = ""  # reward service URL(s), comma-separated, or a reward_func .py; empty: the agent's reward
    timeout: float = 10.0  # seconds per reward call (math-verify, reward_func, service request); below the step timeout
    retries: int = 5  # reward service: attempts after the first, with exponential backoff
    max_concurrency: int = 64  # reward calls in flight per engine
    workers: int = 2  # math-verify processes per engine
    max_error_ratio: float = 0.5  # stop the run when more than this share of a batch's episodes lost their reward
    overlong_buffer_len: int = 0  # 0: no overlong shaping
    overlong_penalty_factor: float = 1.0

    def source(self) -> dict:
        """make_reward's arguments."""
        return {"remote_url": self.remote_url, "timeout": self.timeout, "retries": self.retries,
                "max_concurrency": self.max_concurrency, "workers": self.workers}


@dataclass
class DSConfig:
    zero_stage: int = 3
    param_dtype: str = ""  # empty: fp32 on cpu, bf16 on cuda


@dataclass
class CkptConfig:
    output_dir: str = ""  # empty: <run dir>/final_hf
    save_steps: int = 0  # 0: no resumable checkpoints
    path: str = ""  # empty: <run dir>/ckpt
    resume: bool = False
    max_num: int = 2  # checkpoints kept; older ones are deleted


@dataclass
class LoggerConfig:
    use_tensorboard: bool = False  # event files under <run dir>/tensorboard
    use_wandb: bool = False
    wandb_project: str = "openrlhf_async"
    wandb_run_name: str = ""  # empty: --run_name
    wandb_mode: str = ""  # online | offline | disabled; empty: WANDB_MODE, else online with an API key, else offline


@dataclass
class Config:
    actor: ActorConfig = field(default_factory=ActorConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    ds: DSConfig = field(default_factory=DSConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    mode: str = "sync"  # sync | async | fully_async
    device: str = ""  # cpu | cuda; empty: auto-detect (env DEVICE overrides)
    run_name: str = "demo"
    runs_dir: str = "runs"
    cache_dir: str = ""  # where the embedded model is built; empty: ~/.cache/openrlhf_async
    progress: bool = True
    dry_run: bool = False  # resolve and validate the configuration, print it, start nothing
    overwrite: bool = False  # a fresh run may replace an earlier run's records in its run folder

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_dir, self.run_name)

    @property
    def ckpt_path(self) -> str:
        return self.ckpt.path or os.path.join(self.run_dir, "ckpt")

    @property
    def max_concurrent_prompts(self) -> int:
        return self.rollout.max_concurrent_prompts or 2 * self.rollout.batch_size

    @property
    def queue_size(self) -> int:
        return env_int("OPENRLHF_ASYNC_QUEUE_SIZE", "--train.async_queue_size", self.train.async_queue_size)

    @property
    def staleness_limit(self) -> int:
        """The hard bound on a trained sample's staleness in versions."""
        if self.train.max_staleness >= 0:
            return self.train.max_staleness
        if self.mode == "sync":
            return 0
        if self.mode == "async":
            return self.queue_size
        # The production gate lets a group start up to ceil(threshold) versions before it is trained; one more
        # for a group carried over from the previous batch. Older ones are dropped and counted.
        return 1 + math.ceil(self.train.staleness_threshold)

    @property
    def backend(self) -> str:
        return self.vllm.sync_backend or ("nccl" if self.device == "cuda" else "gloo")

    @property
    def dtype(self) -> str:
        return self.ds.param_dtype or ("bf16" if self.device == "cuda" else "fp32")


# Flags whose dotted name in OpenRLHF 0.11 differs from "<section>.<field>".
_FLAG_NAMES = {
    "actor.adam_lr": "actor.adam.lr",
    "actor.adam_betas": "actor.adam.betas",
    "actor.adam_weight_decay": "actor.adam.weight_decay",
    "algo.advantage_estimator": "algo.advantage.estimator",
    "algo.advantage_no_std_norm": "algo.advantage.no_std_norm",
    "agent.func_path": "train.agent_func_path",
    "logger.wandb_project": "logger.wandb.project",
    "logger.wandb_run_name": "logger.wandb.run_name",
}

_HELP = {
    "actor.model_name_or_path": "HF model folder; empty builds the embedded tiny model",
    "actor.num_gpus_per_node": "DeepSpeed ranks per node (CPU processes when device is cpu)",
    "vllm.sync_backend": "weight-sync group backend: nccl or gloo (default: by device)",
    "vllm.max_concurrency": "requests in flight per engine (asyncio semaphore)",
    "rollout.batch_size": "prompts per training step",
    "train.max_steps": "training steps (each: rollout, update, weight sync)",
    "data.prompt_dataset": "JSONL or Parquet file of prompts; empty uses the built-in arithmetic task",
    "eval.dataset": "held-out JSONL/Parquet; empty: the built-in task's eval split, or no eval with --data.prompt_dataset",
    "eval.steps": "evaluate every N steps, plus at start and end",
    "algo.advantage.estimator": "group_norm (GRPO), dr_grpo or reinforce_baseline",
    "device": "cpu or cuda (default: cuda if available; env DEVICE overrides)",
    "train.agent_func_path": "agent .py file: step(state, action, label) or an OpenRLHF AgentExecutor; "
                             "empty: the built-in single-turn math agent",
    "agent.workers": "0 runs agent steps in the engine's process; N isolates them in N worker processes per engine",
    "agent.max_steps": "agent steps (turns) per episode at most",
    "agent.step_timeout": "seconds one agent step may take; a step over it gives its episode reward 0",
    "agent.max_error_ratio": "stop the run when more than this share of a batch's episodes failed in the agent",
    "agent.sandbox": "how agents' tools run model-written code: bwrap (operating-system isolation with bubblewrap; "
                     "refuses to run the code where it is missing) or unsafe (no isolation: accept the risk that "
                     "model code reads and writes what the engine can)",
    "mode": "sync (generate, train, sync), async (generation runs up to --train.async_queue_size batches ahead) "
            "or fully_async (streaming groups under staleness bounds, optional partial rollout)",
    "actor.eps_clip": "PPO clip range, low side",
    "actor.eps_clip_high": "PPO clip range, high side (DAPO clip-higher)",
    "train.async_queue_size": "async: batches the generator may run ahead of the trainer (env "
                              "OPENRLHF_ASYNC_QUEUE_SIZE overrides)",
    "train.max_staleness": "hard bound on a trained sample's staleness (trainer version minus the oldest version "
                           "of its tokens); staler groups are dropped and counted; -1: the mode's own bound",
    "train.staleness_threshold": "fully_async: share of a sync window the generator may produce beyond it",
    "train.trigger_parameter_sync_step": "fully_async: optimizer steps between weight syncs",
    "train.require_batches": "fully_async: batches of --rollout.batch_size groups per optimizer step",
    "train.partial_rollout": "fully_async: at a sync, freeze episodes in flight and continue them on the new "
                             "weights instead of letting them finish first",
    "algo.off_policy_correction": "tis (truncated importance sampling against the rollout logprobs), icepop "
                                  "(mask tokens outside --algo.icepop_band) or none",
    "algo.tis_clamp": "tis: the largest importance weight",
    "algo.icepop_band": "icepop: importance weights outside [low, high] mask their token",
    "algo.kl_coef": "k3 KL penalty against the initial policy (loads a reference model); 0: none",
    "rollout.max_concurrent_prompts": "prompt groups in flight at once (FIFO); 0: twice --rollout.batch_size",
    "rollout.early_stop": "stop the rollout once enough valid groups exist: cancel queued groups, abort running ones",
    "rollout.admission_margin": "start this share more groups than the valid rate says are needed: faster "
                                "batches, more aborted tokens",
    "rollout.skip_flat_prompts": "skip a prompt, when its turn comes again, with this probability if its last "
                                 "group's rewards were all equal (it taught nothing then); 0: never skip",
    "rollout.screen_samples": "screening: run M of a group's samples first and the other n - M only if the M "
                              "rewards vary; a group whose M all score the same is dropped as flat, having cost "
                              "M/n of its tokens (SPEED-RL); 0: off, else 2 <= M < n",
    "rollout.unbiased_early_stop": "stop only when every group started before the last accepted one has finished",
    "algo.dynamic_filtering_enable": "keep a group only if its rewards vary (DAPO dynamic sampling)",
    "algo.dynamic_filtering_rule": "std: reward std above --algo.dynamic_filtering_std_eps; mean_range: mean "
                                   "strictly inside --algo.dynamic_filtering_range (OpenRLHF's rule)",
    "reward.remote_url": "reward source scoring each finished episode instead of the agent's own reward: reward "
                         "service URL(s) (comma-separated, POST /score) or an OpenRLHF reward_func .py file",
    "reward.timeout": "seconds one reward call may take (math-verify, reward_func); for a reward service, its time "
                      "per sample: the client waits 2T + 10 s for an answer",
    "reward.retries": "reward service: retries with exponential backoff after a failed request",
    "reward.max_concurrency": "reward calls in flight per engine",
    "reward.workers": "worker processes per engine for math-verify and for a plain def reward_func file (a hung "
                      "call has its worker killed, so it cannot stall generation)",
    "reward.max_error_ratio": "stop the run when more than this share of a batch's episodes lost their reward",
    "eval.n_samples_per_prompt": "k samples per eval problem: eval/mean@k and eval/pass@k",
    "eval.temperature": "eval sampling temperature; 0 is greedy (k must be 1)",
    "eval.max_new_tokens": "eval response budget; 0: --rollout.max_new_tokens",
    "dry_run": "resolve and validate the whole configuration (files, datasets, resources) and print it; start nothing",
    "reward.overlong_buffer_len": "DAPO overlong shaping: penalise responses within this many tokens of the budget",
    "reward.overlong_penalty_factor": "DAPO overlong shaping: the penalty at the full budget",
    "ckpt.output_dir": "where the final HF-format model is saved; empty: <run dir>/final_hf",
    "ckpt.save_steps": "save a resumable checkpoint (DeepSpeed state, data position, weight version, random "
                       "state) every N steps; 0: none",
    "ckpt.path": "folder of the resumable checkpoints; empty: <run dir>/ckpt",
    "ckpt.resume": "continue from the newest checkpoint in --ckpt.path (an error when there is none); its records "
                   "are cut back to that checkpoint's step",
    "overwrite": "start a fresh run even where an earlier run left its records (metrics, timeline, prompts, final "
                 "model, checkpoints): they are deleted first. Without it such a run folder is refused",
    "run_name": "the run folder under --runs_dir: a plain folder name",
    "ckpt.max_num": "resumable checkpoints kept; older ones are deleted",
    "logger.use_tensorboard": "write every numeric metric as a TensorBoard scalar under <run dir>/tensorboard",
    "logger.use_wandb": "log metrics and the config to Weights & Biases from a background thread (never blocks "
                        "the run); run files under <run dir>/wandb",
    "logger.wandb.project": "W&B project",
    "logger.wandb.run_name": "W&B run name; empty: --run_name",
    "logger.wandb_mode": "online, offline or disabled; empty: env WANDB_MODE if set, else online when an API key "
                         "is found (WANDB_API_KEY or a netrc entry for api.wandb.ai), else offline",
}


def _walk(cls, prefix=""):
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, type) and dataclasses.is_dataclass(f.type)):
            yield from _walk(f.type, name + ".")
        else:
            yield name, f


def _default(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m openrlhf_async.cli.train_async",
        description="Asynchronous agentic RL with verifiable rewards (OpenRLHF-compatible flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a mistyped flag must fail, not silently match a longer one
    )
    for name, f in _walk(Config):
        flag = "--" + _FLAG_NAMES.get(name, name)
        default = _default(f)
        help_text = _HELP.get(_FLAG_NAMES.get(name, name), " ")
        if isinstance(default, bool):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif isinstance(default, tuple):
            parser.add_argument(flag, dest=name, type=type(default[0]), nargs=len(default), default=default, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=type(default), default=default, help=help_text)
    return parser


def parse_config(argv=None) -> Config:
    args = vars(build_parser().parse_args(argv))
    cfg = Config()
    for name, value in args.items():
        obj = cfg
        *path, leaf = name.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, leaf, tuple(value) if isinstance(value, list) else value)
    return cfg


def resolve_device(requested: str) -> str:
    device = requested or os.environ.get("DEVICE", "")
    if not device:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def env_int(name: str, flag: str, default: int) -> int:
    """The whole number in environment variable `name` (which overrides `flag`), else default."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text[:40]!r} (the environment override of {flag}): must be a whole number; "
                          f"fix or unset it") from None


# Each float flag's range (a key of _FLOAT_RANGES); "below": checked with its own message in validate. Every float
# flag, listed here or not, must be a finite number.
_FLOAT_FLAGS = {
    "actor.eps_clip": "> 0",
    "actor.eps_clip_high": "> 0",
    "actor.adam.lr": "> 0",
    "actor.adam.betas": "[0, 1)",
    "actor.adam.weight_decay": ">= 0",
    "actor.max_norm": ">= 0",  # 0: no gradient clipping
    "vllm.gpu_memory_utilization": "(0, 1]",
    "rollout.temperature": "> 0",
    "rollout.top_p": "(0, 1]",
    "rollout.admission_margin": ">= 0",
    "rollout.skip_flat_prompts": "below",
    "agent.step_timeout": "> 0 s",
    "agent.max_error_ratio": "[0, 1]",
    "train.staleness_threshold": ">= 0",
    "eval.temperature": ">= 0",
    "eval.top_p": "(0, 1]",
    "algo.dynamic_filtering_std_eps": "> 0",
    "algo.dynamic_filtering_range": "below",
    "algo.tis_clamp": ">= 1",
    "algo.icepop_band": "below",
    "algo.kl_coef": ">= 0",
    "reward.timeout": "> 0 s",
    "reward.max_error_ratio": "[0, 1]",
    "reward.overlong_penalty_factor": ">= 0",
}
_FLOAT_RANGES = {
    "> 0": (lambda v: v > 0, "must be above 0"),
    "> 0 s": (lambda v: v > 0, "must be above 0 seconds"),
    ">= 0": (lambda v: v >= 0, "must not be negative"),
    ">= 1": (lambda v: v >= 1, "must be at least 1"),
    "[0, 1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "(0, 1]": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "[0, 1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
}


def float_flags() -> dict:
    """{flag name: field name} of every float flag (and float tuple), walked from the dataclasses."""
    out = {}
    for name, f in _walk(Config):
        default = _default(f)
        if isinstance(default, float) or (isinstance(default, tuple) and all(isinstance(v, float) for v in default)):
            out[_FLAG_NAMES.get(name, name)] = name
    return out


def _validate_floats(cfg: Config) -> None:
    for flag, name in float_flags().items():
        obj = cfg
        for part in name.split("."):
            obj = getattr(obj, part)
        values = obj if isinstance(obj, tuple) else (obj,)
        shown = " ".join(map(str, values))
        if not all(math.isfinite(v) for v in values):
            raise ConfigError(f"--{flag} {shown}: must be a finite number")
        test, says = _FLOAT_RANGES.get(_FLOAT_FLAGS.get(flag), (None, ""))
        if test and not all(test(v) for v in values):
            raise ConfigError(f"--{flag} {shown}: {'each ' if len(values) > 1 else ''}{says}")


def _validate_environment(requested_device: str, cfg: Config) -> None:
    if cfg.device not in ("cpu", "cuda"):
        source = (f"--device {cfg.device!r}" if requested_device
                  else f"DEVICE={cfg.device!r} (the environment default of --device)")
        raise ConfigError(f"{source}: use cpu or cuda")
    if env_int("OPENRLHF_ASYNC_NUM_TASKS", "--vllm.max_concurrency", 1) < 1:
        raise ConfigError(f"OPENRLHF_ASYNC_NUM_TASKS={os.environ['OPENRLHF_ASYNC_NUM_TASKS']} (the environment "
                          "override of --vllm.max_concurrency): must be at least 1")
    if "OPENRLHF_ASYNC_CACHE" in os.environ and not os.environ["OPENRLHF_ASYNC_CACHE"].strip():
        raise ConfigError("OPENRLHF_ASYNC_CACHE is set but empty: give the cache folder, or unset it for "
                          "~/.cache/openrlhf_async")


def validate(cfg: Config) -> Config:
    """Check every setting before any actor starts; raise ConfigError naming the flag and the fix."""
    requested_device, cfg.device = cfg.device, resolve_device(cfg.device)
    _validate_environment(requested_device, cfg)
    if cfg.run_name in ("", ".", "..") or any(c in cfg.run_name for c in "/\\\0"):
        raise ConfigError(f"--run_name {cfg.run_name!r}: give a plain folder name (no path separators, not . or ..)")
    if cfg.overwrite and cfg.ckpt.resume:
        raise ConfigError("--overwrite deletes the earlier run's records and --ckpt.resume continues them: pass "
                          "one of the two")
    _validate_floats(cfg)
    # Whether the GPUs exist is checked against the Ray cluster at start (a job's driver may run on a CPU-only head).
    positive = {
        "vllm.num_engines": cfg.vllm.num_engines,
        "vllm.tensor_parallel_size": cfg.vllm.tensor_parallel_size,
        "vllm.max_concurrency": cfg.vllm.max_concurrency,
        "actor.num_nodes": cfg.actor.num_nodes,
        "actor.num_gpus_per_node": cfg.actor.num_gpus_per_node,
        "rollout.batch_size": cfg.rollout.batch_size,
        "rollout.n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "train.max_steps": cfg.train.max_steps,
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.weight_sync_bucket_mb": cfg.train.weight_sync_bucket_mb,
        "data.max_len": cfg.data.max_len,
        "data.max_samples": cfg.data.max_samples,
        "eval.steps": cfg.eval.steps,
        "eval.max_samples": cfg.eval.max_samples,
        "agent.max_steps": cfg.agent.max_steps,
    }
    for flag, value in positive.items():
        if value < 1:
            raise ConfigError(f"--{flag} {value}: must be at least 1")
    for flag, value in {"agent.workers": cfg.agent.workers,
                        "rollout.max_concurrent_prompts": cfg.rollout.max_concurrent_prompts,
                        "reward.overlong_buffer_len": cfg.reward.overlong_buffer_len}.items():
        if value < 0:
            raise ConfigError(f"--{flag} {value}: must not be negative")
    if not 0 <= cfg.rollout.skip_flat_prompts < 1:
        raise ConfigError(f"--rollout.skip_flat_prompts {cfg.rollout.skip_flat_prompts}: must be in [0, 1) (a "
                          f"probability; below 1 so that a prompt can come back once the policy has moved)")
    screen, n = cfg.rollout.screen_samples, cfg.rollout.n_samples_per_prompt
    if screen and not 2 <= screen < n:
        raise ConfigError(f"--rollout.screen_samples {screen}: use 0 (off) or a number from 2 to "
                          f"--rollout.n_samples_per_prompt - 1 ({n - 1}); one sample cannot show a flat group")
    if screen and not cfg.algo.dynamic_filtering_enable:
        raise ConfigError(f"--rollout.screen_samples {screen} drops groups that would be flat, which only makes "
                          f"sense with dynamic sampling: drop --no-algo.dynamic_filtering_enable or the screening")
    if cfg.agent.sandbox not in ("bwrap", "unsafe"):
        raise ConfigError(f"--agent.sandbox {cfg.agent.sandbox!r}: use bwrap (isolated) or unsafe (no isolation)")
    if cfg.algo.dynamic_filtering_rule not in ("std", "mean_range"):
        raise ConfigError(f"--algo.dynamic_filtering_rule {cfg.algo.dynamic_filtering_rule!r}: use std or mean_range")
    low, high = cfg.algo.dynamic_filtering_range
    if not low < high:
        raise ConfigError(f"--algo.dynamic_filtering_range {low} {high}: the low end must be below the high end")
    if cfg.reward.overlong_buffer_len >= cfg.rollout.max_new_tokens:
        raise ConfigError(f"--reward.overlong_buffer_len {cfg.reward.overlong_buffer_len} must be below "
                          f"--rollout.max_new_tokens {cfg.rollout.max_new_tokens}")
    if cfg.rollout.max_new_tokens >= cfg.data.max_len:
        raise ConfigError(
            f"--rollout.max_new_tokens {cfg.rollout.max_new_tokens} must be below --data.max_len {cfg.data.max_len}"
        )
    if cfg.algo.advantage_estimator not in ("group_norm", "dr_grpo", "reinforce_baseline"):
        raise ConfigError(
            f"--algo.advantage.estimator {cfg.algo.advantage_estimator!r}: use group_norm, dr_grpo or reinforce_baseline"
        )
    if cfg.algo.advantage_estimator in ("group_norm", "dr_grpo") and cfg.rollout.n_samples_per_prompt < 2:
        raise ConfigError("--rollout.n_samples_per_prompt must be at least 2 for group advantages")
    if cfg.ds.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--ds.zero_stage {cfg.ds.zero_stage}: use 0, 1, 2 or 3")
    if cfg.dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--ds.param_dtype {cfg.ds.param_dtype!r}: use fp32, bf16 or fp16")
    if cfg.backend not in ("gloo", "nccl"):
        raise ConfigError(f"--vllm.sync_backend {cfg.backend!r}: use gloo or nccl")
    if cfg.backend == "nccl" and cfg.device != "cuda":
        raise ConfigError("--vllm.sync_backend nccl needs --device cuda; use gloo on cpu")
    model = cfg.actor.model_name_or_path
    if model and not os.path.isdir(model) and not is_hub_id(model):
        raise ConfigError(f"--actor.model_name_or_path {model}: no such model folder (give a local HF model folder, "
                          "a Hugging Face id such as Qwen/Qwen3-8B-Base, or nothing for the embedded tiny model)")
    if model and os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(f"--actor.model_name_or_path {model}: folder has no config.json")
    _validate_reward_and_eval(cfg)
    _validate_pipeline(cfg)
    _validate_logger(cfg)
    return cfg


def is_hub_id(name: str) -> bool:
    """A Hugging Face model id ("org/name"), fetched when the model loads; a local path is anything else."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not os.path.exists(name)


def _validate_reward_and_eval(cfg: Config) -> None:
    r, e = cfg.reward, cfg.eval
    for url in filter(None, (u.strip() for u in r.remote_url.split(","))):
        if url.endswith(".py"):
            continue
        try:
            parts = urllib.parse.urlsplit(url)
            host, _port = parts.hostname, parts.port  # parsed on access: a port that is not a number raises
        except ValueError as err:
            raise ConfigError(f"--reward.remote_url {url}: not a URL ({err}); give http(s)://host:port/score") from None
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"--reward.remote_url {url}: give http(s)://host:port/score URLs or a reward_func .py file")
        if not host:
            raise ConfigError(f"--reward.remote_url {url}: the URL has no host; give http(s)://host:port/score")
    if "," in r.remote_url and ".py" in r.remote_url:
        raise ConfigError(f"--reward.remote_url {r.remote_url}: a reward_func .py file cannot be mixed with URLs")
    for flag, value, least in (("reward.retries", r.retries, 0), ("reward.max_concurrency", r.max_concurrency, 1),
                               ("reward.workers", r.workers, 1), ("eval.n_samples_per_prompt", e.n_samples_per_prompt, 1),
                               ("eval.max_new_tokens", e.max_new_tokens, 0)):
        if value < least:
            raise ConfigError(f"--{flag} {value}: must be at least {least}")
    if e.temperature == 0 and e.n_samples_per_prompt > 1:
        raise ConfigError(f"--eval.n_samples_per_prompt {e.n_samples_per_prompt} with --eval.temperature 0 draws "
                          "the same greedy answer k times; set --eval.temperature (e.g. 0.6) or k = 1")
    if e.max_new_tokens >= cfg.data.max_len:
        raise ConfigError(f"--eval.max_new_tokens {e.max_new_tokens} must be below --data.max_len {cfg.data.max_len}")


def _validate_pipeline(cfg: Config) -> None:
    t = cfg.train
    if cfg.mode not in ("sync", "async", "fully_async"):
        raise ConfigError(f"--mode {cfg.mode!r}: use sync, async or fully_async")
    if cfg.queue_size < 1:
        raise ConfigError(f"--train.async_queue_size {cfg.queue_size} (or OPENRLHF_ASYNC_QUEUE_SIZE): must be at "
                          "least 1")
    if t.max_staleness < -1:
        raise ConfigError(f"--train.max_staleness {t.max_staleness}: must be 0 or more (-1: the mode's bound)")
    for flag, value in {"train.trigger_parameter_sync_step": t.trigger_parameter_sync_step,
                        "train.require_batches": t.require_batches}.items():
        if value < 1:
            raise ConfigError(f"--{flag} {value}: must be at least 1")
    if cfg.mode != "fully_async":
        used = [f for f, on in (("--train.partial_rollout", t.partial_rollout),
                                ("--train.trigger_parameter_sync_step", t.trigger_parameter_sync_step != 1),
                                ("--train.require_batches", t.require_batches != 1)) if on]
        if used:
            raise ConfigError(f"{', '.join(used)} only apply to --mode fully_async (got --mode {cfg.mode})")
    if cfg.mode == "sync" and t.max_staleness > 0:
        raise ConfigError(f"--train.max_staleness {t.max_staleness} contradicts --mode sync, which trains on fresh "
                          "samples only; use --mode async or fully_async")
    if cfg.mode == "async" and 0 <= t.max_staleness < cfg.queue_size:
        raise ConfigError(f"--train.max_staleness {t.max_staleness} is below --train.async_queue_size "
                          f"{cfg.queue_size}: batches the queue holds would be too stale; raise one or lower the other")
    if cfg.algo.off_policy_correction not in ("tis", "icepop", "none"):
        raise ConfigError(f"--algo.off_policy_correction {cfg.algo.off_policy_correction!r}: use tis, icepop or none")
    low, high = cfg.algo.icepop_band
    if not 0 < low < 1 < high:
        raise ConfigError(f"--algo.icepop_band {low} {high}: need 0 < low < 1 < high")
    c = cfg.ckpt
    if c.save_steps < 0 or c.max_num < 1:
        raise ConfigError(f"--ckpt.save_steps {c.save_steps} / --ckpt.max_num {c.max_num}: need save_steps >= 0 "
                          "(0: none) and max_num >= 1")
    if c.save_steps % t.trigger_parameter_sync_step:
        raise ConfigError(f"--ckpt.save_steps {c.save_steps} must be a multiple of --train.trigger_parameter_sync_step "
                          f"{t.trigger_parameter_sync_step}: a checkpoint is taken when the engines hold its weights")


def wandb_api_key_available() -> bool:
    """Whether W&B finds credentials: env WANDB_API_KEY or a netrc entry for api.wandb.ai."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(requested: str) -> str:
    """--logger.wandb_mode, else env WANDB_MODE, else online with an API key and offline without."""
    env = os.environ.get("WANDB_MODE", "")
    env = {"dryrun": "offline", "run": "online"}.get(env, env)  # wandb's legacy names
    return requested or env or ("online" if wandb_api_key_available() else "offline")


def _validate_logger(cfg: Config) -> None:
    lg = cfg.logger
    modes = ("online", "offline", "disabled")
    if lg.wandb_mode not in ("", *modes):
        raise ConfigError(f"--logger.wandb_mode {lg.wandb_mode!r}: use online, offline or disabled (empty: online "
                          "with an API key, else offline)")
    if not lg.use_wandb:
        return
    if not lg.wandb_project:
        raise ConfigError("--logger.wandb.project is empty: give a W&B project name")
    mode = resolve_wandb_mode(lg.wandb_mode)
    if mode not in modes:
        raise ConfigError(f"WANDB_MODE={mode!r} (the default of --logger.wandb_mode): use online, offline or disabled")
    if mode == "online" and not wandb_api_key_available():
        raise ConfigError("--logger.wandb_mode online needs a W&B API key (set WANDB_API_KEY or run `wandb login`); "
                          "or use --logger.wandb_mode offline and `wandb sync` later")
    lg.wandb_mode = mode  # resolved once here, so the printed config says what the run will do


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def default_cache_dir(cfg: Optional[Config] = None) -> str:
    if cfg is not None and cfg.cache_dir:
        return cfg.cache_dir
    return os.environ.get("OPENRLHF_ASYNC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "openrlhf_async"))
