"""Per-step metrics under one set of names: one JSON object per line in <run dir>/metrics.jsonl, a console
progress bar, and optionally TensorBoard scalars (--logger.tensorboard_dir) and Weights & Biases (run files in
<run dir>/wandb).
Three side records go to their own files, one JSON object per line with its step: the prompts each step used up
(used_prompts.jsonl), the actors' activity spans (timeline.jsonl) and the text of a few samples (samples.jsonl,
also a W&B table and TensorBoard text; see samples.py)."""

import collections
import dataclasses
import json
import os
import queue
import sys
import threading
import time

from openrlhf_async.utils.samples import TABLE_COLUMNS, console_line, markdown, table_rows
from openrlhf_async.utils.wandb_mode import resolve_wandb_mode


def scalars(metrics: dict) -> dict:
    """What a plotting backend gets: every number (not strings such as a first error), the step being the x axis."""
    return {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


class TokenRate:
    """The progress bar's tokens per second: the tokens of the last `window` steps over the wall-clock time they
    took, from log to log. A step's own rollout/tokens_per_s divides by its generation time, which is microseconds
    when a carried-over batch is ready at once (the bar once showed 4,209,218 tok/s)."""

    def __init__(self, window: int = 5, clock=time.monotonic):
        self.points = collections.deque(maxlen=window + 1)  # (time of a log, tokens generated up to it)
        self.clock, self.total = clock, 0

    def add(self, tokens: float):
        """Count a log's tokens; the rate over the window, or None before two logs a moment apart."""
        self.total += tokens
        self.points.append((self.clock(), self.total))
        (start, first), (end, last) = self.points[0], self.points[-1]
        return (last - first) / (end - start) if end - start > 1e-3 else None


class MetricsLog:
    def __init__(self, run_dir: str, total_steps: int, progress: bool = True, logger=None, config=None,
                 wandb_close_timeout_s: float = 60.0, resume_step: int = None, samples=None):
        """logger: the LoggerConfig choosing the extra backends; config: the run's Config (or a dict), recorded
        once in each. resume_step: continue a run's records after this step (what came later is dropped: that
        part of the run was lost with the process and is trained again). samples: the SampleText that turns the
        episodes a step sends ("_samples") into text rows; without it they are not kept."""
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file, self.used_file, self.timeline_file, self.samples_file = (
            _open_record(os.path.join(run_dir, name), resume_step)
            for name in ("metrics.jsonl", "used_prompts.jsonl", "timeline.jsonl", "samples.jsonl"))
        self.samples = samples
        self.started = time.monotonic()  # timing/elapsed_s: a step's place in wall-clock time (time to accuracy)
        self.last_step = resume_step or 0  # the newest step in the records: what a stopped run had trained
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=resume_step or 0, desc="RL", unit="step", dynamic_ncols=True)
        self.last_accuracy = None
        self.rate = TokenRate()
        self.tensorboard = None
        self.wandb = None
        if dataclasses.is_dataclass(config):
            from openrlhf_async.utils.config_record import to_dict

            config = to_dict(config)
        config_text = json.dumps(config or {}, indent=2, default=str)
        self.logging_steps = logger.logging_steps if logger is not None else 1
        if logger is not None and logger.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            # Resuming: TensorBoard hides what the killed run logged after the checkpoint.
            self.tensorboard = SummaryWriter(logger.tensorboard_dir.replace("{run_dir}", run_dir),
                                             purge_step=None if resume_step is None else resume_step + 1)
            # Indented four spaces: TensorBoard renders text as Markdown, and this keeps the JSON a code block.
            self.tensorboard.add_text("config", "\n".join("    " + line for line in config_text.splitlines()))
        if logger is not None and logger.wandb_enabled:
            mode = resolve_wandb_mode(logger.wandb_mode)
            if logger.wandb_key:
                os.environ["WANDB_API_KEY"] = logger.wandb_key  # what wandb.init reads; never written to the records
            if mode != "disabled":
                name = logger.wandb_run_name or os.path.basename(os.path.normpath(run_dir))
                self.wandb = WandbWriter(dict(dir=run_dir, project=logger.wandb_project, name=name, mode=mode,
                                              entity=logger.wandb_org, group=logger.wandb_group,
                                              config=json.loads(config_text)), wandb_close_timeout_s)

    def log(self, metrics: dict) -> None:
        step = metrics.get("step")
        if step is not None:
            self.last_step = max(self.last_step, step)
        metrics.setdefault("timing/elapsed_s", round(time.monotonic() - self.started, 3))
        used, spans, episodes = metrics.pop("_used", None), metrics.pop("_spans", ()), metrics.pop("_samples", {})
        if used is not None:
            self.used_file.write(json.dumps({"step": step, **used}) + "\n")
        for span in spans:
            self.timeline_file.write(json.dumps({**span, "step": step}) + "\n")
        self.file.write(json.dumps(metrics) + "\n")
        tables = self._log_samples(step, episodes)
        if step and step % self.logging_steps:  # --logger.logging_steps: W&B and TensorBoard get every Nth step
            tables, sinks = {}, False
        else:
            sinks = True
        if self.tensorboard is not None and sinks:
            for name, value in scalars(metrics).items():
                self.tensorboard.add_scalar(name, value, global_step=step)
        if self.wandb is not None and sinks:
            self.wandb.log(scalars(metrics), step, tables)
        if "eval/accuracy" in metrics:
            self.last_accuracy = metrics["eval/accuracy"]
        if self.bar is not None:
            postfix = {"reward": f"{metrics['reward/mean']:.3f}"} if "reward/mean" in metrics else {}
            if self.last_accuracy is not None:
                postfix["acc"] = f"{self.last_accuracy:.3f}"
            if "staleness/max" in metrics:
                postfix["stale"] = f"{metrics['staleness/max']:g}"
            rate = self.rate.add(metrics.get("rollout/tokens_generated", 0))  # the evaluation before training: 0
            if rate is not None:
                postfix["tok/s"] = f"{rate:.0f}"
            self.bar.set_postfix(postfix)
            if metrics.get("step", 0) > 0:  # step 0 is the evaluation before training
                self.bar.update(1)

    def _log_samples(self, step, episodes: dict) -> dict:
        """Write the step's samples to samples.jsonl and TensorBoard, print an evaluation answer; returns them as
        W&B tables (name -> (columns, rows))."""
        if self.samples is None:
            return {}
        rows = self.samples.rows(step, episodes)
        for row in rows:
            self.samples_file.write(json.dumps(row, default=str) + "\n")
        tables = {}
        for kind in ("train", "eval"):
            chosen = [r for r in rows if r["kind"] == kind]
            if not chosen:
                continue
            tables[f"{kind}/generated_samples"] = (TABLE_COLUMNS, table_rows(chosen))
            if self.tensorboard is not None:
                self.tensorboard.add_text(f"{kind}/generated_samples", markdown(chosen), global_step=step)
            if kind == "eval":
                line = console_line(chosen[0])
                if self.bar is not None:
                    self.bar.write(line)
                else:
                    print(line, flush=True)
        return tables

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for f in (self.file, self.used_file, self.timeline_file, self.samples_file):
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

    def log(self, metrics: dict, step, tables: dict = None) -> None:
        """tables: name -> (columns, rows), added to that name's W&B table (one per name, logged incrementally)."""
        if self.failed:
            return
        try:
            self.pending.put_nowait((metrics, tables or {}, step))
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
        log_failed, run_tables = False, {}
        while not (self.closing.is_set() and self.pending.empty()):
            try:
                metrics, tables, step = self.pending.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                for name, (columns, rows) in tables.items():
                    # Incremental: each log sends only the new rows, the W&B page shows them all.
                    if name not in run_tables:
                        run_tables[name] = wandb.Table(columns=columns, log_mode="INCREMENTAL")
                    for row in rows:
                        run_tables[name].add_data(*row)
                run.log({**metrics, **{name: run_tables[name] for name in tables}}, step=step)
            except Exception as e:
                if not log_failed:  # once: a broken W&B would otherwise repeat it every step
                    warn(f"wandb.log failed ({one_line(e)}); later records may be missing from W&B")
                log_failed = True
        try:
            if self.dropped:
                run.summary["wandb/dropped_records"] = self.dropped
            run.finish()
            # finish() returns before wandb-core's writer has flushed the run's .wandb file (read straight after,
            # it held only its header in about one run of six); the service's teardown waits for its streams.
            wandb.teardown()
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
