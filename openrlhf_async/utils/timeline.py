"""What each actor was doing when: spans {"actor", "kind", "start", "end"} (Unix seconds) that the trainer collects
every step into <run dir>/timeline.jsonl, drawn by `python -m openrlhf_async.cli.report`. Kinds: generate, train,
sync, eval, checkpoint, wait; time outside any span is idle. The actor's own timing figures (seconds per phase, idle
ratios) are read off the same spans."""

import collections
import contextlib
import time

MAX_SPANS = 100_000  # an actor nobody collects from (a test's engine) keeps only the newest


class Timeline:
    def __init__(self, actor: str):
        self.actor = actor
        self.spans = collections.deque(maxlen=MAX_SPANS)
        self.open = {}  # kind -> start of a span begun and not yet ended
        self.seconds = collections.Counter()  # kind -> seconds in its spans so far; take() leaves it
        self.last = {}  # kind -> seconds of its newest span

    @contextlib.contextmanager
    def span(self, kind: str):
        start = time.time()
        try:
            yield
        finally:
            self.add(kind, start, time.time())

    def add(self, kind: str, start: float, end: float) -> None:
        self.spans.append({"actor": self.actor, "kind": kind, "start": start, "end": end})
        self.seconds[kind] += end - start
        self.last[kind] = end - start

    def begin(self, kind: str) -> None:
        self.open.setdefault(kind, time.time())

    def end(self, kind: str) -> None:
        if kind in self.open:
            self.add(kind, self.open.pop(kind), time.time())

    def take(self) -> list:
        """The spans so far, forgotten here; an open span is cut at now and continues in the next take."""
        now = time.time()
        for kind, start in self.open.items():
            self.add(kind, start, now)
            self.open[kind] = now
        spans, self.spans = list(self.spans), collections.deque(maxlen=MAX_SPANS)
        return spans

    def idle_ratio(self, since: float, seconds: dict = None) -> float:
        """The share of the time since `since` (a time.time()) spent waiting, leaving out evaluation and checkpoints,
        which are neither work on the run's batches nor idling. seconds: the totals as they stood at `since`."""
        spent = self.seconds - collections.Counter(seconds or {})
        return spent["wait"] / max(1e-9, time.time() - since - spent["eval"] - spent["checkpoint"])
