"""User agents: a step file (`step(state, action, label) -> (reward, next_state, done, extra_info)`) or an
OpenRLHF 0.11 agent file (`AgentExecutor` built on `openrlhf.utils.agent`).

The step contract, as this project defines it:
- `state`: the episode's text so far (the prompt, then every action and observation), as the model sees it;
- `action`: the text the model has just written (special tokens such as EOS left out);
- `label`: the prompt's label from the dataset;
- returns `reward` (a number; an episode's reward is the sum over its steps), `next_state` (the new episode text:
  `state + action + observation`, of which only the new observation is tokenised and appended; ignored when
  done), `done` (bool) and `extra_info` (a dict, logged).
`step` may be `async def` (run on the engine's event loop) or a plain `def` (run off the loop, in threads of its
own or, with --agent.workers N, in worker processes)."""

import asyncio
import inspect
import os
from dataclasses import dataclass, field

from openrlhf_async.utils.user_code import UserThreads, UserWorkers
from openrlhf_async.utils.user_files import import_user_file

# Plain def steps of one agent file running at once in the engine's process; a thread still running past its
# step's timeout keeps its place, so this many hung steps at once are needed to stall the others.
STEP_THREADS = 64
DEFAULT_AGENT = os.path.join(os.path.dirname(__file__), "math_single_turn.py")
CONTRACT = ("a module-level `step(state, action, label)` returning (reward, next_state, done, extra_info), "
            "or an OpenRLHF `AgentExecutor` class")


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


def _import_file(path: str):
    return import_user_file(path, "--train.agent_func_path", CONTRACT, AgentFileError, "openrlhf_async_agent")


def check_step_result(value) -> StepResult:
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise AgentStepError(f"step returned {type(value).__name__}; expected a tuple "
                             "(reward, next_state, done, extra_info)")
    reward, next_state, done, extra = value
    if hasattr(reward, "item"):
        reward = reward.item()
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise AgentStepError(f"step returned reward {reward!r}; expected a number")
    if not isinstance(next_state, str):
        raise AgentStepError(f"step returned next_state of type {type(next_state).__name__}; expected str")
    return StepResult(float(reward), next_state, bool(done), dict(extra or {}))


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


class ExecutorAgent:
    """An OpenRLHF 0.11 agent file: its AgentExecutor drives generation through an engine adapter."""

    kind = "executor"

    def __init__(self, path: str, executor):
        self.path, self.executor = path, executor

    def close(self):
        pass


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
    raise AgentFileError(f"--train.agent_func_path {path}: defines neither step nor AgentExecutor; expected {CONTRACT}")
