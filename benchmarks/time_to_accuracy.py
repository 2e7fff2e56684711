"""Time to accuracy: how soon each training mode reaches a held-out accuracy, the figure the field reports (AReaL, veRL's
fully async recipe). Sync, async and fully async with partial rollout train the same task from the same model, the
same data order and sample budget per seed (the same steps of the same batch), over several seeds, through the CLI
as a user runs them. Held-out greedy accuracy is taken every --eval_steps steps, with the wall clock
(timing/elapsed_s) and the groups trained at each point.

The target is the lowest final held-out accuracy of the sync seeds. For each mode: the time at which the mean over
seeds first reaches the target and stays there (the mean of the seeds' clocks at that evaluation), its speed-up
against sync, its final accuracy (mean and standard error over seeds) and its lowest point below the start (the dip).

Two layouts:
- separate: the roles on devices of their own, as on a GPU cluster. Here the vLLM engine (its actor and engine core)
  is pinned to core 0 and the trainer ranks to core 1, the same in every mode (each thread of each process, by its
  process title, as the processes come: os.sched_setaffinity). The headline figure.
- shared: the laptop's shared cores, nothing pinned. There overlap makes each phase slower; the bound is measured
  from the sync runs (each phase's busy time alone: the generation wait and the training and sync time of a step,
  (Tg + Tt) / max(Tg, Tt)), and the speed-up is reported as a share of it.

--quick: the tiny model on the built-in task (the demo's preset), 20 steps, 3 seeds: 17 minutes a layout on 2 cores (2026-12-03).
Without it: 100 steps. Draws time_to_accuracy.png (accuracy against wall clock, a band per mode) and ends with one
JSON line."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"sync": ["--mode", "sync"], "async": ["--mode", "async"],
         "fully_async": ["--mode", "fully_async", "--train.partial_rollout_enable"]}
# Process titles of each role (Ray's "ray::Class.method", vLLM's engine core), and the core each is pinned to.
ROLES = (("VLLM::EngineCore", 0), ("ray::LLMRayActorAsync", 0), ("ray::PolicyActor", 1))


class Pinner(threading.Thread):
    """Pins every thread of the processes of each role to its core, looking again every interval (processes and
    their threads come as the run starts; a thread inherits its creator's affinity, and vLLM binds its own OMP
    threads once, which the next look overrides)."""

    def __init__(self, interval: float = 0.2):
        super().__init__(daemon=True)
        self.interval, self.stopped, self.pinned = interval, threading.Event(), set()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        title = f.read().replace(b"\0", b" ").decode(errors="replace")
                    core = next((c for prefix, c in ROLES if title.startswith(prefix)), None)
                    if core is None:
                        continue
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        if os.sched_getaffinity(int(tid)) != {core}:
                            os.sched_setaffinity(int(tid), {core})
                            self.pinned.add((pid, title.split()[0]))
                except (OSError, ValueError):  # gone meanwhile
                    continue


def train(out: str, name: str, mode: str, seed: int, steps: int, eval_steps: int, layout: str, extra: list) -> list:
    """One CLI run; returns its metrics records."""
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@openrlhf_async/presets/tiny_cpu.args", *MODES[mode],
           "--train.seed", str(seed), "--train.max_steps", str(steps), "--eval.steps", str(eval_steps),
           "--runs_dir", out, "--run_name", name, "--overwrite", "--no-progress", "--ckpt.save_steps", "-1", *extra]
    env = {**os.environ, "RAY_ADDRESS": ""}  # a cluster of its own, whatever runs beside it
    pinner = None
    if layout == "separate":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0"  # vLLM's own binding, to the engine's core
        pinner = Pinner()
        pinner.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        if pinner is not None:
            pinner.stopped.set()
    if proc.returncode != 0:
        raise SystemExit(f"time-to-accuracy: the {name} run failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1:]}")
    if pinner is not None and {t for _, t in pinner.pinned} < {"VLLM::EngineCore", "ray::PolicyActor"}:
        raise SystemExit(f"time-to-accuracy: the {name} run's roles were not all pinned ({sorted(pinner.pinned)})")
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def curve(records: list) -> list:
    """[(step, seconds, groups trained so far, held-out accuracy)] at each evaluation."""
    out, groups = [], 0
    for r in records:
        groups += r.get("rollout/groups_accepted", 0)
        if "eval/accuracy" in r:
            out.append((r["step"], r["timing/elapsed_s"], groups, r["eval/accuracy"]))
    return out


def phase_bound(records: list) -> float:
    """(Tg + Tt) / max(Tg, Tt) from a sync run's steps: what overlapping generation with training could buy."""
    tg = sum(r.get("timing/wait_s", 0.0) for r in records if r.get("step"))
    tt = sum(r.get("timing/train_s", 0.0) + r.get("timing/sync_s", 0.0) for r in records if r.get("step"))
    return (tg + tt) / max(tg, tt, 1e-9)


