"""Prompt datasets: rows with a prompt field (text or chat messages) and a label field, from JSON-lines files read
here or any other source read by data/sources.py; their tokenisation; the sampler's epoch order."""

import json
import math
import os
import random
import re
import reprlib
import string
import sys

from openrlhf_async.data.sources import TABLE_FILES, Budget, dataset_names, mix, mixture_probs, read_dataset
from openrlhf_async.errors import ConfigError


def read_rows(name: str, split: str, flag: str, max_samples: int) -> list:
    """One dataset's first max_samples rows, within its Budget (data/sources.py). A file that is no table file
    (TABLE_FILES) is JSON lines, read here a line at a time so that an error names the bad line; everything else is
    sources.read_dataset's."""
    if os.path.isfile(name) and os.path.splitext(name)[1].lower() not in TABLE_FILES:
        budget = Budget(f"{flag} {name}", flag)
        with open(name, "rb") as f:  # bytes: a line that is not UTF-8 is a bad line, not a failed read
            rows = json_lines(_budgeted_lines(f, budget), budget.where, most=budget.most(max_samples))
        budget.take(len(rows), 0)
        return rows
    return read_dataset(name, split, flag, max_samples)


def _budgeted_lines(f, budget: Budget):
    while True:  # readline's limit: one endless line is read no further than the budget
        line = f.readline(budget.bytes_left + 1)
        if not line:
            return
        budget.take(0, len(line))
        yield line


MAX_DEPTH = 64  # how deeply a row's JSON may nest (a chat prompt: 3 levels); deeper is malformed or hostile


_BLANK = object()  # what _parse_line returns for a blank line


class BadLine:
    """A line of a JSON-lines file that holds no JSON value, in place of its row (json_lines with keep_bad)."""

    def __init__(self, reason: str):
        self.reason = reason


def json_lines(lines, where: str, check=None, keep_bad: bool = False, most: int = None) -> list:
    """One JSON value per non-blank line (text, or bytes decoded as UTF-8), the first `most` of them; a bad line is a
    ConfigError naming `where` and the line, or with keep_bad a BadLine in the rows. check(value): what is wrong with
    a parsed value ("does not have ..."), or None when it is fine."""
    rows = []
    for line_no, line in enumerate(lines, 1):
        if most is not None and len(rows) >= most:
            break
        row, problem = _parse_line(line)
        if row is _BLANK:
            continue
        problem = problem or (check and check(row))
        if problem and keep_bad:
            row = BadLine(problem)
        elif problem:
            raise ConfigError(f"{where}: line {line_no} {problem}")
        rows.append(row)
    return rows


def _parse_line(line):
    """(JSON value, None), (None, what is wrong with the line), or (_BLANK, None)."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:
            return None, "is not UTF-8 text"
    if not line.strip():
        return _BLANK, None
    try:
        value = json.loads(line)
    except RecursionError:
        return None, f"is nested more than {MAX_DEPTH} levels deep"
    except ValueError as e:  # JSONDecodeError, or a number too long to convert
        return None, f"is not valid JSON ({getattr(e, 'msg', None) or (str(e).splitlines() or [''])[0]})"
    if _nests_deeper(value, MAX_DEPTH):
        return None, f"is nested more than {MAX_DEPTH} levels deep"
    return value, None


def _nests_deeper(value, limit: int) -> bool:
    level = [value]
    for _ in range(limit):
        level = [child for v in level if isinstance(v, (list, dict))
                 for child in (v.values() if isinstance(v, dict) else v)]
        if not level:
            return False
    return True


def as_prompt(value):
    """A text prompt or a list of {"role", "content"} text messages with a user turn; None for anything else."""
    if isinstance(value, str):
        return value if value.strip() else None
    if not isinstance(value, list) or not value:
        return None
    messages = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        messages.append({"role": m["role"], "content": m["content"]})  # Parquet structs carry extra null keys
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return None
    return messages


def label_problem(value):
    """What is wrong with a dataset label, or None: a label is text or a number, as the reward reads it. A list, an
    object or a boolean would become its Python spelling ("[4]", "True") that no answer matches, and NaN or inf is
    a table's missing value, so such a row is skipped (and counted) rather than trained on a label nothing earns."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "empty"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        kind = {bool: "a boolean", list: "a list", dict: "an object"}.get(type(value), f"a {type(value).__name__}")
        return f"{kind} ({reprlib.repr(value)}), not text or a number: store it as text"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} (a missing value?), not text or a number"
    return None


