"""Reward sources an engine scores finished episodes with: an OpenRLHF reward_func file (or veRL's compute_score
file: ScoreReward, reward/verl_score.py), a reward service, or the reward models' actors (ModelReward;
reward/model.py starts them).

Both answer `await source.score(queries, prompts, labels)` with one `{"reward", "score", "extra"}` per query, as
OpenRLHF reads a reward_func's answer: "rewards" drive the advantages, "scores" (the rewards when left out) the
dynamic-sampling filter, and "extra_logs" are logged. `make_reward` picks one from the flags; None means the
agent's own step reward stands."""

import asyncio
import functools
import inspect
import itertools
import json
import math
import weakref

from openrlhf_async.reward import verl_score
from openrlhf_async.utils.user_code import UserCodeStalled, UserThreads, UserWorkers
from openrlhf_async.utils.user_files import import_user_file

# Far beyond any real reward, and far enough inside float32 that group sums, squares and advantages stay finite.
MAX_REWARD = 1e6

# The most a reward service may answer, per query of the request: its rewards, scores and logs are a few numbers.
ANSWER_BYTES_PER_QUERY = 1 << 20

FUNC_CONTRACT = ("a module-level `reward_func(queries, prompts, labels, **kwargs)` returning "
                 '{"rewards": one number per query, "scores": optional, "extra_logs": optional dict of lists}; '
                 "with one query (as the engines call it) a number stands for the list; or veRL's "
                 "`compute_score(data_source, solution_str, ground_truth, extra_info=None)`")

NAMESPACE = "openrlhf_async"  # the reward-model actors' Ray namespace: named per run, found by the engines


class RewardFileError(ValueError):
    """The reward flags or the reward_func file are wrong; raised at start, before any engine runs."""


class RewardError(RuntimeError):
    """A sample's reward could not be computed (after retries); the message says why."""


class RewardTimeout(TimeoutError):
    """A sample's reward took longer than its timeout."""


def check_reward(value, what: str) -> float:
    """value as a float if it is a real number (bool, int, float, numpy or torch scalar), finite and at most
    MAX_REWARD in size; else RewardError, one line naming the value."""
    if hasattr(value, "item"):  # numpy and torch scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # more than one element: refused below
            pass
    if isinstance(value, (bool, int, float)) and abs(value) <= MAX_REWARD:  # false for nan and inf
        return float(value)
    shown = " ".join(repr(value).split())[:60]
    expected = (f"a finite number of size at most {MAX_REWARD:g}" if isinstance(value, (bool, int, float))
                else "a number")
    raise RewardError(f"{what} is {shown}; expected {expected}")


