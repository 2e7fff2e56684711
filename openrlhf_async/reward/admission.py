"""The reward service's admission to its workers (reward_func calls, or math-verify samples): at most `size` calls
run and at most `queue` wait, and none waits longer than one call's timeout and WORKER_START_S more, so a backlog
of hung calls cannot hold a later request for longer than that: it is served, or answered ServiceBusy (503) and
retried by its client.

Waiters are served oldest first while the queue moves, and newest first once the oldest has waited longer than a
call may run: the workers are then held by calls running to their timeout, most likely hung, and the oldest waiters
came with them. This is Facebook's adaptive LIFO with CoDel's bounded queue time ("Fail at Scale", ACM Queue 2015)."""

import asyncio
import collections
import contextlib

# A worker killed for its call's timeout is restarted inside the next call's place, outside that call's timeout.
# A request then takes at most 2 x timeout, 5 s and a worker's start: a RemoteReward client waits 2 x timeout + 10 s.
WORKER_START_S = 5.0


class ServiceBusy(RuntimeError):
    """No place came free within the patience, or the queue was full."""


class Admission:
    def __init__(self, size: int, queue: int, call_timeout: float, what: str):
        self.size, self.queue, self.call_timeout, self.what = size, queue, call_timeout, what
        self.patience = call_timeout + WORKER_START_S
        self.running = 0
        self._waiters = collections.deque()  # (arrival time, future), oldest first

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        return len(self._waiters) >= self.queue

    @contextlib.asynccontextmanager
    async def slot(self, past_full_queue: bool = False):
        """Holds one of the `size` places while the block runs; ServiceBusy when none came in time, or when `queue`
        already wait (unless past_full_queue: a sample of a request that was let in whole)."""
        await self._acquire(past_full_queue)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, past_full_queue: bool):
        if self.running < self.size and not self._waiters:
            self.running += 1
            return
        if self.full and not past_full_queue:
            raise ServiceBusy(f"{self.queue} requests already wait for the {self.size} {self.what}")
        loop = asyncio.get_running_loop()
        entry = (loop.time(), loop.create_future())
        self._waiters.append(entry)
        timer = loop.call_later(self.patience, self._expire, entry)
        try:
            await entry[1]
        except BaseException:
            future = entry[1]
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release()  # handed a place just as this request was cancelled: pass it on
            elif entry in self._waiters:
                self._waiters.remove(entry)
            raise
        finally:
            timer.cancel()

    def _expire(self, entry):
        if entry in self._waiters:
            self._waiters.remove(entry)
            if not entry[1].done():
                entry[1].set_exception(ServiceBusy(f"all {self.size} {self.what} stayed busy for "
                                                   f"{self.patience:g} s"))

    def _release(self):
        loop = asyncio.get_running_loop()
        while self._waiters:
            held_up = loop.time() - self._waiters[0][0] > self.call_timeout
            _, future = self._waiters.pop() if held_up else self._waiters.popleft()
            if not future.done():  # a cancelled waiter leaves its entry until it runs again
                future.set_result(None)  # the place passes to it: `running` stays
                return
        self.running -= 1
