"""The same metric names reach metrics.jsonl, TensorBoard and W&B; W&B never blocks or breaks a run."""

import glob
import json
import os
import struct
import threading

import pytest

from openrlhf_async.config import Config, LoggerConfig
from openrlhf_async.utils.metrics import MetricsLog, TokenRate
from openrlhf_async.utils.wandb_mode import resolve_wandb_mode

STEPS = [
    {"step": 1, "reward/mean": 0.25, "staleness/max": 0, "rollout/tokens_per_s": 120.0, "rollout/tokens_generated": 140,
     "queue/depth": 1,
     "agent/first_error": "ValueError: bad answer"},
    {"step": 2, "reward/mean": 0.5, "staleness/max": 1, "rollout/tokens_per_s": 130.5, "rollout/tokens_generated": 140,
     "queue/depth": 0},
    {"step": 3, "reward/mean": 0.75, "staleness/max": 2, "rollout/tokens_per_s": 9e6, "rollout/tokens_generated": 140,
     "queue/depth": 1, "eval/accuracy": 0.6},
]


def log_steps(log):
    """Log every step of STEPS, then close the log."""
    for metrics in STEPS:
        log.log(metrics)
    log.close()


def read_jsonl(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def numeric_series(records):
    """{name: [(step, value)]} for every numeric metric of metrics.jsonl."""
    series = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)):
                series.setdefault(k, []).append((r["step"], float(v)))
    return series


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    return home


def test_tensorboard_scalars_match_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = str(tmp_path / "run")
    log = MetricsLog(run_dir, 3, progress=False, logger=LoggerConfig(tensorboard_dir="{run_dir}/tensorboard"),
                     config=Config())
    log_steps(log)

    expected = numeric_series(read_jsonl(run_dir))
    assert "agent/first_error" not in expected and "timing/elapsed_s" in expected and len(expected) == 7
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for name, points in expected.items():
        got = events.Scalars(name)
        assert [e.step for e in got] == [step for step, _ in points], name
        assert [e.value for e in got] == pytest.approx([value for _, value in points]), name
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"run_name": "run"' in config_text and '"tensorboard_dir": null' in config_text


