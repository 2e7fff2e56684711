"""Where a prompt dataset's rows come from, read with Hugging Face `datasets` as OpenRLHF reads them: a data file
(JSON, CSV, Parquet, Arrow), a dataset folder (the Hub's layout or a save_to_disk folder), a Hub dataset id, and a
mixture of several. JSON-lines files are read by data/prompts.py, whose errors name the bad line."""

import contextlib
import logging
import math
import os

from openrlhf_async.errors import ConfigError

TABLE_FILES = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
LOCAL_SUFFIXES = (".jsonl", *TABLE_FILES)  # a name ending so is a path, never a Hub id


def dataset_names(spec: str, split: str, flag: str) -> list:
    """[(name, split)] of a comma-separated dataset flag; `name@split` picks that dataset's own split."""
    names = []
    for name in filter(None, (n.strip() for n in spec.split(","))):
        if "@" in name and not os.path.exists(name):
            name, _, own_split = name.rpartition("@")
            names.append((name.strip(), own_split.strip() or split))
        else:
            names.append((name, split))
    if not names:
        raise ConfigError(f"{flag} {spec!r}: names no dataset")
    return names


def mixture_probs(probs, count: int):
    """--data.prompt_probs as floats, one per dataset; None (concatenate the datasets) when unset."""
    if not probs:
        return None
    try:
        values = [float(p) for p in probs.split(",")]
    except ValueError:
        values = []
    if len(values) != count or min(values) < 0 or not math.isclose(sum(values), 1.0, abs_tol=1e-8):
        raise ConfigError(f"--data.prompt_probs {probs}: give {count} probabilities summing to 1, comma-separated, "
                          f"one per --data.prompt_dataset")
    return values


def read_dataset(name: str, split: str, flag: str, max_samples: int) -> list:
    """The first max_samples rows (dicts) of a table file (TABLE_FILES), a dataset folder or a Hub dataset id. split
    picks one split of a folder or Hub dataset; a file is a split of its own."""
    where = f"{flag} {name}"
    with _quiet_library_output():
        data = _load(name, where)
    data = _pick_split(data, split, where)
    return data.select(range(min(max_samples, len(data)))).to_list()


def _load(name: str, where: str):
    import datasets

    suffix = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        return _attempt(lambda: datasets.load_dataset(TABLE_FILES[suffix], data_files=name, split="train"), where,
                        "could not be read")
    if os.path.isdir(name):
        if any(os.path.isfile(os.path.join(name, f)) for f in ("state.json", "dataset_dict.json")):
            return _attempt(lambda: datasets.load_from_disk(name), where, "could not be read (a save_to_disk folder)")
        return _attempt(lambda: datasets.load_dataset(name), where, "could not be read as a dataset folder")
    if suffix in LOCAL_SUFFIXES or name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(f"{where}: no such file" if suffix else f"{where}: no such file or folder")
    return _attempt(lambda: datasets.load_dataset(name), where,
                    "is no local file or folder and could not be fetched from the Hugging Face Hub",
                    "; give a local file or folder, or a Hub dataset id this machine can reach")


def _attempt(load, where: str, failure: str, advice: str = ""):
    """load(), its failure as a one-line ConfigError: the cause the library chained, not its wrapper."""
    try:
        return load()
    except Exception as e:
        while e.__cause__ is not None:
            e = e.__cause__
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"{where}: {failure} ({type(e).__name__}: {reason}){advice}") from None


def _pick_split(data, split: str, where: str):
    import datasets

    if isinstance(data, datasets.Dataset):
        return data
    if split not in data:
        raise ConfigError(f"{where}: has no split {split!r}, only {', '.join(data)}; pick one as NAME@SPLIT")
    return data[split]


@contextlib.contextmanager
def _quiet_library_output():
    """The libraries' retry warnings, read errors and split-building bars would repeat, over many lines, what the
    one-line error says."""
    import datasets  # first: importing it sets its loggers' levels

    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if bars_were_on:
            datasets.utils.enable_progress_bars()


def mix(parts: list, probs, seed: int) -> list:
    """Several datasets' rows in one list: concatenated, or with probs interleaved as OpenRLHF does
    (datasets.interleave_datasets, seeded, until every dataset is used up, so the smaller ones repeat)."""
    if probs is None:
        return [row for rows in parts for row in rows]
    import datasets

    # Interleave row numbers, not rows: the datasets need not share columns or types, and the order is the same.
    numbers = [datasets.Dataset.from_dict({"part": [i] * len(rows), "row": list(range(len(rows)))})
               for i, rows in enumerate(parts)]
    order = datasets.interleave_datasets(numbers, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
    return [parts[part][row] for part, row in zip(order["part"], order["row"])]
