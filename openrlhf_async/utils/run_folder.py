"""One run per run folder, and every folder a run writes checked before it starts.

A run holds an OS lock on <run dir>/.lock from its start (before any actor starts or any record is deleted) to its
end; the kernel drops it when the process dies, however it dies, so a dead run never blocks a resume. It is a POSIX
record lock (fcntl.lockf), not flock: a forked child does not inherit it (a leftover child of a killed run cannot keep
the folder locked), and F_GETLK names the holder's pid without taking the lock, which is what a dry run needs. One
catch of POSIX locks: closing any descriptor of the file drops the process's lock, so this module opens it once and
keeps it open (_held)."""

import errno
import fcntl
import glob
import os
import struct
import tempfile
import time

from openrlhf_async.errors import ConfigError
from openrlhf_async.utils.metrics import warn

LOCK_FILE = ".lock"
STALE_BUILD_LOCK_S = 20 * 60  # DeepSpeed's ops compile in a few minutes; a lock this old was left by a killed build
_held = {}  # real path of a lock file -> the descriptor holding its lock, for the life of the process


def folders(cfg) -> list:
    """(flag, folder) for every folder the run writes, outermost first."""
    found = [("--runs_dir", cfg.runs_dir), ("--run_name", cfg.run_dir)]
    if cfg.ckpt.save_steps > 0:
        found.append(("--ckpt.path", cfg.ckpt_path))
    found.append(("--ckpt.output_dir", cfg.output_dir))
    if cfg.logger.tensorboard_dir:
        found.append(("--logger.tensorboard_dir", cfg.in_run(cfg.logger.tensorboard_dir)))
    return found


# The operating system's folders: a run writing there (as root, or where they are writable) would replace the
# system's files with its own (config.json, model files). /var/tmp is anyone's.
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin", "/sys", "/usr",
               "/var")
ANYONES_DIRS = ("/var/tmp",)


def system_dir(folder: str):
    """The system folder (SYSTEM_DIRS, or / itself) that folder is or lies in, links resolved; None when none."""
    path = os.path.realpath(folder)
    if path == "/":
        return path
    if any(path == d or path.startswith(d + "/") for d in ANYONES_DIRS):
        return None
    return next((d for d in SYSTEM_DIRS if path == d or path.startswith(d + "/")), None)


def check_folders(cfg) -> None:
    """Every folder the run writes can be created and written, and lies in no system folder unless
    --allow_system_dirs says so; ConfigError naming the flag otherwise. Leaves nothing behind (a dry run writes
    nothing): what it creates to test, it removes."""
    for flag, folder in folders(cfg):
        system = None if cfg.allow_system_dirs else system_dir(folder)
        if system:
            raise ConfigError(f"{flag} {folder}: lies in the system folder {system}, whose files the run's would "
                              "replace; choose a folder of your own, or pass --allow_system_dirs if you mean it")
        problem = _write_problem(folder)
        if problem:
            which = f"--run_name: the run folder {folder}" if flag == "--run_name" else f"{flag} {folder}"
            fix = "choose another --run_name or --runs_dir" if flag == "--run_name" else f"choose a writable {flag}"
            raise ConfigError(f"{which}: {problem}; {fix}")


def check_build_locks() -> None:
    """A DeepSpeed op build killed midway (an out-of-memory kill, a Ctrl-C) leaves torch's lock file in the op's
    build folder, and every later build of that op waits for it to go, for ever, inside a trainer rank. ConfigError
    naming the folder to delete when a lock there is older than any build takes."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    for lock in sorted(glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))):
        try:
            age = time.time() - os.stat(lock).st_mtime
        except OSError:  # a build just ended
            continue
        if age > STALE_BUILD_LOCK_S:
            folder = os.path.dirname(lock)
            raise ConfigError(f"{lock} was left {age / 60:.0f} minutes ago by a compile of DeepSpeed's "
                              f"'{os.path.basename(folder)}' op that never ended, and the trainer would wait on it "
                              f"for ever: unless a build is running now, delete {folder} (it is rebuilt)")


def _write_problem(folder: str):
    """Why a file cannot be written in folder (created if missing, then removed again), or None."""
    path, missing = os.path.abspath(folder), []
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"{path} is a file, not a folder"
    created = []
    try:
        for part in reversed(missing):
            os.mkdir(part)
            created.append(part)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write_test")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    finally:
        for part in reversed(created):
            try:
                os.rmdir(part)
            except OSError:  # something else wrote into it meanwhile: it is theirs now
                pass
    return None


def hold(cfg) -> None:
    """Take the run folder's lock (creating the folder) for the rest of this process's life; ConfigError when
    another live run holds it."""
    os.makedirs(cfg.run_dir, exist_ok=True)
    path = os.path.realpath(os.path.join(cfg.run_dir, LOCK_FILE))
    if path in _held:  # taken already by this process (a test calling prepare again)
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(f"--run_name {cfg.run_name}: cannot open the run folder's lock file {path} ({e.strerror}); "
                          "remove it, or choose another --run_name or --runs_dir") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        pid = _holder(fd) if e.errno in (errno.EACCES, errno.EAGAIN) else None
        os.close(fd)
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks: run, unguarded
            warn(f"the run folder {cfg.run_dir} cannot be locked ({e.strerror}); nothing stops a second run with "
                 "the same --run_name from writing into it meanwhile")
            return
        raise ConfigError(_in_use(cfg, pid)) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())  # for a person looking; the lock itself is what counts
    _held[path] = fd


def check_free(cfg) -> None:
    """A dry run's check: ConfigError when a live run holds the run folder's lock (which is not taken)."""
    path = os.path.join(cfg.run_dir, LOCK_FILE)
    if os.path.realpath(path) in _held or not os.path.isfile(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # unreadable: the real start says why
        return
    try:
        pid = _holder(fd)
    finally:
        os.close(fd)
    if pid is not None:
        raise ConfigError(_in_use(cfg, pid))


def _holder(fd: int):
    """The pid of the process holding a lock on the file (0 when it is not visible from here), or None when none
    is held."""
    # struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (padded to 32).
    query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    kind, _, _, _, pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, query))
    return None if kind == fcntl.F_UNLCK else pid


def _in_use(cfg, pid) -> str:
    holder = f" (pid {pid})" if pid else ""
    return (f"--run_name {cfg.run_name} (--runs_dir {cfg.runs_dir}): the run folder {cfg.run_dir} is in use by a "
            f"running run{holder}; wait for it to end, or choose another --run_name or --runs_dir")
