"""User agents: a step file (`step(state, action, label) -> (reward, next_state, done, extra_info)`, or OpenRLHF
0.8's dict-returning step), an OpenRLHF 0.11 agent file (`AgentExecutor` built on `openrlhf.utils.agent`), an agent
written against the OpenAI API (`async def run(client, model, prompt, label, **info)`), or a `verifiers` environment
(agent/verifiers_env.py).

The OpenAI-API contract: `client` is an `openai.AsyncOpenAI` bound to this episode on the engine's OpenAI-compatible
endpoint (rollout/endpoint.py), `model` the name to pass it, `prompt` the dataset's prompt (text or chat messages),
`label` its label; `info` holds `budget`, the response tokens the episode may use in all (its calls' completions
and the tokens between them), and `base_url`, the episode's network address when the endpoint listens
(--agent.openai_port), else None. It makes any number of chat or completion calls, with or without tools, and
returns the episode's reward: a number, or a dict with "reward" and optionally "scores" (what the filter reads) and
"extra_logs". Its training sample is the tokens vLLM sampled for those calls, whatever text the agent kept.

The step contract, as this project defines it:
- `state`: the episode's text so far (the prompt, then every action and observation), as the model sees it;
- `action`: the text the model has just written (special tokens such as EOS left out);
- `label`: the prompt's label from the dataset;
- returns `reward` (a number; an episode's reward is the sum over its steps), `next_state` (the new episode text:
  `state + action + observation`, of which only the new observation is tokenised and appended; ignored when
  done), `done` (bool) and `extra_info` (a dict, logged).
A step that sets the sampling of its episode's next turns returns OpenRLHF 0.8's dict (below) with
"sampling_params": a dict of TURN_SAMPLING keys, each of which holds from the next turn on, over the --rollout
flags', until a step gives that key again.
`step` may be `async def` (run on the engine's event loop) or a plain `def` (run off the loop, in threads of its
own or, with --agent.workers N, in worker processes).

OpenRLHF 0.8.3-0.8.6 step files, `async def step(observation, action, label, **kwargs)` returning
{"rewards", "scores" (optional), "next_observation", "done", "sampling_params" (optional), "extra_logs"}, are the
same contract spelled differently: their observation is the whole text so far, and next_observation replaces it,
so it is this contract's state and next_state. The dynamic-sampling filter reads the last step's "scores" where
given, else the summed rewards, as OpenRLHF does. They are called without kwargs: a step that reads
kwargs.get("sampling_params") gets None."""

import asyncio
import inspect
import os
from dataclasses import dataclass, field
from typing import Optional

from openrlhf_async.utils.user_code import UserThreads, UserWorkers
from openrlhf_async.utils.user_files import import_user_file

# Plain def steps of one agent file running at once in the engine's process; a thread still running past its
# step's timeout keeps its place, so this many hung steps at once are needed to stall the others.
STEP_THREADS = 64
DEFAULT_AGENT = os.path.join(os.path.dirname(__file__), "math_single_turn.py")
CONTRACT = ("a module-level `step(state, action, label)` returning (reward, next_state, done, extra_info) "
            '(or OpenRLHF 0.8\'s dict {"rewards", "next_observation", "done", ...}), an OpenRLHF `AgentExecutor` '
            "class, or `async def run(client, model, prompt, label, **info)` returning the reward (OpenAI API)")
STEP_DICT_KEYS = ("rewards", "next_observation", "done")
# A request body field naming its episode on the engine's OpenAI endpoint, for agents that cannot choose their URL per
# episode (verifiers' proxy, agent/verifiers_env.py): the endpoint takes it out before vLLM reads the request.
EPISODE_FIELD = "openrlhf_episode"


def _stop_strings(value) -> bool:
    strings = [value] if isinstance(value, str) else value
    return isinstance(strings, (list, tuple)) and all(isinstance(s, str) and s for s in strings)


# What a step's sampling_params may set, each with the test of its value and what it expects. Temperature and top-p
# are not among them: the trainer scores every token at --rollout.temperature, so a turn sampled otherwise would be
# trained on the log-probs of another distribution.
TURN_SAMPLING = {
    "stop": (_stop_strings, "a non-empty string or a list of them"),
    "stop_token_ids": (lambda v: isinstance(v, (list, tuple)) and all(type(i) is int and i >= 0 for i in v),
                       "a list of token ids (whole numbers from 0)"),
    "max_tokens": (lambda v: type(v) is int and v >= 1, "a whole number from 1 (capped by the episode's budget)"),
}


class AgentFileError(ValueError):
    """The agent file is missing, does not import, or does not follow the contract."""


class AgentStepError(RuntimeError):
    """A step returned something that breaks the contract."""


