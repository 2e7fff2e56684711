"""Run model-written Python in a throwaway sandbox: the code-execution tool of agent steps.

    run_python(code, timeout=5.0, memory_mb=512, max_output=4096)
        -> {"stdout", "stderr", "exit_code", "timed_out", "truncated"}
    await run_python_async(...)  # the same for an agent's async step: an asyncio subprocess on the running
                                 # loop, so the engine keeps generating while the code runs

The boundary is the operating system, through bubblewrap (`bwrap`, the sandbox of Flatpak), never Python alone:
the code may run arbitrary native code (ctypes, a shell) and is still held by the kernel. Each run gets
- its own user namespace with a non-root uid (65534), no capabilities, and no way to make further namespaces;
- its own network namespace (no address outside is reachable, loopback included), PID namespace (it sees and
  can signal only its own processes, and all of them die with it, timeout or not) and fresh /proc and /dev;
- a file system of read-only binds (the system's /usr and the Python installation) and one writable place, a
  size-limited tmpfs at /sandbox (also /tmp, HOME and TMPDIR) that vanishes with the run; nothing of the host's
  files is writable and the parent's environment is not passed;
- resource limits set before any of its code runs (RLIMIT_AS memory, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NPROC
  counted inside its own user namespace, no core files), which unprivileged code cannot raise again;
- a wall-clock timeout in the parent that kills bwrap, and with it (`--die-with-parent`, the PID namespace) every
  process the code started; output read in bounded chunks. The timeout counts from the moment the code starts (the
  sandbox says so on a pipe of its own), so a loaded machine's slow start of bwrap and the interpreter takes none
  of the code's time; the start itself is bounded apart (START_BOUND_S, a timeout too).

An audit hook in the interpreter (refusing sockets, processes, ctypes calls and writes outside the working dir)
stays as an extra layer that turns most attempts into a clear PermissionError; it is not relied on.

Where bwrap is missing or cannot create namespaces, running model code raises SandboxUnavailable (one line: why,
and how to fix it) unless the run accepted the risk with `--agent.sandbox unsafe` (environment
OPENRLHF_ASYNC_SANDBOX=unsafe in the engines): then the code runs in a plain subprocess with the audit hook and the
resource limits only, which native code can defeat."""

import asyncio
import itertools
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from openrlhf_async.agent.kernel_limits import RunCgroup, memory_bound, seccomp_fd, seccomp_program

logger = logging.getLogger(__name__)

MODES = ("bwrap", "unsafe")
MODE_ENV = "OPENRLHF_ASYNC_SANDBOX"  # set in each engine from --agent.sandbox
WORKDIR_MB = 32  # the working dir's tmpfs size, and the largest file the code may write
NPROC = 16  # threads the code may run at once (inside its own user namespace; the filter refuses processes)
NOFILE = 64  # open descriptors: each pipe or socket holds kernel buffers outside the process's memory limit
CGROUP_SLACK_MB = 32  # the cgroup's limit over RLIMIT_AS and the tmpfs: page tables, kernel buffers
ROOT = "/sandbox"  # the working dir inside bwrap
# /proc/keys lists the keys of the engine's session keyring, which every child inherits (the filter refuses the
# keyring calls; their names still show there).
PROC_MASKED = ("/proc/keys", "/proc/key-users", "/proc/kcore", "/proc/timer_list", "/proc/sched_debug",
               "/proc/latency_stats")
UID = 65534  # the code's uid inside its user namespace: "nobody", not root
ROOT_ENGINE_UIDS = (100_000, 4096)  # an engine run by root runs each sandbox as a host uid from this range
_READ_CHUNK = 65536
_DRAIN_AFTER_KILL = 2.0  # seconds to collect the output left in the pipes after a kill
START_BOUND_S = 60.0  # seconds bwrap and the interpreter may take to reach the code: past it, stuck, not slow


class SandboxUnavailable(RuntimeError):
    """No operating-system isolation here, and the run did not accept running model code without it."""


