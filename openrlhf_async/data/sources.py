"""Where a prompt dataset's rows come from, as OpenRLHF reads them: a data file (JSON, CSV, Parquet, Arrow), a dataset
folder (the Hub's layout or a save_to_disk folder), a Hub dataset id, and a mixture of several; each within a row and
byte budget (Budget). JSON-lines files are read by data/prompts.py, whose errors name the bad line."""

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


# A dataset is read within these budgets, whatever --data.max_samples allows: each row becomes a Python dict of a few
# hundred bytes however short it is, so a small compressed file of millions of identical rows would fill the memory.
ROWS_MAX = 1_000_000
BYTES_MAX = 1 << 29  # of the rows' values, decoded
BATCH_ROWS = 10_000  # rows decoded at a time, each batch counted before it becomes Python rows
SAMPLES_FLAG = {"--eval.dataset": "--eval.max_samples"}  # else --data.max_samples


class Budget:
    """A dataset's rows and bytes counted as they are read; past ROWS_MAX or BYTES_MAX, a one-line ConfigError naming
    the file and the budget."""

    def __init__(self, where: str, flag: str):
        self.where, self.samples_flag = where, SAMPLES_FLAG.get(flag, "--data.max_samples")
        self.rows = self.bytes = 0

    def most(self, max_samples: int) -> int:
        """The rows to read: max_samples, or one past the budget (to tell a dataset past it)."""
        return min(max_samples, ROWS_MAX + 1)

    @property
    def bytes_left(self) -> int:
        return BYTES_MAX - self.bytes

    def take(self, rows: int, size: int) -> None:
        self.rows, self.bytes = self.rows + rows, self.bytes + size
        if self.rows > ROWS_MAX:
            raise ConfigError(f"{self.where}: holds more than {ROWS_MAX:,} rows, the most a dataset is read with; pass "
                              f"{self.samples_flag} N (at most {ROWS_MAX}) to read its first N rows, or give a "
                              "smaller dataset")
        if self.bytes > BYTES_MAX:
            raise ConfigError(f"{self.where}: its first {self.rows:,} rows hold more than {BYTES_MAX / 2**20:g} MiB, "
                              f"the most a dataset is read with; pass {self.samples_flag} N to read fewer rows, or "
                              "give shorter ones")


def read_dataset(name: str, split: str, flag: str, max_samples: int) -> list:
    """The first max_samples rows (dicts) of a table file (TABLE_FILES), a dataset folder or a Hub dataset id, within
    the Budget. A Parquet or Arrow file is read a batch at a time and leaves no cache; the others go through Hugging
    Face datasets. split picks one split of a folder or Hub dataset; a file is a split of its own."""
    where, suffix = f"{flag} {name}", os.path.splitext(name)[1].lower()
    if os.path.isfile(name) and suffix in (".parquet", ".arrow"):
        return _attempt(lambda: _budgeted_rows(_file_batches(name, suffix), Budget(where, flag), max_samples), where,
                        "could not be read")
    with _quiet_library_output():
        data = _load(name, where)
    data = _pick_split(data, split, where)
    return _budgeted_rows(data.with_format("arrow").iter(batch_size=BATCH_ROWS), Budget(where, flag), max_samples)


def _file_batches(path: str, suffix: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if suffix == ".parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        return
    with pa.memory_map(path) as source:
        try:  # Hugging Face datasets writes the stream format; the file format is read too
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            file = pa.ipc.open_file(source)
            reader = (file.get_batch(i) for i in range(file.num_record_batches))
        yield from reader


def _budgeted_rows(batches, budget: Budget, most: int) -> list:
    """The first `most` rows of Arrow batches (or tables) as dicts, each slice of BATCH_ROWS rows counted, its
    dictionary-encoded columns decoded (as Python will hold them), before it becomes Python rows."""
    import pyarrow as pa

    rows, most = [], budget.most(most)
    for batch in batches:
        for part in batch.to_batches() if isinstance(batch, pa.Table) else [batch]:
            for start in range(0, part.num_rows, BATCH_ROWS):
                if len(rows) >= most:
                    return rows
                piece = part.slice(start, min(BATCH_ROWS, most - len(rows)))
                piece = pa.RecordBatch.from_arrays(
                    [c.dictionary_decode() if pa.types.is_dictionary(c.type) else c for c in piece.columns],
                    names=piece.schema.names)
                budget.take(piece.num_rows, piece.nbytes)
                rows.extend(piece.to_pylist())
    return rows


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
    except ConfigError:  # a Budget's, already one line
        raise
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
