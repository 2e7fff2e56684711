"""OpenRLHF parity: the parser of the installed OpenRLHF 0.11.2 `train_ppo_ray`, built from the package's own source,
against this project's flags. It fails when OpenRLHF gains a flag this project does not know, or a supported flag's
default drifts."""

import argparse
import importlib.metadata
import importlib.util
import os
import textwrap
from datetime import datetime

import pytest

from conftest import preset_config
from openrlhf_async import compat
from openrlhf_async.config import ConfigError, build_parser, parse_config, settings, support, validate


def openrlhf_parser() -> argparse.ArgumentParser:
    """OpenRLHF's own parser: its module builds it under `if __name__ == "__main__"` (and importing the module needs
    GPUs), so the parser-building block of the installed source is run on its own."""
    assert importlib.metadata.version("openrlhf") == "0.11.2"
    spec = importlib.util.find_spec("openrlhf.cli.train_ppo_ray")
    with open(spec.origin) as f:
        source = f.read()
    block = source.split('if __name__ == "__main__":', 1)[1].split("args = parser.parse_args()", 1)[0]
    scope = {"argparse": argparse, "datetime": datetime, "os": os}
    exec(textwrap.dedent(block), scope)
    return scope["parser"]


def openrlhf_flags() -> dict:
    """{flag without --: argparse action} of every OpenRLHF 0.11.2 flag."""
    return {o[2:]: a for a in openrlhf_parser()._actions for o in a.option_strings if o.startswith("--")
            and o != "--help"}


def _same(ours, theirs) -> bool:
    if isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)):
        return len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs))
    if isinstance(theirs, (int, float)) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
        return float(ours) == float(theirs)
    return ours == theirs


def test_every_openrlhf_flag_is_recognised():
    ours = {o[2:] for o in build_parser()._option_string_actions}
    missing = sorted(flag for flag in openrlhf_flags() if flag not in ours)
    assert missing == [], f"OpenRLHF 0.11.2 flags unknown here: {missing}"
    assert len(openrlhf_flags()) >= 167


def test_supported_flags_keep_openrlhfs_default():
    table, theirs = settings(), openrlhf_flags()
    drifted = []
    for flag, action in theirs.items():
        if flag not in table:  # the negation spellings (--actor.muon.no_nesterov) set another flag
            continue
        kind, _ = support(table[flag][1])
        ours = table[flag][1].default
        if flag == "logger.wandb.run_name":  # a time stamp taken at start
            assert ours.startswith("ppo_") and action.default.startswith("ppo_")
        elif kind == "same" and not _same(ours, action.default):
            drifted.append((flag, ours, action.default))
    assert drifted == []


def test_every_openrlhf_flag_says_how_it_is_supported_and_only_those():
    table, theirs = settings(), openrlhf_flags()
    claimed = {flag for flag, (_, f) in table.items() if support(f)[0]}
    assert claimed == set(theirs) - {"actor.muon.no_nesterov", "critic.muon.no_nesterov"}
    unexplained = [flag for flag in claimed if support(table[flag][1])[0] != "same" and not support(table[flag][1])[1]]
    assert unexplained == []


def test_each_openrlhf_flag_parses_with_its_own_default_value():
    """Every flag takes the value OpenRLHF would give it (a switch: given alone)."""
    table = settings()
    for flag, action in openrlhf_flags().items():
        if action.nargs == 0:
            argv = ["--" + flag]
        elif action.default is None:
            continue
        else:
            values = action.default if isinstance(action.default, (list, tuple)) else [action.default]
            values = values if not isinstance(values, str) else [values]
            argv = ["--" + flag, *map(str, values)]
        cfg = parse_config(argv)
        if flag in table and action.nargs != 0:
            name = table[flag][0]
            value = cfg
            for part in name.split("."):
                value = getattr(value, part)
            assert _same(value, action.default) or flag == "ds.lora.target_modules", (flag, value, action.default)


