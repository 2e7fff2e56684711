"""A run folder's records are never lost by accident: a fresh run refuses a folder that holds an earlier run's
records (unless --overwrite), --ckpt.load_enable continues a checkpoint when there is one, records are appended, and
a dry run writes nothing."""

import json
import os
import subprocess
import sys

from openrlhf_async.cli.train_async import main, prepare
from openrlhf_async.config import parse_config, preset_path

PRESET = "@" + preset_path("tiny_cpu")


def run_cli(tmp_path, *flags):
    return main([PRESET, "--runs_dir", str(tmp_path / "runs"), "--no-progress", *flags])


def earlier_run(tmp_path, name="run") -> str:
    """A run folder as a finished run leaves it (the parts the check looks at), with a checkpoint at step 2."""
    run_dir = tmp_path / "runs" / name
    (run_dir / "final_hf").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (run_dir / "timeline.jsonl").write_text('{"actor": "trainer", "kind": "train", "start": 0, "end": 1, "step": 1}\n')
    (run_dir / "ckpt" / "step_2").mkdir(parents=True)
    (run_dir / "ckpt" / "step_2" / "trainer_state.json").write_text("{}")
    return str(run_dir)


def fake_model(tmp_path) -> str:
    """A model folder that validation accepts, so prepare() builds nothing."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return str(model)


def test_a_fresh_dry_run_refuses_a_folder_with_an_earlier_runs_records(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_cli(tmp_path, "--dry_run") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {run_dir} holds an earlier run's records (metrics.jsonl) and no checkpoint: choose "
                   "another --run_name or --ckpt.path / --ckpt.output_dir, or pass --overwrite to delete them and "
                   "start again"), err


def test_a_fresh_run_refuses_an_earlier_runs_checkpoints_without_save_steps(tmp_path, capsys):
    run_dir = earlier_run(tmp_path)
    assert run_cli(tmp_path, "--dry_run") == 2
    err = capsys.readouterr().err.strip()
    assert (f"{run_dir} holds an earlier run's records (metrics.jsonl, timeline.jsonl, final_hf; newest checkpoint: "
            "step 2): pass --ckpt.load_enable to continue it, choose another --run_name or --ckpt.path / "
            "--ckpt.output_dir, or pass --overwrite") in err, err


def test_a_real_start_refuses_before_writing_anything(tmp_path):
    run_dir = earlier_run(tmp_path)
    before = sorted(os.walk(run_dir))
    cfg = parse_config([PRESET, "--runs_dir", str(tmp_path / "runs"), "--actor.model_name_or_path",
                        fake_model(tmp_path)])
    try:
        prepare(cfg)
        refused = None
    except ValueError as e:  # ConfigError
        refused = str(e)
    assert refused and "holds an earlier run's records" in refused and sorted(os.walk(run_dir)) == before


def test_overwrite_deletes_the_earlier_runs_records_before_the_run_starts(tmp_path):
    run_dir = earlier_run(tmp_path)
    cfg = parse_config([PRESET, "--runs_dir", str(tmp_path / "runs"), "--actor.model_name_or_path",
                        fake_model(tmp_path), "--overwrite"])
    prepare(cfg)
    assert sorted(os.listdir(run_dir)) == ["ckpt", "config.json", "data"] and not os.listdir(f"{run_dir}/ckpt")


def test_load_enable_without_a_checkpoint_starts_a_new_run_and_says_so(tmp_path, capsys):
    assert run_cli(tmp_path, "--ckpt.load_enable", "--dry_run") == 0
    err = capsys.readouterr().err.strip()
    assert err == (f"notice: --ckpt.load_enable: no checkpoint in {tmp_path / 'runs' / 'run' / 'ckpt'}; starting a "
                   "new run"), err


def test_overwrite_and_resume_together_are_refused(tmp_path, capsys):
    assert run_cli(tmp_path, "--ckpt.load_enable", "--overwrite", "--dry_run") == 2
    assert "--overwrite deletes the earlier run's records and --ckpt.load_enable continues them" in \
        capsys.readouterr().err


def test_records_are_appended_never_truncated(tmp_path):
    from openrlhf_async.utils.metrics import MetricsLog

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    log = MetricsLog(str(run_dir), 3, progress=False)
    log.log({"step": 2})
    log.close()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_dry_run_writes_nothing(tmp_path):
    """Not the built-in dataset, not a temporary folder, not config.json, not __pycache__ beside a user's file."""
    work = tmp_path / "work"
    (work / "tmp").mkdir(parents=True)
    (work / "agents").mkdir()
    (work / "agents" / "agent.py").write_text("def step(state, action, label):\n    return 1.0, state, True, {}\n")
    before = sorted(os.walk(work))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as most users run it
    proc = subprocess.run(
        [sys.executable, "-m", "openrlhf_async.cli.train_async", PRESET, "--dry_run", "--runs_dir",
         str(work / "runs"), "--train.agent_func_path", str(work / "agents" / "agent.py")],
        capture_output=True, text=True, timeout=120, cwd=work, env={**env, "TMPDIR": str(work / "tmp")})
    assert proc.returncode == 0 and sorted(os.walk(work)) == before, (proc.stderr[-2000:], sorted(os.walk(work)))
