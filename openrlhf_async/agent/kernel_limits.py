"""What the kernel holds a sandboxed run to beyond bubblewrap's namespaces: a seccomp filter and a memory cgroup.

RLIMIT_AS bounds one process's mappings, not memory held elsewhere. So each sandboxed run also gets
- a seccomp filter (built by libseccomp through `pyseccomp`, handed to `bwrap --seccomp FD`) that refuses what a code
  tool never needs and what would hold memory or state outside the process: new processes (threads stay allowed),
  memfd, SysV IPC, POSIX message queues, the kernel keyrings, io_uring, BPF, userfaultfd, ptrace, perf, mounts and
  namespaces, modules, reboot and the like; and what would let a descriptor's kernel buffers grow or outlive it:
  sockets other than AF_UNIX, passing descriptors (sendmsg: a descriptor in flight keeps its buffers while closed in
  the process), larger socket buffers (SO_SNDBUF, SO_RCVBUF) and larger pipes (F_SETPIPE_SZ). With no second process
  and no memory outside its own mappings, the run holds at most its RLIMIT_AS, its sized tmpfs and, per open
  descriptor (RLIMIT_NOFILE), a pipe's default 64 KB or a socket's default send buffer (net.core.wmem_default);
- where one can be had, a memory cgroup of its own (v2, or v1's memory hierarchy) whose limit the kernel enforces on
  everything the run charges, page cache and tmpfs pages included; the run is killed at the limit and says so.
  A cgroup can be had where this process may create a child of its own cgroup with the memory controller on (root
  in a container or VM with a writable cgroup file system; a systemd-delegated subtree); elsewhere the filter and the
  process limits hold alone."""

import atexit
import errno
import itertools
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

