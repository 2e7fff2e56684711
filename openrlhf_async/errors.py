"""What a setting that is wrong, or surprising, gives at start: ConfigError (refused) or a notice (accepted). Below
the config and the translation of older OpenRLHF spellings (compat.py), which both raise and notice."""

import sys


class ConfigError(ValueError):
    """A bad flag, file or field; the message is one line naming it and the fix (a line per refusal when a command
    line has several: config.refuse_together)."""


def notice(message: str) -> None:
    """One line on stderr about a setting that is accepted but acts other than its name suggests."""
    print(f"notice: {message}", file=sys.stderr, flush=True)