def label_text(value) -> str:
    """A label that passed label_problem, as text."""
    return value if isinstance(value, str) else str(value)


_MISSING = object()  # what field() gives for a field the row lacks

# A row's fields that travel with its prompt to a veRL compute_score reward (reward/verl_score.py), as "info".
ROW_INFO = ("data_source", "extra_info")


def field(row: dict, key: str):
    """row[key]; for a dotted key (reward_model.ground_truth) that is no field of the row, the nested field it
    names; _MISSING when there is none."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _names(fields: dict, most: int = 20) -> str:
    names = [" ".join(str(name).split())[:40] for name in fields]  # one line, whatever the field names hold
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more if names else "no field"


def _fields_held(row: dict, missing: dict) -> str:
    """Which flags' keys (missing: flag -> key) a row lacks, the fields it has, and those of the nested field where
    a missing dotted key stops: what to name instead."""
    said = [f"no {' or '.join(f'{flag} {key}' for flag, key in missing.items())}: the row has {_names(row)}"]
    for key in missing.values():
        value, walked = row, []
        for part in key.split(".")[:-1]:
            if not isinstance(value.get(part), dict):
                break
            value, walked = value[part], walked + [part]
        if walked:
            said.append(f"{'.'.join(walked)} has {_names(value)}")
    return "; ".join(said)


def _bad_row_reason(row, input_key: str, label_key):
    keys = (input_key,) if label_key is None else (input_key, label_key)
    if not isinstance(row, dict):
        return f"has no {' or '.join(map(repr, keys))} field (it is no record)"
    missing = {flag: key for flag, key in zip(("--data.input_key", "--data.label_key"), keys)
               if field(row, key) is _MISSING}
    if missing:
        return f"has no {' or '.join(map(repr, keys))} field ({_fields_held(row, missing)})"
    problem = None if label_key is None else label_problem(field(row, label_key))
    if problem == "empty":
        return f"has an empty {label_key!r} field"
    if problem:
        return f"has a {label_key!r} field that is {problem}"
    if as_prompt(field(row, input_key)) is None:
        return f"has a {input_key!r} field that is neither text nor chat messages with a user turn"
    return None


# Ordinary text is a few characters per token; only long runs of one character come near this many. A prompt longer
# than --data.max_len x this cannot fit, so it is skipped without being tokenised (a 30 MB prompt took 12 GB to).
CHARS_PER_TOKEN_MAX = 64


def _prompt_chars(prompt) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


def load_prompts(spec: str, input_key: str, label_key, flag: str, max_samples: int = 100_000_000, *,
                 split: str = "train", probs=None, seed: int = 42, max_len: int = None) -> list:
    """Return [{"prompt": str | [{"role", "content"}], "label": str}] from spec's comma-separated datasets (each a
    file, a folder or a Hub id, maybe name@split), concatenated, or mixed with probs (--data.prompt_probs) and seed;
    at most max_samples from each and in all. The keys may be dotted (field()). label_key None: every label is "".
    A row's data_source and extra_info fields (ROW_INFO) go along as "info". max_len (--data.max_len): rows whose
    prompt is too long for it by its characters alone are skipped and counted."""
    names = dataset_names(spec, split, flag)
    probs = mixture_probs(probs, len(names))
    parts = [_usable_rows(read_rows(name, own_split, flag, max_samples), input_key, label_key, f"{flag} {name}",
                          max_len) for name, own_split in names]
    return mix(parts, probs, seed)[:max_samples]


def _usable_rows(rows: list, input_key: str, label_key, where: str, max_len: int = None) -> list:
    """Rows without a label or a text prompt, and rows whose prompt has more than CHARS_PER_TOKEN_MAX x max_len
    characters, are skipped and reported once each on stderr; an empty or wholly unusable dataset is a one-line
    error."""
    if not rows:
        raise ConfigError(f"{where}: the dataset is empty")
    max_chars = max_len and max_len * CHARS_PER_TOKEN_MAX
    out, bad, first_bad, too_long, first_long = [], 0, None, 0, None
    for i, row in enumerate(rows):
        reason = _bad_row_reason(row, input_key, label_key)
        if reason:
            bad += 1
            first_bad = first_bad or (i, reason)
            continue
        prompt = as_prompt(field(row, input_key))
        if max_chars and _prompt_chars(prompt) > max_chars:
            too_long += 1
            first_long = first_long if first_long is not None else i
            continue
        info = {key: row[key] for key in ROW_INFO if row.get(key) is not None}
        out.append({"prompt": prompt, "label": "" if label_key is None else label_text(field(row, label_key)),
                    **({"info": info} if info else {})})
    long_text = (f"longer than {max_chars} characters, more than --data.max_len {max_len} tokens can hold (the first "
                 f"is row {first_long})")
    if not out and too_long:
        raise ConfigError(f"{where}: every usable prompt is {long_text}; raise --data.max_len or give shorter prompts")
    if not out:
        raise ConfigError(f"{where}: row {first_bad[0]} {first_bad[1]}, and no row is usable "
                          f"(set --data.input_key / --data.label_key to the dataset's field names)")
    if bad:
        wanted = f"{input_key!r} prompt" + ("" if label_key is None else f" or {label_key!r} label")
        print(f"warning: {where}: skipped {bad} rows without a usable {wanted}; the first is row {first_bad[0]}, "
              f"which {first_bad[1]}", file=sys.stderr)
    if too_long:
        print(f"warning: {where}: skipped {too_long} rows whose prompt is {long_text}", file=sys.stderr)
    return out


def check_input_template(template) -> None:
    """OpenRLHF drops a template without "{}" with a warning; here it is an error, as is one str.format cannot fill
    with the prompt alone."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template or "{}") if field is not None]
    except ValueError:  # an unmatched brace
        fields = None
    if fields != [""]:
        raise ConfigError(f"--data.input_template {template!r}: give one {{}} where the prompt goes (other braces "
                          f"doubled: {{{{ }}}})")