def test_a_resumed_log_continues_every_record_after_the_checkpoint_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = str(tmp_path / "run")
    tb = LoggerConfig(tensorboard_dir="{run_dir}/tensorboard")
    killed = MetricsLog(run_dir, 3, progress=False, logger=tb)
    for step in (1, 2, 3):  # the killed run got to step 3; its checkpoint is from step 1
        killed.log({"step": step, "reward/mean": 0.1 * step, "_used": {"positions": [step], "prompt_ids": [step]},
                    "_spans": [{"actor": "trainer", "kind": "train", "start": step, "end": step + 0.5}]})
    killed.close()
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "rew')  # cut short by the kill

    resumed = MetricsLog(run_dir, 3, progress=False, logger=tb, resume_step=1)
    for step in (2, 3):
        resumed.log({"step": step, "reward/mean": 0.5 * step, "_used": {"positions": [10 + step], "prompt_ids": [0]},
                     "_spans": []})
    resumed.close()

    assert [(m["step"], m["reward/mean"]) for m in read_jsonl(run_dir)] == [(1, 0.1), (2, 1.0), (3, 1.5)]
    with open(os.path.join(run_dir, "used_prompts.jsonl")) as f:
        assert [json.loads(line)["positions"] for line in f] == [[1], [12], [13]]
    with open(os.path.join(run_dir, "timeline.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1]
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("reward/mean")] == [(1, 0.1), (2, 1.0), (3, 1.5)]


def test_progress_bar_shows_staleness_and_the_token_rate_over_its_window(tmp_path, capsys):
    log = MetricsLog(str(tmp_path / "run"), 3, progress=True)
    log.rate.clock = iter([0.0, 1.0, 2.0]).__next__  # a step a second, 140 tokens each
    log_steps(log)
    bar = capsys.readouterr().err
    assert "stale=2" in bar and "reward=0.750" in bar and "acc=0.600" in bar, bar
    # Step 3's own rate (9e6: a carried batch ready at once) is not what the bar shows.
    assert "tok/s=140" in bar and "9000000" not in bar, bar


def test_the_token_rate_is_over_the_last_steps_wall_time_and_does_not_spike():
    times = iter([0.0, 10.0, 20.0, 20.000001, 30.0, 40.0, 50.0, 60.0, 70.0])
    rate = TokenRate(window=5, clock=times.__next__)
    assert rate.add(0) is None  # the evaluation before training: no tokens, no time yet
    assert [round(rate.add(1000)) for _ in range(2)] == [100, 100]
    assert round(rate.add(1000)) == 150  # a carried batch logged a microsecond later: 3000 tokens in 20 s
    assert [round(rate.add(500)) for _ in range(5)] == [117, 100, 88, 75, 50]  # the first steps leave the window


def wandb_history(run_file):
    """The history records of an offline run's .wandb file: a LevelDB-style log (32 KiB blocks, 7-byte record
    headers) of protobuf Records after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk, history = open(run_file, "rb").read(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return history


def test_wandb_without_a_key_runs_offline_in_the_run_dir(tmp_path, no_wandb_credentials):
    run_dir = str(tmp_path / "run")
    log = MetricsLog(run_dir, 3, progress=False, logger=LoggerConfig(use_wandb=True, wandb_run_name="wb"),
                     config=Config(), wandb_close_timeout_s=60)
    log_steps(log)
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*.wandb")), os.listdir(os.path.join(run_dir, "wandb"))
    assert read_jsonl(run_dir) == STEPS
    history = wandb_history(glob.glob(os.path.join(runs[0], "*.wandb"))[0])
    assert [{k: v for k, v in h.items() if not k.startswith("_")} for h in history] == [
        {k: v for k, v in m.items() if k != "step" and isinstance(v, (int, float))} for m in STEPS], history


def test_a_failing_wandb_warns_once_and_the_run_goes_on(tmp_path, no_wandb_credentials, monkeypatch, capsys):
    import wandb

    def broken_init(**kwargs):
        raise wandb.errors.CommError("cannot reach api.wandb.ai\nsecond line of detail")

    monkeypatch.setattr(wandb, "init", broken_init)
    run_dir = str(tmp_path / "run")
    log = MetricsLog(run_dir, 3, progress=False, logger=LoggerConfig(use_wandb=True, wandb_mode="online"),
                     config=Config(), wandb_close_timeout_s=10)
    log_steps(log)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "wandb is off for this run" in err and "cannot reach" in err, err
    assert read_jsonl(run_dir) == STEPS


def test_a_hanging_wandb_cannot_hold_up_the_run(tmp_path, no_wandb_credentials, monkeypatch, capsys):
    import wandb

    release = threading.Event()

    def hanging_init(**kwargs):
        release.wait(600)  # until the test releases it (a fail-safe for a run that waits for it: it fails below)
        raise RuntimeError("released")

    monkeypatch.setattr(wandb, "init", hanging_init)
    run_dir = str(tmp_path / "run")
    log = MetricsLog(run_dir, 3, progress=False, logger=LoggerConfig(use_wandb=True), wandb_close_timeout_s=0.5)
    log_steps(log)
    assert log.wandb.thread.is_alive(), "the run waited for wandb's init to end"  # the run ended, the init hangs on
    assert "wandb did not finish within 0.5 s" in capsys.readouterr().err
    assert read_jsonl(run_dir) == STEPS
    release.set()
    log.wandb.thread.join(5)


def test_wandb_mode_is_online_only_with_a_key(no_wandb_credentials, monkeypatch):
    assert resolve_wandb_mode("") == "offline"
    assert resolve_wandb_mode("disabled") == "disabled"
    (no_wandb_credentials / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    assert resolve_wandb_mode("") == "online"
    (no_wandb_credentials / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "abc123")
    assert resolve_wandb_mode("") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_wandb_mode("") == "offline"
