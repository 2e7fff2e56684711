"""What a setting is: one `setting(...)` field carrying its default, its --help text, its choices, range and bound,
its flag spelling and its OpenRLHF support. The schema (schema.py) declares every setting with it; the parser
(command_line.py) and the checks (checks.py) read these fields' metadata."""

import os
from dataclasses import field

from openrlhf_async.errors import ConfigError


# A setting's range: a test of each value (each of a pair's) and what the error says.
EACH = {
    "> 0": (lambda v: v > 0, "must be above 0"),
    "> 0 s": (lambda v: v > 0, "must be above 0 seconds"),
    ">= 0": (lambda v: v >= 0, "must not be negative"),
    ">= 1": (lambda v: v >= 1, "must be at least 1"),
    "> 1": (lambda v: v > 1, "must be above 1"),
    "<= 1": (lambda v: v <= 1, "must not be above 1"),
    "[0, 1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "(0, 1]": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "[0, 1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "-1 or >= 1": (lambda v: v == -1 or v >= 1, "use -1 (never) or a number of steps from 1"),
}
# A (low, high) setting's range: a test of the pair.
PAIR = {
    "low < high": (lambda low, high: low < high, "the low end must be below the high end"),
    "low <= high": (lambda low, high: low <= high, "the low end must not be above the high end"),
    "0 < low < 1 < high": (lambda low, high: 0 < low < 1 < high, "need 0 < low < 1 < high"),
}

# How a flag of OpenRLHF 0.11.2 is supported (the `openrlhf=` of a setting; None: this project's own flag):
#   "same"            its meaning and default there;
#   "differs: WHY"    supported, with the difference WHY (shown in docs/FLAGS.md's flag table);
#   "refused: WHY"    a value other than the default stops the run before anything starts (it would change what is
#                     trained, and is not built);
#   "no effect: WHY"  accepted; a value other than the default prints one notice (it tunes speed or memory with
#                     something this system does not use).
SUPPORT_KINDS = ("same", "differs", "refused", "no effect")


# Every number a setting holds is bounded, so that a value its use cannot take fails here with one line instead of
# after start-up (an OverflowError, a seed numpy refuses, a sleep that never ends, a pool of 10^20 workers):
INT_LIMIT = 2**31 - 1  # an int setting's magnitude unless its `most` is lower: C int, as vLLM, torch and numpy take
FLOAT_LIMIT = 1e15  # a float setting's magnitude: rewards, clips and coefficients meet in fp32 sums and squares
WEEK_S = 7 * 24 * 3600  # a timeout's (range "> 0 s") upper end: past it nothing waits, and 1e308 s overflows
SEED_MAX = 2**31 - 1  # seeds reach numpy (below 2**32) as the seed plus an engine index or weight version
PER_NODE_MAX = 1024  # GPUs, cores, ranks or worker processes one node can hold
NODES_MAX = 4096  # nodes (or engines) one Ray cluster holds


def setting(default, help: str, choices: tuple = None, range: str = None, flag: str = None, openrlhf: str = None,
            type=None, nargs=None, most=None, beyond: str = ""):
    """A config field with its --help text, its allowed values (choices, or a range of EACH or PAIR, and at most
    `most`: INT_LIMIT, FLOAT_LIMIT or WEEK_S when not given; `beyond`: what the error past it adds), its flag where
    it is spelled other than --<section>.<field>, its OpenRLHF support, and (for a default of None) the type and
    nargs of its value."""
    assert help and (range is None or range in EACH or range in PAIR), (help, range)
    assert openrlhf is None or openrlhf.split(":")[0] in SUPPORT_KINDS, openrlhf
    return field(default=default, metadata={"help": help, "choices": choices, "range": range, "flag": flag,
                                            "openrlhf": openrlhf, "type": type, "nargs": nargs, "most": most,
                                            "beyond": beyond})



def support(f) -> tuple:
    """(kind, why) of an OpenRLHF flag's support: ("same", ""), ("differs", why), ("refused", why) or
    ("no effect", why); (None, "") for a flag of this project's own."""
    kind, _, why = (f.metadata["openrlhf"] or "").partition(": ")
    return kind or None, why


def value_type(f):
    """The type of a setting's value (of each of a pair's): its `type=`, else its default's."""
    if f.metadata["type"]:
        return f.metadata["type"]
    return type(f.default[0]) if isinstance(f.default, tuple) else type(f.default)


def env_int(name: str, flag: str, default: int) -> int:
    """The whole number in environment variable `name` (which overrides `flag`), else default."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text[:40]!r} (the environment override of {flag}): must be a whole number; "
                          f"fix or unset it") from None
    if abs(value) > INT_LIMIT:
        raise ConfigError(f"{name}={text[:40]} (the environment override of {flag}): must be at most {INT_LIMIT}; "
                          f"fix or unset it")
    return value