@dataclass
class StepResult:
    reward: float
    next_state: str
    done: bool
    extra_info: dict = field(default_factory=dict)
    score: Optional[float] = None  # what the filter reads (OpenRLHF's "scores"); None: the episode's summed reward
    sampling_params: dict = field(default_factory=dict)  # vLLM settings for the episode's next turns; {}: as before
    # An OpenAI-API agent's reward per session (the X-Session-ID header its calls carried, as verifiers sends its
    # trace's id): {session: (seat, reward)}; each session's calls train on its reward, and calls of a session left
    # out are not trained. None: every call trains on the episode's reward.
    sessions: Optional[dict] = None


def _import_file(path: str):
    return import_user_file(path, "--train.agent_func_path", CONTRACT, AgentFileError, "openrlhf_async_agent")


def _number(value, what: str) -> float:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentStepError(f"step returned {what} {value!r}; expected a number")
    return float(value)


def check_step_result(value) -> StepResult:
    """A step's answer: this project's tuple, or OpenRLHF 0.8's dict (see the module's docstring)."""
    score, sampling = None, {}
    if isinstance(value, dict):
        missing = [key for key in STEP_DICT_KEYS if key not in value]
        if missing:
            raise AgentStepError(f"step returned a dict without {', '.join(map(repr, missing))}; expected OpenRLHF "
                                 '0.8\'s {"rewards", "next_observation", "done", "scores", "extra_logs"}')
        score = None if value.get("scores") is None else _number(value["scores"], "scores")
        sampling = _turn_sampling(value.get("sampling_params") or {})
        value = (value["rewards"], value["next_observation"], value["done"], value.get("extra_logs"))
    elif not isinstance(value, (tuple, list)) or len(value) != 4:
        raise AgentStepError(f"step returned {type(value).__name__}; expected a tuple "
                             "(reward, next_state, done, extra_info)")
    reward, next_state, done, extra = value
    if not isinstance(next_state, str):
        raise AgentStepError(f"step returned next_state of type {type(next_state).__name__}; expected str")
    return StepResult(_number(reward, "reward"), next_state, bool(done), dict(extra or {}), score, sampling)


def _turn_sampling(params) -> dict:
    """A step's sampling_params, checked here (vLLM would fail the whole group on a bad one), in the lists vLLM
    takes."""
    if not isinstance(params, dict):
        raise AgentStepError(f"step returned sampling_params of type {type(params).__name__}; expected a dict with "
                             f"keys among {', '.join(TURN_SAMPLING)}")
    params = {key: value for key, value in params.items() if value is not None}
    for key, value in params.items():
        if key not in TURN_SAMPLING:
            raise AgentStepError(f"step returned sampling_params {key!r}; a step may set {', '.join(TURN_SAMPLING)} "
                                 "(temperature and top_p stay the --rollout flags': the trainer scores every token "
                                 "with them)")
        if not TURN_SAMPLING[key][0](value):
            raise AgentStepError(f"step returned sampling_params {key} {value!r}; expected {TURN_SAMPLING[key][1]}")
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    return {key: list(value) if isinstance(value, tuple) else value for key, value in params.items()}


class StepAgent:
    """A step-file agent. An `async def` step runs on the engine's event loop; a plain `def` step runs in threads
    of its own in the engine's process (default), or in `workers` worker processes, where a hung step is killed."""

    kind = "step"

    def __init__(self, path: str, module, workers: int = 0):
        self.path, self.workers = path, workers
        self._step = module.step
        self._is_async = inspect.iscoroutinefunction(self._step)
        if workers:
            self._runner = UserWorkers(workers, _load_step, (path,), f"agent step ({path})")
        elif not self._is_async:
            self._runner = UserThreads(self._step, STEP_THREADS, f"plain def agent steps ({path})",
                                       "a thread cannot be killed: fix the hang, or run steps in processes with "
                                       "--agent.workers N, where a hung step is killed")
        else:
            self._runner = None

    async def step(self, state: str, action: str, label, timeout: float) -> StepResult:
        """One step under a timeout; raises TimeoutError, the step's own exception, or AgentStepError.
        In worker processes the timeout starts when a worker takes the step."""
        if self._runner is not None:
            return check_step_result(await self._runner.call(state, action, label, timeout=timeout))
        return check_step_result(await asyncio.wait_for(self._step(state, action, label), timeout))

    def close(self):
        if self._runner is not None:
            self._runner.close()


class OpenAIAgent:
    """An agent written against the OpenAI API (see the module's docstring); its episodes run in
    rollout/endpoint.py: run_openai_episode."""

    kind = "openai"

    def __init__(self, path: str, run):
        self.path, self._run = path, run

    async def run(self, client, model: str, prompt, label, **info) -> StepResult:
        return check_run_result(await self._run(client, model, prompt, label, **info))

    def close(self):
        pass


