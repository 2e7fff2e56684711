"""One typed config for a run, built from OpenRLHF-style dotted flags and validated once at start.

Each setting is one `setting(...)` line: its default, its --help text, and the choices, range and OpenRLHF flag
spelling that the generated parser and `validate` enforce. Adding a flag is adding that line."""

import argparse
import dataclasses
import math
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A bad flag, file or field; the message is one line naming it and the fix."""


# A setting's range: a test of each value (each of a pair's) and what the error says.
_EACH = {
    "> 0": (lambda v: v > 0, "must be above 0"),
    "> 0 s": (lambda v: v > 0, "must be above 0 seconds"),
    ">= 0": (lambda v: v >= 0, "must not be negative"),
    ">= 1": (lambda v: v >= 1, "must be at least 1"),
    "[0, 1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "(0, 1]": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "[0, 1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
}
# A (low, high) setting's range: a test of the pair.
_PAIR = {
    "low < high": (lambda low, high: low < high, "the low end must be below the high end"),
    "0 < low < 1 < high": (lambda low, high: 0 < low < 1 < high, "need 0 < low < 1 < high"),
}


def setting(default, help: str, choices: tuple = None, range: str = None, flag: str = None):
    """A config field with its --help text, its allowed values (choices, or a range of _EACH or _PAIR) and its
    flag where OpenRLHF spells it other than --<section>.<field>."""
    assert help and (range is None or range in _EACH or range in _PAIR), (help, range)
    return field(default=default, metadata={"help": help, "choices": choices, "range": range, "flag": flag})


@dataclass
class ActorConfig:
    model_name_or_path: str = setting("", "HF model folder or Hugging Face id; empty builds the embedded tiny model")
    num_nodes: int = setting(1, "nodes of DeepSpeed trainer ranks", range=">= 1")
    num_gpus_per_node: int = setting(2, "DeepSpeed ranks per node (CPU processes when device is cpu)", range=">= 1")
    eps_clip: float = setting(0.2, "PPO clip range, low side", range="> 0")
    eps_clip_high: float = setting(0.28, "PPO clip range, high side (DAPO clip-higher)", range="> 0")
    adam_lr: float = setting(3e-4, "Adam learning rate", range="> 0", flag="actor.adam.lr")
    adam_betas: tuple = setting((0.9, 0.95), "Adam beta1 beta2", range="[0, 1)", flag="actor.adam.betas")
    adam_weight_decay: float = setting(0.0, "AdamW weight decay", range=">= 0", flag="actor.adam.weight_decay")
    max_norm: float = setting(1.0, "gradient clipping norm; 0: no clipping", range=">= 0")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


@dataclass
class VLLMConfig:
    num_engines: int = setting(1, "vLLM engines generating rollouts", range=">= 1")
    tensor_parallel_size: int = setting(1, "GPUs per vLLM engine", range=">= 1")
    sync_backend: str = setting("", "weight-sync group backend; empty: nccl on cuda, gloo on cpu",
                                choices=("", "nccl", "gloo"))
    enforce_eager: bool = setting(True, "run vLLM without CUDA graphs")
    gpu_memory_utilization: float = setting(0.9, "share of GPU memory a vLLM engine may take", range="(0, 1]")
    cpu_kvcache_space_gib: int = setting(1, "KV cache per engine on cpu, in GiB (VLLM_CPU_KVCACHE_SPACE)")
    max_num_seqs: int = setting(256, "sequences one vLLM engine batches at once")
    max_concurrency: int = setting(256, "requests in flight per engine (asyncio semaphore; env "
                                        "OPENRLHF_ASYNC_NUM_TASKS overrides)", range=">= 1")


@dataclass
class RolloutConfig:
    batch_size: int = setting(32, "prompts per training step", range=">= 1")
    n_samples_per_prompt: int = setting(8, "samples per prompt (its group)", range=">= 1")
    max_new_tokens: int = setting(8, "response tokens per sample at most", range=">= 1")
    temperature: float = setting(1.0, "rollout sampling temperature", range="> 0")
    top_p: float = setting(1.0, "rollout nucleus sampling top-p", range="(0, 1]")
    max_concurrent_prompts: int = setting(0, "prompt groups in flight at once (FIFO); 0: twice --rollout.batch_size",
                                          range=">= 0")
    early_stop: bool = setting(True, "stop the rollout once enough valid groups exist: cancel queued groups, abort "
                                     "running ones")
    unbiased_early_stop: bool = setting(False, "stop only when every group started before the last accepted one "
                                               "has finished")
    admission_margin: float = setting(0.0, "start this share more groups than the valid rate says are needed: "
                                           "faster batches, more aborted tokens", range=">= 0")
    skip_flat_prompts: float = setting(0.0, "skip a prompt, when its turn comes again, with this probability if its "
                                            "last group's rewards were all equal (it taught nothing then); 0: never; "
                                            "below 1 so that a prompt comes back once the policy has moved",
                                       range="[0, 1)")
    screen_samples: int = setting(0, "screening: run M of a group's samples first and the other n - M only if the M "
                                     "rewards vary; a group whose M all score the same is dropped as flat, having "
                                     "cost M/n of its tokens (SPEED-RL); 0: off, else 2 <= M < n")


@dataclass
class AgentConfig:
    func_path: str = setting("", "agent .py file: step(state, action, label) or an OpenRLHF AgentExecutor; empty: "
                                 "the built-in single-turn math agent", flag="train.agent_func_path")
    workers: int = setting(0, "0 runs agent steps in the engine's process; N isolates them in N worker processes per "
                              "engine", range=">= 0")
    max_steps: int = setting(8, "agent steps (turns) per episode at most", range=">= 1")
    step_timeout: float = setting(30.0, "seconds one agent step may take; a step over it gives its episode reward 0",
                                  range="> 0 s")
    max_error_ratio: float = setting(0.5, "stop the run when more than this share of a batch's episodes failed in "
                                          "the agent", range="[0, 1]")
    sandbox: str = setting("bwrap", "how agents' tools run model-written code: bwrap (operating-system isolation "
                                    "with bubblewrap; refuses to run the code where it is missing) or unsafe (no "
                                    "isolation: accept the risk that model code reads and writes what the engine can)",
                           choices=("bwrap", "unsafe"))


@dataclass
class TrainConfig:
    max_steps: int = setting(100, "training steps (each: rollout, update, weight sync)", range=">= 1")
    micro_batch_size: int = setting(64, "samples per forward/backward on one rank", range=">= 1")
    seed: int = setting(42, "random seed of prompt order, sampling and training")
    weight_sync_bucket_mb: int = setting(64, "MB of weights per broadcast when syncing the engines", range=">= 1")
    # Checked in validate with its environment override.
    async_queue_size: int = setting(1, "async: batches the generator may run ahead of the trainer (env "
                                       "OPENRLHF_ASYNC_QUEUE_SIZE overrides)")
    max_staleness: int = setting(-1, "hard bound on a trained sample's staleness (trainer version minus the oldest "
                                     "version of its tokens); staler groups are dropped and counted; -1: the mode's "
                                     "own bound")
    staleness_threshold: float = setting(0.5, "fully_async: share of a sync window the generator may produce beyond "
                                              "it", range=">= 0")
    trigger_parameter_sync_step: int = setting(1, "fully_async: optimizer steps between weight syncs", range=">= 1")
    require_batches: int = setting(1, "fully_async: batches of --rollout.batch_size groups per optimizer step",
                                   range=">= 1")
    partial_rollout: bool = setting(False, "fully_async: at a sync, freeze episodes in flight and continue them on "
                                           "the new weights instead of letting them finish first")


@dataclass
class DataConfig:
    prompt_dataset: str = setting("", "JSONL or Parquet file of prompts; empty uses the built-in arithmetic task")
    input_key: str = setting("prompt", "the dataset field holding the prompt")
    label_key: str = setting("label", "the dataset field holding the label the reward checks against")
    apply_chat_template: bool = setting(True, "format prompts with the tokenizer's chat template")
    max_len: int = setting(256, "prompt + response tokens at most", range=">= 1")
    max_samples: int = setting(100_000_000, "training prompts used at most", range=">= 1")


@dataclass
class EvalConfig:
    dataset: str = setting("", "held-out JSONL/Parquet; empty: the built-in task's eval split, or no eval with "
                               "--data.prompt_dataset")
    steps: int = setting(10, "evaluate every N steps, plus at start and end", range=">= 1")
    max_samples: int = setting(500, "eval prompts used at most", range=">= 1")
    n_samples_per_prompt: int = setting(1, "k samples per eval problem: eval/mean@k and eval/pass@k", range=">= 1")
    temperature: float = setting(0.0, "eval sampling temperature; 0 is greedy (k must be 1)", range=">= 0")
    top_p: float = setting(1.0, "eval nucleus sampling top-p", range="(0, 1]")
    max_new_tokens: int = setting(0, "eval response budget; 0: --rollout.max_new_tokens", range=">= 0")


@dataclass
class AlgoConfig:
    advantage_estimator: str = setting("group_norm", "group_norm (GRPO), dr_grpo or reinforce_baseline",
                                       choices=("group_norm", "dr_grpo", "reinforce_baseline"),
                                       flag="algo.advantage.estimator")
    advantage_no_std_norm: bool = setting(False, "group_norm: do not divide by the group's reward std",
                                          flag="algo.advantage.no_std_norm")
    dynamic_filtering_enable: bool = setting(True, "keep a group only if its rewards vary (DAPO dynamic sampling)")
    dynamic_filtering_rule: str = setting("std", "std: reward std above --algo.dynamic_filtering_std_eps; "
                                                 "mean_range: mean strictly inside --algo.dynamic_filtering_range "
                                                 "(OpenRLHF's rule)", choices=("std", "mean_range"))
    dynamic_filtering_std_eps: float = setting(1e-6, "std rule: the reward std a group must exceed", range="> 0")
    dynamic_filtering_range: tuple = setting((0.0, 1.0), "mean_range rule: low high bounds of a kept group's mean "
                                                          "reward", range="low < high")
    off_policy_correction: str = setting("tis", "tis (truncated importance sampling against the rollout logprobs), "
                                                "icepop (mask tokens outside --algo.icepop_band) or none",
                                         choices=("tis", "icepop", "none"))
    tis_clamp: float = setting(2.0, "tis: the largest importance weight", range=">= 1")
    icepop_band: tuple = setting((0.5, 2.0), "icepop: importance weights outside [low, high] mask their token",
                                 range="0 < low < 1 < high")
    kl_coef: float = setting(0.0, "k3 KL penalty against the initial policy (loads a reference model); 0: none",
                             range=">= 0")


@dataclass
class RewardConfig:
    remote_url: str = setting("", "reward source scoring each finished episode instead of the agent's own reward: "
                                  "reward service URL(s) (comma-separated, POST /score) or an OpenRLHF reward_func "
                                  ".py file")
    timeout: float = setting(10.0, "seconds one reward call may take (math-verify, reward_func); for a reward "
                                   "service, its time per sample: the client waits 2T + 10 s for an answer",
                             range="> 0 s")
    retries: int = setting(5, "reward service: retries with exponential backoff after a failed request", range=">= 0")
    max_concurrency: int = setting(64, "reward calls in flight per engine", range=">= 1")
    workers: int = setting(2, "worker processes per engine for math-verify and for a plain def reward_func file (a "
                              "hung call has its worker killed, so it cannot stall generation)", range=">= 1")
    max_error_ratio: float = setting(0.5, "stop the run when more than this share of a batch's episodes lost their "
                                          "reward", range="[0, 1]")
    overlong_buffer_len: int = setting(0, "DAPO overlong shaping: penalise responses within this many tokens of the "
                                          "budget; 0: off", range=">= 0")
    overlong_penalty_factor: float = setting(1.0, "DAPO overlong shaping: the penalty at the full budget",
                                             range=">= 0")

    def source(self) -> dict:
        """make_reward's arguments."""
        return {"remote_url": self.remote_url, "timeout": self.timeout, "retries": self.retries,
                "max_concurrency": self.max_concurrency, "workers": self.workers}


