"""Hostile payloads against the code sandbox at full size, with the in-interpreter hook off (the OS layer alone), and
the host's available memory while each runs (x86_64: the keyring payloads name its call numbers).

    python benchmarks/sandbox_hostile.py [--memory_mb 256]

Per payload one line: contained or not, what the code printed last, the host's MemAvailable before, lowest while it
ran, and after (MB). Ends with one JSON line: {"payloads", "contained", "lowest_available_mb", "memory_bound"}."""

import argparse
import json
import threading

from openrlhf_async.agent import sandbox
from openrlhf_async.agent.kernel_limits import memory_bound

# Each prints "HELD ..." only if it got what it asked for.
PAYLOADS = {
    "memfd 6 GB": """
import os
fds = [os.memfd_create("m") for _ in range(192)]
for fd in fds:
    for _ in range(32):
        os.write(fd, b"\\1" * (1 << 20))
print("HELD 6 GB in memfd")""",
    "SysV shared memory 1 GB": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
for _ in range(8):
    shm = libc.shmget(0, 128 << 20, 0o1600)
    address = libc.shmat(shm, None, 0) if shm >= 0 else None
    if not address or address == ctypes.c_void_p(-1).value:
        break
    ctypes.memset(address, 1, 128 << 20)
    libc.shmdt(ctypes.c_void_p(address))  # the segment lives on, outside the process's mappings
    held += 128
print(f"HELD {held} MB of SysV shared memory" if held else f"refused {ctypes.get_errno()}")""",
    "POSIX shared memory 1 GB": """
import os, _posixshmem
fd = _posixshmem.shm_open("/m", os.O_CREAT | os.O_RDWR, 0o600)
for _ in range(1024):
    os.write(fd, b"\\1" * (1 << 20))
print("HELD 1 GB of POSIX shared memory")""",
    "15 forks x 200 MB": """
import os, time
children = 0
for _ in range(15):
    if os.fork() == 0:
        b = bytearray(200 << 20)
        b[::4096] = b"x" * len(b[::4096])
        time.sleep(2)
        os._exit(0)
    children += 1
time.sleep(2.5)
print("HELD", children, "children of 200 MB")""",
    "keyring read": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
found = libc.syscall(250, 10, -3, b"user", b"openrlhf-bench", 0)  # keyctl(KEYCTL_SEARCH), the host's key
print("HELD key", found) if found >= 0 else print("refused", ctypes.get_errno())""",
    "keyring write (a key for the next run)": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
key = libc.syscall(248, b"user", b"planted", b"next run", 8, -4)  # add_key to the user keyring on x86_64
print("HELD key", key) if key >= 0 else print("refused", ctypes.get_errno())""",
    "tmpfs and /dev/shm 6 GB": """
written = 0
for folder in (".", "/dev/shm", "/tmp"):
    try:
        with open(f"{folder}/fill", "wb") as f:
            for _ in range(2048):
                f.write(b"x" * (1 << 20))
                written += 1
    except OSError:
        pass
print("HELD" if written > 64 else "wrote", written, "MB")""",
}


def available_mb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) // 1024


def host_key():
    """A key in this process's session keyring (which children inherit), as a host's secret: (id, revoke)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(248, b"user", b"openrlhf-bench", b"host secret", 11, -3)
    return key, lambda: libc.syscall(250, 3, key)  # KEYCTL_REVOKE


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory_mb", type=int, default=256, help="the sandbox's memory limit (the tool agent's)")
    args = parser.parse_args()
    sandbox.run_python("print(0)")  # probe once
    lowest_all, contained = None, 0
    key, revoke = host_key()
    for name, code in PAYLOADS.items():
        before, lowest, running = available_mb(), [available_mb()], threading.Event()

        def sample():
            while not running.wait(0.02):
                lowest[0] = min(lowest[0], available_mb())

        watcher = threading.Thread(target=sample)
        watcher.start()
        try:
            result = sandbox.run_python(code, timeout=20.0, memory_mb=args.memory_mb, audit=False)
        finally:
            running.set()
            watcher.join()
        held = "HELD" in result["stdout"]
        contained += not held
        lowest_all = lowest[0] if lowest_all is None else min(lowest_all, lowest[0])
        last = (result["stdout"].strip() or result["stderr"].strip() or "-").splitlines()[-1][:90]
        print(f"{name:40s} {'ESCAPED' if held else 'contained':9s} MemAvailable {before} / lowest {lowest[0]} / "
              f"after {available_mb()} MB: {last}", flush=True)
    revoke()
    print(json.dumps({"payloads": len(PAYLOADS), "contained": contained, "lowest_available_mb": lowest_all,
                      "memory_bound": memory_bound()}))


if __name__ == "__main__":
    main()
