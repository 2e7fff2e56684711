"""The README and the pages in docs/ tell the truth: the table of OpenRLHF flags in docs/FLAGS.md is the one the config
generates, every flag they name exists, every default a table quotes is the config's, every file path and link they
name exists, every `make X` they show is a Makefile target, and the README stays a page one reads top to bottom."""

import ast
import glob
import os
import re

import pytest

from openrlhf_async import compat
from openrlhf_async.cli.flag_table import _SHOWN, shown, table
from openrlhf_async.config import build_parser, settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, END = "<!-- flag-table:start -->", "<!-- flag-table:end -->"
FLAG_PAGE = "docs/FLAGS.md"
README_MAX_LINES = 300
# The project's other commands, whose flags the pages show too (benchmarks/*.py are added in known_flags).
OTHER_COMMANDS = ("openrlhf_async/cli/prepare_data.py", "openrlhf_async/cli/reward_server.py",
                  "openrlhf_async/cli/report.py", "openrlhf_async/models/tiny.py")
# Flags of other tools in the pages' command lines: ray start / ray job submit, pip, tensorboard, hf download, pytest,
# py-spy.
OTHER_TOOLS = {"--head", "--address", "--runtime-env-json", "--dashboard-host", "--no-deps", "--logdir",
               "--local-dir", "--repo-type", "--durations", "--format", "--target", "--no-compile"}  # pip's, for the GPU kit
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w.-]*\w")
# Paths from the repository root, and paths inside the package as docs/ARCHITECTURE.md writes them (`trainer/run.py`).
ROOT_PATH = re.compile(r"(?<![\w./{}<>$-])((?:agents|openrlhf_async|benchmarks|examples|docs|tests)/[\w./*-]*[\w*])")
PACKAGE_PATH = re.compile(r"(?<![\w./{}<>$-])((?:agent|cli|data|models|presets|reward|rollout|trainer|utils)/"
                          r"[\w/*.-]*\.(?:py|args))\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?<![\w-])make\s+(?:[A-Z_]+=\S*\s+)*([a-z][\w-]*)")


def pages() -> list:
    """README.md and every docs/*.md, as paths from the repository root."""
    return ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


def read(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def readme() -> str:
    return read("README.md")


def test_the_flag_table_is_the_generated_one():
    text = read(FLAG_PAGE)
    assert text.count(START) == 1 and text.count(END) == 1, f"{FLAG_PAGE} needs one {START} ... {END} block"
    pasted = text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert pasted == table(), (f"{FLAG_PAGE}'s flag table is out of date (a flag's default or support changed): run "
                               "`python -m openrlhf_async.cli.flag_table` and paste its output between the "
                               "flag-table markers")


def test_the_flag_table_lives_in_one_page():
    holders = [page for page in pages() if START in read(page) or END in read(page)]
    assert holders == [FLAG_PAGE], f"the flag-table markers belong in {FLAG_PAGE} alone, found in {holders}"


def _flags_of_python_file(path: str) -> set:
    """The option strings of every add_argument call in a file (with --no-X for switches)."""
    found = set()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            options = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                       and a.value.startswith("--")]
            found |= set(options)
            if any(k.arg == "action" and "BooleanOptional" in ast.dump(k.value) for k in node.keywords):
                found |= {"--no-" + o[2:] for o in options}
    return found


def known_flags() -> set:
    known = set(build_parser()._option_string_actions)
    old_spellings = (*compat.RENAMED, *compat.SWITCHES, *compat._CORRECTION_SWITCHES, *compat._CORRECTION_TYPES)
    known |= {"--" + old for old in old_spellings}
    for path in [*OTHER_COMMANDS, *glob.glob(os.path.join(REPO, "benchmarks", "*.py"))]:
        known |= _flags_of_python_file(os.path.join(REPO, path))
    return known | OTHER_TOOLS


