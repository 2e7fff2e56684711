"""The README tells the truth about the flags: its table of OpenRLHF flags is the one the config generates, every
flag it names exists, and it keeps the test command CI runs."""

import os
import re

from openrlhf_async import compat
from openrlhf_async.cli.flag_table import table
from openrlhf_async.config import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, END = "<!-- flag-table:start -->", "<!-- flag-table:end -->"
# The project's other commands, whose flags the README shows too.
OTHER_COMMANDS = ("openrlhf_async/cli/prepare_data.py", "openrlhf_async/cli/reward_server.py", "benchmarks/gpu_check.py")
# Flags of other tools in the README's command lines: ray start / ray job submit, pip, tensorboard, hf download.
OTHER_TOOLS = {"--head", "--address", "--runtime-env-json", "--no-deps", "--logdir", "--local-dir"}
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w.-]*\w")


def readme() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_the_readme_flag_table_is_the_generated_one():
    text = readme()
    assert text.count(START) == 1 and text.count(END) == 1, f"README.md needs one {START} ... {END} block"
    pasted = text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert pasted == table(), ("README.md's flag table is out of date (a flag's default or support changed): run "
                               "`python -m openrlhf_async.cli.flag_table` and paste its output between the "
                               "flag-table markers")


def known_flags() -> set:
    known = set(build_parser()._option_string_actions)
    old_spellings = (*compat.RENAMED, *compat.SWITCHES, *compat._CORRECTION_SWITCHES, *compat._CORRECTION_TYPES)
    known |= {"--" + old for old in old_spellings}
    for path in OTHER_COMMANDS:
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            known |= set(re.findall(r"add_argument\(\s*\"(--[\w.-]+)\"", f.read()))
    return known | OTHER_TOOLS


def test_every_flag_the_readme_names_exists():
    unknown = sorted(set(FLAG.findall(readme())) - known_flags())
    assert unknown == [], (f"README.md names flags that no command has: {unknown} (see `python -m "
                           "openrlhf_async.cli.train_async --help`)")


def test_the_flag_check_catches_a_flag_that_does_not_exist():
    assert "--rollout.max_new_tokens" in known_flags() and "--pretrain" in known_flags()
    assert "--no-data.apply_chat_template" in known_flags() and "--port" in known_flags()
    assert set(FLAG.findall("use `--ckpt.resume`, --train.partial_rollout.")) - known_flags() == {
        "--ckpt.resume", "--train.partial_rollout"}


def test_the_readme_keeps_the_commands_ci_and_users_run():
    text = readme()
    assert "make test" in text and "make demo" in text
