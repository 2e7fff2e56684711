"""Soak: a long run of the tiny model on a simulated multi-node Ray cluster (raylets on loopback) with a fault every
minute or so, and the same run without faults for comparison.

The cluster: a head node (driver, trainer loop, fleet) and three 1-CPU worker nodes; two engines of 1 CPU each
(--vllm.cpus_per_engine 1) and two ZeRO-3 ranks; rewards from a reward service (cli/reward_server.py, a process of
its own) and an agent whose step hangs while a flag file exists. The faults, in turn: an engine killed, an agent step
hanging, a node with an engine killed, a node added, the reward service restarted, a policy rank killed. The next
fault waits until the run has made two steps since the last one. Every fault is survived when the run goes on after
it and finishes all its steps; the prompts it trained on are read back from used_prompts.jsonl.

    python benchmarks/soak.py            # 15 minutes of faults (about 20 in all, with the baseline)
    python benchmarks/soak.py --quick    # a few faults, about 11 minutes in all

The reward is the label's digits in the response, so scores vary and every fault meets a trainer that learns: the
run's held-out greedy accuracy before and after training is given beside the run without faults' after its (fewer)
steps, with the samples whose reward failed.

Ends with one JSON line: faults_injected, faults_survived, steps_done, steps_planned, prompts_duplicated,
prompts_skipped, leftover_processes, throughput_ratio (steps per minute under faults over the run without),
eval_start, eval_end, baseline_eval_end, reward_failures."""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openrlhf_async.utils.ports import free_port  # noqa: E402

FAULTS = ("engine_kill", "agent_hang", "node_kill", "node_add", "reward_restart", "policy_kill")

REWARD = '''
async def reward_func(queries, prompts, labels, **kwargs):
    """1 when the response holds the label (the tiny model answers digits)."""
    rewards = [float(str(label) in query[len(prompt):]) for query, prompt, label in zip(queries, prompts, labels)]
    return {"rewards": rewards}
'''

AGENT = '''
import asyncio
import os


async def step(state, action, label):
    """One turn; hangs (the run's --agent.step_timeout ends it) while the soak's flag file exists."""
    if os.path.exists({flag!r}):
        await asyncio.sleep(3600)
    return 0.0, state + action, True, {{}}  # the reward service scores the episode
'''