@pytest.mark.parametrize("page", pages())
def test_every_flag_a_page_names_exists(page):
    unknown = sorted(set(FLAG.findall(read(page))) - known_flags())
    assert unknown == [], (f"{page} names flags that no command has: {unknown} (see `python -m "
                           "openrlhf_async.cli.train_async --help`)")


def test_the_flag_check_catches_a_flag_that_does_not_exist():
    assert "--rollout.max_new_tokens" in known_flags() and "--pretrain" in known_flags()
    assert "--no-data.apply_chat_template" in known_flags() and "--port" in known_flags()
    assert "--quick" in known_flags() and "--dataset" in known_flags()  # a benchmark's, prepare_data's
    assert set(FLAG.findall("use `--ckpt.resume`, --train.partial_rollout.")) - known_flags() == {
        "--ckpt.resume", "--train.partial_rollout"}


# --- defaults quoted in tables ----------------------------------------------------------------------------------


def tables(text: str):
    """Each Markdown table as (header cells, [row cells]), fenced code left out."""
    lines = FENCE.sub("", text).splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|\s*$", lines[i + 1]):
            header = _cells(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            yield header, rows
        else:
            i += 1


def _cells(line: str) -> list:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _value(cell: str) -> str:
    """The value a cell quotes: its first code span when it starts with one, else its words before any comment."""
    cell = cell.strip()
    if cell.startswith("`"):
        return cell[1:].split("`", 1)[0]
    return re.split(r"\s*[(:;]", cell, 1)[0].strip()


def _row_flags(cell: str) -> list:
    """The flags a table row is about: `--a.b_c`, `_d` is --a.b_c and --a.b_d."""
    flags = []
    for span in INLINE_CODE.findall(cell) or [cell]:
        if span.startswith("--"):
            flags.append(span.split()[0])
        elif span.startswith("_") and flags:
            flags.append(flags[0].rsplit("_", 1)[0] + span)
    return flags


def quoted_defaults(text: str):
    """(flag, quoted default) for every row of a table with a column headed "default..." whose first cell names
    flags: one value per flag (comma-separated), or one value for them all."""
    for header, rows in tables(text):
        columns = [i for i, h in enumerate(header) if h.lower().startswith("default")]
        for row in rows:
            flags = _row_flags(row[0])
            for i in columns:
                if not flags or i >= len(row):
                    continue
                values = [_value(v) for v in re.split(r",\s+(?![^(]*\))", row[i])]
                if len(values) == 1:
                    values = values * len(flags)
                if len(values) == len(flags):
                    yield from zip(flags, values)


def config_default(flag: str):
    """The default as the flag table writes it, or None for a flag that is no setting."""
    found = settings().get(flag[2:])
    if found is None:
        return None
    return _SHOWN.get(flag[2:]) or shown(found[1].default)


@pytest.mark.parametrize("page", pages())
def test_every_default_a_table_quotes_is_the_configs(page):
    wrong = [f"{flag}: {quoted!r}, the config says {config_default(flag)!r}"
             for flag, quoted in quoted_defaults(read(page))
             if config_default(flag) is not None and quoted != config_default(flag)]
    assert wrong == [], f"{page} quotes defaults the config does not have: {wrong}"


def test_the_default_check_reads_rows_of_several_flags():
    text = ("| flag | preset | default |\n|---|---|---|\n"
            "| `--algo.advantage.is_correction_level`, `_mode` | `token`, `clip` | off |\n"
            "| `--rollout.batch_size`, `--train.batch_size` | 32, 256 | 1024, `128` (its product) |\n")
    assert list(quoted_defaults(text)) == [
        ("--algo.advantage.is_correction_level", "off"), ("--algo.advantage.is_correction_mode", "off"),
        ("--rollout.batch_size", "1024"), ("--train.batch_size", "128")]
    assert config_default("--algo.advantage.is_correction_mode") == "mask"


# --- paths, links, make targets -----------------------------------------------------------------------------------


def named_paths(text: str) -> set:
    """Files and folders a page names: from the repository root, or inside the package."""
    paths = {p.rstrip(".") for p in ROOT_PATH.findall(text)}
    paths |= {"openrlhf_async/" + p for p in PACKAGE_PATH.findall(text)}
    return paths


def _exists(path: str) -> bool:
    full = os.path.join(REPO, path)
    return bool(glob.glob(full)) if "*" in path else os.path.exists(full)


@pytest.mark.parametrize("page", pages())
def test_every_path_a_page_names_exists(page):
    missing = sorted(p for p in named_paths(read(page)) if not _exists(p))
    assert missing == [], f"{page} names files that do not exist: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set:
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", text), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


@pytest.mark.parametrize("page", pages())
def test_every_link_of_a_page_leads_somewhere(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", read(page))):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(REPO, resolved)):
            broken.append(target)
        elif anchor and resolved.endswith(".md") and anchor not in anchors(read(resolved)):
            broken.append(target)
    assert broken == [], f"{page} links to files or headings that do not exist: {broken}"


def makefile_targets() -> set:
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        return set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", f.read(), re.M))


def make_commands(text: str) -> set:
    """The targets of every `make X` in a page's code: fenced blocks and inline code."""
    code = FENCE.findall(text) + INLINE_CODE.findall(FENCE.sub("", text))
    return {target for snippet in code for target in MAKE.findall(snippet)}


@pytest.mark.parametrize("page", pages())
def test_every_make_target_a_page_shows_exists(page):
    missing = sorted(make_commands(read(page)) - makefile_targets())
    assert missing == [], f"{page} shows make targets the Makefile does not have: {missing}"


def test_the_path_and_make_checks_catch_what_does_not_exist():
    assert named_paths("see `agents/nothing.py`, trainer/run.py and {run_dir}/ckpt") == {
        "agents/nothing.py", "openrlhf_async/trainer/run.py"}
    assert not _exists("agents/nothing.py") and _exists("openrlhf_async/trainer/run.py")
    assert make_commands("run `make demo`, then\n```bash\nmake DEVICE=cpu smollm2-rl\n```\nto make sure") == {
        "demo", "smollm2-rl"}
    assert {"demo", "test", "install"} <= makefile_targets() and "deploy" not in makefile_targets()
    assert slug("4. Launch it") == "4-launch-it" and slug("From OpenRLHF") == "from-openrlhf"


# --- code the pages show -----------------------------------------------------------------------------------------


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
QUOTED_FILE = re.compile(r"From `((?:agents|openrlhf_async|benchmarks)/[\w/]+\.py)`:\s*\n\s*```python\n(.*?)^```",
                         re.S | re.M)


def _code_lines(code: str) -> list:
    """A snippet's lines without comments and blank lines, stripped."""
    lines = (line.split("  # ")[0].rstrip() for line in code.splitlines())
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


@pytest.mark.parametrize("page", pages())
def test_every_python_block_of_a_page_parses(page):
    for code in PYTHON_BLOCK.findall(read(page)):
        ast.parse(code)


@pytest.mark.parametrize("page", pages())
def test_code_said_to_come_from_a_file_is_in_it(page):
    for path, code in QUOTED_FILE.findall(read(page)):
        source = _code_lines(read(path))
        missing = [line for line in _code_lines(code) if line not in source]
        assert missing == [], f"{page} shows lines from {path} that it does not have: {missing}"


def test_the_quoted_file_check_reads_what_a_page_quotes():
    text = "From `agents/math_single_turn.py`:\n\n```python\nasync def step(state, action, label):\n```\n"
    assert QUOTED_FILE.findall(text) == [("agents/math_single_turn.py", "async def step(state, action, label):\n")]


# --- the README as a page ---------------------------------------------------------------------------------------


def test_the_readme_keeps_the_commands_ci_and_users_run():
    text = readme()
    assert "make test" in text and "make demo" in text


def test_the_readme_is_a_page_one_reads():
    lines = readme().count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines: keep it under {README_MAX_LINES} and move "
                                       "subjects into docs/")
