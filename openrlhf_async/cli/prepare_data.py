"""Convert a published math RL dataset into the project's prompt/label JSONL:
`python -m openrlhf_async.cli.prepare_data --dataset dapo-math-17k --input <file or folder> --output data/`.

Input: a Parquet, JSONL or JSON file, or a folder of them (a Hugging Face snapshot: data/*.parquet), every one
converted. Output: <output>/<dataset>.jsonl with {"prompt", "label", "id", "source"} rows (data/formats.py), then a
summary and a final JSON line with the counts. A bad row (no label, a prompt that is not text, a line that is not
JSON, a label that is a list, an object, a boolean or NaN) is skipped and counted, and the summary names the first;
so is a file of a folder that is in another schema or unreadable, with a warning (no file that fits: an error)."""

import argparse
import filecmp
import json
import os
import sys

from openrlhf_async.data.prompts import json_lines

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def parse_args(argv=None):
    from openrlhf_async.data.formats import DATASETS

    parser = argparse.ArgumentParser(prog="python -m openrlhf_async.cli.prepare_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, choices=DATASETS)
    parser.add_argument("--input", required=True, help="a .parquet/.jsonl/.json file or a folder of them (all read)")
    parser.add_argument("--output", required=True, help="folder for <dataset>.jsonl")
    parser.add_argument("--system_prompt", default="", help="prepend this system turn (prompts become messages)")
    parser.add_argument("--instruction", default="",
                        help="replace the dataset's own instruction: bare problem + this text")
    parser.add_argument("--no-dedup", dest="dedup", action="store_false", help="keep repeated prompts")
    parser.add_argument("--max_samples", type=int, default=None, help="stop after this many rows written")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing <dataset>.jsonl that holds another preparation")
    args = parser.parse_args(argv)
    if args.max_samples is not None and args.max_samples < 1:
        parser.error(f"--max_samples {args.max_samples}: must be at least 1")
    return args


def input_files(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"--input {path}: no such file or folder")
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .cache/.git of a hub snapshot
        found += [os.path.join(root, f) for f in files if f.endswith(DATA_SUFFIXES)]
    if not found:
        raise ValueError(f"--input {path}: no {', '.join(DATA_SUFFIXES)} files in the folder")
    return sorted(found)


def read_batches(path: str):
    """(column names, iterator of row batches) for one file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            raise ValueError(f"--input {path}: not a readable Parquet file ({e})") from None
        return pf.schema_arrow.names, (b.to_pylist() for b in pf.iter_batches(batch_size=8192))
    with open(path, "rb") as f:
        data = f.read()
    try:
        rows = json.loads(data)  # one JSON document; else JSON lines (what datasets' to_json writes, even to .json)
    except (ValueError, RecursionError):
        # A line that holds no JSON value is a bad row, counted and skipped like the others.
        rows = json_lines(data.splitlines(), f"--input {path}", keep_bad=True)
    if not isinstance(rows, list):
        rows = [rows]
    columns = set().union(*(r.keys() for r in rows if isinstance(r, dict)))
    return columns, iter([rows])


def convert_files(args, files: list, out_path: str):
    from openrlhf_async.data.formats import Converter, detect_schema

    converter = Converter(args.dataset, args.instruction, args.system_prompt, args.dedup, args.max_samples)
    counts = converter.counts
    with open(out_path, "w", encoding="utf-8") as out:
        for path in files:
            try:
                columns, batches = read_batches(path)
                schema = detect_schema(args.dataset, columns)
            except ValueError as e:  # FormatError too: a file of a folder that is no such dataset; the others may be
                reason = str(e) if str(e).startswith("--input ") else f"--input {path}: {e}"
                counts.files_skipped += 1
                counts.first_skipped_file = counts.first_skipped_file or reason
                if counts.files_skipped == len(files):
                    raise ValueError(reason if len(files) == 1 else
                                     f"no file of the {len(files)} in --input {args.input} fits; the first: "
                                     f"{counts.first_skipped_file}") from None
                print(f"warning: {reason}; skipped", file=sys.stderr, flush=True)
                continue
            for batch in batches:
                for row in converter.convert(schema, batch):
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                if converter.full:
                    return converter.counts
    return converter.counts


def main(argv=None) -> int:
    args = parse_args(argv)
    out_path = os.path.join(args.output, f"{args.dataset}.jsonl")
    tmp_path = out_path + ".tmp"
    try:
        files = input_files(args.input)
        os.makedirs(args.output, exist_ok=True)
        counts = convert_files(args, files, tmp_path)
        if not counts.written:
            why = [f"{counts.bad_rows_skipped} bad, the first is row {counts.first_bad_row}, which "
                   f"{counts.first_bad_reason}"] if counts.bad_rows_skipped else []
            why += [f"{counts.non_math_dropped} not math"] if counts.non_math_dropped else []
            raise ValueError(f"--input {args.input}: no usable row in the {counts.rows_read} rows read"
                             + (f" ({'; '.join(why)})" if why else ""))
        if os.path.exists(out_path) and not args.overwrite and not filecmp.cmp(tmp_path, out_path, shallow=False):
            raise ValueError(f"{out_path} exists and holds another preparation (other flags or input): pass "
                             "--overwrite to replace it, or write this one to another --output folder")
        os.replace(tmp_path, out_path)
    except (ValueError, OSError) as e:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.dataset}: read {counts.rows_read} rows from {len(files)} file(s), wrote {counts.written} to "
          f"{out_path}; dropped {counts.duplicates_dropped} duplicates"
          + (f" ({counts.label_conflicts} with a different label)" if counts.label_conflicts else "")
          + (f", {counts.non_math_dropped} non-math rows" if counts.non_math_dropped else "")
          + f", skipped {counts.bad_rows_skipped} bad rows"
          + (f" (the first is row {counts.first_bad_row}, which {counts.first_bad_reason})"
             if counts.bad_rows_skipped else "")
          + (f"; skipped {counts.files_skipped} file(s) (the first: {counts.first_skipped_file})"
             if counts.files_skipped else ""))
    print(json.dumps({"dataset": args.dataset, "rows_read": counts.rows_read, "written": counts.written,
                      "duplicates_dropped": counts.duplicates_dropped, "label_conflicts": counts.label_conflicts,
                      "bad_rows_skipped": counts.bad_rows_skipped, "first_bad_row": counts.first_bad_row,
                      "non_math_dropped": counts.non_math_dropped, "files_skipped": counts.files_skipped,
                      "output": out_path}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
