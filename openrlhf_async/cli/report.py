"""Pictures of a run: `python -m openrlhf_async.cli.report <run_dir>` writes into the run folder
learning.png (reward/mean per step, eval accuracy and pass@k where evaluated) and timeline.png (a row per actor, a
bar per span coloured by kind, each row labelled with its busy share, so idle time and async overlap show at a
glance), then prints their paths and a final JSON line."""

import argparse
import json
import sys

from openrlhf_async.trainer.report import write_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_async.cli.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run folder with metrics.jsonl (and timeline.jsonl)")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.run_dir)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(p for p in (report["learning_png"], report["timeline_png"]) if p))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