def log_number(value):
    """A logged value as a float; None (left out of the logs) when it is not a finite real number."""
    if hasattr(value, "item"):  # numpy and torch scalars, one-element tensors
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return None
    if not isinstance(value, (bool, int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _as_list(value, what: str, n: int, read=check_reward) -> list:
    """One entry per query, each read by read(entry, name), from a list, tuple, tensor or array; for one query a
    single value (a number, a 0-d tensor) is its entry, as OpenRLHF 0.11 takes a reward_func called per sample."""
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays
        value = value.tolist()
    if n == 1 and not isinstance(value, (list, tuple)):
        value = [value]
    if not isinstance(value, (list, tuple)) or len(value) != n:
        length = f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
        raise RewardError(f"{what}: got {length} for {n} queries; expected one number per query")
    return [read(v, f"{what}[{i}]") for i, v in enumerate(value)]


def parse_reward_output(out, n: int) -> list:
    """A reward_func's (or a service's) answer -> one {"reward", "score", "extra"} per query. A reward or score
    that is not a sane number (check_reward) is a RewardError; a logged value that is not a number is left out."""
    if not isinstance(out, dict) or "rewards" not in out:
        raise RewardError(f"reward returned {type(out).__name__} without 'rewards'; expected {FUNC_CONTRACT}")
    rewards = _as_list(out["rewards"], "rewards", n)
    scores = rewards if out.get("scores") is None else _as_list(out["scores"], "scores", n)
    logs = out.get("extra_logs") or {}
    if not isinstance(logs, dict):
        raise RewardError(f"extra_logs is {type(logs).__name__}; expected a dict of per-query lists")
    per_key = {}
    for key, value in logs.items():
        if hasattr(value, "tolist"):
            value = value.tolist()
        if not isinstance(value, (list, tuple)):  # one value for the whole batch: every sample logs it
            value = [value] * n
        per_key[key] = _as_list(value, f"extra_logs[{key!r}]", n, lambda v, _: log_number(v))
    return [{"reward": rewards[i], "score": scores[i],
             "extra": {k: v[i] for k, v in per_key.items() if v[i] is not None}} for i in range(n)]


class FuncReward:
    """An OpenRLHF reward_func file, called once per batch: an `async def` one on the event loop, a plain `def`
    one off it, in at most max_concurrency threads of its own or, with workers, in worker processes, where a hung
    call is killed (its timeout then starts when a worker takes it). what, load: the function's name in messages,
    and how a worker process loads it (ScoreReward gives its own)."""

    reads_info = False  # whether score() takes each sample's response text and row info (rollout's rescored)

    def __init__(self, path: str, func, timeout: float = 30.0, workers: int = 0, max_concurrency: int = 64,
                 what: str = "reward_func", load=None):
        self.path, self.func, self.timeout, self.what = path, func, timeout, what
        if inspect.iscoroutinefunction(func):
            self._runner = None
        elif workers:
            self._runner = UserWorkers(workers, load or _load_reward_func, (path,), f"{what} ({path})")
        else:
            self._runner = UserThreads(func, max_concurrency, f"{what} in {path}",
                                       f"a thread cannot be killed: fix the hang in {what}")

    async def call(self, *args):
        """The function's answer to args, within the timeout; its failures as RewardError or RewardTimeout."""
        try:
            if self._runner is None:
                return await asyncio.wait_for(self.func(*args), self.timeout)
            return await self._runner.call(*args, timeout=self.timeout)
        except asyncio.TimeoutError:
            raise RewardTimeout(f"{self.what} in {self.path} took over {self.timeout:g} s") from None
        except UserCodeStalled as e:
            raise RewardError(str(e)) from None
        except Exception as e:
            raise RewardError(f"{self.what} in {self.path} raised {type(e).__name__}: {e}") from e

    async def score(self, queries: list, prompts: list, labels: list) -> list:
        return parse_reward_output(await self.call(list(queries), list(prompts), list(labels)), len(queries))

    async def close(self):
        if self._runner is not None:
            self._runner.close()


class ScoreReward(FuncReward):
    """A veRL compute_score file (reward/verl_score.py), called once per sample: a plain def one in threads or
    worker processes, an async def one on the event loop."""

    reads_info = True

    def __init__(self, path: str, compute_score, timeout: float = 30.0, workers: int = 0, max_concurrency: int = 64):
        if inspect.iscoroutinefunction(compute_score):
            async def rows(*args):
                return await verl_score.score_rows_async(compute_score, *args)
        else:
            rows = functools.partial(verl_score.score_rows, compute_score)
        super().__init__(path, rows, timeout, workers, max_concurrency, "compute_score", _load_compute_score)

    async def score(self, queries: list, prompts: list, labels: list, responses: list = None,
                    infos: list = None) -> list:
        """responses: the model's text per sample (None: each query less its prompt, as a reward service has them);
        infos: each row's info (None: none)."""
        if responses is None:
            responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
        infos = [info or {} for info in (infos or [None] * len(queries))]
        answers = await self.call(list(labels), list(responses), infos)
        try:
            out = verl_score.as_reward_output(list(answers), self.path)
        except ValueError as e:
            raise RewardError(str(e)) from None
        return parse_reward_output(out, len(queries))


def _load_reward_func(path: str):
    """The reward_func, as a worker process loads it."""
    module = import_user_file(path, "--reward.func_path", FUNC_CONTRACT, RewardFileError, "openrlhf_async_reward")
    return module.reward_func


def _load_compute_score(path: str):
    """score_rows over the file's compute_score, as a worker process loads it."""
    module = import_user_file(path, "--reward.remote_url", FUNC_CONTRACT, RewardFileError, "openrlhf_async_reward")
    return functools.partial(verl_score.score_rows, module.compute_score)


def load_reward_func(path: str, timeout: float = 30.0, flag: str = "--reward.func_path", workers: int = 0,
                     max_concurrency: int = 64) -> FuncReward:
    """The reward file's source: its reward_func (OpenRLHF's), else its compute_score (veRL's)."""
    module = import_user_file(path, flag, FUNC_CONTRACT, RewardFileError, "openrlhf_async_reward")
    func = getattr(module, "reward_func", None)
    if not callable(func) and callable(getattr(module, "compute_score", None)):
        return ScoreReward(path, module.compute_score, timeout, workers, max_concurrency)
    if not callable(func):
        raise RewardFileError(f"{flag} {path}: defines no reward_func (nor compute_score); expected {FUNC_CONTRACT}")
    return FuncReward(path, func, timeout, workers, max_concurrency)


async def _read_at_most(resp, limit: int):
    """The answer's body, read in chunks; None when it is longer than limit bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


class RemoteReward:
    """A reward service speaking OpenRLHF's remote RM protocol, with retries over a bounded set of requests.

    `timeout` is the time the service gives one sample (its --timeout, which must not be more). A request may
    take twice that and 10 s more: the service tries a sample again when its worker was killed for another
    sample's timeout, and restarts workers. So the service's own answer for a sample over its time arrives, and
    is counted as that sample's reward error (RewardTimeout) instead of being retried. A 4xx answer (a bad
    request, or a reward_func that fails on it) is not retried either: it would fail again."""

    def __init__(self, urls, timeout: float = 30.0, retries: int = 5, max_concurrency: int = 64,
                 backoff: float = 0.5):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.timeout, self.retries, self.max_concurrency, self.backoff = timeout, retries, max_concurrency, backoff
        self.request_timeout = 2 * timeout + 10
        self._turn = itertools.count()
        self._per_loop = weakref.WeakKeyDictionary()  # event loop -> (session, semaphore): both are loop-bound

    def _session(self):
        import aiohttp

        loop = asyncio.get_running_loop()
        if loop not in self._per_loop:
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout))
            self._per_loop[loop] = (session, asyncio.Semaphore(self.max_concurrency))
        return self._per_loop[loop]

    async def score(self, queries: list, prompts: list, labels: list) -> list:
        import aiohttp

        session, semaphore = self._session()
        payload = {"query": list(queries), "prompts": list(prompts), "labels": list(labels)}
        limit = (1 + len(queries)) * ANSWER_BYTES_PER_QUERY
        cause = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(8.0, self.backoff * 2 ** (attempt - 1)))
            url = self.urls[next(self._turn) % len(self.urls)]
            try:
                async with semaphore, session.post(url, json=payload) as resp:
                    status = resp.status
                    if status == 200:
                        body = await _read_at_most(resp, limit)
                    else:
                        message = (await resp.content.read(200)).decode(errors="replace")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                cause = f"{url}: {type(e).__name__}: {e}"
                continue
            if status >= 500 or status == 429:  # the service is down, restarting or overloaded
                cause = f"{url} answered {status}: {message}"
                continue
            if status != 200:
                raise RewardError(f"{url} answered {status}: {message}")
            if body is None:
                raise RewardError(f"{url} answered with more than {limit / 2 ** 20:g} MB for {len(queries)} "
                                  f"queries; a reward answer is a few numbers per query")
            return self._read_answer(url, body, len(queries))
        raise RewardError(f"reward service failed after {self.retries + 1} attempts; last: {cause}")

    def _read_answer(self, url: str, body: bytes, n: int) -> list:
        """The results, or the service's own error for a sample it could not score (RewardTimeout, RewardError)."""
        try:
            out = json.loads(body)
        except ValueError as e:
            raise RewardError(f"{url} answered with a body that is not JSON ({e})") from None
        if isinstance(out, dict):
            service_timeout = out.get("timeout")
            if isinstance(service_timeout, (int, float)) and service_timeout > self.timeout:
                raise RewardError(f"{url} gives each sample up to {service_timeout:g} s (its --timeout), more than "
                                  f"--reward.timeout {self.timeout:g}: set --reward.timeout {service_timeout:g} "
                                  "or more, or start the service with a smaller --timeout")
            errors = out.get("errors") or []
            if not isinstance(errors, list) or not all(isinstance(e, dict) for e in errors):
                raise RewardError(f"{url} answered 'errors' that are not a list of {{'index', 'error'}} objects")
            if errors:
                first = errors[0]
                more = f" (and {len(errors) - 1} more of {n} samples)" if len(errors) > 1 else ""
                message = f"{url} could not score sample {first.get('index')}: {first.get('error')}"[:500] + more
                timed_out = all(str(e.get("error", "")).startswith("RewardTimeout") for e in errors)
                raise (RewardTimeout if timed_out else RewardError)(message)
        return parse_reward_output(out, n)

    async def close(self):
        entry = self._per_loop.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[0].close()


class ModelReward:
    """The engines' reward source over the reward-model actors: each model scores the episode's text (its group's
    actors taken in turn), the rewards add up; a call that fails or outlasts the timeout raises (a counted reward
    error or timeout). A call waits for the forward running before its own: it may take --reward.timeout + 60 s."""

    def __init__(self, names: tuple, timeout: float = 30.0):
        self.names, self.timeout = names, timeout + 60.0
        self.turns = [itertools.cycle(range(len(group))) for group in names]
        self.actors = {}

    def _actor(self, name: str):
        import ray

        if name not in self.actors:
            self.actors[name] = ray.get_actor(name, namespace=NAMESPACE)
        return self.actors[name]

    async def score(self, queries: list, prompts: list, labels: list) -> list:
        calls = [self._actor(group[next(turn)]).score.remote(queries) for group, turn in zip(self.names, self.turns)]
        try:
            per_model = await asyncio.wait_for(asyncio.gather(*calls), self.timeout)
        except asyncio.TimeoutError:
            raise RewardTimeout(f"a reward model took more than {self.timeout:g} s") from None
        totals = [sum(check_reward(model[i], "reward model's reward") for model in per_model)
                  for i in range(len(queries))]
        return [{"reward": total, "score": total, "extra": {f"reward_model_{m}": model[i]
                                                            for m, model in enumerate(per_model)}}
                for i, total in enumerate(totals)]

    async def close(self):
        pass


class SumReward:
    """Several reward sources scoring every episode (a reward_func or service and reward models): rewards and scores
    add up, logs merge."""

    def __init__(self, sources: list):
        self.sources = sources
        self.reads_info = any(getattr(s, "reads_info", False) for s in sources)

    async def score(self, queries: list, prompts: list, labels: list, **context) -> list:
        """context: each sample's response text and row info, for the sources that read them (reads_info)."""
        results = await asyncio.gather(*(s.score(queries, prompts, labels,
                                                 **(context if getattr(s, "reads_info", False) else {}))
                                         for s in self.sources))
        return [{"reward": sum(r[i]["reward"] for r in results), "score": sum(r[i]["score"] for r in results),
                 "extra": {k: v for r in results for k, v in r[i]["extra"].items()}} for i in range(len(queries))]

    async def close(self):
        for s in self.sources:
            await s.close()


def make_reward(remote_url: str = "", timeout: float = 30.0, retries: int = 5, max_concurrency: int = 64,
                workers: int = 0, models: tuple = ()):
    """The run's reward source from --reward.remote_url, which (as in OpenRLHF) is either reward service URLs
    (comma-separated) or a reward_func .py file, and the reward models' actors (models: their names per model,
    reward/model.py), whose rewards add to it; None when there is neither. workers: run a plain def reward_func in
    that many worker processes (a hung call killed) instead of threads of the engine's process."""
    if models:
        rule = make_reward(remote_url, timeout, retries, max_concurrency, workers)
        return ModelReward(models, timeout) if rule is None else SumReward([rule, ModelReward(models, timeout)])
    if remote_url.endswith(".py"):
        return load_reward_func(remote_url, timeout, "--reward.remote_url", workers, max_concurrency)
    if not remote_url:
        return None
    urls = [u.strip() for u in remote_url.split(",") if u.strip()]
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad or not urls:
        raise RewardFileError(f"--reward.remote_url {remote_url}: {bad[0] if bad else 'empty'} is not an "
                              "http(s):// URL; give service URLs (comma-separated) or a reward_func .py file")
    return RemoteReward(urls, timeout, retries, max_concurrency)
