"""The command line generated from the schema: the parser (a flag per setting, with its help, choices and type),
`--help SECTION`, flags files (@FILE, nested, bounded) and the project's presets. A bad flag is a one-line
ConfigError; older OpenRLHF spellings are translated first (compat.py)."""

import argparse
import os
import shlex
import sys

from openrlhf_async.compat import translate_old_spellings
from openrlhf_async.config import schema
from openrlhf_async.config.schema import settings, value_at
from openrlhf_async.config.setting import support, value_type
from openrlhf_async.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the flag (argparse's own adds the whole usage)
        raise ConfigError(message)

    def format_help(self, prefix: str = "") -> str:
        if not prefix:
            return super().format_help()
        prefix = prefix.lstrip("-")
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, [], [])
        found = False
        for group in self._action_groups[2:]:  # the sections (argparse's own two groups hold only --help)
            actions = [a for a in group._group_actions if a.option_strings[0][2:].startswith(prefix)]
            if actions:
                found = True
                formatter.start_section(group.title)
                formatter.add_text(group.description)
                formatter.add_arguments(actions)
                formatter.end_section()
        if not found:
            raise ConfigError(f"--help {prefix}: no flag starts with --{prefix}; sections: {', '.join(SECTIONS)}")
        return formatter.format_help()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):  # the description's lines kept; flags' help wrapped
    def _get_help_string(self, action):
        if action.default is argparse.SUPPRESS or "%(default)" in action.help:
            return action.help
        return f"{action.help} (default: %(default)r)"


# --help's sections: the flags' first part, in the order a user meets them, each with what it holds.
SECTIONS = {
    "run": "the run: its folder, mode, device, dry run",
    "actor": "the policy model and its optimizer",
    "rollout": "generation: samples per prompt, budgets, early stop",
    "vllm": "the vLLM engines",
    "train": "training steps, batches, asynchrony and staleness",
    "algo": "advantages, losses, KL, dynamic filtering, log-prob correction",
    "data": "prompt datasets and the built-in tasks",
    "eval": "held-out evaluation",
    "reward": "reward functions, services and models",
    "agent": "agents, their sandbox and the OpenAI endpoint",
    "ds": "DeepSpeed: ZeRO, dtypes, LoRA",
    "ref": "the reference model",
    "critic": "the critic (--algo.advantage.estimator gae)",
    "ckpt": "checkpoints and the final model",
    "logger": "metrics, W&B, TensorBoard, progress",
    "plan": "the memory plan",
}
# How --help marks a flag by its OpenRLHF support (setting.support); this project's own flags are unmarked.
_MARKS = {"same": "[OpenRLHF] ", "differs": "[OpenRLHF, differs] ", "no effect": "[OpenRLHF, no effect] ",
          "refused": "[OpenRLHF, refused] "}


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _section(flag: str) -> str:
    return flag.partition(".")[0] if "." in flag else "run"


class _HelpAction(argparse.Action):
    """--help: every section; --help SECTION (or a flag prefix such as rollout or actor.adam): those flags only."""

    def __call__(self, parser, namespace, values, option_string=None):
        text = parser.format_help(values or "")
        parser._print_message(text, sys.stdout)
        parser.exit()


# OpenRLHF 0.11.2 spells these negations as flags of their own.
_NEGATIONS = {"actor.muon.no_nesterov": "actor.muon.nesterov", "critic.muon.no_nesterov": "critic.muon.nesterov"}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m openrlhf_async.cli.train_async",
        usage="%(prog)s [@FLAGS_FILE] [--SECTION.FLAG VALUE ...] [--dry_run]",
        description="Asynchronous agentic RL with verifiable rewards, with OpenRLHF's flags. Flags may also come from\n"
                    "a file: @openrlhf_async/presets/tiny_cpu.args. --help SECTION shows one section (or the flags\n"
                    "starting with a prefix: --help actor.adam). [OpenRLHF] marks OpenRLHF 0.11.2's flags, with\n"
                    "differs / no effect / refused where they act otherwise here (docs/FLAGS.md says how);\n"
                    "unmarked flags are this project's own.\n\nsections:\n"
                    + "\n".join(f"  {name:<9}{what}" for name, what in SECTIONS.items()),
        formatter_class=_HelpFormatter, add_help=False,
        allow_abbrev=False,  # a mistyped flag must fail, not silently match a longer one
    )
    parser.add_argument("-h", "--help", action=_HelpAction, nargs="?", default=argparse.SUPPRESS, metavar="SECTION",
                        help="show the flags (of one section, or those starting with a prefix) and exit")
    table = settings()
    used = dict.fromkeys(_section(flag) for flag in table)  # in the flags' order
    groups = {section: parser.add_argument_group(f"--{section}.*" if section != "run" else "run",
                                                 SECTIONS.get(section))
              for section in [*[s for s in SECTIONS if s in used], *[s for s in used if s not in SECTIONS]]}
    for flag, (name, f) in table.items():
        mark = _MARKS.get(support(f)[0], "")
        kwargs = dict(dest=name, default=f.default, help=(mark + f.metadata["help"]).replace("%", "%%"))
        if not f.metadata["choices"] and not isinstance(f.default, bool):
            kwargs["metavar"] = _METAVARS.get(value_type(f), "VALUE")
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.metadata["nargs"] or isinstance(f.default, tuple):
            kwargs.update(type=value_type(f), nargs=f.metadata["nargs"] or len(f.default))
        else:
            kwargs.update(type=value_type(f), choices=f.metadata["choices"])
        groups[_section(flag)].add_argument("--" + flag, **kwargs)
    for flag, positive in _NEGATIONS.items():
        groups[_section(flag)].add_argument(
            "--" + flag, dest=table[positive][0], action="store_false", default=argparse.SUPPRESS,
            help=f"turn --{positive} off (OpenRLHF's spelling of --no-{positive})")
    return parser