@pytest.mark.parametrize("flags, message", [
    (["--critic.optim", "muon"], "--critic.optim muon: not supported here: only the adam optimizer is built"),
    (["--ds.load_in_4bit"], "--ds.load_in_4bit True: not supported here: QLoRA needs bitsandbytes' CUDA kernels"),
    (["--data.max_images_per_prompt", "2"], "--data.max_images_per_prompt 2: not supported here: vision-language"),
    (["--algo.advantage.estimator", "gae", "--train.colocate_all", "--vllm.num_engines", "2"],
     "--train.colocate_all puts --critic's models on --actor's devices, one to one: --critic.num_nodes 1 x "
     "--critic.num_gpus_per_node 8 must equal --actor.num_nodes 1 x --actor.num_gpus_per_node 2"),
    (["--actor.optim", "muon"], "--actor.optim muon: not supported here: only adam"),
    (["--train.colocate_all"], "--train.colocate_all: --vllm.num_engines 1 x --vllm.tensor_parallel_size 1 (1) "
                               "must equal"),
    (["--train.async_enable", "--vllm.enable_sleep"], "--vllm.enable_sleep with --mode async: the asynchronous "
                                                      "modes keep the engines on devices of their own"),
    (["--train.batch_size", "512"], "--train.batch_size 512: a mini batch cannot hold more than the rollout batch's"),
    (["--train.partial_rollout_enable"], "--train.partial_rollout_enable needs --train.async_enable"),
    (["--use_ms"], "--use_ms True: not supported here: ModelScope"),
    # They would do nothing, and a context or model sized for them runs out of memory later: refused now.
    (["--ds.tensor_parallel_size", "2"], "--ds.tensor_parallel_size 2: not supported here: DeepSpeed AutoTP is not"),
])
def test_flags_that_would_change_training_and_are_not_built_are_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError) as e:
        preset_config(*flags)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("flags, message", [
    (["--ds.use_liger_kernel"], "--ds.use_liger_kernel True has no effect here: a speed/memory kernel"),
    (["--ds.ring_attn_head_stride", "2"], "--ds.ring_attn_head_stride 2 has no effect here"),
    (["--critic.adam.lr", "1e-5"], "--critic.adam.lr has no effect without --algo.advantage.estimator gae"),
    (["--train.async_queue_size", "2"], "--train.async_queue_size 2 has no effect in --mode sync"),
    (["--train.async_enable", "--train.colocate_all", "--ds.enable_sleep"],
     "--ds.enable_sleep has no effect in the async modes"),
])
def test_flags_that_only_tune_speed_or_memory_run_with_one_notice(flags, message, capsys):
    preset_config(*flags)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: ")]
    assert len(notices) == 1 and notices[0].startswith("notice: " + message), notices


def test_mode_follows_openrlhfs_switches_and_the_shortcut_agrees_with_them():
    assert preset_config().mode == "sync"
    assert preset_config("--train.async_enable").mode == "async"
    cfg = preset_config("--train.async_enable", "--train.partial_rollout_enable")
    assert cfg.mode == "fully_async" and cfg.train.partial_rollout_enable
    assert preset_config("--mode", "async").train.async_enable
    with pytest.raises(ConfigError, match="^--mode sync contradicts --train.async_enable"):
        preset_config("--mode", "sync", "--train.async_enable")


def test_openrlhfs_defaults_are_the_defaults_here(capsys):
    cfg = parse_config([])
    assert (cfg.actor.adam_lr, cfg.rollout.max_new_tokens, cfg.data.max_len, cfg.train.micro_batch_size,
            cfg.rollout.batch_size, cfg.data.input_key, cfg.data.apply_chat_template, cfg.algo.dynamic_filtering_enable,
            cfg.algo.is_correction_level, cfg.ds.zero_stage) == (1e-6, None, 2048, 1, 1024, "input", False, False,
                                                                   "off", 2)
    assert cfg.actor.clip_range == (0.2, 0.2)  # no clip-higher unless asked for
    assert preset_config("--actor.eps_clip_low_high", "0.1", "0.3").actor.clip_range == (0.1, 0.3)
    with pytest.raises(ConfigError, match=r"^--actor.eps_clip 0.1 is overridden by --actor.eps_clip_low_high 0.2 "
                                          r"0.28 \(the preset's\?\)"):
        preset_config("--actor.eps_clip", "0.1")  # the preset asks for 0.2 0.28
    cfg = validate(parse_config(["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8",
                                 "--train.batch_size", "8192", "--device", "cpu"]))
    # The embedded tiny model has 256 positions: --data.max_len 2048 is capped, with a notice.
    assert cfg.data.max_len == 256 and "max_position_embeddings (256): sequences are capped" in capsys.readouterr().err
    assert cfg.budget(100) == 156  # no --rollout.max_new_tokens: what --data.max_len leaves after the prompt
    assert cfg.max_concurrent_prompts == 1024 and cfg.num_engines == 1


def test_the_std_rule_refuses_a_range_it_would_ignore():
    with pytest.raises(ConfigError, match="^--algo.dynamic_filtering_range is read by the mean_range rule only"):
        preset_config("--algo.dynamic_filtering_range", "0.1", "0.9")
    assert preset_config("--algo.dynamic_filtering_rule", "mean_range", "--algo.dynamic_filtering_range", "0.1",
                         "0.9").algo.dynamic_filtering_range == (0.1, 0.9)


def test_a_lone_correction_threshold_is_an_upper_bound():
    cfg = preset_config("--algo.advantage.is_correction_gating", "binary_kl", "--algo.advantage.is_correction_mode",
                        "mask", "--algo.advantage.is_correction_threshold", "0.01")
    assert cfg.algo.is_correction_threshold == (0.0, 0.01)