# The program the sandboxed interpreter runs: argv = root, memory bytes, cpu seconds, disk bytes, nproc (0: no
# limit), open descriptors, audit (install the hook; off only in the tests that show the OS layer holds alone), the
# descriptor on which it says that the code starts (the parent's timeout counts from there).
PREAMBLE = r'''
import os, sys


def _limit(memory_bytes, cpu_seconds, disk_bytes, nproc, nofile):
    import resource

    limits = [(resource.RLIMIT_AS, memory_bytes, memory_bytes), (resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1),
              (resource.RLIMIT_FSIZE, disk_bytes, disk_bytes), (resource.RLIMIT_CORE, 0, 0),
              (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_MSGQUEUE, 0, 0)]
    if nproc:  # counted per user: only inside our own user namespace is a small number safe
        limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def _make_hook(root, fspath=os.fspath, getcwd=os.getcwd, stat=os.stat, lstat=os.lstat, readlink=os.readlink,
               type=type, str=str, bytes=bytes, int=int, OSError=OSError, PermissionError=PermissionError,
               WRITE=os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC):
    """The audit hook. It uses only these bound values, never a global, so user code cannot swap its helpers."""
    from types import MappingProxyType

    deny = frozenset({
        "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.startfile",
        "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "os.link",
        "resource.setrlimit", "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "cpython.PyInterpreterState_New", "sqlite3.enable_load_extension",
        "sqlite3.load_extension", "webbrowser.open"})
    deny_imports = frozenset({"_posixsubprocess", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"})
    ctypes_allowed = frozenset({"ctypes.create_string_buffer", "ctypes.create_unicode_buffer", "ctypes.get_errno",
                                "ctypes.set_errno", "ctypes.addressof"})
    # event -> (indices of the paths it changes, indices of its dir_fd arguments)
    path_events = MappingProxyType({
        "os.mkdir": ((0,), (2,)), "os.rmdir": ((0,), (1,)), "os.remove": ((0,), (1,)),
        "os.rename": ((0, 1), (2, 3)), "os.symlink": ((1,), (2,)), "os.chmod": ((0,), (2,)),
        "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()),
        "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()), "os.chflags": ((0,), ()),
        "os.mkfifo": ((0,), ()), "os.mknod": ((0,), ()), "sqlite3.connect": ((0,), ())})
    default_dir_fds = (None, -1, -100)  # -100: AT_FDCWD
    inside = root + "/"

    def hook(event, args):
        if event in deny:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event.startswith("socket."):
            if (event == "socket.__new__" and args[1] == 1) or event == "socket.gethostname":
                return  # AF_UNIX socketpairs (asyncio's self-pipe); connect, bind and sendto stay refused
            raise PermissionError(f"sandbox: no network ({event})")
        if event.startswith("ctypes."):
            if event in ctypes_allowed or (event == "ctypes.dlopen" and args[0] is None):
                return  # `import ctypes` opens the process itself; looking up or calling a symbol is refused
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import":
            if args[0] in deny_imports:
                raise PermissionError(f"sandbox: import {args[0]} is not allowed")
            return
        if event == "open":
            if type(args[0]) is int:
                return
            flags, mode = args[2], args[1]
            writing = ((type(flags) is int and flags & WRITE) or
                       (type(mode) is str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)))
            todo = [args[0]]
        else:
            spec = path_events.get(event)
            if spec is None:
                return
            if event == "sqlite3.connect" and (args[0] == ":memory:" or args[0] == ""):
                return
            for i in spec[1]:
                if args[i] not in default_dir_fds:
                    raise PermissionError(f"sandbox: {event} relative to a directory descriptor is not allowed")
            writing = True
            todo = []
            for i in spec[0]:
                todo.append(args[i])
        for path in todo:
            if type(path) is int:
                raise PermissionError(f"sandbox: {event} on a file descriptor is not allowed")
            if type(path) is not str and type(path) is not bytes:
                path = fspath(path)
            if type(path) is bytes:
                path = path.decode("utf-8", "surrogateescape")
            if not writing:
                # Reading files is allowed; opening a directory outside is not (its descriptor would let
                # os.open(..., dir_fd=) create files there, and the event does not show dir_fd).
                try:
                    if stat(path).st_mode & 0o170000 != 0o040000:
                        continue
                except OSError:
                    continue
            if not path.startswith("/"):
                path = getcwd() + "/" + path
            pending = path.split("/")
            pending.reverse()
            parts = []
            hops = 0
            while pending:  # resolve symlinks and "..", as the kernel will
                name = pending.pop()
                if name == "" or name == ".":
                    continue
                if name == "..":
                    if parts:
                        parts.pop()
                    continue
                parts.append(name)
                current = "/" + "/".join(parts)
                try:
                    mode_bits = lstat(current).st_mode
                except OSError:
                    continue
                if mode_bits & 0o170000 == 0o120000:
                    hops += 1
                    if hops > 40:
                        raise PermissionError(f"sandbox: too many symlinks in {path}")
                    parts.pop()
                    target = readlink(current)
                    if target.startswith("/"):
                        parts = []
                    more = target.split("/")
                    more.reverse()
                    pending.extend(more)
            real = "/" + "/".join(parts)
            if real != root and not real.startswith(inside):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed ({path})")

    return hook


def _main():
    root, memory, cpu, disk, nproc, nofile, audit, started = sys.argv[1:9]
    memory, cpu, disk, nproc, nofile, audit = int(memory), int(cpu), int(disk), int(nproc), int(nofile), audit == "1"
    import atexit, builtins, traceback, types

    with open("main.py", "rb") as f:
        source = f.read()
    _limit(memory, cpu, disk, nproc, nofile)
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = "main.py", builtins
    sys.modules["__main__"], sys.argv = main, ["main.py"]
    if audit:
        import _posixsubprocess

        def fork_exec(*args, **kwargs):  # it starts processes without an audit event of its own
            raise PermissionError("sandbox: starting processes is not allowed")

        _posixsubprocess.fork_exec = fork_exec
        sys.addaudithook(_make_hook(os.path.realpath(root)))
    status = 0
    os.write(int(started), b"1")
    os.close(int(started))
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        status = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)  # no interpreter shutdown: CPython clears audit hooks before its last frees


_main()
'''


