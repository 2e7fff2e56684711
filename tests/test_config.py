"""Every setting documents itself in one place: its field. The parser, --help and the checks come from there."""

import dataclasses
import re

import pytest

from openrlhf_async import config
from openrlhf_async.config import ConfigError, build_parser, checks, command_line, parse_config, schema, settings


def test_every_setting_has_help():
    assert [flag for flag, (_, f) in settings().items() if not f.metadata["help"].strip()] == []


def test_every_flag_in_help_shows_its_help_and_default():
    text = build_parser().format_help()
    options = text.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  --)", options)[1:]  # one entry per flag, from its option strings to its help's end
    flags = {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}
    assert set(flags) == {"--" + flag for flag in settings()} | {"--" + flag for flag in command_line._NEGATIONS}
    assert [flag for flag, entry in flags.items() if "(default: " not in entry and flag[2:] not in command_line._NEGATIONS] == []
    assert "(default: None)" in flags["--actor.model_name_or_path"]  # an empty default is visible, not blank
    assert "(default: '')" in flags["--device"]
    assert "--no-rollout.early_stop" in flags["--rollout.early_stop"]


def test_a_setting_added_in_one_line_is_a_checked_flag(monkeypatch):
    @dataclasses.dataclass
    class Extra:
        warmup_ratio: float = config.setting(0.03, "share of steps with a rising learning rate", range="[0, 1]")
        scheduler: str = config.setting("cosine", "learning-rate schedule", choices=("cosine", "constant"))
        lr_warmup: int = config.setting(5, "warm-up steps", flag="actor.lr.warmup")

    monkeypatch.setattr(schema, "Config", dataclasses.make_dataclass(
        "Config", [("extra", Extra, dataclasses.field(default_factory=Extra))], bases=(config.Config,)))
    cfg = parse_config(["--extra.warmup_ratio", "0.1", "--extra.scheduler", "constant", "--actor.lr.warmup", "7"])
    assert (cfg.extra.warmup_ratio, cfg.extra.scheduler, cfg.extra.lr_warmup) == (0.1, "constant", 7)
    help_text = " ".join(build_parser().format_help().split())
    assert "share of steps with a rising learning rate (default: 0.03)" in help_text
    with pytest.raises(ConfigError, match=r"^--extra.warmup_ratio 2.0: must be in \[0, 1\]$"):
        checks._validate_settings(parse_config(["--extra.warmup_ratio", "2"]))


@pytest.mark.parametrize("flags, expected", [
    (["--ds.zero_stage", "4"], "argument --ds.zero_stage: invalid choice: 4"),
    (["--agent.sandbox", "docker"], "argument --agent.sandbox: invalid choice: 'docker'"),
    (["--ds.param_dtype", "int8"], "argument --ds.param_dtype: invalid choice: 'int8'"),
    (["--rollout.batch_size", "many"], "argument --rollout.batch_size: invalid int value: 'many'"),
    (["--vllm.num_engine", "2"], "unrecognized arguments: --vllm.num_engine 2"),
])
def test_argparse_rejects_bad_choices_and_types_in_one_line(flags, expected):
    with pytest.raises(ConfigError) as e:
        parse_config(flags)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_a_config_built_in_code_is_held_to_the_same_choices():
    cfg = config.Config()
    cfg.algo.dynamic_filtering_rule = "median"
    with pytest.raises(ConfigError, match=r"^--algo.dynamic_filtering_rule 'median': use mean_range or std$"):
        checks._validate_settings(cfg)


@pytest.mark.parametrize("mode,extra,said", [
    ("fully_async", [], True), ("async", [], True), ("sync", [], False),
    ("fully_async", ["--algo.advantage.is_correction_level", "token"], False),
    ("async", ["--actor.proximal_policy", "rollout"], False)])
def test_asynchrony_without_a_correction_says_what_stale_tokens_get(capsys, mode, extra, said):
    """OpenRLHF's defaults train stale tokens uncorrected (the PPO ratio 1 against the recomputed policy): the run
    says so in one line, and names the flag that corrects them; a user's own correction stays theirs."""
    from openrlhf_async.config import validate

    validate(parse_config(["--mode", mode, *extra]))
    lines = [line for line in capsys.readouterr().err.splitlines() if "as if fresh" in line]
    assert len(lines) == int(said), lines
    if said:
        assert lines[0].startswith(f"notice: --mode {mode} trains samples of older weights as if fresh")
        assert "--algo.advantage.is_correction_level token" in lines[0]
