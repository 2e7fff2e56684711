"""Users' .py files (agents, reward functions), imported by path with a one-line error naming their flag."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys

IMPORT_TIMEOUT_S = 60.0  # how long a user file may take to import in check_user_file's child process

# Run by run_child in a child Python, before its body: argv gives the pipe fd to report on, the parent's pid, an
# address-space limit (0: none), sys.path and the body's own args. The child has a session of its own (a timeout
# kills it all), so a signal that ends the parent (SIGTERM, Ctrl-C) does not reach it: a watchdog thread kills its
# process group, whatever the body started included, once the parent is gone (the GIL lets the thread run beside a
# body that loops).
_PRELUDE = """
import json, os, resource, signal, sys, threading, time
fd, parent, memory, sys.path[:], args = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]),
                                         sys.argv[5:])
if memory:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

def die_with_parent():
    while os.getppid() == parent:
        time.sleep(0.2)
    os.killpg(0, signal.SIGKILL)

def report(text):
    os.write(fd, text.encode())

threading.Thread(target=die_with_parent, daemon=True).start()
"""

# check_user_file's body: import the file, then report how it went.
_IMPORT = """
path, name = args
try:
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    verdict = "ok"
except BaseException as e:  # SystemExit too: a file that exits at import is broken
    verdict = "does not import ({}: {})".format(type(e).__name__, (str(e).strip().splitlines() or [""])[0][:500])
report(verdict)
"""


def _module_name(path: str, prefix: str) -> str:
    return f"{prefix}_{abs(hash(os.path.abspath(path)))}"


def _check_path(path: str, flag: str, contract: str, error: type) -> None:
    if not os.path.isfile(path):
        raise error(f"{flag} {path}: no such file; expected a .py file with {contract}")
    if not path.endswith(".py"):
        raise error(f"{flag} {path}: not a Python file; expected {contract}")


def run_child(body: str, args: list, timeout: float, memory: int = 0) -> tuple:
    """Run Python `body` in a short-lived child process (this sys.path; `args` its strings; report(text) its
    channel, whatever it prints), its address space limited to `memory` bytes (0: no limit), killed with all it
    started after `timeout` seconds, or with this process. Returns (what it reported, its exit code: None when it
    ran past the timeout, negative when a signal ended it)."""
    read_fd, write_fd = os.pipe()  # the report's own channel: the body may print anything, start anything
    try:
        try:
            child = subprocess.Popen(
                [sys.executable, "-B", "-c", _PRELUDE + body, str(write_fd), str(os.getpid()), str(int(memory)),
                 json.dumps(sys.path), *args], pass_fds=(write_fd,), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)  # its own process group: a timeout kills it all
        finally:
            os.close(write_fd)
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return _read_all(read_fd), None
        except BaseException:  # Ctrl-C, or a signal handler's exception: the child ends with its caller
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        return _read_all(read_fd), child.returncode
    finally:
        os.close(read_fd)


def _read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def check_user_file(path: str, flag: str, contract: str, error: type, prefix: str) -> None:
    """Import the file once in a short-lived child process, so that a file which hangs at import (bounded by
    IMPORT_TIMEOUT_S), exits or crashes the interpreter is an `error` naming `flag path`, not a hung or silently
    ended run. The driver calls this for agent and reward files before it imports them itself."""
    _check_path(path, flag, contract, error)
    verdict, code = run_child(_IMPORT, [path, _module_name(path, prefix)], IMPORT_TIMEOUT_S)
    if code is None:
        raise error(f"{flag} {path}: did not finish importing within {IMPORT_TIMEOUT_S:g} s (a loop or a "
                    "blocking call at module level?); keep slow work out of import")
    if verdict == "ok":
        return
    if verdict:
        raise error(f"{flag} {path}: {verdict}")
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    raise error(f"{flag} {path}: ends the Python process while importing ({how}; os._exit or a crash at module "
                "level?); keep module-level code to definitions")


def import_user_file(path: str, flag: str, contract: str, error: type, prefix: str):
    """The module at path, registered in sys.modules under a name derived from its path (dataclasses and
    pickling look a module up by name). Raises `error` naming `flag path` for a missing or broken file."""
    _check_path(path, flag, contract, error)
    name = _module_name(path, prefix)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise error(f"{flag} {path}: not a Python file; expected {contract}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # No __pycache__ beside the user's file: loading it (a dry run included) writes nothing.
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SystemExit: a script-like file
        sys.modules.pop(name, None)
        raise error(f"{flag} {path}: does not import ({type(e).__name__}: {e})") from None
    finally:
        sys.dont_write_bytecode = dont_write
    return module