def _env(home: str) -> dict:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _python_dirs() -> list:
    """The folders the interpreter and its packages live in, outermost first, none inside another or in /usr."""
    dirs = {os.path.realpath(d) for d in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                           os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))}
    dirs |= {os.path.abspath(d) for d in (sys.prefix, sys.base_prefix)}  # the venv's own path, as it names itself
    kept = []
    for d in sorted(dirs):
        if d != "/" and not d.startswith("/usr/") and not any(d == k or d.startswith(k + "/") for k in kept):
            kept.append(d)
    return kept


class _RootUserNamespace:
    """For an engine run by root. A user namespace that bwrap maps to the engine's own uid would make the code
    root on the host (owner of every root-owned file, exempt from RLIMIT_NPROC). Instead, one long-lived holder
    process per engine owns a user namespace that maps a range of unprivileged host uids to themselves (and root
    to root, for bwrap's own set-up), with no further user namespaces allowed in it; each run enters it
    (`bwrap --userns`) and drops to a uid of its own from the range, so runs cannot signal each other either."""

    HOLDER = ("import ctypes, sys\n"
              "assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0, 'unshare(CLONE_NEWUSER) failed'\n"
              "print('unshared', flush=True)\n"
              "sys.stdin.readline()\n"
              "open('/proc/sys/user/max_user_namespaces', 'w').write('0')\n"
              "print('ready', flush=True)\n"
              "sys.stdin.read()\n")  # lives until the engine closes the pipe (or dies)

    def __init__(self):
        first, count = ROOT_ENGINE_UIDS
        self.holder = subprocess.Popen([sys.executable, "-I", "-c", self.HOLDER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.holder.stdout.readline() != "unshared\n":
            raise OSError(f"no user namespace: {self._error()}")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{self.holder.pid}/{name}", "w") as f:
                f.write(f"0 0 1\n{first} {first} {count}\n")
        self.holder.stdin.write("\n")
        self.holder.stdin.flush()
        if self.holder.stdout.readline() != "ready\n":
            raise OSError(f"no user namespace: {self._error()}")
        self._uids = itertools.cycle(range(first, first + count))

    def _error(self) -> str:
        self.holder.kill()
        return (self.holder.stderr.read().strip().splitlines() or ["the holder process died"])[-1]

    def open(self) -> tuple:
        """(a descriptor of the namespace for `bwrap --userns`, the uid this run gets)."""
        return os.open(f"/proc/{self.holder.pid}/ns/user", os.O_RDONLY), next(self._uids)


_root_userns = None
_root_userns_lock = threading.Lock()


def _user_namespace(fds: list) -> tuple:
    """(bwrap's user-namespace arguments, the program that drops to the code's uid) for this run; descriptors
    bwrap needs are appended to fds."""
    global _root_userns
    if os.geteuid() != 0:  # bwrap maps the code's uid to the engine's own, unprivileged one
        return ["--unshare-user", "--disable-userns", "--uid", str(UID), "--gid", str(UID), "--cap-drop", "ALL"], []
    with _root_userns_lock:
        if _root_userns is None or _root_userns.holder.poll() is not None:
            _root_userns = _RootUserNamespace()
        fd, uid = _root_userns.open()
    fds.append(fd)
    # bwrap sets up as root of that namespace; setpriv (util-linux) then drops to the run's uid, all capabilities
    # and supplementary groups before the interpreter starts.
    drop = [shutil.which("setpriv") or "setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--"]
    return ["--userns", str(fd), "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"], drop


def _bwrap_command(fds: list, disk_bytes: int, workdir: str = None, env: dict = None) -> list:
    """The bwrap command line up to the program; fds: [the code's memfd, the seccomp filter's] (with workdir: [the
    filter's]), to which namespace descriptors are added. workdir: a host folder bound writable as the working dir
    (run_command_async) in place of the tmpfs holding the code; env: variables set beside _env's."""
    code_fd, filter_fd = (None, fds[0]) if workdir else fds[:2]
    userns, drop = _user_namespace(fds)
    command = [*userns, "--unshare-pid", "--unshare-net", "--unshare-ipc",
               "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
               "--hostname", "sandbox", "--seccomp", str(filter_fd)]
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: /bin -> usr/bin
            command += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            command += ["--ro-bind", top, top]
    for path in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        command += ["--ro-bind-try", path, path]
    python_dirs = _python_dirs()
    for path in python_dirs:
        parents = [os.path.dirname(path)]
        while parents[-1] != "/":
            parents.append(os.path.dirname(parents[-1]))
        for parent in reversed(parents[:-1]):  # bwrap would copy a parent's mode, and /root is 0700
            command += ["--perms", "0755", "--dir", parent]
        command += ["--ro-bind", path, path]
    command += ["--proc", "/proc"]
    for path in PROC_MASKED:  # as container runtimes mask them: the host's keys, kernel memory and timers
        if os.path.exists(path):  # the same kernel: what the host's /proc has, the sandbox's has
            command += ["--ro-bind", "/dev/null", path]
    tmp_free = not any(d == "/tmp" or d.startswith("/tmp/") for d in python_dirs)  # else /tmp holds the interpreter
    if workdir is None:
        command += ["--dev", "/dev", "--perms", "0777", "--size", str(disk_bytes), "--tmpfs", ROOT,
                    "--file", str(code_fd), f"{ROOT}/main.py"]
        command += ["--symlink", ROOT, "/tmp"] if tmp_free else []  # else read-only; TMPDIR is ROOT
    else:  # the folder's own parents, made in the sandbox's root as the interpreter's are
        parents = [os.path.dirname(workdir)]
        while parents[-1] != "/":
            parents.append(os.path.dirname(parents[-1]))
        command += ["--dev", "/dev"]
        command += ["--perms", "0777", "--size", str(disk_bytes), "--tmpfs", "/tmp"] if tmp_free else []
        for parent in reversed(parents[:-1]):
            command += ["--perms", "0755", "--dir", parent]
        command += ["--bind", workdir, workdir]
    home = workdir or ROOT
    command += ["--remount-ro", "/dev", "--remount-ro", "/",  # the only writable places left: the tmpfs, workdir
                "--chdir", home, "--clearenv"]
    for name, value in {**_env(home), **(env or {})}.items():
        command += ["--setenv", name, value]
    # The options travel in a descriptor (--args), so bwrap's command line, which the code sees as /proc/1/cmdline,
    # shows no host paths or sandbox set-up.
    options_fd = os.memfd_create("sandbox-options")
    fds.append(options_fd)
    os.write(options_fd, b"".join(arg.encode() + b"\0" for arg in command))
    os.lseek(options_fd, 0, os.SEEK_SET)
    return [shutil.which("bwrap") or "bwrap", "--args", str(options_fd), "--", *drop]


def _bwrap_launch(bwrap, cgroup, options: dict, started_w: int) -> tuple:
    """_launch's result for the bwrap command that bwrap(fds) builds, appending the descriptors it passes to fds
    (started_w, the code's start pipe, among them); if building it fails, they, the pipe and the cgroup are
    closed."""
    fds = []
    try:
        command = bwrap(fds)
    except BaseException:
        for fd in {*fds, started_w, options["started_fd"]}:
            os.close(fd)
        cgroup.close()
        raise
    return None, cgroup, cgroup.wrap(command), {**options, "env": _env(ROOT), "pass_fds": tuple(fds), "cwd": "/"}


def _launch(code: str, timeout: float, memory_mb: int, mode: str, audit: bool) -> tuple:
    """(host folder to remove afterwards or None, the run's cgroup, the command, its Popen arguments); _cleanup
    closes pass_fds and the cgroup."""
    limits = [str(memory_mb << 20), str(math.ceil(timeout) + 1), str(WORKDIR_MB << 20)]  # then nproc, nofile
    python = [sys.executable, "-I", "-B", "-u", "-c", PREAMBLE]
    # start_new_session: one process group holds the launcher, so one kill ends it (and bwrap takes the rest).
    options = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    cgroup = RunCgroup((memory_mb + WORKDIR_MB + CGROUP_SLACK_MB) << 20)
    started_w = _start_pipe(options)
    if mode == "bwrap":
        def bwrap(fds: list) -> list:
            code_fd = os.memfd_create("sandbox-code")  # bwrap copies it into the tmpfs: nothing is written on the host
            fds.append(code_fd)
            os.write(code_fd, code.encode("utf-8", "surrogatepass"))
            os.lseek(code_fd, 0, os.SEEK_SET)
            fds += [seccomp_fd(), started_w]
            return _bwrap_command(fds, WORKDIR_MB << 20) + python + [ROOT, *limits, str(NPROC), str(NOFILE),
                                                                    str(int(audit)), str(started_w)]

        return _bwrap_launch(bwrap, cgroup, options, started_w)
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    # RLIMIT_NPROC counts every process of the user outside a user namespace: no small number is safe there.
    command = python + [os.path.realpath(workdir), *limits, "0", str(NOFILE), str(int(audit)), str(started_w)]
    return workdir, cgroup, cgroup.wrap(command), {**options, "env": _env(workdir), "cwd": workdir,
                                                   "pass_fds": (started_w,)}


def _start_pipe(options: dict) -> int:
    """The pipe on which the sandbox says that the code starts: its reading end kept in options (started_fd, for the
    supervisor; _cleanup closes it), its writing end returned, to be passed to the sandbox."""
    options["started_fd"], started_w = os.pipe()
    return started_w


def _spawned(options: dict) -> dict:
    """Popen's arguments of _launch's options; call _passed once the sandbox is spawned."""
    return {k: v for k, v in options.items() if k != "started_fd"}


def _passed(options: dict) -> None:
    """Close this side's copies of the descriptors the sandbox was given (its start pipe's end among them, so that
    the pipe ends with the sandbox)."""
    for fd in options.pop("pass_fds", ()):
        os.close(fd)


def _cleanup(workdir, cgroup, options) -> bool:
    """Release what the run held; True when the kernel killed it at its cgroup's memory limit."""
    _passed(options)
    os.close(options["started_fd"])
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
    return cgroup.close()


def _exit_code(returncode: int, mode: str) -> int:
    # bwrap reports a child killed by signal N as 128 + N; say it as subprocess does (-N).
    return -(returncode - 128) if mode == "bwrap" and returncode is not None and returncode > 128 else returncode


class _Output:
    """One pipe's first `cap` bytes, and how many it carried in all."""

    def __init__(self, cap: int):
        self.cap, self.chunks, self.size = cap, [], 0

    def add(self, data: bytes) -> None:
        if self.size < self.cap:
            self.chunks.append(data[: self.cap - self.size])
        self.size += len(data)


def _result(out: _Output, err: _Output, exit_code, timed_out: bool, max_output: int, memory_mb: int,
            out_of_memory: bool) -> dict:
    if out_of_memory:  # SIGKILL from the kernel says nothing by itself
        err.add(f"\nsandbox: killed at its memory limit ({memory_mb} MB and the {WORKDIR_MB} MB working folder)\n"
                .encode())
    texts, truncated = [], False
    for pipe in (out, err):
        text = b"".join(pipe.chunks).decode("utf-8", "replace")
        truncated = truncated or pipe.size > pipe.cap or len(text) > max_output
        texts.append(text[:max_output])
    return {"stdout": texts[0], "stderr": texts[1], "exit_code": exit_code, "timed_out": timed_out,
            "truncated": truncated}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run_blocking(code: str, timeout: float, memory_mb: int, max_output: int, mode: str, audit: bool) -> dict:
    # Plain subprocess, no event loop: uvloop (installed by Ray) refuses two loops spawning at once, and a
    # blocking call may come from any thread of an engine.
    workdir, cgroup, command, options = _launch(code, timeout, memory_mb, mode, audit)
    proc = None
    try:
        proc = subprocess.Popen(command, **_spawned(options))
        _passed(options)
        out, err = _Output(4 * max_output), _Output(4 * max_output)  # bytes: max_output characters of UTF-8
        started = options["started_fd"]
        pipes = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        with selectors.DefaultSelector() as selector:
            for fd in (*pipes, started):
                selector.register(fd, selectors.EVENT_READ)
            ends = [time.monotonic() + START_BOUND_S]  # until the code starts; then its timeout from there

            def read_until(deadline):
                while selector.get_map() and time.monotonic() < deadline():
                    for key, _ in selector.select(max(0.0, deadline() - time.monotonic())):
                        data = os.read(key.fd, _READ_CHUNK)
                        if key.fd == started:  # the code starts (or the sandbox ended before it could)
                            selector.unregister(started)
                            ends[0] = time.monotonic() + timeout
                        elif data:
                            pipes[key.fd].add(data)
                        else:
                            selector.unregister(key.fd)

            read_until(lambda: ends[0])
            timed_out = False
            try:
                proc.wait(max(0.0, ends[0] - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                drained = time.monotonic() + _DRAIN_AFTER_KILL
                read_until(lambda: drained)  # what it wrote before the kill
                proc.wait()
    finally:
        if proc is not None:
            if proc.returncode is None:
                _kill_group(proc.pid)
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        out_of_memory = _cleanup(workdir, cgroup, options)
    return _result(out, err, _exit_code(proc.returncode, mode), timed_out, max_output, memory_mb, out_of_memory)


async def _read(stream, output: _Output) -> None:
    while True:
        data = await stream.read(_READ_CHUNK)
        if not data:
            return
        output.add(data)


async def _run(code: str, timeout: float, memory_mb: int, max_output: int, mode: str, audit: bool) -> dict:
    return await _supervise(*_launch(code, timeout, memory_mb, mode, audit), timeout, memory_mb, max_output, mode)


async def _supervise(workdir, cgroup, command: list, options: dict, timeout: float, memory_mb: int, max_output: int,
                     mode: str) -> dict:
    """Run a launched sandbox to its end or its timeout on the running loop, then release what _launch held."""
    proc, loop, started = None, asyncio.get_running_loop(), options["started_fd"]
    try:
        proc = await asyncio.create_subprocess_exec(*command, **_spawned(options))
        _passed(options)
        out, err = _Output(4 * max_output), _Output(4 * max_output)
        done = asyncio.ensure_future(asyncio.gather(_read(proc.stdout, out), _read(proc.stderr, err), proc.wait()))
        begun = loop.create_future()  # the code starts (or the sandbox ended before it could)

        def on_start():
            loop.remove_reader(started)
            if not begun.done():
                begun.set_result(None)
        loop.add_reader(started, on_start)
        timed_out = False
        try:
            await asyncio.wait({begun, done}, timeout=START_BOUND_S, return_when=asyncio.FIRST_COMPLETED)
            if not begun.done() and not done.done():
                raise asyncio.TimeoutError
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            _kill_group(proc.pid)
            try:  # the pipes close when the sandbox is gone
                await asyncio.wait_for(done, _DRAIN_AFTER_KILL)
            except asyncio.TimeoutError:
                pass
        if proc.returncode is None:
            _kill_group(proc.pid)
            await proc.wait()
    finally:
        loop.remove_reader(started)
        if proc is not None and proc.returncode is None:  # cancelled by the caller (a step timeout)
            _kill_group(proc.pid)
            try:
                await asyncio.wait_for(proc.wait(), _DRAIN_AFTER_KILL)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        if proc is not None and getattr(proc, "_transport", None) is not None:
            proc._transport.close()
        out_of_memory = _cleanup(workdir, cgroup, options)
    return _result(out, err, _exit_code(proc.returncode, mode), timed_out, max_output, memory_mb, out_of_memory)


# Sets the limits, says on its start pipe that the command starts, then becomes the command (argv: memory bytes, cpu
# seconds, disk bytes, nproc, open descriptors, the start pipe, then the command): run_command_async's counterpart
# of PREAMBLE.
LAUNCHER = r'''
import os, resource, sys

memory, cpu, disk, nproc, nofile, started = (int(a) for a in sys.argv[1:7])
limits = [(resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, disk), (resource.RLIMIT_CORE, 0),
          (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_MSGQUEUE, 0)]
if nproc:  # counted per user: only inside the sandbox's own user namespace is a small number safe
    limits.append((resource.RLIMIT_NPROC, nproc))
for which, value in limits:
    resource.setrlimit(which, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
os.umask(0)  # a root engine runs each command as another uid: what one leaves, the next may change
os.write(started, b"1")  # the parent's timeout counts from here
os.close(started)
try:
    os.execvp(sys.argv[7], sys.argv[7:])
except OSError as e:
    sys.stderr.write(f"sandbox: cannot run {sys.argv[7]!r}: {e.strerror}\n")
    os._exit(127)
'''


def _launch_command(argv: list, workdir: str, env: dict, timeout: float, memory_mb: int, mode: str) -> tuple:
    """_launch's result for a command run in workdir (which is the caller's: not removed afterwards)."""
    if any("\0" in text for text in (workdir, *env, *env.values())):  # bwrap's options are NUL-separated
        raise ValueError("a sandboxed command's folder and environment cannot hold NUL characters")
    limits = [str(memory_mb << 20), str(math.ceil(timeout) + 1), str(WORKDIR_MB << 20)]
    launcher = [sys.executable, "-I", "-B", "-c", LAUNCHER]
    options = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    cgroup = RunCgroup((memory_mb + WORKDIR_MB + CGROUP_SLACK_MB) << 20)
    started_w = _start_pipe(options)
    if mode != "bwrap":  # RLIMIT_NPROC outside a user namespace counts the user's every process: none is safe
        command = cgroup.wrap(launcher + [*limits, "0", str(NOFILE), str(started_w), *argv])
        return None, cgroup, command, {**options, "env": {**_env(workdir), **env}, "cwd": workdir,
                                       "pass_fds": (started_w,)}

    def bwrap(fds: list) -> list:
        fds += [seccomp_fd(), started_w]
        return _bwrap_command(fds, WORKDIR_MB << 20, workdir, env) + launcher + [*limits, str(NPROC), str(NOFILE),
                                                                               str(started_w), *argv]

    return _bwrap_launch(bwrap, cgroup, options, started_w)


_probe_lock = threading.Lock()
_probed = {}  # mode -> None when it works, else why not


def sandbox_mode() -> str:
    mode = os.environ.get(MODE_ENV, "bwrap")
    if mode not in MODES:
        raise SandboxUnavailable(f"{MODE_ENV}={mode!r} (set from --agent.sandbox): use bwrap or unsafe")
    return mode


def unavailable_reason(mode: str = "bwrap") -> str:
    """Why the sandbox cannot run code in this mode here ("" when it can); probed once per process."""
    with _probe_lock:
        if mode not in _probed:
            _probed[mode] = _probe(mode)
        return _probed[mode]


def _probe(mode: str) -> str:
    if mode == "unsafe":
        logger.warning("sandbox: --agent.sandbox unsafe: model code runs without operating-system isolation (an "
                       "audit hook and resource limits only, which native code can defeat)")
        return ""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        seccomp_program()
    except Exception as e:  # ImportError, or OSError from ctypes where libseccomp.so.2 is missing
        return f"no seccomp filter: libseccomp (apt-get install libseccomp2) or pyseccomp is missing ({e})"
    logger.info(f"sandbox: model code's memory bounded by {memory_bound()}")
    result = _run_blocking("print('ok')", timeout=30.0, memory_mb=512, max_output=4096, mode=mode, audit=True)
    if result["stdout"] == "ok\n" and result["exit_code"] == 0:
        return ""
    return (result["stderr"].strip().splitlines() or [f"exit code {result['exit_code']}"])[-1]


def _checked_mode(mode) -> str:
    mode = mode or sandbox_mode()
    reason = unavailable_reason(mode)
    if reason:
        raise SandboxUnavailable(
            f"sandbox: cannot isolate model code here ({reason}); install bubblewrap (apt-get install bubblewrap; "
            f"it needs unprivileged user namespaces) or pass --agent.sandbox unsafe to run it without isolation at "
            f"your own risk")
    return mode


async def run_python_async(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 4096,
                           mode: str = "", audit: bool = True) -> dict:
    """Run `code` in the sandbox on the running event loop; see the module docstring. Never raises for anything
    the code does; raises SandboxUnavailable where it cannot be contained. mode: bwrap or unsafe (empty: the
    engine's --agent.sandbox); audit=False leaves out the in-interpreter hook (for tests of the OS layer)."""
    mode = mode or sandbox_mode()
    if mode not in _probed:  # the first call probes, running a subprocess: off the loop
        await asyncio.to_thread(unavailable_reason, mode)
    mode = _checked_mode(mode)
    return await _run(code, timeout, memory_mb, max_output, mode, audit)


async def run_command_async(argv: list, workdir: str, env: dict = None, timeout: float = 60.0, memory_mb: int = 1024,
                            max_output: int = 1 << 16, mode: str = "") -> dict:
    """Run a program (argv, found on PATH: the engine's interpreter's folder, then the system's) in the sandbox, in
    `workdir`, a host folder bound writable as its working dir (HOME too) and the one place beside its /tmp tmpfs
    where what it writes stays (each file at most WORKDIR_MB): verifiers' runtimes run their commands so
    (agent/verifiers_runtime.py). The isolation and limits are run_python's, env (a dict) its only variables beside
    _env's. Returns run_python's dict; raises SandboxUnavailable where it cannot be contained."""
    mode = mode or sandbox_mode()
    if mode not in _probed:
        await asyncio.to_thread(unavailable_reason, mode)
    mode = _checked_mode(mode)
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", **(env or {})}
    launched = _launch_command(list(argv), os.path.realpath(workdir), env, timeout, memory_mb, mode)
    return await _supervise(*launched, timeout, memory_mb, max_output, mode)


def run_python(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 4096, mode: str = "",
               audit: bool = True) -> dict:
    """The blocking form of run_python_async (for plain `def` steps)."""
    return _run_blocking(code, timeout, memory_mb, max_output, _checked_mode(mode), audit)