def tokenize_prompts(tokenizer, rows: list, apply_chat_template: bool, input_template=None,
                     parse_special_tokens: bool = True, where: str = "--data.prompt_dataset") -> list:
    """Prompt rows to [{"prompt_ids", "label", "prompt"}]; a text prompt is one user turn, a message list goes in whole.
    Without the chat template, the text (a message list's contents, a line each) goes into input_template's {}.
    parse_special_tokens (--data.parse_special_tokens): the dataset's text may hold the tokenizer's special tokens,
    encoded as those tokens, as Hugging Face and OpenRLHF encode it (a warning counts the prompts that do); off, it is
    encoded as plain text, and only the template's own special tokens are special."""
    special = _special_tokens(tokenizer)
    added = None if parse_special_tokens or apply_chat_template else _added_around(tokenizer)
    out, forged = [], []
    for row in rows:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if parse_special_tokens and any(special.search(m["content"]) for m in messages):
            forged.append(len(out))
        if not parse_special_tokens:
            ids = _encode_text_plainly(tokenizer, messages, apply_chat_template, input_template, added)
        elif apply_chat_template:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            text = "\n".join(m["content"] for m in messages)
            ids = tokenizer.encode(input_template.format(text) if input_template else text)
        # The prompt as the dataset gave it, for agents written against the OpenAI API (they send the messages).
        out.append({"prompt_ids": list(ids), "label": row["label"], "prompt": prompt,
                    **({"info": row["info"]} if "info" in row else {})})
    if forged:
        print(f"warning: {where}: {len(forged)} of {len(rows)} prompts (the first is prompt {forged[0]}) hold the "
              "tokenizer's special tokens, encoded as those tokens, so a row can write chat turns of its own; "
              "--no-data.parse_special_tokens encodes them as text", file=sys.stderr, flush=True)
    return out


# Private-use characters around each text of the dataset in a render, to tell it from the template's pieces.
_OPEN, _CLOSE = "\ue000", "\ue001"