class RewardService:
    """cli/reward_server.py serving a reward_func file, as a process of its own on a fixed port, restartable."""

    def __init__(self, port: int, func_path: str):
        self.port, self.func_path, self.proc = port, func_path, None
        self.start()

    def start(self) -> None:
        from benchmarks.local_cluster import wait_for

        # Its --timeout within the run's --reward.timeout (5 s), which the run checks: with the service's default of
        # 10 s every sample's reward failed, and scored 0.
        self.proc = subprocess.Popen([sys.executable, "-m", "openrlhf_async.cli.reward_server", "--port",
                                      str(self.port), "--workers", "1", "--timeout", "4",
                                      "--reward.func_path", self.func_path],
                                     stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_for(self._up, 60, "the reward service to listen", poll_s=0.2)

    def _up(self) -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def restart(self, down_s: float = 3.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_argv(model: str, out: str, name: str, steps: int, agent: str, reward_url: str) -> list:
    from openrlhf_async.config import preset_path

    return ["@" + preset_path("tiny_cpu"), "--actor.model_name_or_path", model, "--train.async_enable",
            "--vllm.num_engines", "2", "--vllm.cpus_per_engine", "1", "--vllm.max_engine_restarts", "100",
            "--vllm.sync_timeout", "30", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4",
            "--train.batch_size", "16", "--rollout.vllm_generate_batch_size", "8", "--train.max_steps", str(steps),
            "--eval.steps", str(steps), "--ckpt.save_steps", "2", "--ckpt.max_auto_resumes", "100",  # held out: start, end
            "--train.agent_func_path", agent, "--agent.step_timeout", "2", "--agent.max_error_ratio", "1.0",
            "--reward.remote_url", reward_url, "--reward.timeout", "5", "--reward.max_error_ratio", "1.0",
            "--runs_dir", os.path.join(out, "runs"), "--run_name", name, "--no-progress"]


class Run:
    """One run in a thread of this process, with the times its step records first appeared."""

    def __init__(self, argv: list, run_dir: str, watch):
        from openrlhf_async.cli.train_async import main as train_main
        from benchmarks.local_cluster import RunThread

        self.run_dir, self.watch, self.seen = run_dir, watch, {}
        self.thread = RunThread(train_main, argv)
        self.thread.start()

    def poll(self) -> int:
        """The newest step recorded (records cut back by a resume are rewritten later)."""
        from benchmarks.local_cluster import read_steps

        self.watch.poll()
        records = read_steps(self.run_dir)
        for r in records:
            self.seen.setdefault(r["step"], time.time())
        return max((r["step"] for r in records), default=0)

    def done(self) -> bool:
        return self.thread.code is not None

    def steps_per_minute(self) -> float:
        steps = sorted(s for s in self.seen if s >= 1)
        if len(steps) < 2:
            return 0.0
        return (len(steps) - 1) / max(1e-9, (self.seen[steps[-1]] - self.seen[steps[0]]) / 60)


def latest(records: list) -> list:
    """Each step's last record, in step order (a resume rewrites the steps after its checkpoint)."""
    return [r for _, r in sorted({r["step"]: r for r in records if "step" in r}.items())]


def held_out(records: list) -> list:
    """The held-out accuracies, in step order (step 0: before training)."""
    return [round(r["eval/accuracy"], 3) for r in latest([r for r in records if "eval/accuracy" in r])]


def inject(kind: str, cluster, reward: RewardService, flag: str) -> str:
    """Inject one fault; returns what was done (a node kill without a safe node falls back to an engine kill)."""
    from benchmarks.local_cluster import ENGINE, POLICY

    if kind == "node_kill":
        ranks = {a["node_id"] for a in cluster.actors(POLICY)}
        nodes = [a["node_id"] for a in cluster.actors(ENGINE) if a["node_id"] not in ranks | {cluster.head}]
        if nodes:
            cluster.kill_node(nodes[0])
            return "node_kill"
        kind = "engine_kill"
    if kind == "engine_kill":
        cluster.kill_actor(ENGINE, 0)
    elif kind == "node_add":
        cluster.add_node(1)
    elif kind == "reward_restart":
        reward.restart()
    elif kind == "agent_hang":
        open(flag, "w").close()
        time.sleep(6)  # episodes started meanwhile hang until --agent.step_timeout
        os.remove(flag)
    elif kind == "policy_kill":
        cluster.kill_actor(POLICY, len(cluster.actors(POLICY)) - 1)
    return kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few faults, about 11 minutes in all")
    parser.add_argument("--minutes", type=float, default=None, help="the faulted run's length (default 15; quick 3)")
    parser.add_argument("--interval", type=float, default=None, help="seconds between faults (default 60; quick 25)")
    parser.add_argument("--baseline_steps", type=int, default=None, help="steps of the run without faults "
                                                                         "(default 100; quick 30)")
    parser.add_argument("--out", default=None, help="folder of the runs (default: a temporary one)")
    args = parser.parse_args()
    minutes = args.minutes or (3.0 if args.quick else 15.0)
    interval = args.interval or (25.0 if args.quick else 60.0)
    baseline_steps = args.baseline_steps or (30 if args.quick else 100)

    from openrlhf_async.config import default_cache_dir
    from openrlhf_async.models.tiny import build_tiny_model
    from benchmarks.local_cluster import LocalCluster, ProcessWatch, read_steps

    t0 = time.time()
    model = build_tiny_model(default_cache_dir())
    out = args.out or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(out, exist_ok=True)
    flag = os.path.join(out, "hang_agent")
    agent = os.path.join(out, "hanging_agent.py")
    with open(agent, "w") as f:
        f.write(AGENT.format(flag=flag))
    watch = ProcessWatch()
    reward_file = os.path.join(out, "reward.py")
    with open(reward_file, "w") as f:
        f.write(REWARD)
    reward = RewardService(free_port(), reward_file)
    reward_url = f"http://127.0.0.1:{reward.port}/score"
    cluster = LocalCluster(head_cpus=1, node_cpus=(1, 1, 1))
    result, faults = {}, []
    try:
        baseline = Run(run_argv(model, out, "baseline", baseline_steps, agent, reward_url),
                       os.path.join(out, "runs", "baseline"), watch)
        while not baseline.done():
            baseline.poll()
            time.sleep(0.5)
        baseline.poll()
        if baseline.thread.code != 0:
            raise RuntimeError(f"the run without faults failed (exit {baseline.thread.code})")
        cluster.connect()
        rate = baseline.steps_per_minute()
        planned = max(10, math.ceil(rate * minutes))
        print(f"without faults: {rate:.1f} steps/min; the faulted run plans {planned} steps", file=sys.stderr,
              flush=True)

        run_dir = os.path.join(out, "runs", "soak")
        run = Run(run_argv(model, out, "soak", planned, agent, reward_url), run_dir, watch)
        last_fault, step_at_fault = time.time(), None
        while not run.done():
            step = run.poll()
            if faults and faults[-1]["survived"] is None and step >= step_at_fault + 2:
                faults[-1]["survived"] = True
                faults[-1]["recovered_s"] = round(time.time() - faults[-1]["at"], 1)
            ready = not faults or faults[-1]["survived"]
            if ready and step >= 1 and time.time() - last_fault >= interval and step < planned - 2:
                kind = FAULTS[len(faults) % len(FAULTS)]
                at, step_at_fault = time.time(), step
                try:
                    done = inject(kind, cluster, reward, flag)
                except Exception as e:  # the cluster changed under the injector: try the next one later
                    print(f"fault {kind} not injected: {e}", file=sys.stderr, flush=True)
                    last_fault = time.time()
                    continue
                faults.append({"kind": done, "at": at, "step": step, "survived": None})
                print(f"fault {len(faults)}: {done} at step {step}", file=sys.stderr, flush=True)
                last_fault = time.time()
            time.sleep(0.5)
        run.poll()
        code = run.thread.code
        records = read_steps(run_dir)
        steps_done = max((r["step"] for r in records), default=0)
        for fault in faults:
            if fault["survived"] is None:  # no step after it: survived only if the run finished after it
                fault["survived"] = code == 0 and steps_done == planned
        with open(os.path.join(run_dir, "used_prompts.jsonl")) as f:
            used = [json.loads(line) for line in f]
        positions = sorted(p for u in used for p in u["positions"])  # in the prompt stream (epoch after epoch)
        last = records[-1] if records else {}
        evals, baseline_evals = held_out(records), held_out(read_steps(baseline.run_dir))
        result = {
            "faults_injected": len(faults),
            "faults_survived": sum(bool(f["survived"]) and code == 0 for f in faults),
            "fault_kinds": [f["kind"] for f in faults],
            "recovered_s": [f.get("recovered_s") for f in faults],
            "steps_done": steps_done,
            "steps_planned": planned,
            "exit_code": code,
            "prompts_duplicated": len(positions) - len(set(positions)),
            "prompts_skipped": (positions[-1] + 1 - len(set(positions))) if positions else 0,
            "engines_replaced": last.get("engines/replaced"),
            "engines_alive_at_end": last.get("engines/alive"),
            "steps_per_min_faults": round(run.steps_per_minute(), 2),
            "steps_per_min_baseline": round(rate, 2),
            "throughput_ratio": round(run.steps_per_minute() / rate, 3) if rate else None,
            "faulted_run_minutes": round((max(run.seen.values()) - min(run.seen.values())) / 60, 1),
            "eval_start": evals[0] if evals else None,
            "eval_end": evals[-1] if len(evals) > 1 else None,
            "baseline_eval_end": baseline_evals[-1] if len(baseline_evals) > 1 else None,
            "reward_failures": sum(r.get("rollout/reward_errors", 0) + r.get("rollout/reward_timeouts", 0)
                                   for r in latest(records)),
        }
    finally:
        cluster.shutdown()
        reward.stop()
    time.sleep(5)
    left = watch.leftover()
    if left:
        print("left behind:\n" + "\n".join(left), file=sys.stderr)
    result["leftover_processes"] = len(left)
    result["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(result))
    return 0 if result.get("faults_survived") == result.get("faults_injected") and result.get("exit_code") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
