"""Verifiable math reward: 1.0 when the completion's final answer equals the label, else 0.0.

`math_score` is the sync check; `MathVerifyPool` runs it in worker processes, because pathological LaTeX can
hang sympy and only a process can be killed; `math_verify` is the async call agents use."""

import asyncio
import logging
import os
import re
import threading
import time
import weakref
from decimal import Decimal, InvalidOperation

from openrlhf_async.reward.sources import RewardError, RewardTimeout
from openrlhf_async.utils.user_code import exit_with_parent

# math-verify warns on every call when its signal-based timeout is off; it must be off outside the main thread.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_ANSWER_LINE = re.compile(r"answer\s*:", re.IGNORECASE)  # DAPO-Math ends with the line `Answer: $Answer`
_ANSWER_IS = re.compile(r"the (?:final )?answer is\s*:?", re.IGNORECASE)
_INLINE_MATH = re.compile(r"\$([^$]+)\$")
# Scientific notation too: a JSON number label reaches the reward as str(float), `1e-07`. Up to 3 exponent digits,
# so a number written out stays short.
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][+-]?\d{1,3})?")
_EXPRESSION = re.compile(r"[\w\s+\-*/^().,=<>{}\[\]|!%\\$:']+")

_STARTUP_TIMEOUT = 120.0  # seconds fresh workers may take to import sympy and math-verify on a busy machine

# Seconds math-verify's own (SIGALRM) timeouts allow each parse and comparison; set only in pool workers,
# where scoring runs in the process's main thread.
_SIGNAL_TIMEOUT = None


def _boxed(text: str):
    """The content of the last complete \\boxed{...} or \\fbox{...}, braces balanced."""
    starts = [m.end() - 1 for m in _BOX.finditer(text)]
    if not starts:
        return None
    closing, open_at = {}, []
    for brace in _BRACE.finditer(text):  # one pass: hostile text may open thousands of boxes
        if brace.group() == "{":
            open_at.append(brace.start())
        elif open_at:
            closing[open_at.pop()] = brace.start()
    for start in reversed(starts):
        content = text[start + 1:closing[start]].strip() if start in closing else ""
        if content:
            return content
    return None


def _clean(answer: str):
    answer = answer.strip()
    inline = _INLINE_MATH.search(answer)
    if inline:
        answer = inline.group(1)
    answer = answer.strip().strip("$").strip()
    answer = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", answer).strip()
    return answer.rstrip(".").strip() or None