def check_run_result(value) -> StepResult:
    """An OpenAI-API agent's answer: its reward, or {"reward", "scores" (optional), "extra_logs" (optional)}."""
    score, extra = None, {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise AgentStepError(f"run returned a dict without 'reward' (keys: {', '.join(map(str, value))}); "
                                 'expected a number or {"reward", "scores", "extra_logs"}')
        score = None if value.get("scores") is None else _number(value["scores"], "scores")
        extra = dict(value.get("extra_logs") or {})
        value = value["reward"]
    reward = _number(value, "reward")
    return StepResult(reward, "", True, extra, reward if score is None else score)


class ExecutorAgent:
    """An OpenRLHF 0.11 agent file: its AgentExecutor drives generation through an engine adapter. An
    AgentInstance with an `async def __init__` (OpenRLHF's MultiTurnAgentExecutor cannot build one) is built with
    its __init__ awaited before the instance is used."""

    kind = "executor"

    def __init__(self, path: str, executor):
        self.path, self.executor = path, executor
        instance_cls = getattr(executor, "agent_instance_cls", None)
        if isinstance(instance_cls, type) and inspect.iscoroutinefunction(instance_cls.__init__):
            executor.agent_instance_cls = _awaiting_init(instance_cls)

    def close(self):
        pass


def _awaiting_init(cls: type) -> type:
    """A subclass of cls, whose __init__ is `async def`, that the executor can build without awaiting: building
    it keeps the coroutine __init__ returns, and its first reset or step awaits it."""

    class AwaitingInit(cls):
        def __init__(self, *args, **kwargs):
            self._pending_init = cls.__init__(self, *args, **kwargs)

        async def _initialised(self):
            pending, self._pending_init = self._pending_init, None
            if pending is not None:
                await pending

        async def reset(self, states: dict, **kwargs):
            await self._initialised()
            return await super().reset(states, **kwargs)

        async def step(self, states: dict, **kwargs):
            await self._initialised()
            return await super().step(states, **kwargs)

    AwaitingInit.__name__ = AwaitingInit.__qualname__ = cls.__name__
    return AwaitingInit


def _load_step(path: str):
    """The step function, as a worker process loads it."""
    return _import_file(path).step


def load_agent(path: str = "", workers: int = 0):
    """Load and check an agent file (the built-in single-turn math agent when path is empty)."""
    path = path or DEFAULT_AGENT
    module = _import_file(path)
    step = getattr(module, "step", None)
    executor_cls = getattr(module, "AgentExecutor", None)
    if callable(step):
        params = list(inspect.signature(step).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in params):
            raise AgentFileError(f"--train.agent_func_path {path}: step takes {len(positional)} arguments; expected "
                                 "step(state, action, label) returning (reward, next_state, done, extra_info)")
        return StepAgent(path, module, workers)
    run = getattr(module, "run", None)
    if inspect.iscoroutinefunction(run):
        if workers:
            raise AgentFileError(f"--agent.workers {workers}: an OpenAI-API agent ({path}) runs on the engine's event "
                                 "loop; use --agent.workers 0")
        return OpenAIAgent(path, run)
    if isinstance(executor_cls, type):
        if workers:
            raise AgentFileError(f"--agent.workers {workers}: an AgentExecutor file ({path}) drives the engine "
                                 "itself and runs in the engine's process; use --agent.workers 0")
        try:
            from openrlhf.utils.agent import AgentExecutorBase
        except ImportError as e:
            raise AgentFileError(f"--train.agent_func_path {path}: AgentExecutor files need openrlhf importable ({e})") from e
        if not issubclass(executor_cls, AgentExecutorBase):
            raise AgentFileError(f"--train.agent_func_path {path}: AgentExecutor must subclass "
                                 "openrlhf.utils.agent.AgentExecutorBase")
        try:
            executor = executor_cls()
        except Exception as e:
            raise AgentFileError(f"--train.agent_func_path {path}: AgentExecutor() failed ({type(e).__name__}: {e})") from e
        return ExecutorAgent(path, executor)
    if callable(run):
        raise AgentFileError(f"--train.agent_func_path {path}: run must be `async def run(client, model, prompt, "
                             "label, **info)` (the OpenAI client's calls are awaited)")
    if callable(getattr(module, "compute_score", None)) or callable(getattr(module, "reward_func", None)):
        raise AgentFileError(f"--train.agent_func_path {path}: is a reward file (compute_score or reward_func), not an "
                             f"agent; pass it as --reward.remote_url {path}")
    raise AgentFileError(f"--train.agent_func_path {path}: defines none of step, AgentExecutor and run; expected "
                         f"{CONTRACT}")
