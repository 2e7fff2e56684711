"""A `verifiers` environment as the agent (--agent.verifiers_env): verifiers 0.4's `verifiers.v1` API, where an
environment is a taskset (its tasks, scored by their own @vf.reward functions), a harness (the program that talks to
the model) and an env (how a task becomes an episode). Its episodes run against the engine's OpenAI endpoint, which
listens on loopback for them (verifiers forwards the harness's calls through a proxy of its own), each request
carrying its episode's key in the body (EPISODE_FIELD), so that its tokens are recorded for training as any
OpenAI-API agent's. Its tasks are the prompt dataset unless --data.prompt_dataset is given (a row's label: the
task's index).

An environment is an installed package's module id (as `verifiers.load_environment` takes it) or a .py file, imported
as the project imports users' files. The harness runs where the engine runs: verifiers' built-in `bash`/`null` harnesses install their
programs with `uv` from the network, and its default runtime is a hosted sandbox, so the runtime here is the local
subprocess one and the harness, for an environment that exports none, the in-process chat loop of
agent/verifiers_harness.py, unless --agent.verifiers_args says otherwise."""

import copy
import json
import os

from openrlhf_async.agent import EPISODE_FIELD, AgentFileError, StepResult
from openrlhf_async.utils.user_files import check_user_file, import_user_file

TASKS_MAX = 100_000  # tasks read of a taskset: its load() may yield for ever
KEY_VAR = "OPENRLHF_ASYNC_ENDPOINT_KEY"  # verifiers reads the endpoint's key from an environment variable
# The in-process harness's id: verifiers takes a plugin id for a top-level module name.
HARNESS_ID = "openrlhf_async_verifiers_harness"


def module_id(spec: str) -> str:
    """The environment's module id; a .py file is imported first (utils/user_files.py), under a name of its own."""
    if not spec.endswith(".py"):
        return spec
    # Checked in a child process first, as agent and reward files are: one that hangs or exits at import is an error.
    args = ("--agent.verifiers_env", "a verifiers environment exporting its Taskset in __all__", AgentFileError,
            "openrlhf_async_verifiers_env")
    check_user_file(spec, *args)
    return import_user_file(spec, *args).__name__


def _merged(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_env(spec: str, args: str = "{}"):
    """The environment of --agent.verifiers_env with --agent.verifiers_args merged into its config."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise AgentFileError(f"--agent.verifiers_env needs the verifiers package ({e}); run `make install`") from None
    from openrlhf_async.utils.json_text import loads

    try:
        extra = loads(args, "--agent.verifiers_args", AgentFileError)
    except json.JSONDecodeError as e:
        raise AgentFileError(f"--agent.verifiers_args is not JSON ({e})") from None
    if not isinstance(extra, dict):
        raise AgentFileError("--agent.verifiers_args: expected a JSON object (the environment's config)")
    import importlib
    import sys

    from verifiers.v1.utils.loaders import default_harness_id

    sys.modules.setdefault(HARNESS_ID, importlib.import_module("openrlhf_async.agent.verifiers_harness"))
    taskset = module_id(spec)
    base = {"taskset": {"id": taskset}, "agent": {"runtime": {"type": "subprocess"}}}
    try:
        if default_harness_id(taskset) == "bash":  # the environment exports no harness: the in-process one
            base["agent"]["harness"] = {"id": HARNESS_ID}
    except Exception as e:
        raise AgentFileError(f"--agent.verifiers_env {spec}: verifiers could not import it "
                             f"({type(e).__name__}: {e})") from None
    config = _merged(base, extra)
    try:
        return vf.load_environment(vf.resolve_env_config(config))
    except Exception as e:
        raise AgentFileError(f"--agent.verifiers_env {spec}: verifiers could not load it "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _message(m) -> dict:
    m = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
    return {"role": m["role"], "content": m.get("content") or ""}


def tasks(env) -> list:
    """The environment's tasks, at most TASKS_MAX (AgentFileError for more, or for a taskset that says it is
    infinite), so that an endless one is a line at start rather than a MemoryError."""
    import itertools

    bounded = getattr(env.taskset, "bounded", True)  # verifiers' own flag: INFINITE, less a view that caps it
    out = list(itertools.islice(env.taskset, TASKS_MAX + 1)) if bounded else None
    if out is None or len(out) > TASKS_MAX:
        raise AgentFileError(f"--agent.verifiers_env: its taskset yields more than {TASKS_MAX} tasks"
                             f"{'' if bounded else ' (it is INFINITE)'}; bound it (its load(), or a view such as "
                             ".take(N)) to at most that many")
    return out


def prompt_rows(env) -> list:
    """The environment's tasks as prompt rows: {"prompt": text or messages (its system prompt first), "label":
    the task's index}."""
    rows = []
    for i, task in enumerate(tasks(env)):
        prompt, system = task.data.prompt, getattr(task.data, "system_prompt", None)
        if not isinstance(prompt, str):
            prompt = [_message(m) for m in prompt or []]
        if system:
            prompt = [{"role": "system", "content": system}] + (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        rows.append({"prompt": prompt, "label": str(i)})
    return rows


class VerifiersAgent:
    """An OpenAI-API agent (rollout/endpoint.py: run_openai_episode) whose run is one verifiers episode of the task
    its label names, scored by the task's rewards (the trace's reward; its metrics logged)."""

    kind = "openai"
    needs_network = True  # the endpoint must listen: verifiers' proxy forwards over HTTP

    def __init__(self, spec: str, args: str = "{}"):
        self.path, self.env = spec, load_env(spec, args)
        self.tasks = tasks(self.env)
        self._serving = None

    async def run(self, client, model: str, prompt, label, episode: str = None, base_url: str = None,
                  **info) -> StepResult:
        import contextlib

        import verifiers.v1 as vf

        if self._serving is None:  # verifiers' proxy and shared tools, for the engine's life
            self._serving = contextlib.AsyncExitStack()
            await self._serving.enter_async_context(self.env.serving())
        os.environ.setdefault(KEY_VAR, "EMPTY")
        engine_url = base_url.split("/episodes/")[0] + "/v1"
        ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=engine_url, api_key_var=KEY_VAR),
                              sampling=vf.Sampling(**{EPISODE_FIELD: episode}))
        result = await self.env.run_episode(self.tasks[int(label)], ctx)
        trace = result.traces[-1]
        if not trace.ok and trace.errors:
            raise RuntimeError(f"the verifiers episode failed: {trace.errors[0]}")
        extra = {key: value for key, value in (trace.metrics or {}).items() if isinstance(value, (int, float))}
        reward = float(trace.reward)
        return StepResult(reward, "", True, {**extra, "turns": float(trace.num_turns)}, reward)

    def close(self):
        pass
