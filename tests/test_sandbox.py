"""The code-execution sandbox contains hostile code, assumed to run arbitrary native code.

The boundary is bubblewrap: every hostile payload runs twice, with the in-interpreter audit hook and with it
turned off, and must be contained both times (the OS layer alone holds). The hook is tested on its own only in
the `unsafe` mode, where it is all there is. Each test fails when the protection it names is missing."""

import asyncio
import contextlib
import dis
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from openrlhf_async.agent import sandbox
from openrlhf_async.agent.sandbox import PREAMBLE, SandboxUnavailable, run_python, run_python_async

HOOK = {"hook on": True, "OS layer alone": False}
HOME = os.path.expanduser("~")


@pytest.fixture(scope="module", autouse=True)
def bwrap_works():
    reason = sandbox.unavailable_reason("bwrap")
    assert not reason, f"the sandbox needs bubblewrap here (`make install` installs it): {reason}"


def run(code: str, hook: str = "hook on", **kwargs) -> dict:
    return run_python(textwrap.dedent(code), audit=HOOK[hook], **kwargs)


def host_processes_with(marker: str) -> list:
    """Host processes whose command line holds marker (left behind if containment failed)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture
def outside(tmp_path):
    """A folder of the host's, writable by the engine's user: the code must not write here."""
    os.chmod(tmp_path, 0o777)
    return str(tmp_path)


def nothing_written(folder: str) -> bool:
    return os.listdir(folder) == []


# --- what ordinary code needs --------------------------------------------------------------------------------

def test_prints_work():
    assert run_python("print(1+1)") == {"stdout": "2\n", "stderr": "", "exit_code": 0, "timed_out": False,
                                        "truncated": False}


def test_errors_come_back_as_a_traceback_of_the_users_code():
    result = run_python("def f():\n    return 1 / 0\nf()")
    assert result["exit_code"] == 1 and not result["timed_out"]
    assert 'File "main.py", line 2, in f' in result["stderr"]
    assert result["stderr"].rstrip().endswith("ZeroDivisionError: division by zero")


def test_writing_inside_the_working_directory_works_and_site_packages_import():
    result = run_python("""
import os, pathlib, tempfile
import numpy
pathlib.Path("data").mkdir()
pathlib.Path("data/x.txt").write_text("kept")
os.rename("data/x.txt", "data/y.txt")
with tempfile.NamedTemporaryFile() as f:
    f.write(b"tmp works")
