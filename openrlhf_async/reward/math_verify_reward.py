"""Verifiable math reward: 1.0 when the completion's final answer equals the label, else 0.0.

`math_score` is the sync check; `MathVerifyPool` runs it in worker processes, because pathological LaTeX can
hang sympy and only a process can be killed (one per sample over its time, never its neighbours'); `math_verify` is
the async call agents use."""

import asyncio
import logging
import re
import weakref
from decimal import Decimal, InvalidOperation

from openrlhf_async.reward.sources import RewardError, RewardTimeout
from openrlhf_async.utils.user_code import UserWorkers

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


def _load_math_score(signal_timeout: int):
    """math_score, as a worker process loads it: sympy and math-verify imported and run once here, outside any
    sample's timeout."""
    global _SIGNAL_TIMEOUT
    _SIGNAL_TIMEOUT = signal_timeout
    math_score("\\boxed{\\frac{1}{2}}", "0.5")
    return math_score


def _retrieve(task):
    if not task.cancelled():
        task.exception()  # a sample whose caller left: its outcome is dropped, not logged as never retrieved


class MathVerifyPool:
    """math_score in `workers` processes, one sample each at a time, each under the timeout. A sample over it has
    its own worker killed and replaced (the next sample there waits for the fresh one to start, outside its own
    timeout); the samples beside it run on."""

    def __init__(self, workers: int = 2, timeout: float = 10.0):
        self.workers, self.timeout = workers, timeout
        # Soft first line inside workers: each parse or comparison stops after this many whole seconds.
        self.signal_timeout = max(1, int(timeout / 4))
        self._workers = UserWorkers(workers, _load_math_score, (self.signal_timeout,), "math-verify")
        self._turns = weakref.WeakKeyDictionary()  # event loop -> semaphore over the workers (loop-bound)

    def needs_worker(self, completion: str, label) -> bool:
        """False when the answer is settled without sympy (no answer, or two plain numbers)."""
        return _fast_score(completion, label) is None

    async def start(self):
        """Starts every worker now, rather than inside the first samples."""
        await asyncio.gather(*(self._workers.call("\\boxed{\\frac{1}{2}}", "0.5", timeout=self.timeout)
                               for _ in range(self.workers)))

    async def score(self, completion: str, label, admission=None) -> dict:
        """Raises RewardTimeout when math-verify runs past the timeout, RewardError when its worker fails.
        admission: the reward service's, where a sample waits at most its patience for a worker (else ServiceBusy);
        None (in an engine): samples wait their turn. A caller that gives up on a sample already on a worker leaves
        it to finish there, within its timeout, so that the worker is kept rather than killed."""
        fast = _fast_score(completion, label)
        if fast is not None:
            return fast
        placed = asyncio.Event()
        run = asyncio.ensure_future(self._on_worker(completion, label, admission, placed))
        try:
            return await asyncio.shield(run)
        except asyncio.CancelledError:
            if placed.is_set():
                run.add_done_callback(_retrieve)
            else:
                run.cancel()
            raise

    def _place(self, admission):
        if admission is not None:
            return admission.slot(past_full_queue=True)  # the service refuses whole requests at a full queue
        loop = asyncio.get_running_loop()
        if loop not in self._turns:
            self._turns[loop] = asyncio.Semaphore(self.workers)
        return self._turns[loop]

    async def _on_worker(self, completion: str, label, admission, placed: asyncio.Event) -> dict:
        async with self._place(admission):
            placed.set()
            try:
                return await self._workers.call(completion, label, timeout=self.timeout)
            except asyncio.TimeoutError:
                raise RewardTimeout(f"math-verify took over {self.timeout:g} s on answer "
                                    f"{extract_answer(completion)[:80]!r}; its worker was replaced") from None
            except Exception as e:  # its worker died or did not start, or math-verify raised
                raise RewardError(f"math-verify failed: {type(e).__name__}: {e}") from e

    def close(self):
        self._workers.close()


_DEFAULT_OPTIONS = {"workers": 2, "timeout": 10.0}
_DEFAULT_POOL = None


def configure_math_verify(workers: int = 2, timeout: float = 10.0):
    """Options of this process's default pool (the one `math_verify` uses); takes effect on its next call. Samples
    beyond the workers wait their turn."""
    global _DEFAULT_POOL
    _DEFAULT_OPTIONS.update(workers=workers, timeout=timeout)
    if _DEFAULT_POOL is not None:
        _DEFAULT_POOL.close()
        _DEFAULT_POOL = None


async def math_verify(completion: str, label) -> dict:
    """{"score", "accuracy", "pred"} from this process's default pool (started on first use)."""
    global _DEFAULT_POOL
    if _DEFAULT_POOL is None:
        _DEFAULT_POOL = MathVerifyPool(**_DEFAULT_OPTIONS)
    return await _DEFAULT_POOL.score(completion, label)
