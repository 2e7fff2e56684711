"""Older OpenRLHF command lines: the flat spellings before 0.10.2 (and 0.11.0's correction flags) translated to
today's flags, each with one notice. OpenRLHF 0.11 itself refuses them."""

from openrlhf_async.errors import ConfigError, notice

# Renamed flags, old spelling -> today's (OpenRLHF 0.10.1 and 0.8.x).
RENAMED = {
    "ref_num_nodes": "ref.num_nodes", "ref_num_gpus_per_node": "ref.num_gpus_per_node",
    "reward_num_nodes": "reward.num_nodes", "reward_num_gpus_per_node": "reward.num_gpus_per_node",
    "actor_num_nodes": "actor.num_nodes", "actor_num_gpus_per_node": "actor.num_gpus_per_node",
    "critic_num_nodes": "critic.num_nodes", "critic_num_gpus_per_node": "critic.num_gpus_per_node",
    "colocate_actor_ref": "train.colocate_actor_ref", "colocate_critic_reward": "train.colocate_critic_reward",
    "colocate_all_models": "train.colocate_all", "vllm_num_engines": "vllm.num_engines",
    "vllm_tensor_parallel_size": "vllm.tensor_parallel_size", "vllm_sync_backend": "vllm.sync_backend",
    "vllm_sync_with_ray": "vllm.sync_with_ray", "enable_prefix_caching": "vllm.enable_prefix_caching",
    "enforce_eager": "vllm.enforce_eager", "vllm_enable_sleep": "vllm.enable_sleep",
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization", "async_train": "train.async_enable",
    "async_queue_size": "train.async_queue_size", "partial_rollout": "train.partial_rollout_enable",
    "eval_steps": "eval.steps", "save_steps": "ckpt.save_steps", "logging_steps": "logger.logging_steps",
    "ckpt_path": "ckpt.path", "save_hf_ckpt": "ckpt.save_hf", "disable_ds_ckpt": "ckpt.disable_ds",
    "max_ckpt_num": "ckpt.max_num", "max_ckpt_mem": "ckpt.max_mem", "load_checkpoint": "ckpt.load_enable",
    "best_metric_key": "ckpt.best_metric_key", "use_ds_universal_ckpt": "ds.use_universal_ckpt",
    "zero_stage": "ds.zero_stage", "gradient_checkpointing": "actor.gradient_checkpointing_enable",
    "deepcompile": "ds.deepcompile", "param_dtype": "ds.param_dtype", "enable_ema": "train.enable_ema",
    "ema_beta": "train.ema_beta", "zpg": "ds.zpg", "adam_offload": "ds.adam_offload",
    "attn_implementation": "ds.attn_implementation", "use_liger_kernel": "ds.use_liger_kernel",
    "grad_accum_dtype": "ds.grad_accum_dtype", "overlap_comm": "ds.overlap_comm",
    "gradient_checkpointing_use_reentrant": "actor.gradient_checkpointing_reentrant",
    "disable_fast_tokenizer": "data.disable_fast_tokenizer", "dataloader_num_workers": "data.dataloader_num_workers",
    "deepspeed_enable_sleep": "ds.enable_sleep", "ds_tensor_parallel_size": "ds.tensor_parallel_size",
    "packing_samples": "ds.packing_samples", "use_dynamic_batch": "train.dynamic_batch_enable",
    "rollout_max_tokens_per_gpu": "rollout.max_tokens_per_gpu", "train_max_tokens_per_gpu": "train.max_tokens_per_gpu",
    "load_in_4bit": "ds.load_in_4bit", "lora_rank": "ds.lora.rank", "lora_alpha": "ds.lora.alpha",
    "target_modules": "ds.lora.target_modules", "lora_dropout": "ds.lora.dropout", "save_path": "ckpt.output_dir",
    "num_episodes": "train.num_episodes", "rollout_batch_size": "rollout.batch_size",
    "vllm_generate_batch_size": "rollout.vllm_generate_batch_size", "micro_rollout_batch_size": "rollout.micro_batch_size",
    "max_epochs": "train.max_epochs", "max_len": "data.max_len", "max_new_tokens": "rollout.max_new_tokens",
    "max_samples": "data.max_samples", "max_norm": "actor.max_norm", "l2": "actor.adam.weight_decay",
    "eps_clip": "actor.eps_clip", "eps_clip_low_high": "actor.eps_clip_low_high", "dual_clip": "actor.dual_clip",
    "value_clip": "critic.value_clip", "lambd": "algo.advantage.lambd", "gamma": "algo.advantage.gamma",
    "micro_train_batch_size": "train.micro_batch_size", "train_batch_size": "train.batch_size",
    "normalize_reward": "reward.normalize_enable", "top_p": "rollout.top_p", "temperature": "rollout.temperature",
    "seed": "train.seed", "full_determinism": "train.full_determinism_enable",
    "freezing_actor_steps": "critic.freezing_steps", "n_samples_per_prompt": "rollout.n_samples_per_prompt",
    "save_value_network": "critic.save_value_network", "actor_learning_rate": "actor.adam.lr",
    "critic_learning_rate": "critic.adam.lr", "lr_warmup_ratio": "actor.lr_warmup_ratio",
    "lr_scheduler": "actor.lr_scheduler", "kl_target": "algo.kl.target", "kl_horizon": "algo.kl.horizon",
    "init_kl_coef": "algo.kl.init_coef", "policy_loss_type": "actor.policy_loss_type",
    "kl_estimator": "algo.kl.estimator", "aux_loss_coef": "actor.aux_loss_coef",
    "entropy_loss_coef": "actor.entropy_coef", "adam_betas": "actor.adam.betas",
    "reward_clip_range": "reward.clip_range", "advantage_estimator": "algo.advantage.estimator",
    "use_kl_loss": "algo.kl.use_loss", "no_advantage_std_norm": "algo.advantage.no_std_norm",
    "overlong_buffer_len": "reward.overlong_buffer_len", "overlong_penalty_factor": "reward.overlong_penalty_factor",
    "stop_properly_penalty_coef": "reward.stop_properly_penalty_coef", "ring_attn_size": "ds.ring_attn_size",
    "ring_head_stride": "ds.ring_attn_head_stride", "pretrain": "actor.model_name_or_path",
    "reward_pretrain": "reward.model_name_or_path", "remote_rm_url": "reward.remote_url",
    "critic_pretrain": "critic.model_name_or_path", "value_head_prefix": "ds.value_head_prefix",
    "ref_reward_offload": "ref.offload", "agent_func_path": "train.agent_func_path",
    "prompt_data": "data.prompt_dataset", "prompt_data_probs": "data.prompt_probs", "prompt_split": "data.prompt_split",
    "eval_dataset": "eval.dataset", "eval_split": "eval.split", "eval_temperature": "eval.temperature",
    "eval_n_samples_per_prompt": "eval.n_samples_per_prompt", "input_key": "data.input_key",
    "label_key": "data.label_key", "input_template": "data.input_template",
    "apply_chat_template": "data.apply_chat_template", "use_wandb": "logger.wandb.key", "wandb_org": "logger.wandb.org",
    "wandb_group": "logger.wandb.group", "wandb_project": "logger.wandb.project",
    "wandb_run_name": "logger.wandb.run_name", "dynamic_filtering": "algo.dynamic_filtering_enable",
    "dynamic_filtering_reward_range": "algo.dynamic_filtering_range", "image_key": "data.image_key",
    "max_images_per_prompt": "data.max_images_per_prompt", "freeze_visual_encoder": "actor.freeze_visual_encoder",
    "use_tensorboard": "logger.tensorboard_dir", "vllm_is_truncated_threshold": "algo.advantage.is_correction_threshold",
    "generate_max_len": "rollout.max_new_tokens",
}
# Switches that became a flag with a value (OpenRLHF 0.8.x).
SWITCHES = {"bf16": ("ds.param_dtype", "bf16"), "flash_attn": ("ds.attn_implementation", "flash_attention_2"),
            "use_kl_estimator_k3": ("algo.kl.estimator", "k3")}  # 0.5-0.8's KL switch, before --kl_estimator