def _encode_text_plainly(tokenizer, messages: list, apply_chat_template: bool, input_template, added) -> list:
    """The prompt's ids with the dataset's text encoded as plain text (split_special_tokens) and the template's pieces
    around it as usual, its special tokens included: the text is rendered between markers and each piece encoded on
    its own. added: what encode puts around a text (a BOS), which the chat template writes itself."""
    marked = [{**m, "content": _OPEN + m["content"].replace(_OPEN, "").replace(_CLOSE, "") + _CLOSE}
              for m in messages]
    if apply_chat_template:
        rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in marked)
        rendered = input_template.format(text) if input_template else text
    pieces = rendered.replace(_CLOSE, _OPEN).split(_OPEN)
    if len(pieces) != 2 * len(messages) + 1:  # a template that drops or repeats a message's text
        raise ConfigError("--no-data.parse_special_tokens: the chat template does not place each message's text once, "
                          "so the dataset's text cannot be told from the template's; drop the flag")
    ids = [t for i, piece in enumerate(pieces) if piece
           for t in tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=i % 2 == 1)]
    return ids if added is None else added[0] + ids + added[1]


def _added_around(tokenizer) -> tuple:
    """(before, after): the ids encode adds around a text (a BOS, an EOS), found around the ids of one letter."""
    inner, outer = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a")
    at = next((i for i in range(len(outer)) if outer[i:i + len(inner)] == inner), None)
    return ([], []) if at is None else (outer[:at], outer[at + len(inner):])