@dataclass
class DSConfig:
    zero_stage: int = setting(3, "DeepSpeed ZeRO stage", choices=(0, 1, 2, 3))
    param_dtype: str = setting("", "training dtype; empty: fp32 on cpu, bf16 on cuda",
                               choices=("", "fp32", "bf16", "fp16"))


@dataclass
class CkptConfig:
    output_dir: str = setting("", "where the final HF-format model is saved; empty: <run dir>/final_hf")
    save_steps: int = setting(0, "save a resumable checkpoint (DeepSpeed state, data position, weight version, "
                                 "random state) every N steps; 0: none")
    path: str = setting("", "folder of the resumable checkpoints; empty: <run dir>/ckpt")
    resume: bool = setting(False, "continue from the newest checkpoint in --ckpt.path (an error when there is none); "
                                  "its records are cut back to that checkpoint's step")
    max_num: int = setting(2, "resumable checkpoints kept; older ones are deleted")


@dataclass
class LoggerConfig:
    use_tensorboard: bool = setting(False, "write every numeric metric as a TensorBoard scalar under <run "
                                           "dir>/tensorboard")
    use_wandb: bool = setting(False, "log metrics and the config to Weights & Biases from a background thread "
                                     "(never blocks the run); run files under <run dir>/wandb")
    wandb_project: str = setting("openrlhf_async", "W&B project", flag="logger.wandb.project")
    wandb_run_name: str = setting("", "W&B run name; empty: --run_name", flag="logger.wandb.run_name")
    wandb_mode: str = setting("", "online, offline or disabled; empty: env WANDB_MODE if set, else online when an "
                                  "API key is found (WANDB_API_KEY or a netrc entry for api.wandb.ai), else offline",
                              choices=("", "online", "offline", "disabled"))


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
    mode: str = setting("sync", "sync (generate, train, sync), async (generation runs up to --train.async_queue_size "
                                "batches ahead) or fully_async (streaming groups under staleness bounds, optional "
                                "partial rollout)", choices=("sync", "async", "fully_async"))
    device: str = setting("", "cpu or cuda; empty: cuda if available (env DEVICE overrides)",
                          choices=("", "cpu", "cuda"))
    run_name: str = setting("demo", "the run folder under --runs_dir: a plain folder name")
    runs_dir: str = setting("runs", "the folder holding the run folders")
    cache_dir: str = setting("", "where the embedded model is built; empty: env OPENRLHF_ASYNC_CACHE, else "
                                 "~/.cache/openrlhf_async")
    progress: bool = setting(True, "show a progress bar")
    dry_run: bool = setting(False, "resolve and validate the whole configuration (files, datasets, resources) and "
                                   "print it; start nothing")
    overwrite: bool = setting(False, "start a fresh run even where an earlier run left its records (metrics, "
                                     "timeline, prompts, final model, checkpoints): they are deleted first. Without "
                                     "it such a run folder is refused")

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
    def backend(self) -> str:
        return self.vllm.sync_backend or ("nccl" if self.device == "cuda" else "gloo")

    @property
    def dtype(self) -> str:
        return self.ds.param_dtype or ("bf16" if self.device == "cuda" else "fp32")