def test_old_spellings_are_read_as_todays_flags_with_a_notice_each(capsys):
    argv = ["--pretrain", "Qwen/Qwen3-8B", "--prompt_data", "org/data", "--agent_func_path", "agent.py",
            "--async_train", "--n_samples_per_prompt", "8", "--micro_train_batch_size", "2", "--dynamic_filtering",
            "--vllm_num_engines", "4", "--remote_rm_url", "http://rm:5000/score", "--save_path", "out", "--bf16",
            "--use_wandb", "KEY", "--enable_vllm_is_correction", "--vllm_is_correction_type", "icepop",
            "--prompt_max_len", "1024", "--generate_max_len", "512", "--perf"]
    cfg = parse_config(argv)
    assert (cfg.actor.model_name_or_path, cfg.data.prompt_dataset, cfg.agent.func_path, cfg.train.async_enable,
            cfg.rollout.n_samples_per_prompt, cfg.train.micro_batch_size, cfg.algo.dynamic_filtering_enable,
            cfg.vllm.num_engines, cfg.reward.remote_url, cfg.ckpt.output_dir, cfg.ds.param_dtype,
            cfg.logger.wandb_key) == ("Qwen/Qwen3-8B", "org/data", "agent.py", True, 8, 2, True, 4,
                                      "http://rm:5000/score", "out", "bf16", "KEY")
    assert (cfg.algo.is_correction_level, cfg.algo.is_correction_mode) == ("token", "mask")
    assert (cfg.data.max_len, cfg.rollout.max_new_tokens) == (1536, 512)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: ")]
    assert len(notices) == 16, notices
    assert "notice: --pretrain is OpenRLHF's old spelling of --actor.model_name_or_path: read as that" in notices


def test_old_spellings_map_onto_flags_that_exist():
    table = settings()
    assert [new for new in compat.RENAMED.values() if new not in table] == []
    assert [flag for flag, _ in compat.SWITCHES.values() if flag not in table] == []
    with pytest.raises(ConfigError, match="^--pretrain_data: not supported here: PPO-ptx"):
        parse_config(["--pretrain_data", "x"])


def test_0_11_0_correction_flags_become_0_11_2s(capsys):
    cfg = parse_config(["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "seq-mask-tis"])
    assert (cfg.algo.is_correction_level, cfg.algo.is_correction_mode) == ("seq", "mask")
    cfg = parse_config(["--algo.advantage.is_correction_enable"])  # 0.11.0's default type: tis
    assert (cfg.algo.is_correction_level, cfg.algo.is_correction_mode) == ("token", "clip")


def test_a_flags_file_reads_like_a_command_line(tmp_path):
    path = tmp_path / "mine.args"
    path.write_text("# my settings\n--rollout.batch_size 4  # four prompts\n--data.input_template 'Q: {} A:'\n")
    cfg = parse_config([f"@{path}", "--rollout.n_samples_per_prompt", "2"])
    assert (cfg.rollout.batch_size, cfg.data.input_template, cfg.rollout.n_samples_per_prompt) == (4, "Q: {} A:", 2)
    with pytest.raises(ConfigError, match=r"^@/no/such.args: cannot read the flags file"):
        parse_config(["@/no/such.args"])


def test_openrlhf_flags_with_another_meaning_here_are_noticed_once_the_run_is_checked(tmp_path, capsys):
    from test_bad_input import run_cli

    assert run_cli(tmp_path, "--train.async_enable", "--train.partial_rollout_enable",
                   "--rollout.vllm_generate_batch_size", "8", "--dry_run") == 0
    notices = [line.split(":")[1].strip() for line in capsys.readouterr().err.splitlines()
               if line.startswith("notice: ")]
    assert notices == ["--train.partial_rollout_enable differs from OpenRLHF's",
                       "--rollout.vllm_generate_batch_size 8 differs from OpenRLHF's",
                       "no --actor.model_name_or_path", "no --data.prompt_dataset",
                       "no --train.agent_func_path, --reward.remote_url or --reward.model_name_or_path"], notices
    # What OpenRLHF itself needs given (a model, a dataset, a reward), none of those notices; a failing run shows
    # its error alone.
    data, reward = tmp_path / "prompts.jsonl", tmp_path / "reward.py"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    reward.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': [0.0] * len(queries)}\n")
    flags = ["--data.prompt_dataset", str(data), "--data.input_key", "prompt", "--data.label_key", "label",
             "--reward.remote_url", str(reward),
             "--rollout.batch_size", "1", "--train.batch_size", "8", "--dry_run"]
    assert run_cli(tmp_path, *flags) == 0
    notices = [line.split(":")[1].strip() for line in capsys.readouterr().err.splitlines()
               if line.startswith("notice: ")]
    assert notices == ["--rollout.vllm_generate_batch_size 64 differs from OpenRLHF's",  # the tests' preset's
                       "no --actor.model_name_or_path"], notices  # the preset trains the tiny model
    assert run_cli(tmp_path, *flags, "--rollout.vllm_generate_batch_size", "0") == 2
    assert capsys.readouterr().err.strip().startswith("error: --rollout.vllm_generate_batch_size 0")