# Refused with EPERM: state outside the process (memory, keys, IPC), the kernel's attack surface, the host's set-up.
DENIED_SYSCALLS = (
    "fork", "vfork",  # processes; clone without CLONE_THREAD below
    "memfd_create", "memfd_secret",
    "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl",
    "ipc", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "userfaultfd", "perf_event_open",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "quotactl_fd", "syslog", "vhangup", "iopl", "ioperm", "lookup_dcookie", "uselib",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "move_pages", "migrate_pages",
    "sendmsg", "sendmmsg",  # SCM_RIGHTS: descriptors parked in flight, their buffers outside RLIMIT_NOFILE's count
)
CLONE_THREAD = 0x00010000
AF_UNIX = 1  # the only socket family allowed (asyncio's self-pipe); the network namespace has nothing to reach anyway
SOL_SOCKET, BUFFER_OPTIONS = 1, (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE
F_SETPIPE_SZ = 1031

_program = None
_program_lock = threading.Lock()


def seccomp_program() -> bytes:
    """The compiled filter (classic BPF, as `bwrap --seccomp` reads it); built once per process. Raises OSError
    (ImportError) where libseccomp or its binding is missing."""
    global _program
    with _program_lock:
        if _program is None:
            _program = _build_program()
        return _program


def _build_program() -> bytes:
    import pyseccomp as seccomp

    arch = seccomp.system_arch()
    filt = seccomp.SyscallFilter(seccomp.ALLOW)  # another architecture's calls (int 0x80) kill the process
    for name in DENIED_SYSCALLS:
        try:
            seccomp.resolve_syscall(arch, name)
        except (ValueError, OSError):
            continue  # not a call of this architecture
        filt.add_rule(seccomp.ERRNO(errno.EPERM), name)
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes the C library fall back to clone.
    filt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    filt.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    for name in ("socket", "socketpair"):
        filt.add_rule(seccomp.ERRNO(errno.EPERM), name, seccomp.Arg(0, seccomp.NE, AF_UNIX))
    for option in BUFFER_OPTIONS:
        filt.add_rule(seccomp.ERRNO(errno.EPERM), "setsockopt", seccomp.Arg(1, seccomp.EQ, SOL_SOCKET),
                      seccomp.Arg(2, seccomp.EQ, option))
    filt.add_rule(seccomp.ERRNO(errno.EPERM), "fcntl", seccomp.Arg(1, seccomp.EQ, F_SETPIPE_SZ))
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb", closefd=False) as f:  # a filter is a few KB: the pipe holds it whole
            filt.export_bpf(f)
        os.close(write)
        write = None
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(read)
        if write is not None:
            os.close(write)


def seccomp_fd() -> int:
    """A descriptor holding the filter for `bwrap --seccomp FD` (the caller closes it)."""
    fd = os.memfd_create("sandbox-seccomp")
    os.write(fd, seccomp_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Hierarchy:
    """Where this process may make memory cgroups: the folder of its own cgroup and the files' names there."""

    def __init__(self, parent: str, version: int):
        self.parent, self.version = parent, version
        self.limit_files = ("memory.max", "memory.swap.max") if version == 2 else (
            "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")  # memsw after the limit: it must not be lower


def _mounts() -> list:
    """(mount point, file system type, options) of the cgroup file systems."""
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, kind, options = line.split()[:4]
            if kind in ("cgroup", "cgroup2"):
                found.append((point.replace("\\040", " "), kind, options.split(",")))
    return found


def _own_paths() -> dict:
    """controller list ("" for v2) -> this process's cgroup path."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            paths[controllers] = path
    return paths


def _find_hierarchy():
    """A place where a child memory cgroup can be made and limited, or None."""
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError:
        return None
    for point, kind, options in mounts:
        if kind == "cgroup2" and "" in own:
            parent = os.path.join(point, own[""].lstrip("/"))
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        continue  # turning it on here fails while this process lives in it (no internal processes)
            except OSError:
                continue
        elif kind == "cgroup" and "memory" in options:
            path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
            if path is None:
                continue
            parent = os.path.join(point, path.lstrip("/"))
        else:
            continue
        if os.access(parent, os.W_OK):
            return _Hierarchy(parent, 2 if kind == "cgroup2" else 1)
    return None


_hierarchy = None
_hierarchy_probed = False
_hierarchy_lock = threading.Lock()
_names = itertools.count()


def _hierarchy_here():
    global _hierarchy, _hierarchy_probed
    with _hierarchy_lock:
        if not _hierarchy_probed:
            _hierarchy_probed = True
            _hierarchy = _find_hierarchy()
            if _hierarchy is not None:
                _remove_stale(_hierarchy.parent)
    return _hierarchy


def _remove_stale(parent: str) -> None:
    """Cgroups left by engines that died mid-run (empty ones: rmdir refuses a busy cgroup)."""
    for name in os.listdir(parent):
        if name.startswith("openrlhf-sandbox-"):
            try:
                os.kill(int(name.split("-")[2]), 0)
            except ProcessLookupError:
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass
            except (ValueError, IndexError, PermissionError):
                pass


def memory_bound() -> str:
    """What bounds a sandboxed run's memory here, in words."""
    found = _hierarchy_here()
    if found is None:
        return "the seccomp filter and the process limits (no cgroup can be made here)"
    return f"a cgroup v{found.version} per run under {found.parent}"


class RunCgroup:
    """A memory cgroup for one run, or nothing where none can be had. `wrap(command)` runs the command inside it;
    `close()` says whether the kernel killed the run at the limit and removes the cgroup."""

    def __init__(self, limit_bytes: int):
        self.path = None
        found = _hierarchy_here()
        if found is None:
            return
        _remove_pending()
        path = os.path.join(found.parent, f"openrlhf-sandbox-{os.getpid()}-{next(_names)}")
        try:
            os.mkdir(path)
            for name in found.limit_files:
                value = "0" if name == "memory.swap.max" else str(limit_bytes)
                if os.path.exists(os.path.join(path, name)):
                    with open(os.path.join(path, name), "w") as f:
                        f.write(value)
            if found.version == 2 and os.path.exists(os.path.join(path, "pids.max")):
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write("64")
        except OSError as e:
            logger.warning(f"sandbox: no cgroup for this run ({e}); the filter and the process limits hold alone")
            _pending.append(path)
            _remove_pending()
            return
        self.path, self.version = path, found.version

    def wrap(self, command: list) -> list:
        """The command, entered into the cgroup first (a shell moves itself in, then becomes the command)."""
        if self.path is None:
            return command
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *command]

    def close(self) -> bool:
        """True when the kernel killed a process of the run at the memory limit."""
        if self.path is None:
            return False
        killed = False
        try:
            with open(os.path.join(self.path, "memory.events" if self.version == 2 else "memory.oom_control")) as f:
                killed = any(line.split()[:1] == ["oom_kill"] and int(line.split()[1]) > 0 for line in f)
        except (OSError, ValueError, IndexError):
            pass
        _pending.append(self.path)  # its last process may still be leaving: removed now or at a later run
        _remove_pending()
        self.path = None
        return killed


_pending = []  # cgroups of finished runs, to remove once their last process has left


def _remove_pending(wait_s: float = 0.0) -> None:
    deadline = time.monotonic() + wait_s
    with _hierarchy_lock:
        while True:
            for path in list(_pending):
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                _pending.remove(path)
            if not _pending or time.monotonic() >= deadline:
                return
            time.sleep(0.01)


atexit.register(_remove_pending, 2.0)
