"""Blocking user code (plain `def` agent steps and reward functions) run off the event loop, where a hung call
cannot starve the others.

`UserThreads` runs it in the caller's process, in threads of its own: never asyncio's default executor, which a
handful of hung calls fill (and which asyncio itself needs, for DNS look-ups). `UserWorkers` runs it in worker
processes, one call per worker at a time, and kills the one worker whose call hangs."""

import asyncio
import concurrent.futures
import contextlib
import inspect
import multiprocessing
import os
import re
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool

_STARTUP_TIMEOUT = 120.0  # seconds a fresh worker may take to start and import the user's file on a busy machine
SEM_FOLDER = "/dev/shm"  # where Linux keeps named POSIX semaphores (sem.<name>)
_OWNED = re.compile(r"sem\.mp-oa(\d+)-\w+")  # a pool's semaphore, named after its owner's pid (owned_semaphores)


@contextlib.contextmanager
def owned_semaphores():
    """The multiprocessing semaphores made inside (a process pool's queues: 5 a pool) named after this process, so
    that remove_dead_semaphores can tell them from others': killed outright with its process group (Ray's cleanup,
    kill -9 -PGID), a process takes multiprocessing's resource tracker, which would remove them, along."""
    config = multiprocessing.current_process()._config
    previous = config.get("semprefix", "/mp")
    config["semprefix"] = f"/mp-oa{os.getpid()}"
    try:
        yield
    finally:
        config["semprefix"] = previous


def remove_dead_semaphores(folder: str = SEM_FOLDER) -> None:
    """Remove the pools' semaphores whose owner process is gone (its live workers keep theirs open)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            owner = _OWNED.fullmatch(name)
            if owner and not _alive(int(owner.group(1))):
                with contextlib.suppress(OSError):  # removed meanwhile, or another user's
                    os.unlink(os.path.join(folder, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


class UserCodeStalled(RuntimeError):
    """Every thread is held by a call still running past its timeout; a thread cannot be killed."""


class UserThreads:
    """func(*args) in at most `size` threads of its own. A thread still running past its caller's timeout keeps
    its place (nothing can stop it); once all `size` are so held, calls fail at once with a message that says
    so and how to fix it (`fix`), rather than queueing behind hung calls."""

    def __init__(self, func, size: int, what: str, fix: str):
        self.func, self.size, self.what, self.fix = func, size, what, fix
        self._executor = None
        self._held = 0
        self._lock = threading.Lock()

    async def call(self, *args, timeout: float):
        with self._lock:
            if self._held >= self.size:
                raise UserCodeStalled(f"all {self.size} threads for {self.what} are held by calls still running "
                                      f"past their timeout; {self.fix}")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="user-code")
            future = self._executor.submit(self.func, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            if not future.done():  # running (a queued call was cancelled): its thread stays held until it returns
                with self._lock:
                    self._held += 1
                future.add_done_callback(self._release)
            raise

    def _release(self, _future):
        with self._lock:
            self._held -= 1

    def close(self):
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class UserWorkers:
    """The function `load(*load_args)` returns (run once in each worker), called in at most `size` worker
    processes, one call per worker at a time. A call's timeout starts when a worker takes it; a call past it (or
    cancelled) has its own worker killed, so the calls beside it run on and a fresh worker takes its place."""

    def __init__(self, size: int, load, load_args: tuple, what: str):
        self.size, self.what = size, what
        self._load, self._load_args = load, load_args
        self._idle, self._live = [], set()  # single-process executors: free ones, and all not yet killed
        self._per_loop = weakref.WeakKeyDictionary()  # event loop -> semaphore over the workers (loop-bound)
        remove_dead_semaphores()  # those of a pool killed outright before this start

    def _slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._per_loop:
            self._per_loop[loop] = asyncio.Semaphore(self.size)
        return self._per_loop[loop]

    async def _worker(self):
        if self._idle:
            return self._idle.pop()
        with owned_semaphores():
            worker = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                initargs=(os.getpid(), self._load, self._load_args))
        self._live.add(worker)
        try:  # started outside the call's timeout, as the math-verify workers are
            await asyncio.wait_for(asyncio.wrap_future(worker.submit(_ready)), _STARTUP_TIMEOUT)
        except BaseException as e:
            self._kill(worker)
            if isinstance(e, (asyncio.TimeoutError, BrokenProcessPool)):
                raise RuntimeError(f"{self.what} worker process did not start ({type(e).__name__}: {e})") from None
            raise
        return worker

    async def call(self, *args, timeout: float):
        async with self._slots():
            worker = await self._worker()
            future = asyncio.wrap_future(worker.submit(_call_loaded, *args))
            try:
                result = await asyncio.wait_for(future, timeout)
            except BrokenProcessPool as e:
                self._kill(worker)
                raise RuntimeError(f"{self.what} worker process died ({e})") from None
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._kill(worker)  # it may be stuck in the call, and only killing it frees its place
                raise
            except BaseException:
                self._idle.append(worker)  # the user's own exception: the worker is fine
                raise
            self._idle.append(worker)
            return result

    def _kill(self, worker):
        self._live.discard(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        for process in list((getattr(worker, "_processes", None) or {}).values()):
            process.kill()
        worker.shutdown(wait=False, cancel_futures=True)

    def close(self):
        for worker in list(self._live):
            self._kill(worker)


_LOADED = None  # in a worker: the user's function


def exit_with_parent(parent_pid: int):
    """A worker's watchdog thread: leave once the process that started it is gone (SIGKILL, ray.kill)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _init_worker(parent_pid: int, load, load_args: tuple):
    global _LOADED
    # A killed engine or server (SIGKILL, ray.kill) cannot stop a worker stuck in user code: it notices and leaves.
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    _LOADED = load(*load_args)


def _ready() -> bool:
    return True


def _call_loaded(*args):
    result = _LOADED(*args)
    return asyncio.run(result) if inspect.isawaitable(result) else result