print(open("data/y.txt").read(), os.listdir("data"), os.environ["HOME"] == os.getcwd(), numpy.add(1, 2))
""")
    assert result["exit_code"] == 0, result["stderr"]
    assert result["stdout"] == "kept ['y.txt'] True 3\n"


def test_an_interpreter_installed_under_tmp_runs_sandboxed_code_too(tmp_path):
    """A virtualenv under /tmp (CI runners, notebooks): the sandbox's /tmp must not clash with the interpreter's
    folder bound there; code writes in its working folder (TMPDIR), as anywhere."""
    import site

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    assert str(venv).startswith("/tmp/")
    here = os.path.dirname(os.path.dirname(os.path.abspath(sandbox.__file__)))
    probe = ("from openrlhf_async.agent.sandbox import run_python\n"
             "r = run_python('import os, tempfile\\nwith tempfile.NamedTemporaryFile() as f: print(os.path.dirname("
             "f.name) == os.getcwd())')\n"
             "print(r['exit_code'], r['stdout'].strip(), r['stderr'][-300:])")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([here, *site.getsitepackages()])})
    assert out.stdout.split()[:2] == ["0", "True"], out.stdout + out.stderr[-2000:]


def test_the_code_runs_as_an_unprivileged_user_without_capabilities():
    result = run("""
        import ctypes, os
        status = dict(line.split(":\\t") for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
        print(os.getuid(), os.getgid(), status["CapEff"], status["CapBnd"], sorted(os.environ))
        CLONE_NEWUSER = 0x10000000
        print("unshare", ctypes.CDLL("libc.so.6").unshare(CLONE_NEWUSER))  # a nested namespace would regain caps
    """, hook="OS layer alone")
    uid, gid, effective, bounding, env = result["stdout"].splitlines()[0].split(" ", 4)
    assert uid == gid and int(uid) not in (0, os.geteuid()), "its own unprivileged uid, not root nor the engine's"
    assert effective == bounding == "0000000000000000" and env.startswith("['HOME', 'LANG',")
    assert result["stdout"].endswith("unshare -1\n"), result


def test_output_is_truncated():
    result = run_python("print('x' * 10000)\nimport sys\nprint('e' * 50, file=sys.stderr)", max_output=100)
    assert result["truncated"] and result["stdout"] == "x" * 100 and result["stderr"] == "e" * 50 + "\n"
    assert run_python("print('x' * 99)", max_output=100) == {"stdout": "x" * 99 + "\n", "stderr": "", "exit_code": 0,
                                                             "timed_out": False, "truncated": False}
    flood = run_python("while True:\n    print('y' * 1000)", timeout=1.0, max_output=100)
    assert flood["timed_out"] and flood["truncated"] and len(flood["stdout"]) == 100


@pytest.mark.parametrize("form", ["blocking", "async", "command"])
def test_the_timeout_counts_from_the_codes_start_not_the_sandboxes(monkeypatch, tmp_path, form):
    """A start slower than the timeout (a loaded machine's bwrap and interpreter: here 3 s of sleep before them)
    takes none of the code's 1 s; a start past START_BOUND_S is a timeout, the code never run."""
    wrap = sandbox.RunCgroup.wrap
    monkeypatch.setattr(sandbox.RunCgroup, "wrap",
                        lambda self, command: ["/bin/sh", "-c", 'sleep 3 && exec "$@"', "sh", *wrap(self, command)])

    def run():
        if form == "blocking":
            return run_python("print('ran')", timeout=1.0)
        if form == "async":
            return asyncio.run(run_python_async("print('ran')", timeout=1.0))
        return asyncio.run(sandbox.run_command_async(["python3", "-c", "print('ran')"], str(tmp_path), timeout=1.0))

    assert run() == {"stdout": "ran\n", "stderr": "", "exit_code": 0, "timed_out": False, "truncated": False}
    monkeypatch.setattr(sandbox, "START_BOUND_S", 1.0)
    stuck = run()
    assert stuck["timed_out"] and stuck["stdout"] == "" and stuck["exit_code"] != 0


def test_the_async_form_does_not_block_the_event_loop():
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        result = await run_python_async("import time\ntime.sleep(1)\nprint('slept')")
        task.cancel()
        return result, ticks

    result, ticks = asyncio.run(main())
    assert result["stdout"] == "slept\n" and ticks >= 10


def test_runs_at_once_from_a_uvloop_loop_and_from_threads():
    # An engine's process as Ray sets it up: uvloop's policy, async steps on the loop, plain `def` steps in
    # threads. uvloop refuses two of its loops spawning processes at the same time.
    import uvloop

    async def main():
        on_loop = [run_python_async(f"print({i})") for i in range(4)]
        in_threads = [asyncio.to_thread(run_python, f"print({i})") for i in range(4, 8)]
        return await asyncio.gather(*on_loop, *in_threads)

    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        results = asyncio.run(main())
    finally:
        asyncio.set_event_loop_policy(policy)
    assert [r["stdout"] for r in results] == [f"{i}\n" for i in range(8)], [r["stderr"] for r in results]


# --- hostile payloads, each with the hook on and with the OS layer alone -----------------------------------

HOOK_DEFEAT = """
    import ctypes, os, sys
    try:
        os.system("true")
    except PermissionError as e:  # the hook refused; its deny set is a local of the frame that raised
        tb = e.__traceback__
        while tb.tb_next:
            tb = tb.tb_next
        deny = tb.tb_frame.f_locals["deny"]
        entry = next(s for s in deny if s == "os.system")
        ctypes.memmove(id(entry) + sys.getsizeof("") - 1, b"xx", 2)  # rewrite the string in place
    print("shell status", os.system("id -u; mount -o remount,bind,rw /; echo escaped > OUTSIDE/f; "
                                    "echo escaped > /usr/escaped; echo escaped > HOME_FILE"))
"""


@pytest.mark.parametrize("hook", list(HOOK))
def test_defeating_the_hook_then_a_shell_is_contained(hook, outside, tmp_path_factory):
    home_file = os.path.join(HOME, f"sandbox-escape-{uuid.uuid4().hex}")
    code = HOOK_DEFEAT.replace("OUTSIDE", outside).replace("HOME_FILE", home_file)
    result = run(code, hook)
    try:
        assert "shell status" in result["stdout"], result["stderr"]  # the trick works: the shell did run
        assert result["stdout"].split()[0] != "0" and nothing_written(outside) and not os.path.exists(home_file)
        assert not os.path.exists("/usr/escaped")
    finally:
        for path in (home_file, "/usr/escaped"):
            if os.path.exists(path):
                os.remove(path)


@pytest.mark.parametrize("hook", list(HOOK))
def test_native_libc_system_is_contained(hook, outside):
    result = run(f"""
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        print("status", libc.system(b"echo escaped > {outside}/f; touch {sys.prefix}/escaped"))
    """, hook)
    assert nothing_written(outside) and not os.path.exists(os.path.join(sys.prefix, "escaped"))
    assert ("status" in result["stdout"]) != HOOK[hook], "the hook refuses the call; without it the shell runs"


@pytest.mark.parametrize("hook", list(HOOK))
def test_remounting_the_root_read_write_fails(hook):
    result = run("""
        import ctypes, errno, os
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        MS_REMOUNT, MS_BIND = 32, 4096
        for target in (b"/", b"/usr"):
            rc = libc.mount(None, target, None, MS_REMOUNT | MS_BIND, None)
            print(target.decode(), rc, errno.errorcode.get(ctypes.get_errno()))
        open("/usr/escaped", "w").write("x")
    """, hook)
    assert not os.path.exists("/usr/escaped")
    if not HOOK[hook]:
        assert result["stdout"] == "/ -1 EPERM\n/usr -1 EPERM\n", result["stdout"] + result["stderr"]
        assert "Read-only file system" in result["stderr"]


@pytest.mark.parametrize("hook", list(HOOK))
def test_writing_outside_the_working_folder_fails(hook, outside):
    targets = [f"{outside}/f", f"{HOME}/sandbox-escape-{uuid.uuid4().hex}", f"{sys.prefix}/escaped", "/escaped",
               "/dev/shm/escaped", "/proc/escaped"]
    result = run(f"""
        for path in {targets!r}:
            try:
                open(path, "w").write("escaped")
                print("wrote", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
    """, hook)
    assert "wrote" not in result["stdout"] and result["stdout"].count("refused") == len(targets), result
    assert nothing_written(outside) and not any(os.path.exists(t) for t in targets[1:3])


@pytest.fixture
def listening_server():
    """A TCP server of the host on every address: what the sandbox must not reach."""
    server = socket.create_server(("0.0.0.0", 0))
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: this picks the host's outward address
        host_ip = probe.getsockname()[0]
    except OSError:
        host_ip = None
    finally:
        probe.close()
    yield host_ip, server.getsockname()[1]
    server.close()


@pytest.mark.parametrize("hook", list(HOOK))
def test_no_network(hook, listening_server):
    host_ip, port = listening_server
    targets = [("127.0.0.1", port)] + ([(host_ip, port)] if host_ip else [])
    result = run(f"""
        import ctypes, socket
        for target in {targets!r}:
            try:
                socket.create_connection(target, timeout=2).close()
                print("connected to", target)
            except OSError as e:
                print("refused", target, type(e).__name__)
    """, hook)
    assert "connected" not in result["stdout"]
    assert result["stdout"].count("refused") == len(targets) or (HOOK[hook] and "PermissionError" in result["stderr"])


@pytest.mark.parametrize("hook", list(HOOK))
def test_the_parents_environment_and_processes_are_invisible(hook, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("OPENRLHF_TEST_SECRET", secret)
    victim = subprocess.Popen(["sleep", "30"], env={**os.environ})  # a host process holding the secret
    try:
        result = run(f"""
            import glob, os, signal
            print("env:", os.environ.get("OPENRLHF_TEST_SECRET"))
            for path in glob.glob("/proc/*/environ") + ["/proc/%d/environ" % os.getppid(), "/proc/{victim.pid}/environ"]:
                try:
                    if {secret.encode()!r} in open(path, "rb").read():
                        print("leaked through", path)
                except OSError:
                    pass
            print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
            for how in ("kill", "pidfd"):
                try:
                    if how == "kill":
                        os.kill({victim.pid}, signal.SIGKILL)
                    else:
                        signal.pidfd_send_signal(os.pidfd_open({victim.pid}), signal.SIGKILL)
                    print("signalled with", how)
                except OSError as e:
                    print("no", how, type(e).__name__)
        """, hook)
        assert result["exit_code"] == 0, result["stderr"]
        assert "env: None" in result["stdout"] and "leaked" not in result["stdout"]
        assert "signalled" not in result["stdout"] and victim.poll() is None, result["stdout"]
        pids = eval(result["stdout"].split("pids ")[1].splitlines()[0])
        assert max(pids) < 10, "only the sandbox's own few processes are visible"
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("hook", list(HOOK))
def test_signalling_the_parent_does_not_reach_it(hook):
    result = run("""
        import os, signal
        print("parent", os.getppid())
        try:
            os.kill(os.getppid(), signal.SIGKILL)
        except OSError as e:
            print(type(e).__name__)
        print("still here")
    """, hook)
    # The parent inside is bwrap's own init (pid 1): the kernel shields it from its namespace's signals (or it
    # belongs to another uid); the engine, the real parent, has no pid in there at all.
    assert result["stdout"].startswith("parent 1\n") and result["stdout"].endswith("still here\n"), result


@pytest.mark.parametrize("hook", list(HOOK))
def test_a_fork_bomb_is_contained_and_leaves_nothing(hook):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    result = run(f"""
        import os, sys
        while True:
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
    """, hook, timeout=30.0)
    # Stopped by the process limit (its fork fails), not by the timeout.
    assert not result["timed_out"] and result["exit_code"] != 0, result
    assert "BlockingIOError" in result["stderr"] or "PermissionError" in result["stderr"], result["stderr"][-300:]
    assert host_processes_with(marker) == []


@pytest.mark.parametrize("hook", list(HOOK))
def test_a_thread_bomb_stops_at_the_process_limit(hook):
    result = run("""
        import threading, time
        started = 0
        try:
            while True:
                threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
                started += 1
        except RuntimeError as e:
            print("threads", started, e)
    """, hook, timeout=10.0)
    assert result["stdout"].startswith("threads ") and int(result["stdout"].split()[1]) < sandbox.NPROC


@pytest.mark.parametrize("hook", list(HOOK))
def test_a_memory_bomb_fails_fast(hook):
    result = run("""
        try:
            x = bytearray(4 << 30)
            print("allocated")
        except MemoryError:
            print("MemoryError")
        try:
            import ctypes
            print("malloc", ctypes.CDLL("libc.so.6").malloc(ctypes.c_size_t(4 << 30)))
        except PermissionError as e:
            print("refused:", e)
    """, hook, timeout=10.0, memory_mb=256)
    assert not result["timed_out"] and result["exit_code"] == 0, result
    # Python's allocation fails at the memory limit; so does native code's, where the hook lets it load at all.
    assert result["stdout"] == ("MemoryError\nrefused: sandbox: ctypes.dlopen is not allowed\n" if HOOK[hook] else
                                "MemoryError\nmalloc 0\n"), result


@pytest.mark.parametrize("hook", list(HOOK))
def test_a_disk_bomb_stops_at_the_working_folders_size(hook):
    result = run("""
        import os
        total = 0
        for folder in (".", "/tmp", "/dev/shm", "/", "/dev"):
            for i in range(1000):
                try:
                    with open(f"{folder}/fill-{len(folder)}-{i}", "wb") as f:
                        f.write(b"x" * (8 << 20))
                    total += 8 << 20
                except OSError:
                    name = f"{folder}/fill-{len(folder)}-{i}"
                    total += os.path.getsize(name) if os.path.exists(name) else 0
                    break
        print("wrote", total)
    """, hook, timeout=10.0)
    assert int(result["stdout"].split()[1]) <= sandbox.WORKDIR_MB << 20, result


@pytest.mark.parametrize("hook", list(HOOK))
@pytest.mark.parametrize("ends", ["by timeout", "by returning"])
def test_no_process_outlives_the_run(hook, ends):
    marker = f"daemon-{uuid.uuid4().hex}"
    result = run(f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # a daemon: double fork, own session
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
            os._exit(0)
        time.sleep(0.5)
        print("daemon started", flush=True)
        {"time.sleep(60)" if ends == "by timeout" else "pass"}
    """, hook, timeout=2.0)
    # The hook refuses fork, and without it the seccomp filter does: no second process ever starts.
    assert "daemon started" not in result["stdout"] and "PermissionError" in result["stderr"], result["stderr"]
    left = host_processes_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


# --- memory and kernel state outside the process (RLIMIT_AS bounds only its own mappings) ----------------------

MEMORY_HOLDERS = {
    "memfd": "import os\nfd = os.memfd_create('m')\nos.write(fd, b'1' * (64 << 20))\nprint('held')",
    "SysV shared memory": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                          "shm = libc.shmget(0, 64 << 20, 0o1600)\nassert shm >= 0, ctypes.get_errno()\nprint('held')",
    "SysV message queue": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                          "assert libc.msgget(0, 0o1600) >= 0, ctypes.get_errno()\nprint('held')",
    "POSIX shared memory": "import os, _posixshmem\nfd = _posixshmem.shm_open('/m', os.O_CREAT | os.O_RDWR, 0o600)\n"
                           "os.write(fd, b'1' * (64 << 20))\nprint('held')",
    "memory in a second process": "import os, time\nif os.fork() == 0:\n    b = bytearray(200 << 20)\n"
                                  "    time.sleep(2)\n    os._exit(0)\nprint('held')",
    "io_uring": "import ctypes\nparams = ctypes.create_string_buffer(120)\n"
                "fd = ctypes.CDLL(None, use_errno=True).syscall(425, 8, params)\nassert fd >= 0\nprint('held')",
}


@pytest.mark.parametrize("hook", list(HOOK))
@pytest.mark.parametrize("name", list(MEMORY_HOLDERS))
def test_memory_outside_the_process_cannot_be_held(hook, name):
    result = run(MEMORY_HOLDERS[name], hook, timeout=5.0, memory_mb=256)
    assert "held" not in result["stdout"] and result["exit_code"] != 0, result
    assert any(why in result["stderr"] for why in ("PermissionError", "AssertionError", "Read-only file system")), \
        result["stderr"][-300:]


KERNEL_BUFFERS = """
import fcntl, os, socket
refused = []
def attempt(name, call):
    try:
        call()
        print("allowed", name)
    except OSError as e:
        refused.append(name)
attempt("an AF_INET socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
a, b = socket.socketpair()
attempt("descriptor passing", lambda: socket.send_fds(a, [b"x"], [os.pipe()[0]]))
attempt("a larger socket buffer", lambda: a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30))
r, w = os.pipe()
attempt("a larger pipe", lambda: fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20))
ends = [a, b]
while True:  # every descriptor the limit allows, each a socket end or a pipe's writing end
    try:
        ends += socket.socketpair()
        ends.append(os.pipe()[1])
    except OSError:
        break
queued = 0
for end in ends:
    fd = end if isinstance(end, int) else end.fileno()
    os.set_blocking(fd, False)
    while True:
        try:
            queued += os.write(fd, b"x" * 65536)
        except OSError:
            break
print("refused", len(refused), "queued", queued, "descriptors", len(ends))
"""


@pytest.mark.parametrize("hook", list(HOOK))
def test_kernel_buffers_held_through_descriptors_stay_within_the_documented_bound(hook):
    """Pipes and sockets keep their data in kernel buffers outside RLIMIT_AS (and, for sockets, outside a v1 memory
    cgroup). Each open descriptor's buffer stays at its default size: a pipe's 16 pages, a socket's send buffer
    (net.core.wmem_default; a send may pass it by one skb, at most half of it), and no descriptor is parked in flight."""
    result = run(KERNEL_BUFFERS, hook, timeout=20.0, memory_mb=256)
    words = result["stdout"].split()
    assert "allowed" not in words and words[:2] == ["refused", "4"], result
    with open("/proc/sys/net/core/wmem_default") as f:
        per_descriptor = max(16 * 4096, int(f.read()) * 3 // 2)
    queued, descriptors = int(words[3]), int(words[5])
    assert descriptors <= sandbox.NOFILE and queued <= sandbox.NOFILE * per_descriptor, result


def _keyring_call(name: str) -> int:
    import pyseccomp

    return pyseccomp.resolve_syscall(pyseccomp.system_arch(), name)


@pytest.fixture
def host_key():
    """A key in the engine's own session keyring, as a host secret; revoked afterwards."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    name = f"openrlhf-test-{uuid.uuid4().hex}".encode()
    key = libc.syscall(_keyring_call("add_key"), b"user", name, b"host secret", 11, -3)  # -3: session keyring
    assert key > 0, os.strerror(ctypes.get_errno())
    yield name.decode()
    libc.syscall(_keyring_call("keyctl"), 3, key)  # KEYCTL_REVOKE


@pytest.mark.parametrize("hook", list(HOOK))
def test_the_kernel_keyrings_are_out_of_reach(hook, host_key):
    add_key, keyctl = _keyring_call("add_key"), _keyring_call("keyctl")
    code = f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        for ring in (-3, -4, -5):  # session, user, user-session keyrings
            found = libc.syscall({keyctl}, 10, ring, b"user", b"{host_key}", 0)  # KEYCTL_SEARCH
            print("search", ring, found, os.strerror(ctypes.get_errno()))
        print("left", libc.syscall({add_key}, b"user", b"planted", b"for the next run", 16, -4))
        try:
            print("proc/keys", "{host_key}" in open("/proc/keys").read())
        except OSError as e:
            print("proc/keys", type(e).__name__)
    """
    first, second = run(code, hook), run(code, hook)
    for result in (first, second):
        if HOOK[hook]:  # the hook refuses the ctypes call itself
            assert "PermissionError: sandbox:" in result["stderr"]
            continue
        lines = result["stdout"].splitlines()
        assert [line.split()[2] for line in lines[:3]] == ["-1"] * 3, result
        assert all("Operation not permitted" in line for line in lines[:3]), result
        assert lines[3] == "left -1" and lines[4] != "proc/keys True", result


def test_bwraps_options_are_not_shown_to_the_code():
    result = run_python("print(open('/proc/1/cmdline').read())")
    assert result["exit_code"] == 0 and "--ro-bind" not in result["stdout"] and "--seccomp" not in result["stdout"]


def _cgroup_parent() -> str:
    from openrlhf_async.agent import kernel_limits

    found = kernel_limits._hierarchy_here()
    assert found is not None, (f"no memory cgroup can be made on this machine ({kernel_limits.memory_bound()}); "
                               "the CI machine has one")
    return found.parent


def test_each_run_gets_a_memory_cgroup_that_is_removed_afterwards():
    parent = _cgroup_parent()
    before = {n for n in os.listdir(parent) if n.startswith("openrlhf-sandbox-")}
    seen = []
    import threading

    returned = threading.Event()

    def look():  # until the run returns: its processes are in the cgroup for its 1.5 s at least
        while not seen and not returned.is_set():
            for name in set(os.listdir(parent)) - before:
                if name.startswith("openrlhf-sandbox-"):
                    with contextlib.suppress(FileNotFoundError), open(os.path.join(parent, name, "cgroup.procs")) as f:
                        if f.read().split():  # the run's processes are in it
                            seen.append(name)
            time.sleep(0.05)

    watcher = threading.Thread(target=look)
    watcher.start()
    try:
        result = run_python("import time\ntime.sleep(1.5)\nprint('done')", timeout=60.0)  # the start included
    finally:
        returned.set()
        watcher.join()
    assert result["stdout"] == "done\n" and seen, (result, seen)
    run_python("print(1)")  # a finished run's cgroup goes once its last process has left: at the latest, now
    assert seen[0] not in os.listdir(parent)


def test_a_run_past_its_cgroups_limit_is_killed_and_says_so(monkeypatch):
    _cgroup_parent()
    # The cgroup's limit below RLIMIT_AS (it is normally above it, a backstop): the kernel kills at the cgroup's.
    monkeypatch.setattr(sandbox, "CGROUP_SLACK_MB", -(sandbox.WORKDIR_MB + 192))
    result = run_python("b = bytearray(150 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('allocated')",
                        timeout=10.0, memory_mb=256)
    assert "allocated" not in result["stdout"] and result["exit_code"] == -9, result
    assert "sandbox: killed at its memory limit" in result["stderr"]


# --- without isolation -----------------------------------------------------------------------------------

def test_without_bubblewrap_model_code_is_refused_with_one_line(monkeypatch):
    monkeypatch.setattr(sandbox, "_probed", {})
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable) as error:
        run_python("print(1)")
    message = str(error.value)
    assert "\n" not in message and "bwrap" in message and "--agent.sandbox unsafe" in message


def test_the_mode_comes_from_the_engines_environment(monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "unsafe")
    assert run_python("import os\nprint(os.getuid() == 65534)")["stdout"] == "False\n"
    monkeypatch.setenv(sandbox.MODE_ENV, "off")
    with pytest.raises(SandboxUnavailable, match="use bwrap or unsafe"):
        run_python("print(1)")


BYPASSES = [
    ("posixsubprocess directly", "import _posixsubprocess\n_posixsubprocess.fork_exec()"),
    ("posixsubprocess reimported", "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess"),
    ("ctypes libc call", "import ctypes\nctypes.CDLL(None).getpid()"),
    ("gc walk to the hook list", "import gc\ngc.get_objects()"),
    ("subinterpreter", "import _xxsubinterpreters"),
    ("os.system", "import os\nos.system('true')"),
    ("dir_fd of the home folder", f"import os\nfd = os.open({HOME!r}, os.O_RDONLY)\n"
                                  f"os.open('FILE', os.O_WRONLY | os.O_CREAT, dir_fd=fd)"),
    ("symlink out of the working dir", f"import os\nos.symlink({HOME!r}, 'home')\nopen('home/FILE', 'w')"),
    ("rename into the home folder", f"open('x', 'w').close()\nimport os\nos.rename('x', {HOME!r} + '/FILE')"),
]


@pytest.mark.parametrize("code", [code for _, code in BYPASSES], ids=[name for name, _ in BYPASSES])
def test_in_unsafe_mode_the_audit_hook_refuses_known_bypasses(code):
    # The extra layer: each of these is refused with PermissionError before the OS layer is even needed.
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    result = run_python(code.replace("FILE", name) + "\nprint('escaped')", mode="unsafe")
    assert "escaped" not in result["stdout"] and "PermissionError: sandbox:" in result["stderr"], result["stderr"]
    assert not os.path.exists(os.path.join(HOME, name))


def test_the_audit_hook_reads_no_globals():
    # User code can rebind any global or builtin; a hook that looked one up could be turned off that way.
    def code_objects(code):
        yield code
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                yield from code_objects(const)

    (hook,) = [c for c in code_objects(compile(PREAMBLE, "<preamble>", "exec")) if c.co_name == "hook"]
    assert not [c for c in hook.co_consts if hasattr(c, "co_code")], "a nested function or comprehension"
    assert {i.opname for i in dis.get_instructions(hook)}.isdisjoint({"LOAD_GLOBAL", "LOAD_NAME"})


def test_an_infinite_loop_times_out_and_is_killed():
    # A bound the sandbox's start fits within on a busy machine: "started" must come before it.
    result = run_python("print('started', flush=True)\nwhile True:\n    pass", timeout=5.0)
    assert result["timed_out"] and result["exit_code"] != 0
    assert result["stdout"] == "started\n", "output written before the timeout is kept"
