"""The checks of a config, run once before any actor starts: each setting against its choices, range and bound, then
the rules between settings (mode, layout, colocation, algorithm, model, LoRA, DeepSpeed, rewards, pipeline, logger),
each refusal one line naming the flag and the fix, all of a command line's refusals at once. Settings that follow
from others are resolved by the check that reads them (the mode, the device, a lone correction threshold, the
sequence length a model caps, W&B's mode): `validate` is where the flags become the run's settings. What the checks
need from outside the config (the device, a model's context length, the hub) comes from probes.py."""

import dataclasses
import functools
import math
import os
import sys
import urllib.parse

from openrlhf_async.config.probes import (hub_model_positions, is_hub_id, model_positions, read_model_config,
                                          resolve_device)
from openrlhf_async.config.resolve import name_reward_models
from openrlhf_async.config.schema import Config, CriticConfig, settings, value_at
from openrlhf_async.config.setting import (EACH, FLOAT_LIMIT, INT_LIMIT, PAIR, WEEK_S, env_int, support,
                                           value_type)
from openrlhf_async.errors import ConfigError, notice
from openrlhf_async.utils.cluster import HYBRID_GPU_SHARE
from openrlhf_async.utils.model_info import (EMBEDDED_DIR, EMBEDDED_MODELS, MOE_TYPES, is_gguf, model_config_type,
                                             model_experts)
from openrlhf_async.utils.wandb_mode import resolve_wandb_mode, wandb_api_key_available


def validate(cfg: Config) -> Config:
    """Check every setting before any actor starts; raise ConfigError naming the flag and the fix, one line per
    refusal, all of a command line's refusals at once. Settings that follow from others (the mode, a lone correction
    threshold) are resolved here, once."""
    requested_device, cfg.device = cfg.device, resolve_device(cfg.device)
    try:
        _validate_environment(requested_device, cfg)  # a bad device or override stops here: the checks below read it
        _validate_settings(cfg)  # so does a value out of range (each one said): the checks below compare the values
        _validate_mode(cfg)  # and a contradicting mode: the checks below read the mode it resolves
    except ConfigError as e:
        raise StopChecks(str(e)) from None
    refuse_together(*(functools.partial(check, cfg) for check in (
        _validate_run_name, _validate_openrlhf_support, _validate_layout, _validate_queue, _validate_rollout,
        _validate_colocation, _validate_algo, _validate_model, _validate_deepspeed, _validate_lora,
        _validate_reward_and_eval, _validate_pipeline, _validate_logger)))
    name_reward_models(cfg)
    return cfg


class StopChecks(ConfigError):
    """A refusal that the checks after it would only repeat in other words (a bad device, a value out of range)."""


def refuse_together(*checks) -> None:
    """Run each check (a callable of no arguments) and raise one ConfigError of all their refusals, one a line in
    their order, each once: a command line's faults are said in one go, not one per rerun."""
    refusals = []
    for check in checks:
        try:
            check()
        except ConfigError as e:
            # two checks reading one bad value (an environment override) say it once
            refusals += [line for line in str(e).splitlines() if line not in refusals]
            if isinstance(e, StopChecks):  # later checks would read the bad value and only repeat it
                break
    if refusals:
        raise ConfigError("\n".join(refusals))


def _validate_run_name(cfg: Config) -> None:
    if cfg.run_name in ("", ".", "..") or any(c in cfg.run_name for c in "/\\\0"):
        raise ConfigError(f"--run_name {cfg.run_name!r}: give a plain folder name (no path separators, not . or ..)")
    if cfg.overwrite and cfg.ckpt.load_enable:
        raise ConfigError("--overwrite deletes the earlier run's records and --ckpt.load_enable continues them: pass "
                          "one of the two")


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


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def _validate_settings(cfg: Config) -> None:
    """Each setting on its own: its choices (argparse checks them for flags; a Config built in code too), a float's
    finiteness, and its range, each bad setting a line. None (an optional setting left out) passes."""
    refuse_together(*(functools.partial(_validate_setting, flag, value_at(cfg, name), f)
                      for flag, (name, f) in settings().items()))