def _walk(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            yield from _walk(f.type, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def settings() -> dict:
    """{flag: (dotted field name, dataclass field)} of every setting, walked from the dataclasses."""
    return {f.metadata["flag"] or name: (name, f) for name, f in _walk(Config)}


def float_flags() -> dict:
    """{flag: dotted field name} of every float setting (and float pair)."""
    return {flag: name for flag, (name, f) in settings().items()
            if isinstance(f.default, float) or isinstance(f.default, tuple) and isinstance(f.default[0], float)}


def _get(obj, name: str):
    for part in filter(None, name.split(".")):
        obj = getattr(obj, part)
    return obj


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the flag (argparse's own adds the whole usage)
        raise ConfigError(message)


class _HelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action):
        if action.default is argparse.SUPPRESS or "%(default)" in action.help:
            return action.help
        return f"{action.help} (default: %(default)r)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m openrlhf_async.cli.train_async",
        description="Asynchronous agentic RL with verifiable rewards (OpenRLHF-compatible flags).",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # a mistyped flag must fail, not silently match a longer one
    )
    for flag, (name, f) in settings().items():
        kwargs = dict(dest=name, default=f.default, help=f.metadata["help"].replace("%", "%%"))
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(f.default, tuple):
            kwargs.update(type=type(f.default[0]), nargs=len(f.default))
        else:
            kwargs.update(type=type(f.default), choices=f.metadata["choices"])
        parser.add_argument("--" + flag, **kwargs)
    return parser


def parse_config(argv=None) -> Config:
    """The Config the flags give; a bad flag raises ConfigError (--help prints and exits)."""
    cfg = Config()
    for name, value in vars(build_parser().parse_args(argv)).items():
        section, _, leaf = name.rpartition(".")
        setattr(_get(cfg, section), leaf, tuple(value) if isinstance(value, list) else value)
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


def validate(cfg: Config) -> Config:
    """Check every setting before any actor starts; raise ConfigError naming the flag and the fix."""
    requested_device, cfg.device = cfg.device, resolve_device(cfg.device)
    _validate_environment(requested_device, cfg)
    if cfg.run_name in ("", ".", "..") or any(c in cfg.run_name for c in "/\\\0"):
        raise ConfigError(f"--run_name {cfg.run_name!r}: give a plain folder name (no path separators, not . or ..)")
    if cfg.overwrite and cfg.ckpt.resume:
        raise ConfigError("--overwrite deletes the earlier run's records and --ckpt.resume continues them: pass "
                          "one of the two")
    _validate_settings(cfg)
    _validate_rollout(cfg)
    _validate_model(cfg)
    _validate_reward_and_eval(cfg)
    _validate_pipeline(cfg)
    _validate_logger(cfg)
    return cfg


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


def _validate_settings(cfg: Config) -> None:
    """Each setting on its own: its choices (argparse checks them for flags; a Config built in code too), a float's
    finiteness, and its range."""
    for flag, (name, f) in settings().items():
        value, choices, rng = _get(cfg, name), f.metadata["choices"], f.metadata["range"]
        values = value if isinstance(value, tuple) else (value,)
        shown = " ".join(map(str, values))
        if choices and value not in choices:
            *others, last = [str(c) for c in choices if c != ""]
            raise ConfigError(f"--{flag} {value!r}: use {', '.join(others)} or {last}")
        if not all(math.isfinite(v) for v in values if isinstance(v, float)):
            raise ConfigError(f"--{flag} {shown}: must be a finite number")
        if rng in _PAIR and not _PAIR[rng][0](*values):
            raise ConfigError(f"--{flag} {shown}: {_PAIR[rng][1]}")
        if rng in _EACH and not all(_EACH[rng][0](v) for v in values):
            raise ConfigError(f"--{flag} {shown}: {'each ' if len(values) > 1 else ''}{_EACH[rng][1]}")


def _validate_rollout(cfg: Config) -> None:
    r = cfg.rollout
    screen, n = r.screen_samples, r.n_samples_per_prompt
    if screen and not 2 <= screen < n:
        raise ConfigError(f"--rollout.screen_samples {screen}: use 0 (off) or a number from 2 to "
                          f"--rollout.n_samples_per_prompt - 1 ({n - 1}); one sample cannot show a flat group")
    if screen and not cfg.algo.dynamic_filtering_enable:
        raise ConfigError(f"--rollout.screen_samples {screen} drops groups that would be flat, which only makes "
                          f"sense with dynamic sampling: drop --no-algo.dynamic_filtering_enable or the screening")
    if cfg.reward.overlong_buffer_len >= r.max_new_tokens:
        raise ConfigError(f"--reward.overlong_buffer_len {cfg.reward.overlong_buffer_len} must be below "
                          f"--rollout.max_new_tokens {r.max_new_tokens}")
    if r.max_new_tokens >= cfg.data.max_len:
        raise ConfigError(f"--rollout.max_new_tokens {r.max_new_tokens} must be below --data.max_len "
                          f"{cfg.data.max_len}")
    if cfg.algo.advantage_estimator in ("group_norm", "dr_grpo") and n < 2:
        raise ConfigError("--rollout.n_samples_per_prompt must be at least 2 for group advantages")


def _validate_model(cfg: Config) -> None:
    # Whether the GPUs exist is checked against the Ray cluster at start (a job's driver may run on a CPU-only head).
    if cfg.backend == "nccl" and cfg.device != "cuda":
        raise ConfigError("--vllm.sync_backend nccl needs --device cuda; use gloo on cpu")
    model = cfg.actor.model_name_or_path
    if model and not os.path.isdir(model) and not is_hub_id(model):
        raise ConfigError(f"--actor.model_name_or_path {model}: no such model folder (give a local HF model folder, "
                          "a Hugging Face id such as Qwen/Qwen3-8B-Base, or nothing for the embedded tiny model)")
    if model and os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(f"--actor.model_name_or_path {model}: folder has no config.json")


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
    if e.temperature == 0 and e.n_samples_per_prompt > 1:
        raise ConfigError(f"--eval.n_samples_per_prompt {e.n_samples_per_prompt} with --eval.temperature 0 draws "
                          "the same greedy answer k times; set --eval.temperature (e.g. 0.6) or k = 1")
    if e.max_new_tokens >= cfg.data.max_len:
        raise ConfigError(f"--eval.max_new_tokens {e.max_new_tokens} must be below --data.max_len {cfg.data.max_len}")


def _validate_pipeline(cfg: Config) -> None:
    t = cfg.train
    if cfg.queue_size < 1:
        raise ConfigError(f"--train.async_queue_size {cfg.queue_size} (or OPENRLHF_ASYNC_QUEUE_SIZE): must be at "
                          "least 1")
    if t.max_staleness < -1:
        raise ConfigError(f"--train.max_staleness {t.max_staleness}: must be 0 or more (-1: the mode's bound)")
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
    c = cfg.ckpt
    if c.save_steps < 0 or c.max_num < 1:
        raise ConfigError(f"--ckpt.save_steps {c.save_steps} / --ckpt.max_num {c.max_num}: need save_steps >= 0 "
                          "(0: none) and max_num >= 1")
    if c.save_steps % t.trigger_parameter_sync_step:
        raise ConfigError(f"--ckpt.save_steps {c.save_steps} must be a multiple of --train.trigger_parameter_sync_step "
                          f"{t.trigger_parameter_sync_step}: a checkpoint is taken when the engines hold its weights")


def _validate_logger(cfg: Config) -> None:
    from openrlhf_async.utils.metrics import resolve_wandb_mode, wandb_api_key_available

    lg = cfg.logger
    if not lg.use_wandb:
        return
    if not lg.wandb_project:
        raise ConfigError("--logger.wandb.project is empty: give a W&B project name")
    mode = resolve_wandb_mode(lg.wandb_mode)
    if mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"WANDB_MODE={mode!r} (the default of --logger.wandb_mode): use online, offline or disabled")
    if mode == "online" and not wandb_api_key_available():
        raise ConfigError("--logger.wandb_mode online needs a W&B API key (set WANDB_API_KEY or run `wandb login`); "
                          "or use --logger.wandb_mode offline and `wandb sync` later")
    lg.wandb_mode = mode  # resolved once here, so the printed config says what the run will do


def config_with(cfg, **sections):
    """A copy of the run's config with some settings changed, section by section:
    config_with(cfg, rollout={"n_samples_per_prompt": 4}, algo={"dynamic_filtering_enable": False})."""
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)
                                       for name, changes in sections.items()})


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def default_cache_dir(cfg: Optional[Config] = None) -> str:
    if cfg is not None and cfg.cache_dir:
        return cfg.cache_dir
    return os.environ.get("OPENRLHF_ASYNC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "openrlhf_async"))
