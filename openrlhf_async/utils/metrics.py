"""Per-step metrics under one set of names: one JSON object per line in <run dir>/metrics.jsonl, a console
progress bar, and optionally TensorBoard scalars (<run dir>/tensorboard) and Weights & Biases (<run dir>/wandb).
Two side records go to their own files, one JSON object per line with its step: the prompts each step used up
(used_prompts.jsonl) and the actors' activity spans (timeline.jsonl)."""

import dataclasses
import json
import os
import queue
import sys
import threading


def scalars(metrics: dict) -> dict:
    """What a plotting backend gets: every number (not strings such as a first error), the step being the x axis."""
    return {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}


def wandb_api_key_available() -> bool:
    """Whether W&B finds credentials: env WANDB_API_KEY or a netrc entry for api.wandb.ai."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(requested: str) -> str:
    """--logger.wandb_mode, else env WANDB_MODE, else online with an API key and offline without."""
    env = os.environ.get("WANDB_MODE", "")
    env = {"dryrun": "offline", "run": "online"}.get(env, env)  # wandb's legacy names
    return requested or env or ("online" if wandb_api_key_available() else "offline")


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


class MetricsLog:
    def __init__(self, run_dir: str, total_steps: int, progress: bool = True, logger=None, config=None,
                 wandb_close_timeout_s: float = 60.0, resume_step: int = None):
        """logger: the LoggerConfig choosing the extra backends; config: the run's Config (or a dict), recorded
        once in each. resume_step: continue a run's records after this step (what came later is dropped: that
        part of the run was lost with the process and is trained again)."""
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file, self.used_file, self.timeline_file = (
            _open_record(os.path.join(run_dir, name), resume_step)
            for name in ("metrics.jsonl", "used_prompts.jsonl", "timeline.jsonl"))
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=resume_step or 0, desc="RL", unit="step", dynamic_ncols=True)
        self.last_accuracy = None
        self.tensorboard = None
        self.wandb = None
        if dataclasses.is_dataclass(config):
            config = dataclasses.asdict(config)
        config_text = json.dumps(config or {}, indent=2, default=str)
        if logger is not None and logger.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Resuming: TensorBoard hides what the killed run logged after the checkpoint.
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                             purge_step=None if resume_step is None else resume_step + 1)
            # Indented four spaces: TensorBoard renders text as Markdown, and this keeps the JSON a code block.
            self.tensorboard.add_text("config", "\n".join("    " + line for line in config_text.splitlines()))
        if logger is not None and logger.use_wandb:
            mode = resolve_wandb_mode(logger.wandb_mode)
            if mode != "disabled":
                name = logger.wandb_run_name or os.path.basename(os.path.normpath(run_dir))
                self.wandb = WandbWriter(dict(dir=run_dir, project=logger.wandb_project, name=name, mode=mode,
                                              config=json.loads(config_text)), wandb_close_timeout_s)

    def log(self, metrics: dict) -> None:
        step = metrics.get("step")
        used, spans = metrics.pop("_used", None), metrics.pop("_spans", ())
        if used is not None:
            self.used_file.write(json.dumps({"step": step, **used}) + "\n")
        for span in spans:
            self.timeline_file.write(json.dumps({**span, "step": step}) + "\n")
        self.file.write(json.dumps(metrics) + "\n")
        if self.tensorboard is not None:
            for name, value in scalars(metrics).items():
                self.tensorboard.add_scalar(name, value, global_step=step)
        if self.wandb is not None:
            self.wandb.log(scalars(metrics), step)
        if "eval/accuracy" in metrics:
            self.last_accuracy = metrics["eval/accuracy"]
        if self.bar is not None:
            postfix = {"reward": f"{metrics['reward/mean']:.3f}"} if "reward/mean" in metrics else {}
            if self.last_accuracy is not None:
                postfix["acc"] = f"{self.last_accuracy:.3f}"
            if "staleness/max" in metrics:
                postfix["stale"] = f"{metrics['staleness/max']:g}"
            if "rollout/tokens_per_s" in metrics:
                postfix["tok/s"] = f"{metrics['rollout/tokens_per_s']:.0f}"
            self.bar.set_postfix(postfix)
            if metrics.get("step", 0) > 0:  # step 0 is the evaluation before training
                self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for f in (self.file, self.used_file, self.timeline_file):
            f.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()


def _open_record(path: str, resume_step):
    """A JSON-lines record of steps, line-buffered and appended to: never truncated, except that a resumed run
    keeps only the lines up to resume_step (a fresh run finds none: train_async refuses a run folder that holds
    an earlier run's records, or deletes them first with --overwrite)."""
    if resume_step is None:
        return open(path, "a", buffering=1)
    kept = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):  # a line cut short by the kill
                    pass
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return open(path, "a", buffering=1)


class WandbWriter:
    """wandb.init and wandb.log run in a background thread fed by a bounded queue, so a slow, offline or broken
    W&B never blocks or stops training: records that do not fit are dropped and counted, a failed init is one
    warning line, and close waits a bounded time."""

    def __init__(self, init_kwargs: dict, close_timeout_s: float, max_pending: int = 10_000):
        self.pending = queue.Queue(maxsize=max_pending)
        self.dropped = 0
        self.failed = False
        self.close_timeout_s = close_timeout_s
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(init_kwargs,), name="wandb-logger", daemon=True)
        self.thread.start()

    def log(self, metrics: dict, step) -> None:
        if self.failed:
            return
        try:
            self.pending.put_nowait((metrics, step))
        except queue.Full:
            self.dropped += 1

    def _run(self, init_kwargs: dict) -> None:
        try:
            import wandb

            # console off: W&B must not wrap stdout/stderr (the progress bar, Ray's log relay).
            settings = wandb.Settings(silent=True, console="off")
            run = wandb.init(**init_kwargs, reinit="create_new", settings=settings)
        except Exception as e:
            self.failed = True
            warn(f"wandb is off for this run: its init failed ({one_line(e)}); metrics.jsonl is complete")
            return
        log_failed = False
        while not (self.closing.is_set() and self.pending.empty()):
            try:
                metrics, step = self.pending.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                run.log(metrics, step=step)
            except Exception as e:
                if not log_failed:  # once: a broken W&B would otherwise repeat it every step
                    warn(f"wandb.log failed ({one_line(e)}); later records may be missing from W&B")
                log_failed = True
        try:
            if self.dropped:
                run.summary["wandb/dropped_records"] = self.dropped
            run.finish()
        except Exception as e:
            warn(f"wandb.finish failed ({one_line(e)})")

    def close(self) -> None:
        self.closing.set()
        self.thread.join(self.close_timeout_s)
        if self.thread.is_alive():
            warn(f"wandb did not finish within {self.close_timeout_s:g} s; leaving it behind (its run files may be "
                 "incomplete)")
        if self.dropped:
            warn(f"wandb dropped {self.dropped} metric records (its queue was full); metrics.jsonl has them all")
