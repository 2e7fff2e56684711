"""A run folder's records are never lost by accident: a fresh run refuses a folder that holds an earlier run's
records (unless --overwrite), --ckpt.load_enable continues a checkpoint when there is one, records are appended, a
dry run writes nothing, one run at a time holds a run folder, and a folder the run cannot write is refused before it
starts."""

import builtins
import errno
import io
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from openrlhf_async.cli.train_async import main, prepare
from openrlhf_async.config import parse_config, preset_path
from openrlhf_async.utils.run_folder import LOCK_FILE

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
    after = [(root, dirs, [f for f in files if f != LOCK_FILE]) for root, dirs, files in sorted(os.walk(run_dir))]
    assert refused and "holds an earlier run's records" in refused and after == before


def test_overwrite_deletes_the_earlier_runs_records_before_the_run_starts(tmp_path):
    run_dir = earlier_run(tmp_path)
    cfg = parse_config([PRESET, "--runs_dir", str(tmp_path / "runs"), "--actor.model_name_or_path",
                        fake_model(tmp_path), "--overwrite"])
    prepare(cfg)
    assert sorted(os.listdir(run_dir)) == [LOCK_FILE, "ckpt", "config.json", "data"]
    assert not os.listdir(f"{run_dir}/ckpt")


def test_load_enable_without_a_checkpoint_starts_a_new_run_and_says_so(tmp_path, capsys):
    assert run_cli(tmp_path, "--ckpt.load_enable", "--dry_run") == 0
    err = capsys.readouterr().err.strip()
    notices = [line for line in err.splitlines() if line.startswith("notice: --ckpt")]  # the memory plan's beside
    assert notices == [f"notice: --ckpt.load_enable: no checkpoint in {tmp_path / 'runs' / 'run' / 'ckpt'}; starting a "
                       "new run"], err


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


def _dry_run_steps(tmp_path) -> dict:
    """The built-in task's train prompts and seed, as a checkpoint of this config records them."""
    cfg = parse_config([PRESET, "--runs_dir", str(tmp_path / "elsewhere"), "--dry_run"])
    _, train_rows, _, _ = prepare(cfg)
    return {"num_prompts": len(train_rows), "seed": cfg.train.seed}