def _validate_setting(flag: str, value, f) -> None:
    choices, rng = f.metadata["choices"], f.metadata["range"]
    if value is None:
        return
    values = value if isinstance(value, tuple) else (value,)
    if choices and value not in choices:
        *others, last = [str(c) for c in choices if c != ""]
        raise ConfigError(f"--{flag} {value!r}: use {', '.join(others)} or {last}")
    if not all(math.isfinite(v) for v in values if isinstance(v, float)) and f.default != math.inf:
        raise ConfigError(f"--{flag} {_shown(value)}: must be a finite number")
    if rng in PAIR and not PAIR[rng][0](*values):
        raise ConfigError(f"--{flag} {_shown(value)}: {PAIR[rng][1]}")
    if rng in EACH and not all(EACH[rng][0](v) for v in values):
        raise ConfigError(f"--{flag} {_shown(value)}: {'each ' if len(values) > 1 else ''}{EACH[rng][1]}")
    low, high = _bounds(f)
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if f.default != math.inf and any(v > high for v in numbers):
        unit = " seconds (a week)" if high == WEEK_S and rng == "> 0 s" else ""
        raise ConfigError(f"--{flag} {_shown(value)}: must be at most {_number(high)}{unit}{f.metadata['beyond']}")
    if any(v < low for v in numbers):
        raise ConfigError(f"--{flag} {_shown(value)}: must be at least {_number(low)}")