# Flags OpenRLHF dropped, whose feature does not exist any more.
DROPPED = ("perf", "actor_init_on_gpu", "ptx_coef")
# The importance-sampling correction before 0.11.2: a switch and a type, today a level and a mode.
_CORRECTION_SWITCHES = ("enable_vllm_is_correction", "vllm_enable_is_correction",  # 0.10.0 spelled it both ways
                         "algo.advantage.is_correction_enable")
_CORRECTION_TYPES = ("vllm_is_correction_type", "algo.advantage.is_correction_type")
_CORRECTION = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("seq", "mask")}
_PROMPT_MAX_LEN = "prompt_max_len"  # 0.8.x: the prompt's budget; today --data.max_len covers prompt and response
_OLD_GENERATE_DEFAULT = 1024


def _split(argv: list) -> list:
    """[(flag name without --, [values])] in order; anything before the first flag is kept as a value-only item."""
    items = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            items.append((name, [value] if eq else []))
        elif items:
            items[-1][1].append(arg)
        else:
            items.append((None, [arg]))
    return items


def translate_old_spellings(argv: list) -> list:
    """argv with older OpenRLHF spellings replaced by today's flags; one notice per translated flag."""
    items, out = _split(argv), []
    correction, prompt_max_len, generate = None, None, None
    for name, values in items:
        if name is None:
            out += values
        elif name in RENAMED:
            notice(f"--{name} is OpenRLHF's old spelling of --{RENAMED[name]}: read as that")
            out += ["--" + RENAMED[name], *values]
            if name == "generate_max_len":
                generate = values
        elif name in SWITCHES:
            flag, value = SWITCHES[name]
            notice(f"--{name} is OpenRLHF's old spelling of --{flag} {value}: read as that")
            out += ["--" + flag, value]
        elif name in DROPPED:
            notice(f"--{name} was dropped from OpenRLHF and has no effect here")
        elif name == "pretrain_data":
            raise ConfigError("--pretrain_data: not supported here: PPO-ptx (a pretraining loss mixed into RL) is "
                              "not built")
        elif name in _CORRECTION_SWITCHES:
            correction = correction or "tis"
        elif name in _CORRECTION_TYPES:
            if not values or values[0] not in _CORRECTION:
                raise ConfigError(f"--{name}: use tis, icepop or seq-mask-tis")
            correction = values[0]
        elif name == _PROMPT_MAX_LEN:
            prompt_max_len = values
        else:
            out += ["--" + name, *values]
    switched = any(name in _CORRECTION_SWITCHES for name, _ in items)
    if correction and switched:
        level, mode = _CORRECTION[correction]
        notice(f"the importance-sampling correction {correction} is spelled --algo.advantage.is_correction_level "
               f"{level} --algo.advantage.is_correction_mode {mode} since OpenRLHF 0.11.2: read as that")
        out += ["--algo.advantage.is_correction_level", level, "--algo.advantage.is_correction_mode", mode]
    elif correction:
        notice("an importance-sampling correction type without its enabling switch has no effect, as in OpenRLHF")
    if prompt_max_len is not None:
        try:
            total = int(prompt_max_len[0]) + int((generate or [_OLD_GENERATE_DEFAULT])[0])
        except (IndexError, ValueError):
            raise ConfigError("--prompt_max_len / --generate_max_len: give whole numbers") from None
        notice(f"--prompt_max_len is OpenRLHF's old prompt budget: --data.max_len {total} (prompt plus response)")
        out += ["--data.max_len", str(total)]
    return out
