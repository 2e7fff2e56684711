"""docs/FLAGS.md's table of every OpenRLHF 0.11.2 `train_ppo_ray` flag and how it is supported here, generated from
the config: `python -m openrlhf_async.cli.flag_table`, pasted between that page's flag-table markers
(tests/test_readme.py checks that they agree)."""

from openrlhf_async.config import settings, support

# Defaults that are not one value: shown in words (this one is the time the run's process started).
_SHOWN = {"logger.wandb.run_name": "ppo_%m%dT%H:%M (the start time)",
          "algo.advantage.is_correction_threshold": "0.5 5 (clip: 5)"}
_SUPPORT = {"same": "same as OpenRLHF"}


def shown(value) -> str:
    """A default as it would be written on a command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return ("%g" % value).replace("e-0", "e-").replace("e+0", "e+")
    if isinstance(value, (tuple, list)):
        return " ".join(shown(v) for v in value)
    return str(value) if value != "" else '""'


def table() -> str:
    """A Markdown table, one row per OpenRLHF flag sorted by flag: flag | default here | support."""
    lines = ["| flag | default here | support |", "|---|---|---|"]
    for flag, (_name, f) in sorted(settings().items()):
        kind, why = support(f)
        if kind is None:  # this project's own flag: --help describes it
            continue
        default = _SHOWN.get(flag) or shown(f.default)
        lines.append(f"| `--{flag}` | `{default}` | {_SUPPORT.get(kind) or f'{kind}: {why}'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