def _number(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds(f) -> tuple:
    """(lowest, highest) number a setting takes: its `most`, or WEEK_S for a timeout, else INT_LIMIT or
    FLOAT_LIMIT by the value's type, either way round zero."""
    most = f.metadata["most"]
    if most is None:
        most = WEEK_S if f.metadata["range"] == "> 0 s" else INT_LIMIT if value_type(f) is int else FLOAT_LIMIT
    limit = INT_LIMIT if value_type(f) is int else FLOAT_LIMIT
    return -limit, most


def _validate_openrlhf_support(cfg: Config) -> None:
    """OpenRLHF flags this system does not build: a value other than the default is refused (it would change what is
    trained) or noticed (it only tunes speed or memory)."""
    for flag, (name, f) in settings().items():
        kind, why = support(f)
        value = value_at(cfg, name)
        if kind not in ("refused", "no effect") or value == f.default:
            continue
        if kind == "refused":
            raise ConfigError(f"--{flag} {_shown(value)}: not supported here: {why}")
        notice(f"--{flag} {_shown(value)} has no effect here: {why}")


# OpenRLHF flags accepted with another meaning here: each given one is noticed at start, with the difference.
NOTICED_WHEN_GIVEN = ("train.partial_rollout_enable", "rollout.vllm_generate_batch_size")


def openrlhf_differences(cfg: Config) -> list:
    """The notices a run of these flags gets once they are all checked: each OpenRLHF flag given whose meaning
    differs here, and each left out that OpenRLHF would need but this project fills in by itself (a model, a
    dataset, a reward)."""
    table, out = settings(), []
    for flag in NOTICED_WHEN_GIVEN:
        name, f = table[flag]
        value = value_at(cfg, name)
        if value != f.default:
            out.append(f"--{flag}{'' if value is True else ' ' + _shown(value)} differs from OpenRLHF's: "
                       f"{support(f)[1]}")
    if not cfg.actor.model_name_or_path:
        out.append("no --actor.model_name_or_path: the embedded tiny model is trained (OpenRLHF requires a model)")
    if not (cfg.data.prompt_dataset or cfg.data.reasoning_gym or cfg.agent.verifiers_env):
        out.append(f"no --data.prompt_dataset: the prompts are the built-in task {cfg.data.builtin_task} "
                   "(OpenRLHF requires a dataset)")
    if not (cfg.agent.func_path or cfg.agent.verifiers_env or cfg.reward.remote_url or cfg.reward.model_name_or_path
            or cfg.data.reasoning_gym):
        out.append("no --train.agent_func_path, --reward.remote_url or --reward.model_name_or_path: answers are "
                   "scored by math-verify against the label (OpenRLHF requires a reward)")
    return out


def _validate_mode(cfg: Config) -> None:
    """--mode and OpenRLHF's --train.async_enable / --train.partial_rollout_enable describe the same choice."""
    t = cfg.train
    if cfg.mode is None:
        if t.partial_rollout_enable and not t.async_enable:
            raise ConfigError("--train.partial_rollout_enable needs --train.async_enable (or --mode fully_async)")
        cfg.mode = "fully_async" if t.partial_rollout_enable else "async" if t.async_enable else "sync"
    elif cfg.mode == "sync" and (t.async_enable or t.partial_rollout_enable):
        raise ConfigError("--mode sync contradicts --train.async_enable / --train.partial_rollout_enable: drop one")
    elif cfg.mode == "async" and t.partial_rollout_enable:
        raise ConfigError("--train.partial_rollout_enable needs --mode fully_async (streaming groups continued "
                          "across weight syncs), not --mode async")
    t.async_enable = cfg.mode != "sync"
    if t.dynamic_batch_enable:  # as OpenRLHF: token budgets pack their samples, and the log-prob passes share one
        if not cfg.ds.packing_samples:
            notice("--train.dynamic_batch_enable turns on --ds.packing_samples, as in OpenRLHF")
            cfg.ds.packing_samples = True
        if cfg.rollout.max_tokens_per_gpu is None:
            cfg.rollout.max_tokens_per_gpu = t.max_tokens_per_gpu


def _validate_queue(cfg: Config) -> None:
    if cfg.queue_size < 1:
        raise ConfigError(f"--train.async_queue_size {cfg.queue_size} (or OPENRLHF_ASYNC_QUEUE_SIZE): must be at "
                          "least 1")
    if cfg.queue_size != 1 and cfg.mode != "async":
        notice(f"--train.async_queue_size {cfg.queue_size} has no effect in --mode {cfg.mode} (it bounds --mode "
               "async; fully_async is bounded by --train.staleness_threshold)")


def _validate_layout(cfg: Config) -> None:
    """The hybrid engine's layout (OpenRLHF's colocate_all_models in sync mode): an engine's workers on each trainer
    device, and the sleep flags only where an engine shares the trainer's devices."""
    v, ds, world = cfg.vllm, cfg.ds, cfg.actor.world_size
    if cfg.device == "cuda" and v.sync_backend == "gloo":
        if not cfg.hybrid:  # vLLM's gloo group is registered for host tensors only (distributed/utils.py)
            raise ConfigError("--vllm.sync_backend gloo with --device cuda: the weight-sync group's gloo carries host "
                              "tensors only, and the engines take the weights on their GPUs; use --vllm.sync_backend "
                              "nccl (the default)")
        notice("--vllm.sync_backend gloo has no effect with --train.colocate_all on cuda: each engine takes the "
               "weights from the trainer rank on its GPU by CUDA IPC")
    if cfg.mode != "sync":
        if v.enable_sleep:
            raise ConfigError(f"--vllm.enable_sleep with --mode {cfg.mode}: the asynchronous modes keep the engines on "
                              "devices of their own (they generate while the policy trains), as OpenRLHF requires; "
                              "drop --vllm.enable_sleep, or drop --train.async_enable for the hybrid engine")
        if ds.enable_sleep:
            notice("--ds.enable_sleep has no effect in the async modes: no engine shares the trainer's devices")
        return
    if not cfg.hybrid:
        sleeping = [f for f, on in (("--vllm.enable_sleep", v.enable_sleep), ("--ds.enable_sleep", ds.enable_sleep))
                    if on]
        if sleeping:
            notice(f"{' and '.join(sleeping)} has no effect without --train.colocate_all: the engines have devices of "
                   "their own")
        return
    engine_devices = cfg.num_engines * v.tensor_parallel_size
    if engine_devices != world:
        raise ConfigError(f"--train.colocate_all: --vllm.num_engines {cfg.num_engines} x --vllm.tensor_parallel_size "
                          f"{v.tensor_parallel_size} ({engine_devices}) must equal --actor.num_nodes "
                          f"{cfg.actor.num_nodes} x --actor.num_gpus_per_node {cfg.actor.num_gpus_per_node} ({world}), "
                          "as in OpenRLHF: each engine's workers share the trainer's devices; change "
                          "--vllm.num_engines, or drop --train.colocate_all")
    if ds.enable_sleep and ds.zero_stage == 0:
        raise ConfigError("--ds.enable_sleep with --ds.zero_stage 0: DeepSpeed offloads the states of a ZeRO "
                          "optimizer only; use --ds.zero_stage 1, 2 or 3, or drop --ds.enable_sleep")
    if ds.enable_sleep and ds.adam_offload:
        notice("--ds.enable_sleep has no effect with --ds.adam_offload: the optimizer states live in CPU memory "
               "already")
    if v.max_num_engines is not None and v.max_num_engines > cfg.num_engines:
        raise ConfigError(f"--vllm.max_num_engines {v.max_num_engines} with --train.colocate_all: the hybrid engines "
                          "are tied to the trainer's devices and cannot grow; drop --vllm.max_num_engines")


def _validate_rollout(cfg: Config) -> None:
    r = cfg.rollout
    if not cfg.data.apply_chat_template and cfg.agent.observation_turn != "raw":
        if cfg.agent.observation_turn != "user":  # the default reads "user turns where there is a chat template"
            notice(f"--agent.observation_turn {cfg.agent.observation_turn} has no effect without "
                   "--data.apply_chat_template: observations are appended raw")
        cfg.agent.observation_turn = "raw"
    if r.admission_margin and r.early_stop and cfg.mode == "fully_async":
        notice(f"--rollout.admission_margin {r.admission_margin} has no effect in --mode fully_async: running groups "
               "carry over into the next batch, so all --rollout.vllm_generate_batch_size groups stay in flight")
    if r.stop and not all(r.stop):
        raise ConfigError(f"--rollout.stop {' '.join(map(repr, r.stop))}: an empty string would end every turn at "
                          "once; give non-empty strings")
    screen, n = r.screen_samples, r.n_samples_per_prompt
    if screen and not 2 <= screen < n:
        raise ConfigError(f"--rollout.screen_samples {screen}: use 0 (off) or a number from 2 to "
                          f"--rollout.n_samples_per_prompt - 1 ({n - 1}); one sample cannot show a flat group")
    if screen and not cfg.algo.dynamic_filtering_enable:
        raise ConfigError(f"--rollout.screen_samples {screen} drops groups that would be flat, which only makes "
                          f"sense with dynamic sampling: add --algo.dynamic_filtering_enable or drop the screening")
    if screen and cfg.algo.dynamic_filtering_on_starved == "fill":
        raise ConfigError(f"--algo.dynamic_filtering_on_starved fill fills a starved batch with whole flat groups, "
                          f"but --rollout.screen_samples {screen} stops them after {screen} samples: use partial or "
                          f"stop, or drop the screening")
    if r.max_new_tokens and r.max_new_tokens >= cfg.data.max_len:
        raise ConfigError(f"--rollout.max_new_tokens {r.max_new_tokens} must be below --data.max_len "
                          f"{cfg.data.max_len}")
    buffer = cfg.reward.overlong_buffer_len
    if buffer and buffer >= (r.max_new_tokens or cfg.data.max_len):
        raise ConfigError(f"--reward.overlong_buffer_len {buffer:g} must be below the response budget "
                          f"({r.max_new_tokens or cfg.data.max_len} tokens)")
    if cfg.num_engines < 1:
        raise ConfigError(f"--vllm.num_engines {cfg.vllm.num_engines}: give at least 1 (generation always runs on "
                          "vLLM engines here)")
    if cfg.vllm.max_num_engines is not None and cfg.vllm.max_num_engines < cfg.num_engines:
        raise ConfigError(f"--vllm.max_num_engines {cfg.vllm.max_num_engines} is below --vllm.num_engines "
                          f"{cfg.num_engines}: give at least as many, or leave it out for no growth")
    t = cfg.train
    per_step = r.batch_size * n * (t.require_batches if cfg.mode == "fully_async" else 1)
    if t.batch_size > per_step:
        raise ConfigError(f"--train.batch_size {t.batch_size}: a mini batch cannot hold more than the rollout batch's "
                          f"{per_step} samples (--rollout.batch_size x --rollout.n_samples_per_prompt)")


_GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")


def _validate_colocation(cfg: Config) -> None:
    """Colocated models share bundles one to one, as OpenRLHF requires: the same ranks (nodes x GPUs per node)."""
    place, c, r = cfg.placement, cfg.critic, cfg.reward
    hosts = {"policy": ("--actor", cfg.actor.num_nodes, cfg.actor.num_gpus_per_node),
             "critic": ("--critic", c.num_nodes, c.num_gpus_per_node)}
    for role, flag, nodes, gpus in (("critic", "--critic", c.num_nodes, c.num_gpus_per_node),
                                    ("rewards", "--reward", r.num_nodes, r.num_gpus_per_node)):
        if place[role] in hosts:
            host, host_nodes, host_gpus = hosts[place[role]]
            if (nodes, gpus) != (host_nodes, host_gpus):
                colocating = "--train.colocate_all" if place[role] == "policy" else "--train.colocate_critic_reward"
                raise ConfigError(f"{colocating} puts {flag}'s models on {host}'s devices, one to one: "
                                  f"{flag}.num_nodes {nodes} x {flag}.num_gpus_per_node {gpus} must equal "
                                  f"{host}.num_nodes {host_nodes} x {host}.num_gpus_per_node {host_gpus}; make them "
                                  f"equal or drop {colocating}")
    models = len([p for p in (r.model_name_or_path or "").split(",") if p.strip()])
    host = place["rewards"]
    if cfg.device == "cuda" and host in hosts:  # each model on a shared GPU asks Ray for HYBRID_GPU_SHARE of it
        count = 1 + models + (host == "policy") * (cfg.hybrid + (place["critic"] == "policy"))
        if count * HYBRID_GPU_SHARE > 1 + 1e-9:
            raise ConfigError(f"--reward.model_name_or_path: {models} reward models on the {host}'s GPUs make {count} "
                              f"models of {HYBRID_GPU_SHARE} GPU each on one GPU, which Ray would wait for for ever; "
                              f"score with at most {models - count + round(1 / HYBRID_GPU_SHARE)} there, or drop the "
                              "colocation flag")
    if cfg.train.colocate_critic_reward and not cfg.train.colocate_all and not (place["critic"] and place["rewards"]):
        notice("--train.colocate_critic_reward has no effect without both a critic (--algo.advantage.estimator gae) "
               "and a reward model (--reward.model_name_or_path)")


def _validate_algo(cfg: Config) -> None:
    a, n = cfg.algo, cfg.rollout.n_samples_per_prompt
    if a.advantage_estimator != "gae":
        changed = [f.name for f in dataclasses.fields(CriticConfig)
                   if getattr(cfg.critic, f.name) != CriticConfig.__dataclass_fields__[f.name].default]
        if changed:
            flags = ", ".join("--critic." + name.replace("adam_", "adam.").replace("muon_", "muon.") for name in changed)
            notice(f"{flags} {'has' if len(changed) == 1 else 'have'} no effect without --algo.advantage.estimator gae "
                   f"(no critic is trained with {a.advantage_estimator})")
    if a.advantage_estimator in _GROUP_ESTIMATORS and n < 2:
        raise ConfigError(f"--algo.advantage.estimator {a.advantage_estimator} compares a prompt's samples with each "
                          f"other: --rollout.n_samples_per_prompt must be at least 2 (got {n})")
    if a.dynamic_filtering_enable and n < 2:
        raise ConfigError("--algo.dynamic_filtering_enable needs --rollout.n_samples_per_prompt of at least 2")
    if a.dynamic_filtering_rule == "std" and a.dynamic_filtering_range != (0.0, 1.0):
        raise ConfigError("--algo.dynamic_filtering_range is read by the mean_range rule only: drop it, or use "
                          "--algo.dynamic_filtering_rule mean_range")
    if a.advantage_gamma != 1.0 and a.advantage_estimator != "gae":
        if a.advantage_estimator == "reinforce":
            raise ConfigError(f"--algo.advantage.gamma {a.advantage_gamma}: only 1 is supported (a discount over "
                              "response tokens is not built)")
        notice(f"--algo.advantage.gamma {a.advantage_gamma} is set to 1 for {a.advantage_estimator}, as OpenRLHF "
               "does")
        a.advantage_gamma = 1.0
    if a.kl_init_coef > 0 and not a.kl_use_loss and a.advantage_estimator in ("reinforce", "reinforce_baseline"):
        raise ConfigError(f"--algo.kl.init_coef {a.kl_init_coef} without --algo.kl.use_loss puts the KL in the reward, "
                          f"which {a.advantage_estimator} whitens over the batch's tokens: not built yet; add "
                          "--algo.kl.use_loss, set --algo.kl.init_coef 0, or use group_norm / rloo / dr_grpo")
    # clip is TIS, min(w, HIGH): a weight below 1 is left as it is unless the user gives a floor (LOW HIGH)
    threshold = tuple(a.is_correction_threshold or ((5.0,) if a.is_correction_mode == "clip" else (0.5, 5.0)))
    if len(threshold) == 1:  # HIGH alone: an upper bound
        threshold = (0.0, threshold[0])
    if len(threshold) != 2 or threshold[0] > threshold[1]:
        raise ConfigError(f"--algo.advantage.is_correction_threshold {_shown(a.is_correction_threshold)}: give HIGH "
                          "or LOW HIGH with LOW <= HIGH")
    a.is_correction_threshold = threshold
    if a.is_correction_mode == "clip" and (a.is_correction_level == "seq" or a.is_correction_gating != "ratio"):
        raise ConfigError("--algo.advantage.is_correction_mode clip clamps the token ratio: it needs "
                          "--algo.advantage.is_correction_level token and --algo.advantage.is_correction_gating ratio")
    if a.is_correction_gating != "ratio" and a.is_correction_level != "off" and threshold[0] > 0:
        raise ConfigError(f"--algo.advantage.is_correction_gating {a.is_correction_gating} is bounded from above "
                          "only: give --algo.advantage.is_correction_threshold HIGH")
    low_high = cfg.actor.eps_clip_low_high
    if low_high and cfg.actor.eps_clip != 0.2:
        raise ConfigError(f"--actor.eps_clip {cfg.actor.eps_clip} is overridden by --actor.eps_clip_low_high "
                          f"{_shown(low_high)} (the preset's?): give only --actor.eps_clip_low_high LOW HIGH")
    if cfg.actor.optim != "adam":
        raise ConfigError(f"--actor.optim {cfg.actor.optim}: not supported here: only adam is built")
    if cfg.actor.dual_clip is not None and cfg.actor.policy_loss_type == "gspo":
        notice("--actor.dual_clip applies to the ppo loss's negative advantages and also to gspo here")


def _validate_model(cfg: Config) -> None:
    # Whether the GPUs exist is checked against the Ray cluster at start (a job's driver may run on a CPU-only head).
    model = cfg.actor.model_name_or_path
    if model in EMBEDDED_MODELS and not os.path.exists(model):  # a shipped model by name: its folder (the start
        cfg.actor.model_name_or_path = model = os.path.join(EMBEDDED_DIR, model)  # checks its digest: local_model)
    if model and not os.path.isdir(model) and not is_hub_id(model) and not (is_gguf(model) and os.path.isfile(model)):
        raise ConfigError(f"--actor.model_name_or_path {model}: no such model folder or .gguf file (give a local HF "
                          "model folder, a .gguf file, a Hugging Face id such as Qwen/Qwen3-8B-Base, nothing for "
                          f"the embedded tiny model, or {' '.join(EMBEDDED_MODELS)})")
    for flag, value in (("--critic.model_name_or_path", cfg.critic.model_name_or_path),
                        ("--reward.model_name_or_path", cfg.reward.model_name_or_path)):
        for path in [p.strip() for p in (value or "").split(",") if p.strip()]:
            if os.path.isdir(path):
                read_model_config(flag, path)  # a folder must hold a model: its config.json is read
            elif is_hub_id(path):
                hub_model_positions(path, flag)
            else:
                raise ConfigError(f"{flag} {path}: no such model folder (give a local folder of a causal LM or of a "
                                  "critic / reward model in OpenRLHF's format, or a Hugging Face id)")
    positions = model_positions(model)
    if isinstance(positions, int) and cfg.data.max_len > positions:
        notice(f"--data.max_len {cfg.data.max_len} is above the model's max_position_embeddings ({positions}): "
               f"sequences are capped at {positions} tokens")
        cfg.data.max_len = positions
    if cfg.device == "cpu" and cfg.ds.param_dtype == "fp16":
        raise ConfigError("--ds.param_dtype fp16 does not train on cpu; use bf16 or fp32")
    experts = model_experts(model)
    if experts and model_config_type(model) not in MOE_TYPES:
        raise ConfigError(f"--actor.model_name_or_path {model}: a mixture of experts of type "
                          f"{model_config_type(model)}, whose experts' weights this project does not map to vLLM's "
                          f"names; the types built: {', '.join(MOE_TYPES)}")
    if cfg.actor.routing_replay and experts and cfg.ds.ring_attn_size > 1:
        raise ConfigError(f"--ds.ring_attn_size {cfg.ds.ring_attn_size} with --actor.routing_replay: {model} is a "
                          "mixture of experts, whose rollout routes are not split across a sequence-parallel group "
                          "here (they would go unreplayed); add --no-actor.routing_replay to train on the trainer's "
                          "own routing, or drop --ds.ring_attn_size")
    if cfg.actor.routing_replay and not cfg.vllm.enforce_eager and experts:
        cfg.vllm.enforce_eager = True
        notice(f"--actor.routing_replay turns on --vllm.enforce_eager: {model} is a mixture of experts, whose routes "
               "the engines record through a hook on each router that compiled graphs (CUDA graphs, torch.compile) "
               "run without; --no-actor.routing_replay keeps them, training on the trainer's own routing")
    if cfg.ds.ring_attn_size > 1 and model and os.path.isdir(model):
        config = read_model_config("--actor.model_name_or_path", model)
        windowed = ("sliding_attention" in (config.get("layer_types") or []) or config.get("use_sliding_window")
                    or (config.get("sliding_window") and "use_sliding_window" not in config))
        if windowed:
            raise ConfigError(f"--ds.ring_attn_size {cfg.ds.ring_attn_size}: {model} has sliding-window attention, "
                              "which sequence parallelism does not build here; drop --ds.ring_attn_size")


def _validate_lora(cfg: Config) -> None:
    """LoRA (peft) on the trainer, with OpenRLHF's flags (QLoRA, --ds.load_in_4bit, is refused with the others)."""
    d = cfg.ds
    if list(d.lora_target_modules or []) in (["all-linear"], []):
        d.lora_target_modules = "all-linear"  # peft's shorthand, a string (a list would name a module all-linear)
    if not d.lora_rank:
        if d.lora_save_merged:
            notice("--ds.lora.save_merged has no effect without --ds.lora.rank")
        return
    experts = model_experts(cfg.actor.model_name_or_path)
    if experts:
        raise ConfigError(f"--ds.lora.rank {d.lora_rank}: {cfg.actor.model_name_or_path or 'the model'} is a mixture of "
                          f"experts ({experts} per layer), whose experts transformers holds as fused tensors, not "
                          "linear layers: an adapter would train the attention alone; drop --ds.lora.rank to train "
                          "every weight")
    heads = {"lm_head", "embed_tokens"} & set([d.lora_target_modules] if isinstance(d.lora_target_modules, str)
                                              else d.lora_target_modules)
    if heads:
        raise ConfigError(f"--ds.lora.target_modules {' '.join(sorted(heads))}: an adapter on the embeddings or the "
                          "output head would untie them from each other where the model ties them; target the "
                          "decoder's linear layers (all-linear)")
    if d.lora_target_modules != "all-linear":  # as peft matches them: a layer's dotted name or its ending
        from openrlhf_async.utils.model_info import linear_layers

        layers = linear_layers(cfg.actor.model_name_or_path)
        unknown = [t for t in d.lora_target_modules
                   if layers is not None and not any(n == t or n.endswith("." + t) for n in layers)]
        if unknown:
            names = sorted({n.rsplit(".", 1)[-1] for n in layers} - {"lm_head"})
            raise ConfigError(f"--ds.lora.target_modules {' '.join(unknown)}: the model has no such linear layer "
                              f"(its linear layers: {', '.join(names)}); name some of them, or use all-linear")
    if cfg.ref.offload and cfg.algo.kl_init_coef > 0:
        notice("--ref.offload has no effect with --ds.lora.rank: the reference model is the policy with its adapter "
               "disabled (no second copy)")


def _validate_deepspeed(cfg: Config) -> None:
    """The offloads against the ZeRO stage. On cpu they run as on cuda (DeepSpeed's CPU Adam, ZeRO-3 partitions in
    host memory), so the CPU runs go through the same DeepSpeed code as the GPU runs."""
    stage = cfg.ds.zero_stage
    if cfg.ds.adam_offload and stage == 0:
        raise ConfigError("--ds.adam_offload needs --ds.zero_stage 1, 2 or 3: ZeRO-Offload moves the ZeRO optimizer's "
                          "state, and stage 0 has no ZeRO optimizer")
    n = cfg.ds.ring_attn_size
    if n > 1:
        ranks = [("--actor", cfg.actor)] + ([("--critic", cfg.critic)] if cfg.algo.advantage_estimator == "gae" else [])
        for flag, role in ranks:
            if role.world_size % n:
                raise ConfigError(f"--ds.ring_attn_size {n} must divide the {flag[2:]}'s ranks ({flag}.num_nodes "
                                  f"{role.num_nodes} x {flag}.num_gpus_per_node {role.num_gpus_per_node} = "
                                  f"{role.world_size}): each group of {n} ranks shares a packed row")
        if not cfg.ds.packing_samples:
            notice(f"--ds.ring_attn_size {n} turns on --ds.packing_samples: a packed row is what its ranks share "
                   "(OpenRLHF refuses ring attention without it)")
            cfg.ds.packing_samples = True
    if cfg.ref.offload and cfg.algo.kl_init_coef == 0:
        notice("--ref.offload has no effect with --algo.kl.init_coef 0: no reference model is loaded")
    elif cfg.ref.offload and stage != 3:
        notice(f"--ref.offload has no effect with --ds.zero_stage {stage}: only ZeRO-3 partitions the reference "
               "model's parameters, and only partitions are offloaded (as in OpenRLHF)")


def _validate_reward_and_eval(cfg: Config) -> None:
    r, e = cfg.reward, cfg.eval
    remote = r.remote_url or ""
    for url in filter(None, (u.strip() for u in remote.split(","))):
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
    if "," in remote and ".py" in remote:
        raise ConfigError(f"--reward.remote_url {remote}: a reward_func .py file cannot be mixed with URLs")
    if e.temperature == 0 and e.n_samples_per_prompt > 1:
        raise ConfigError(f"--eval.n_samples_per_prompt {e.n_samples_per_prompt} with --eval.temperature 0 draws "
                          "the same greedy answer k times; set --eval.temperature (e.g. 0.6) or k = 1")
    if e.max_new_tokens >= cfg.data.max_len:
        raise ConfigError(f"--eval.max_new_tokens {e.max_new_tokens} must be below --data.max_len {cfg.data.max_len}")


def _validate_pipeline(cfg: Config) -> None:
    t = cfg.train
    if t.max_staleness < -1:
        raise ConfigError(f"--train.max_staleness {t.max_staleness}: must be 0 or more (-1: the mode's bound)")
    if cfg.mode != "fully_async":
        used = [f for f, on in (("--train.trigger_parameter_sync_step", t.trigger_parameter_sync_step != 1),
                                ("--train.require_batches", t.require_batches != 1)) if on]
        if used:
            raise ConfigError(f"{', '.join(used)} only apply to --mode fully_async (got --mode {cfg.mode})")
    if cfg.mode == "sync" and t.max_staleness > 0:
        raise ConfigError(f"--train.max_staleness {t.max_staleness} contradicts --mode sync, which trains on fresh "
                          "samples only; use --mode async or fully_async")
    if cfg.mode == "async" and 0 <= t.max_staleness < cfg.queue_size:
        raise ConfigError(f"--train.max_staleness {t.max_staleness} is below --train.async_queue_size "
                          f"{cfg.queue_size}: batches the queue holds would be too stale; raise one or lower the other")
    if cfg.mode != "sync" and cfg.algo.is_correction_level == "off" and cfg.actor.proximal_policy == "recompute":
        notice(f"--mode {cfg.mode} trains samples of older weights as if fresh: with --algo.advantage."
               "is_correction_level off and --actor.proximal_policy recompute their PPO ratio is 1; "
               "--algo.advantage.is_correction_level token weights each token by pi / pi_rollout (the presets do)")
    c = cfg.ckpt
    if c.save_steps > 0 and c.save_steps % t.trigger_parameter_sync_step:
        raise ConfigError(f"--ckpt.save_steps {c.save_steps} must be a multiple of --train.trigger_parameter_sync_step "
                          f"{t.trigger_parameter_sync_step}: a checkpoint is taken when the engines hold its weights")
    if c.disable_ds and c.save_steps > 0 and not c.save_hf:
        notice("--ckpt.disable_ds saves no DeepSpeed state, and without --ckpt.save_hf the checkpoints hold only the "
               "data position: add --ckpt.save_hf to keep the weights")


def _validate_logger(cfg: Config) -> None:
    lg = cfg.logger
    if not lg.wandb_enabled:
        return
    if not lg.wandb_project:
        raise ConfigError("--logger.wandb.project is empty: give a W&B project name")
    mode = resolve_wandb_mode(lg.wandb_mode)
    if lg.wandb_key and not lg.wandb_mode and "WANDB_MODE" not in os.environ:
        mode = "online"
    if mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"WANDB_MODE={mode!r} (the default of --logger.wandb_mode): use online, offline or disabled")
    if mode == "online" and not (lg.wandb_key or wandb_api_key_available()):
        raise ConfigError("--logger.wandb_mode online needs a W&B API key (--logger.wandb.key, WANDB_API_KEY or "
                          "`wandb login`); or use --logger.wandb_mode offline and `wandb sync` later")
    lg.wandb_mode = mode  # resolved once here, so the printed config says what the run will do


