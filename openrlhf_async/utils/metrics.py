"""Per-step metrics: one JSON object per line in <run dir>/metrics.jsonl, and a console progress bar."""

import json
import os


class MetricsLog:
    def __init__(self, run_dir: str, total_steps: int, progress: bool = True):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "w", buffering=1)  # a new run starts a new record
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="RL", unit="step", dynamic_ncols=True)
        self.last_accuracy = None

    def log(self, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        if "eval/accuracy" in metrics:
            self.last_accuracy = metrics["eval/accuracy"]
        if self.bar is not None:
            postfix = {"reward": f"{metrics['reward/mean']:.3f}"} if "reward/mean" in metrics else {}
            if self.last_accuracy is not None:
                postfix["acc"] = f"{self.last_accuracy:.3f}"
            if "rollout/tokens_per_s" in metrics:
                postfix["tok/s"] = f"{metrics['rollout/tokens_per_s']:.0f}"
            self.bar.set_postfix(postfix)
            if metrics.get("step", 0) > 0:  # step 0 is the evaluation before training
                self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