def _special_tokens(tokenizer):
    """A pattern matching the tokenizer's special tokens in text."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()  # none on a test's stand-in
    tokens = sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens)) if tokens else "(?!)")


def skip_unfit_prompts(prompts: list, max_len: int, where: str, mark: bool) -> list:
    """Tokenised prompts of max_len tokens or more leave no room for a response: they are skipped, with one warning
    that counts them; all of them is a one-line ConfigError. mark: they stay in the list marked "too_long", which
    PromptSampler passes over, so that the prompt stream (and a checkpoint's prompt count) stays the dataset's;
    else they are dropped."""
    unfit = [i for i, p in enumerate(prompts) if len(p["prompt_ids"]) >= max_len]
    if not unfit:
        return prompts
    first = _unfit_detail(prompts, unfit, range(len(prompts)))
    if len(unfit) == len(prompts):
        raise ConfigError(f"{where}: all {len(prompts)} prompts leave no room for a response within --data.max_len "
                          f"{max_len} ({first}); raise --data.max_len or give shorter prompts")
    print(f"warning: {where}: skipped {len(unfit)} of {len(prompts)} prompts that leave no room for a response "
          f"within --data.max_len {max_len} ({first})", file=sys.stderr, flush=True)
    if mark:
        return [{**p, "too_long": True} if len(p["prompt_ids"]) >= max_len else p for p in prompts]
    return [p for p in prompts if len(p["prompt_ids"]) < max_len]


def _unfit_detail(prompts: list, unfit: list, rows) -> str:
    longest = max(len(prompts[i]["prompt_ids"]) for i in unfit)
    return (f"the first is prompt {rows[unfit[0]]}, of {len(prompts[unfit[0]]['prompt_ids'])} tokens; the longest has "
            f"{longest}")


DRY_RUN_FIRST, DRY_RUN_SPREAD = 256, 64  # a dry run tokenises the first prompts, and this many spread over the rest


def dry_run_sample(n: int) -> list:
    """The row numbers of the prompts a dry run tokenises: the first DRY_RUN_FIRST, and DRY_RUN_SPREAD more spread
    evenly over the rest."""
    rest = range(DRY_RUN_FIRST, n)
    spread = min(len(rest), DRY_RUN_SPREAD)
    return list(range(min(n, DRY_RUN_FIRST))) + [rest[i * len(rest) // spread] for i in range(spread)]


def check_sample_lengths(prompts: list, rows: list, total: int, max_len: int, where: str) -> None:
    """What the start (skip_unfit_prompts) would say of a dataset of total prompts, from a dry run's tokenised sample
    of them (rows: their row numbers): a one-line ConfigError when every one leaves no room for a response, else a
    warning counting those that leave none."""
    if len(prompts) == total:  # the whole dataset: the start's own words
        skip_unfit_prompts(prompts, max_len, where, mark=False)
        return
    unfit = [i for i, p in enumerate(prompts) if len(p["prompt_ids"]) >= max_len]
    if not unfit:
        return
    first, tokenised = _unfit_detail(prompts, unfit, rows), f"prompts a dry run tokenised (of {total})"
    if len(unfit) == len(prompts):
        raise ConfigError(f"{where}: all {len(prompts)} {tokenised} leave no room for a response within "
                          f"--data.max_len {max_len} ({first}); raise --data.max_len or give shorter prompts")
    print(f"warning: {where}: {len(unfit)} of the {len(prompts)} {tokenised} leave no room for a response within "
          f"--data.max_len {max_len} ({first}); the start skips such prompts", file=sys.stderr, flush=True)


class PromptSampler:
    """An endless stream of prompts, epoch after epoch, each epoch a shuffle of the dataset seeded by (seed, epoch).
    Stream position p is row permutation(p // N)[p % N], so a position alone says which prompt it is and a resumed
    run can continue the same stream: it starts at `frontier` (every earlier position was used) and skips the
    positions in `done` (used already, beyond the frontier: groups that finished while earlier ones still ran).

    With skip_flat > 0, a prompt whose last group's rewards were all equal (row ids in `flat`, kept up to date with
    record()) is passed over with that probability when its turn comes, a coin seeded by (seed, position) so that
    a resumed run decides the same way. A passed-over position is used up without a group; take_skipped() lists
    them. Rows marked "too_long" (skip_unfit_prompts) are passed over the same way, always."""

    def __init__(self, rows: list, seed: int, frontier: int = 0, done=(), flat=(), skip_flat: float = 0.0):
        if rows and all(row.get("too_long") for row in rows):
            raise ValueError("every prompt is marked too long: no prompt to sample")
        self.rows, self.seed = rows, seed
        self.position, self.done = frontier, set(done)
        self.flat, self.skip_flat, self._skipped = set(flat), skip_flat, []
        self._epoch, self._order = None, []

    def row_id(self, position: int) -> int:
        epoch = position // len(self.rows)
        if epoch != self._epoch:
            self._order = list(range(len(self.rows)))
            random.Random(f"{self.seed}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order[position % len(self.rows)]

    def next(self) -> dict:
        """The next unused prompt row that is not passed over, with its stream "position" and dataset row "id"."""
        while True:
            while self.position in self.done:
                self.done.discard(self.position)
                self.position += 1
            position, self.position = self.position, self.position + 1
            row_id = self.row_id(position)
            if self.rows[row_id].get("too_long") or (
                    row_id in self.flat and self.skip_flat
                    and random.Random(f"{self.seed}:skip:{position}").random() < self.skip_flat):
                self._skipped.append((position, row_id))
                continue
            return {**self.rows[row_id], "position": position, "id": row_id}

    def take_skipped(self) -> list:
        """[(position, row id)] passed over since the last call."""
        skipped, self._skipped = self._skipped, []
        return skipped

    def record(self, outcomes) -> None:
        """outcomes: [(row id, whether its group's rewards were all equal)], oldest first."""
        record_flat(self.flat, outcomes)


def record_flat(flat: set, outcomes) -> None:
    for row_id, is_flat in outcomes:
        if is_flat:
            flat.add(row_id)
        else:
            flat.discard(row_id)


class StreamProgress:
    """Which stream positions are used up, kept small: a frontier (every position below it is used) and the used
    positions beyond it (groups that finished while earlier ones still ran); and which prompts' last groups were
    flat (all rewards equal), for --rollout.skip_flat_prompts."""

    def __init__(self, frontier: int = 0, done=(), flat=()):
        self.frontier, self.done, self.flat = frontier, set(done), set(flat)

    def add(self, positions, outcomes=()) -> None:
        self.done.update(positions)
        while self.frontier in self.done:
            self.done.remove(self.frontier)
            self.frontier += 1
        record_flat(self.flat, outcomes)

    def state(self) -> dict:
        """PromptSampler's keyword arguments to continue the stream after these positions."""
        return {"frontier": self.frontier, "done": sorted(self.done), "flat": sorted(self.flat)}
