"""User-given JSON text (flags, files read at check time), parsed with a bound on its nesting: json's parser recurses
per level, and 200k levels end in a RecursionError traceback rather than a line naming the flag or file."""

import itertools
import json
import re

from openrlhf_async.errors import ConfigError

DEPTH_MAX = 100  # nesting levels; configs and generator settings use a handful
# Strings (their brackets are text; one left open runs to the end, so no text makes it backtrack) and all else.
_NOT_BRACKETS = re.compile(r'"(?:[^"\\]++|\\.)*+"?|[^][{}"]+')


def depth(text: str) -> int:
    """The deepest nesting of brackets outside strings, in one linear pass."""
    brackets = _NOT_BRACKETS.sub("", text)
    return max(itertools.accumulate(1 if c in "[{" else -1 if c in "]}" else 0 for c in brackets), default=0)


def loads(text, what: str, error: type = ConfigError):
    """json.loads(text), refused with `error` naming `what` (a flag, or a file and its flag) when it nests deeper
    than DEPTH_MAX; a text that is not JSON raises json's own ValueError, for the caller to word."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if depth(text) > DEPTH_MAX:
        raise error(f"{what}: the JSON nests deeper than {DEPTH_MAX} levels; give a flatter one")
    return json.loads(text)