def summarise(curves: dict) -> dict:
    """Per mode, from its seeds' curves (the same evaluation steps): mean accuracy and clock at each point, the time
    the mean first reaches the target and stays, the final accuracy's mean and standard error, the dip."""
    finals_sync = [c[-1][3] for c in curves["sync"]]
    target = min(finals_sync)
    out = {"target": target}
    for mode, seeds in curves.items():
        points = list(zip(*seeds))  # per evaluation, each seed's (step, s, samples, accuracy)
        mean_acc = [statistics.mean(p[3] for p in point) for point in points]
        mean_s = [statistics.mean(p[1] for p in point) for point in points]
        reached = next((k for k in range(len(mean_acc)) if all(a >= target - 1e-12 for a in mean_acc[k:])), None)
        finals = [c[-1][3] for c in seeds]
        out[mode] = {"time_to_target_s": None if reached is None else round(mean_s[reached], 1),
                     "final": round(statistics.mean(finals), 4),
                     "final_se": round(statistics.stdev(finals) / len(finals) ** 0.5, 4) if len(finals) > 1 else 0.0,
                     "dip": round(max(0.0, mean_acc[0] - min(mean_acc)), 4),
                     "curve": [(p[0][0], round(s, 1), round(a, 4)) for p, s, a in zip(points, mean_s, mean_acc)]}
    base = out["sync"]["time_to_target_s"]
    for mode in curves:
        t = out[mode]["time_to_target_s"]
        out[mode]["speedup"] = round(base / t, 3) if base and t else None
    return out


def draw(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (layout, (summary, curves)) in zip(axes[0], results.items()):
        for mode, seeds in curves.items():
            points = list(zip(*seeds))
            s = [statistics.mean(p[1] for p in point) for point in points]
            acc = [[p[3] for p in point] for point in points]
            mean = [statistics.mean(a) for a in acc]
            se = [statistics.stdev(a) / len(a) ** 0.5 if len(a) > 1 else 0.0 for a in acc]
            ax.plot(s, mean, label=f"{mode} (x{summary[mode]['speedup']})")
            ax.fill_between(s, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)], alpha=0.25)
        ax.axhline(summary["target"], color="grey", linestyle=":", label="target (lowest final of sync)")
        ax.set(title=f"{layout} cores", xlabel="wall clock (s)", ylabel="held-out greedy accuracy")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 steps of the tiny model on the built-in task")
    ap.add_argument("--steps", type=int, default=None, help="default: 20 with --quick, else 100")
    ap.add_argument("--eval_steps", type=int, default=5)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--layouts", default="separate,shared")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "time_to_accuracy"), help="where the picture goes")
    ap.add_argument("--flags", default="", help="more CLI flags for every run (a method under test)")
    args = ap.parse_args(argv)
    steps = args.steps or (20 if args.quick else 100)
    seeds, modes = [int(s) for s in args.seeds.split(",")], args.modes.split(",")
    if "sync" not in modes:
        ap.error("--modes: sync is the baseline every other mode is measured against")
    if "separate" in args.layouts and (os.cpu_count() or 1) < 2:
        ap.error("--layouts separate pins the engine and the trainer to cores of their own: it needs 2 cores")
    os.makedirs(args.out, exist_ok=True)
    results, bounds = {}, {}
    with tempfile.TemporaryDirectory() as runs:
        for layout in args.layouts.split(","):
            curves, sync_records = {m: [] for m in modes}, []
            for seed in seeds:
                for mode in modes:
                    records = train(runs, f"{layout}-{mode}-{seed}", mode, seed, steps, args.eval_steps, layout,
                                    args.flags.split())
                    curves[mode].append(curve(records))
                    if mode == "sync":
                        sync_records += records
                    print(f"time-to-accuracy {layout} {mode} seed {seed}: {curves[mode][-1][-1]}", file=sys.stderr,
                          flush=True)
            results[layout] = (summarise(curves), curves)
            bounds[layout] = round(phase_bound(sync_records), 3)
    draw(results, os.path.join(args.out, "time_to_accuracy.png"))
    sep, shared = results.get("separate", (None,))[0], results.get("shared", (None,))[0]
    line = {"steps": steps, "seeds": len(seeds), "picture": os.path.join(args.out, "time_to_accuracy.png")}
    if sep:
        line.update(speedup_fully_async=sep.get("fully_async", {}).get("speedup"),
                    speedup_async=sep.get("async", {}).get("speedup"), target=sep["target"],
                    **{f"final_{m}": sep[m]["final"] for m in modes}, final_se={m: sep[m]["final_se"] for m in modes},
                    dip_fully_async=sep.get("fully_async", {}).get("dip"), bound_separate=bounds["separate"])
    if shared:
        line.update(speedup_fully_async_shared=shared.get("fully_async", {}).get("speedup"),
                    bound_shared=bounds["shared"])
        if line["speedup_fully_async_shared"] and bounds["shared"] > 1:
            line["share_of_bound_shared"] = round((line["speedup_fully_async_shared"] - 1) / (bounds["shared"] - 1), 3)
    line["layouts"] = {k: {m: {x: v[m][x] for x in ("time_to_target_s", "final", "final_se", "dip", "speedup")}
                           for m in modes} for k, (v, _) in results.items()}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