def local_cpu_run(cfg: Config) -> bool:
    """On cpu, a run that starts its own Ray (no RAY_ADDRESS, none running in this process): all on this machine."""
    ray = sys.modules.get("ray")
    return cfg.device == "cpu" and not os.environ.get("RAY_ADDRESS") and not (ray is not None and
                                                                              ray.is_initialized())


def check_local_cores(cfg: Config) -> None:
    """On cpu, a run that starts its own Ray (no RAY_ADDRESS, none running in this process) has this machine's cores:
    each trainer rank is a busy process and needs one (64 ranks on 2 cores never finish a step), and the engines take
    --vllm.cpus_per_engine each. A cluster's room is Ray's to give (cuda: check_cluster at start). Each role too
    large is one line of the one ConfigError."""
    if not local_cpu_run(cfg):
        return
    cores, a, c, r, refusals = os.cpu_count() or 1, cfg.actor, cfg.critic, cfg.reward, []
    if a.world_size > cores:
        refusals.append(f"--actor.num_nodes {a.num_nodes} x --actor.num_gpus_per_node {a.num_gpus_per_node}: "
                        f"{a.world_size} trainer ranks on cpu need a core each and this machine has {cores}; lower "
                        "--actor.num_gpus_per_node, or run on a Ray cluster (RAY_ADDRESS)")
    if cfg.algo.advantage_estimator == "gae" and c.world_size > cores:  # it trains between the policy's steps
        refusals.append(f"--critic.num_nodes {c.num_nodes} x --critic.num_gpus_per_node {c.num_gpus_per_node}: "
                        f"{c.world_size} critic ranks on cpu need a core each and this machine has {cores}; lower "
                        "--critic.num_gpus_per_node, or run on a Ray cluster (RAY_ADDRESS)")
    if r.model_name_or_path and r.num_nodes * r.num_gpus_per_node > cores:
        refusals.append(f"--reward.num_nodes {r.num_nodes} x --reward.num_gpus_per_node {r.num_gpus_per_node}: "
                        f"{r.num_nodes * r.num_gpus_per_node} reward-model actors per model on cpu need a core each "
                        f"and this machine has {cores}; lower --reward.num_gpus_per_node, or run on a Ray cluster "
                        "(RAY_ADDRESS)")
    engine_cores = cfg.num_engines * cfg.vllm.cpus_per_engine
    if engine_cores > cores:
        refusals.append(f"--vllm.num_engines {cfg.num_engines} x --vllm.cpus_per_engine "
                        f"{cfg.vllm.cpus_per_engine:g}: {engine_cores:g} cores and this machine has {cores}; lower "
                        "them, or run on a Ray cluster (RAY_ADDRESS)")
    if refusals:
        raise ConfigError("\n".join(refusals))