def test_one_run_per_run_folder_a_live_runs_folder_is_refused_a_dead_runs_is_not(tmp_path):
    """Two runs with the same --run_name at once wrote their steps into one metrics.jsonl and replaced each other's
    model; the second is refused now, --overwrite included, while the first lives; once it died, a resume starts."""
    import signal

    data = _dry_run_steps(tmp_path)
    flags = [PRESET, "--runs_dir", str(tmp_path / "runs"), "--actor.model_name_or_path", fake_model(tmp_path),
             "--no-progress"]
    # The first run as the CLI is when it starts its actors: prepare() has returned, the process lives on.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from openrlhf_async.cli.train_async import prepare; "
         "from openrlhf_async.config import parse_config; prepare(parse_config(sys.argv[1:])); "
         "print('started', flush=True); sys.stdin.read()", *flags],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "started\n", holder.communicate()[1][-2000:]
        run_dir = tmp_path / "runs" / "run"
        records = '{"step": 0}\n{"step": 1}\n'
        (run_dir / "metrics.jsonl").write_text(records)  # what the first run has logged so far
        (run_dir / "ckpt" / "step_1").mkdir(parents=True)
        (run_dir / "ckpt" / "step_1" / "trainer_state.json").write_text(json.dumps(
            {"step": 1, "weight_version": 1, "eval_start": None, "data_position": {"frontier": 8}, "data": data}))
        refusal = (f"error: --run_name run (--runs_dir {tmp_path / 'runs'}): the run folder {run_dir} is in use by a "
                   f"running run (pid {holder.pid}); wait for it to end, or choose another --run_name or --runs_dir")
        for extra in (["--overwrite"], ["--ckpt.load_enable"], ["--dry_run"]):
            second = subprocess.run([sys.executable, "-m", "openrlhf_async.cli.train_async", *flags, *extra],
                                    capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
            assert (second.returncode, second.stderr.strip()) == (2, refusal), (extra, second.stderr[-2000:])
            assert (run_dir / "metrics.jsonl").read_text() == records and (run_dir / "ckpt" / "step_1").is_dir()
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up of any kind: the kernel drops the lock
        holder.communicate()
    resume = [*flags, "--ckpt.load_enable"]
    assert main([*resume, "--dry_run"]) == 0
    assert prepare(parse_config(resume))[3][1]["step"] == 1  # a real start takes the folder


# Set to 1, the tests that need a file system mounted for them take the route of a machine that refuses them mounts
# (as root, to check that route too).
NO_MOUNT = "OPENRLHF_ASYNC_TEST_NO_MOUNT"


def _refuse_writes(folder, monkeypatch) -> None:
    """In this process, every creation or write in folder (os.mkdir, and os.makedirs through it; os.open, and
    tempfile through it; open; a rename, replace or link into it) fails as on a read-only file system: OSError
    EROFS. Reading it, and everything elsewhere, is untouched."""
    root = os.path.realpath(folder)
    real = {name: getattr(os, name) for name in ("mkdir", "open", "rename", "replace", "symlink", "link")}
    real_open = builtins.open

    def inside(path) -> bool:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return False  # a file descriptor
        path = os.path.realpath(os.fsdecode(path))
        return path == root or path.startswith(root + os.sep)

    def refused(path):
        return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def mkdir(path, *args, **kwargs):
        if inside(path):
            raise refused(path)
        return real["mkdir"](path, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
            raise refused(path)
        return real["open"](path, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if inside(file) and set(mode) & set("wax+"):
            raise refused(file)
        return real_open(file, mode, *args, **kwargs)

    def into(name):
        def call(src, dst, *args, **kwargs):
            if inside(dst):
                raise refused(dst)
            return real[name](src, dst, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    for name in ("rename", "replace", "symlink", "link"):
        monkeypatch.setattr(os, name, into(name))


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A folder on a read-only file system (root ignores permission bits, not a read-only mount): a read-only tmpfs
    where this process may mount one; elsewhere (no mount rights, or NO_MOUNT=1) a folder in which this process's
    every creation or write fails as on one (_refuse_writes), which is all that the refusals checked here go through
    (they run in this process)."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    if os.environ.get(NO_MOUNT) != "1":
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                                 capture_output=True, text=True)
        if not mounted.returncode:
            yield folder
            subprocess.run(["umount", "--lazy", str(folder)], check=True)
            return
    _refuse_writes(folder, monkeypatch)
    for write in (lambda: os.makedirs(folder / "a" / "b"), lambda: tempfile.mkstemp(dir=folder),
                  lambda: open(folder / "f", "w")):
        with pytest.raises(OSError, match=r"^\[Errno 30\] Read-only file system"):
            write()
    yield folder


@pytest.mark.parametrize("case", ["output_dir read-only", "runs_dir read-only", "ckpt.path read-only",
                                  "run folder is a file", "run_name 300 characters", "tensorboard_dir under a file"])
def test_a_folder_the_run_cannot_write_is_refused_by_the_dry_run_and_at_start_naming_its_flag(tmp_path, request,
                                                                                           capsys, case):
    """Such a run passed the dry run, trained to the end and lost its model in a traceback (OSError: [Errno 30]
    Read-only file system), or failed on its first record."""
    runs, name = tmp_path / "runs", "run"
    read_only = request.getfixturevalue("read_only_dir") if "read-only" in case else None
    (tmp_path / "a_file").write_text("")
    flags, expected = {
        "output_dir read-only": (["--ckpt.output_dir", f"{read_only}/final"],
                                 f"--ckpt.output_dir {read_only}/final: cannot write there (Read-only file system); "
                                 "choose a writable --ckpt.output_dir"),
        "runs_dir read-only": ([], f"--runs_dir {read_only}: cannot write there (Read-only file system); choose a "
                                   "writable --runs_dir"),
        "ckpt.path read-only": (["--ckpt.save_steps", "1", "--ckpt.path", str(read_only)],
                                f"--ckpt.path {read_only}: cannot write there (Read-only file system); choose a "
                                "writable --ckpt.path"),
        "run folder is a file": ([], f"--run_name: the run folder {runs / name}: {runs / name} is a file, not a "
                                     "folder; choose another --run_name or --runs_dir"),
        "run_name 300 characters": (["--run_name", "r" * 300],
                                    f"--run_name: the run folder {runs / ('r' * 300)}: cannot write there (File name "
                                    "too long); choose another --run_name or --runs_dir"),
        "tensorboard_dir under a file": (["--logger.tensorboard_dir", f"{tmp_path}/a_file/tb"],
                                         f"--logger.tensorboard_dir {tmp_path}/a_file/tb: {tmp_path}/a_file is a file, "
                                         "not a folder; choose a writable --logger.tensorboard_dir"),
    }[case]
    if case == "runs_dir read-only":
        runs = read_only
    elif case == "run folder is a file":
        runs.mkdir()
        (runs / name).write_text("")
    flags = [PRESET, "--runs_dir", str(runs), "--actor.model_name_or_path", fake_model(tmp_path), *flags]
    before = sorted(os.walk(tmp_path))
    assert main([*flags, "--dry_run"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {expected}"
    assert sorted(os.walk(tmp_path)) == before, "the dry run left something behind"
    with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
        prepare(parse_config(flags))  # a real start, before any actor


def test_runs_with_different_names_in_one_folder_keep_their_models_apart_by_default(tmp_path, capsys):
    """OpenRLHF's default --ckpt.output_dir ./ckpt made a second run refuse to start (or, with --overwrite, delete
    the first run's model); here the defaults are in each run's folder."""
    earlier_run(tmp_path, "a")
    assert run_cli(tmp_path, "--run_name", "a", "--dry_run") == 2
    capsys.readouterr()
    assert run_cli(tmp_path, "--run_name", "b", "--dry_run") == 0
    out = capsys.readouterr().out
    ckpt = json.loads(out[: out.rindex("\ndry run:")])["config"]["ckpt"]
    assert (ckpt["output_dir"], ckpt["path"]) == ("{run_dir}/final_hf", "{run_dir}/ckpt")
    cfg = parse_config([PRESET, "--runs_dir", str(tmp_path / "runs"), "--run_name", "b"])
    assert (cfg.output_dir, cfg.ckpt_path) == (str(tmp_path / "runs" / "b" / "final_hf"),
                                               str(tmp_path / "runs" / "b" / "ckpt"))


def test_a_lock_left_by_a_killed_deepspeed_op_build_is_refused_at_start_naming_the_folder_to_delete(
        tmp_path, capsys, monkeypatch):
    """torch's build lock outlives a build killed midway, and every later trainer rank waited on it for ever."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    assert run_cli(tmp_path, "--dry_run") == 0  # a build may be running now: a young lock is waited for
    capsys.readouterr()
    os.utime(lock, (os.path.getmtime(lock) - 3600,) * 2)
    assert run_cli(tmp_path, "--dry_run") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {lock} was left 60 minutes ago by a compile of DeepSpeed's 'deepspeed_shm_comm' op that never ended, "
        f"and the trainer would wait on it for ever: unless a build is running now, delete {lock.parent} (it is "
        "rebuilt)"]