def _short_expression(text: str) -> bool:
    # A bare answer such as `65`, `-3/4` or `\frac{1}{2}`: no words once LaTeX commands are dropped.
    return (len(text) <= 64 and "\n" not in text and _EXPRESSION.fullmatch(text) is not None
            and re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", "", text)) is None)


def extract_answer(text: str):
    """The completion's final answer as text: the last \\boxed{}, else an `Answer:` line, else what follows
    "the answer is", else the whole completion when it is a short bare expression; None when there is none."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    for marker in (_ANSWER_LINE, _ANSWER_IS):
        last = None
        for last in marker.finditer(text):
            pass
        if last is not None:
            answer = _clean(text[last.end():].split("\n", 1)[0])
            if answer is not None:
                return answer
    text = text.strip()
    return _clean(text) if text and _short_expression(text) and not _BOX.search(text) else None


def _plain_number(text: str):
    if not _NUMBER.fullmatch(text) or not any(c.isdigit() for c in text):
        return None
    try:
        return Decimal(text.replace(",", ""))  # exact: floats would call 20-digit neighbours equal
    except InvalidOperation:
        return None


def _result(correct: bool, pred) -> dict:
    return {"score": float(correct), "accuracy": float(correct), "pred": pred}


def _gold_text(label) -> str:
    label = str(label).strip()
    if "\\boxed" in label or "\\fbox" in label:
        return _boxed(label) or label
    label = label.strip("$").strip()
    number = _plain_number(label)
    return label if number is None else format(number, "f")  # written out for math-verify: `1e-07` is e - 7 to it


def _fast_score(completion: str, label):
    """The answer without sympy when that is possible (no answer, or two plain numbers), else None."""
    pred = extract_answer(completion)
    if pred is None:
        return _result(False, None)
    pred_num, gold_num = _plain_number(pred), _plain_number(_gold_text(label))
    if pred_num is not None and gold_num is not None:
        return _result(pred_num == gold_num, pred)
    return None


def math_score(completion: str, label) -> dict:
    """{"score", "accuracy", "pred"}: score == accuracy, 1.0 when the final answer equals the label."""
    fast = _fast_score(completion, label)
    if fast is not None:
        return fast
    from math_verify import parse, verify

    pred, gold_text = extract_answer(completion), _gold_text(label)
    # Bare answers are boxed so that math-verify reads them as LaTeX (`(0, 1]`, `\{1,2\}`, `\frac12`).
    gold = parse(f"\\boxed{{{gold_text}}}", parsing_timeout=_SIGNAL_TIMEOUT)
    if not gold:  # a label math-verify cannot read: fall back to exact text
        return _result(pred == gold_text, pred)
    parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=_SIGNAL_TIMEOUT)
    return _result(bool(parsed) and verify(gold, parsed, timeout_seconds=_SIGNAL_TIMEOUT), pred)


def _worker_init(signal_timeout: int, parent_pid: int):
    global _SIGNAL_TIMEOUT
    _SIGNAL_TIMEOUT = signal_timeout
    # A killed engine or server (SIGKILL, ray.kill) cannot stop its workers: they notice and leave.
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    import math_verify  # noqa: F401  (paid once per worker, not inside a sample's timeout)


def _warm() -> bool:
    return math_score("\\boxed{\\frac{1}{2}}", "0.5")["score"] == 1.0


class MathVerifyPool:
    """math_score in worker processes, bounded and under a timeout; a hung worker is killed and replaced."""

    def __init__(self, workers: int = 2, timeout: float = 10.0, max_concurrency: int = 64):
        self.workers, self.timeout, self.max_concurrency = workers, timeout, max_concurrency
        # Soft first line inside workers: each parse or comparison stops after this many whole seconds.
        self.signal_timeout = max(1, int(timeout / 4))
        self._pool, self._warmup = None, None
        self._lock = threading.Lock()
        self._per_loop = weakref.WeakKeyDictionary()  # event loop -> (admission, worker slots): loop-bound

    def _limits(self):
        loop = asyncio.get_running_loop()
        if loop not in self._per_loop:
            # Slots: a sample's timeout starts when a worker is free for it, not while it queues.
            self._per_loop[loop] = (asyncio.Semaphore(self.max_concurrency), asyncio.Semaphore(self.workers))
        return self._per_loop[loop]

    def _ready_pool(self):
        import concurrent.futures
        import multiprocessing

        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_init, initargs=(self.signal_timeout, os.getpid()))
                # One warm-up task per worker starts them all now, each importing sympy outside any timeout.
                self._warmup = [self._pool.submit(_warm) for _ in range(self.workers)]
            return self._pool, self._warmup

    def _kill(self, pool):
        with self._lock:
            if self._pool is pool:
                self._pool, self._warmup = None, None
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def _kill_if_stuck(self, pool, future):
        if not future.done():
            self._kill(pool)

    async def score(self, completion: str, label) -> dict:
        """Raises RewardTimeout when math-verify runs past the timeout, RewardError when a worker fails."""
        from concurrent.futures.process import BrokenProcessPool

        fast = _fast_score(completion, label)
        if fast is not None:
            return fast
        admission, slots = self._limits()
        async with admission, slots:
            for _ in range(2):
                pool, warmup = self._ready_pool()
                try:
                    started = await asyncio.wait_for(asyncio.gather(
                        *map(asyncio.wrap_future, warmup), return_exceptions=True), _STARTUP_TIMEOUT)
                    if not all(ok is True for ok in started):
                        raise BrokenProcessPool(f"math-verify workers did not start ({started})")
                    future = pool.submit(math_score, completion, label)
                except asyncio.TimeoutError:
                    self._kill(pool)
                    raise RewardError(f"math-verify workers did not start within {_STARTUP_TIMEOUT:g} s") from None
                except (BrokenProcessPool, RuntimeError) as e:  # killed under us (another sample's timeout)
                    self._kill(pool)
                    cause = e
                    continue
                deadline = time.monotonic() + self.timeout
                try:
                    return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
                except asyncio.TimeoutError:
                    self._kill(pool)  # a hung worker cannot be cancelled, only killed
                    raise RewardTimeout(f"math-verify took over {self.timeout:g} s on answer "
                                        f"{extract_answer(completion)[:80]!r}; its worker was replaced") from None
                except asyncio.CancelledError:
                    # Our caller gave up first; the worker may still be stuck on this sample.
                    timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._kill_if_stuck,
                                            (pool, future))
                    timer.daemon = True
                    timer.start()
                    raise
                except BrokenProcessPool as e:  # a worker died (killed for another sample, or crashed)
                    self._kill(pool)
                    cause = e
                except Exception as e:
                    raise RewardError(f"math-verify failed: {type(e).__name__}: {e}") from e
            raise RewardError(f"math-verify worker process died twice ({type(cause).__name__}: {cause})")

    def close(self):
        with self._lock:
            pool = self._pool
        if pool is not None:
            self._kill(pool)


_DEFAULT_OPTIONS = {"workers": 2, "timeout": 10.0, "max_concurrency": 64}
_DEFAULT_POOL = None


def configure_math_verify(workers: int = 2, timeout: float = 10.0, max_concurrency: int = 64):
    """Options of this process's default pool (the one `math_verify` uses); takes effect on its next call."""
    global _DEFAULT_POOL
    _DEFAULT_OPTIONS.update(workers=workers, timeout=timeout, max_concurrency=max_concurrency)
    if _DEFAULT_POOL is not None:
        _DEFAULT_POOL.close()
        _DEFAULT_POOL = None


async def math_verify(completion: str, label) -> dict:
    """{"score", "accuracy", "pred"} from this process's default pool (started on first use)."""
    global _DEFAULT_POOL
    if _DEFAULT_POOL is None:
        _DEFAULT_POOL = MathVerifyPool(**_DEFAULT_OPTIONS)
    return await _DEFAULT_POOL.score(completion, label)
