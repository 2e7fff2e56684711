"""A run on a simulated 3-node Ray cluster (raylets on loopback) that loses a node and gains two:

1. the head (trainer side) and two 1-CPU nodes; 2 engines of 1 CPU each (--vllm.cpus_per_engine 1), growth up to 3
   (--vllm.max_num_engines 3): the engines land on the two nodes that have room, the third waits for room;
2. after step 3, the node of an engine (not the head, no trainer rank) is killed while that engine has requests in
   flight: its groups are rerouted, and its replacement takes the place that was waiting for room;
3. two nodes are added: the replacement starts on one, catches up to the trainer's weights and version, and takes
   work; the run grows onto the other (a third engine, the same way);
5. the run finishes its steps.

Prints the step times before the kill, between the kill and the replacement taking work, and after the growth, the
time to replace, and the run's prompt accounting (stream positions used twice, and unused), as one JSON line. tests/test_elastic.py runs it; run it yourself:
    python benchmarks/elastic_scenario.py --steps 600
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="the run's --train.max_steps")
    parser.add_argument("--out", default=None, help="folder of the run (default: a temporary one)")
    args = parser.parse_args()

    from openrlhf_async.cli.train_async import main as train_main
    from openrlhf_async.config import default_cache_dir, preset_path
    from openrlhf_async.models.tiny import build_tiny_model
    from benchmarks.local_cluster import (ENGINE, POLICY, LocalCluster, ProcessWatch, RunThread, read_steps,
                                                    wait_for)

    t0 = time.time()
    model = build_tiny_model(default_cache_dir())
    out = args.out or tempfile.mkdtemp(prefix="elastic-")
    run_dir = os.path.join(out, "runs", "elastic")
    cluster = LocalCluster(head_cpus=1, node_cpus=(1, 1))
    # Fully async: groups stream into the engines all the time, so the node is lost with groups running on it.
    argv = ["@" + preset_path("tiny_cpu"), "--actor.model_name_or_path", model, "--mode", "fully_async",
            "--vllm.num_engines", "2", "--vllm.max_num_engines", "3", "--vllm.cpus_per_engine", "1",
            "--vllm.sync_timeout", "60", "--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "4",
            "--train.batch_size", "32", "--rollout.vllm_generate_batch_size", "16", "--train.max_steps",
            str(args.steps), "--eval.steps", "-1", "--runs_dir", os.path.join(out, "runs"), "--run_name", "elastic",
            "--no-progress"]
    run, watch = RunThread(train_main, argv), ProcessWatch()
    run.start()
    seen = {}  # step -> when its record appeared

    def step_reached(step: int):
        def check():
            for record in read_steps(run_dir):
                seen.setdefault(record["step"], time.time())
            if run.code is not None:
                raise RuntimeError(f"the run ended early (exit {run.code}, {run.error})")
            return [r for r in read_steps(run_dir) if r["step"] >= step and r.get("engines/alive") is not None]
        return check

    def record_where(predicate, what: str):
        def check():
            records = step_reached(0)()
            return next((r for r in records if predicate(r)), None)
        return wait_for(check, 600, what, poll_s=0.2, watch=watch)

    result = {}
    try:
        wait_for(step_reached(3), 900, "step 3", watch=watch)
        engines, ranks = cluster.actors(ENGINE), cluster.actors(POLICY)
        engine_nodes = {a["node_id"] for a in engines}
        result["engine_nodes_at_start"] = len(engine_nodes)
        victims = [n for n in engine_nodes if n != cluster.head and n not in {r["node_id"] for r in ranks}]
        # Mid-rollout: the moment its engine has requests in flight.
        victim = wait_for(lambda: set(victims) & cluster.busy_engine_nodes(), 120, "the engine to be busy",
                          poll_s=0.05).pop()
        killed_step = max(seen)
        cluster.kill_node(victim)
        cluster.add_node(1)  # the replacement's room (it takes the place that was waiting for room)
        cluster.add_node(1)  # room to grow onto: both engines start side by side
        replaced = record_where(lambda r: r["step"] > killed_step and r.get("engines/replace_s") is not None,
                                "the replacement to take work")
        result["replace_s"] = replaced["engines/replace_s"]
        result["replaced_by_step"] = replaced["step"]
        result["rerouted_groups"] = sum(r.get("rollout/groups_rerouted", 0) for r in read_steps(run_dir))
        grown = record_where(lambda r: r["step"] > killed_step and r["engines/alive"] >= 3, "the run to grow")
        result["grown_by_step"] = grown["step"]
        def finished():
            for record in read_steps(run_dir):
                seen.setdefault(record["step"], time.time())
            return run.code is not None

        wait_for(finished, 900, "the run to finish", poll_s=0.2, watch=watch)
        result["exit_code"] = run.code
        records = read_steps(run_dir)
        result["steps_done"] = max(r["step"] for r in records)
        result["engines_at_end"] = records[-1]["engines/alive"]
        result["engines_died"] = records[-1]["engines/died"]

        def mean_step_s(first: int, last: int):
            times = [seen[s] for s in range(first, last + 1) if s in seen]
            return round((times[-1] - times[0]) / (len(times) - 1), 2) if len(times) > 1 else None

        result["step_s_before"] = mean_step_s(1, killed_step)
        result["step_s_during"] = mean_step_s(killed_step, replaced["step"])
        result["step_s_after"] = mean_step_s(max(grown["step"], replaced["step"]), result["steps_done"])
        with open(os.path.join(run_dir, "used_prompts.jsonl")) as f:
            used = [json.loads(line) for line in f]
        # Positions in the prompt stream (the run goes through the data several times): each used once at most.
        # Fully async, the groups still running when the run ends were started and never trained: the stream's
        # last positions may have gaps of at most the groups in flight.
        positions = sorted(p for u in used for p in u["positions"])
        result["prompts_duplicated"] = len(positions) - len(set(positions))
        result["prompts_unused"] = (positions[-1] + 1 - len(set(positions))) if positions else 0
        result["prompts_unused_before_last_16"] = len(set(range(positions[-1] - 16)) - set(positions))
    finally:
        cluster.shutdown()
    time.sleep(5)
    left = watch.leftover()
    result["leftover_processes"] = len(left)
    if left:
        print("left behind:\n" + "\n".join(left), file=sys.stderr)
    result["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
