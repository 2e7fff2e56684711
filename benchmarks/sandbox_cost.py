"""The cost of one sandboxed run of model code: median wall time of `run_python("print(1)")`.

    python benchmarks/sandbox_cost.py [--runs 30]

Ends with one JSON line: {"runs", "median_ms", "p90_ms", "mode"} (mode: bwrap, or unsafe: no isolation)."""

import argparse
import json
import statistics
import time

from openrlhf_async.agent import sandbox


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    sandbox.run_python("print(0)")  # the first run probes the isolation and warms the page cache
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        result = sandbox.run_python("print(1)")
        times.append((time.perf_counter() - start) * 1000)
        assert result["stdout"] == "1\n", result
    times.sort()
    print(json.dumps({"runs": args.runs, "median_ms": round(statistics.median(times), 1),
                      "p90_ms": round(times[int(0.9 * (len(times) - 1))], 1),
                      "mode": sandbox.sandbox_mode()}))


if __name__ == "__main__":
    main()