def parse_config(argv=None) -> "schema.Config":
    """The Config the flags give (older OpenRLHF spellings are translated, each with a notice); a bad flag raises
    ConfigError (--help prints and exits)."""
    argv = expand_preset_files(list(sys.argv[1:] if argv is None else argv))
    cfg = schema.Config()  # looked up when called: the settings() walked below may be of an extended schema
    for name, value in vars(build_parser().parse_args(translate_old_spellings(argv))).items():
        section, _, leaf = name.rpartition(".")
        setattr(value_at(cfg, section), leaf, tuple(value) if isinstance(value, list) else value)
    return cfg


def preset_path(name: str) -> str:
    """The flags file of one of the project's presets (openrlhf_async/presets/<name>.args)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package, "presets", f"{name}.args")


def preset_config(name: str = "tiny_cpu", *flags: str) -> "schema.Config":
    """The config of one of the project's presets plus flags (not yet validated)."""
    return parse_config(["@" + preset_path(name), *flags])


FLAGS_FILE_MAX_BYTES = 1 << 20  # a flags file is a few lines; a larger one is something else (or /dev/zero)
FLAGS_FILE_MAX_DEPTH = 16  # flags files within flags files
FLAGS_FILES_MAX = 1000  # flags files read for one command line (a file naming another many times, nested)
FLAGS_FILES_MAX_BYTES = 1 << 20  # all of them together: one file named many times must not expand without end
# Arguments on the command line, flags files expanded: every flag once is under 1,000, and argparse takes time
# quadratic in their number (16,000 take it half a minute).
ARGS_MAX = 4096


def expand_preset_files(argv: list, including: tuple = (), read: list = None) -> list:
    """@FILE arguments replaced by the flags in FILE (written as on a command line; # starts a comment), which may
    name flags files of their own, within FLAGS_FILES_MAX files and FLAGS_FILES_MAX_BYTES bytes in all. including:
    the files whose flags are being read, outermost first; read: the bytes of every flags file read so far."""
    out, read = [], [] if read is None else read
    for arg in argv:
        if not arg.startswith("@"):
            out.append(arg)
            continue
        chain = (*including, arg[1:])
        if len(read) >= FLAGS_FILES_MAX:
            raise ConfigError(f"@{chain[0]}: reads more than {FLAGS_FILES_MAX} flags files (one named many times over "
                              "in nested files?); name each flags file once")
        out.extend(expand_preset_files(_read_flags_file(chain, read), chain, read))
    if not including and len(out) > ARGS_MAX:
        files = " ".join(a for a in argv if a.startswith("@"))[:200]
        raise ConfigError(f"the command line{' with ' + files if files else ''} holds more than {ARGS_MAX} arguments; "
                          "give each flag once")
    return out


def _read_flags_file(chain: tuple, read: list) -> list:
    """The flags in the last file of chain (the files including it before it), its size appended to read; a cycle,
    a file too deep, too large (alone, or with the files read before it), not text or not splittable is a one-line
    ConfigError naming it."""
    path = chain[-1]
    if os.path.realpath(path) in map(os.path.realpath, chain[:-1]):
        raise ConfigError(f"{' -> '.join('@' + p for p in chain)}: the flags file includes itself; remove the @ line "
                          "that closes the cycle")
    if len(chain) > FLAGS_FILE_MAX_DEPTH:
        raise ConfigError(f"@{path}: flags files nest more than {FLAGS_FILE_MAX_DEPTH} deep (@{chain[0]} -> ...); "
                          "name fewer flags files inside flags files")
    try:
        with open(path, "rb") as f:
            data = f.read(FLAGS_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"@{path}: cannot read the flags file ({e.strerror})") from None
    if len(data) > FLAGS_FILE_MAX_BYTES:
        raise ConfigError(f"@{path}: the flags file is larger than {FLAGS_FILE_MAX_BYTES >> 20} MiB: not a flags "
                          "file? Give one with flags written as on a command line")
    read.append(len(data))
    if sum(read) > FLAGS_FILES_MAX_BYTES:
        raise ConfigError(f"@{chain[0]}: its flags files hold more than {FLAGS_FILES_MAX_BYTES / 2**20:g} MiB together "
                          f"(@{path} named many times over?); name each flags file once")
    try:
        text = data.decode("utf-8")
        if "\0" in text:
            raise ValueError("a NUL byte")
    except ValueError as e:  # UnicodeDecodeError too
        where = f" at byte {e.start}" if isinstance(e, UnicodeDecodeError) else f" ({e})"
        raise ConfigError(f"@{path}: the flags file is not text{where}; give one with flags written as on a command "
                          "line") from None
    try:
        return shlex.split(text, comments=True)
    except ValueError as e:  # "No closing quotation", "No escaped character"
        raise ConfigError(f"@{path}: the flags file cannot be split into flags ({e}); close the quote, or escape "
                          "it with a backslash") from None
