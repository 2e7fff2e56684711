"""A `verifiers` environment as the agent (--agent.verifiers_env): verifiers 0.4's `verifiers.v1` API, where an
environment is a taskset (its tasks, scored by their own @vf.reward functions), its seats (each an AgentConfig field
of the env's config: `agent` for a plain taskset, `player0`/`player1` or `golfer` for an env of its own: who plays,
with which harness and runtime) and an env (how a task becomes an episode: which seats play, in what order, how
their outcome is judged). Its episodes run against the engine's OpenAI endpoint, which listens on loopback for them
(verifiers forwards the harnesses' calls through a proxy of its own), each request carrying its episode's key in the
body (EPISODE_FIELD) and its trace's id in verifiers' X-Session-ID header, so that every trace's tokens are recorded
for training as any OpenAI-API agent's, and trained with that trace's own reward (a seat of a zero-sum game on its
own payoff, an attempt on its own score). Its tasks are the prompt dataset unless --data.prompt_dataset is given (a
row's label: the task's index), the first --agent.verifiers_max_tasks of them.

An environment is an installed package's module id (as `verifiers.load_environment` takes it) or a .py file, imported
as the project imports users' files. The harness runs where the engine runs: verifiers' built-in `bash`/`null`
harnesses install their programs with `uv` from the network, and a seat's default runtime is a hosted sandbox, so
every seat gets the local subprocess runtime, whose commands run in this project's sandbox (agent/verifiers_runtime.py)
unless --agent.sandbox unsafe, and a seat with no harness of the environment's own gets the in-process chat loop of
agent/verifiers_harness.py, unless --agent.verifiers_args says otherwise."""

import contextlib
import copy
import json
import os
import sys
import tempfile

from openrlhf_async.agent import EPISODE_FIELD, AgentFileError, StepResult
from openrlhf_async.utils.user_files import check_user_file, import_user_file

KEY_VAR = "OPENRLHF_ASYNC_ENDPOINT_KEY"  # verifiers reads the endpoint's key from an environment variable
# The in-process harness's id: verifiers takes a plugin id for a top-level module name.
HARNESS_ID = "openrlhf_async_verifiers_harness"
NETWORK_HARNESSES = ("bash", "null")  # verifiers' built-ins that install their programs from the network
# verifiers' errors of the environment's own code (its task's setup, finalize or scoring, its env's hooks), of its
# runtime, or of the way to the model (a ProviderError of status 5xx, or none: a dropped connection): a trace that
# ends so has no reward the environment meant. A refused request (4xx, e.g. past the token budget) is the model's.
ENVIRONMENT_ERRORS = ("TaskError", "EnvError", "SandboxError", "ToolsetError", "InterceptionError", "TunnelError")


def _not_the_models(error) -> bool:
    return error.type in ENVIRONMENT_ERRORS or (error.type == "ProviderError" and (error.status_code or 500) >= 500)


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


def cause(e: Exception) -> str:
    """What went wrong, in one line: a pydantic ValidationError's first error (its field and message; its own first
    line only counts them), else the message's first line."""
    try:
        first = e.errors()[0]
        return f"{type(e).__name__}: {'.'.join(map(str, first['loc'])) or 'config'}: {first['msg']}"
    except Exception:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def missing(e: Exception) -> str:
    """cause(e), or for data NLTK could not find (it downloads on first use, which fails offline) which, and how to
    install it ahead of time."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # NLTK's versions colour the name, or quote it
    found = re.search(r"Resource '?([\w./-]+)'? not found", text) if isinstance(e, LookupError) else None
    if found is None:
        return cause(e)
    return (f"NLTK's {found.group(1)!r} data is missing and could not be downloaded; install it ahead of time with "
            f"`python -m nltk.downloader {found.group(1)}`, into a folder NLTK searches (~/nltk_data, or $NLTK_DATA)")


def seats(config_cls) -> dict:
    """The seats of an env config class, in declaration order: {name: its declared AgentConfig} (verifiers makes a
    seat of every field whose default is an AgentConfig)."""
    import verifiers.v1 as vf

    return {name: f.default for name, f in config_cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)}


def _seat_defaults(declared: dict, default_harness: str) -> dict:
    """What this project sets in every seat: the subprocess runtime, and the in-process harness where the seat would
    run one of verifiers' network-installed ones."""
    out = {}
    for name, agent in declared.items():
        harness = agent.harness.id if agent.harness is not None else default_harness
        out[name] = {"runtime": {"type": "subprocess"},
                     **({"harness": {"id": HARNESS_ID}} if harness in NETWORK_HARNESSES else {})}
    return out


def load_env(spec: str, args: str = "{}", sandbox: str = "bwrap"):
    """The environment of --agent.verifiers_env with --agent.verifiers_args merged into its config, checked: every
    seat's runtime is one this project sandboxes (or --agent.sandbox unsafe), and every seat's harness can serve the
    tasks (verifiers' own pairing check: tools, containers)."""
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

    from verifiers.v1.utils.loaders import default_harness_id, env_config_type

    sys.modules.setdefault(HARNESS_ID, importlib.import_module("openrlhf_async.agent.verifiers_harness"))
    taskset = module_id(spec)
    try:
        with _held_output():
            declared = seats(env_config_type(taskset, str(extra.get("id") or "")))
            base = {"taskset": {"id": taskset}, **_seat_defaults(declared, default_harness_id(taskset))}
    except Exception as e:
        raise AgentFileError(f"--agent.verifiers_env {spec}: verifiers could not import it ({missing(e)})") from None
    config = _merged(base, extra)
    names = ", ".join(declared) or "none"
    for name in declared:  # (a malformed seat is verifiers' to refuse, below)
        runtime = config[name].get("runtime") if isinstance(config.get(name), dict) else None
        if isinstance(runtime, dict) and runtime.get("type", "subprocess") != "subprocess" and sandbox != "unsafe":
            raise AgentFileError(f"--agent.verifiers_args: seat {name!r} asks for the {runtime['type']} runtime, which "
                                 "this project's sandbox does not hold; leave the seat's runtime out (the subprocess "
                                 "runtime, sandboxed with bwrap) or pass --agent.sandbox unsafe")
    try:
        with _held_output():
            env = vf.load_environment(vf.resolve_env_config(config))
    except Exception as e:
        raise AgentFileError(f"--agent.verifiers_env {spec}: verifiers could not load it ({missing(e)}; its seats: "
                             f"{names}; --agent.verifiers_args addresses them by name)") from None
    _check_pairing(env, spec)
    return env


def _check_pairing(env, spec: str) -> None:
    """verifiers' check of each seat's harness against the tasks, at start rather than in every episode."""
    from verifiers.v1.utils.compile import validate_pairing
    from verifiers.v1.utils.loaders import load_harness

    task_cls = type(env.taskset).task_type()
    tools = [*task_cls.toolsets(env.taskset.config.task), *env.taskset.toolsets(env.taskset.config)]
    for name, harness_config in env.config.agent_harnesses().items():
        harness = load_harness(harness_config)
        if tools and not harness.SUPPORTS_MCP:
            raise AgentFileError(f"--agent.verifiers_env {spec}: its tasks use MCP tools ({len(tools)} tool "
                                 f"server(s)), which the harness of seat {name!r} ({harness_config.id}) does not "
                                 "serve (this project's in-process chat harness has no tools); give the seat a "
                                 "harness of the environment's own that supports MCP (--agent.verifiers_args) or use "
                                 "tasks without tools")
        try:
            validate_pairing(harness, task_cls, getattr(env.config, name).runtime, tools=tools)
        except ValueError as e:
            raise AgentFileError(f"--agent.verifiers_env {spec}: seat {name!r}: {cause(e)}") from None


def _message(m) -> dict:
    m = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
    return {"role": m["role"], "content": m.get("content") or ""}


def tasks(env, max_tasks: int) -> list:
    """The environment's first max_tasks tasks (--agent.verifiers_max_tasks): an endless taskset is read that far and
    no further, in the dry run and in every engine alike."""
    import itertools

    name = getattr(getattr(env.config, "taskset", None), "id", None) or type(env.taskset).__name__
    try:
        with _held_output():
            out = list(itertools.islice(env.taskset, max_tasks))
    except Exception as e:
        raise AgentFileError(f"--agent.verifiers_env {name}: its tasks could not be read ({missing(e)})") from None
    if not out:
        raise AgentFileError("--agent.verifiers_env: its taskset yields no task")
    return out


@contextlib.contextmanager
def _held_output():
    """What the taskset prints while it loads, shown once it loaded and dropped when it failed (then the error says
    what went wrong in one line): at the descriptors, since NLTK prints its download banners to the stderr it was
    imported with."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    ok = False
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            if ok:
                sink.seek(0)
                sys.stderr.write(sink.read().decode(errors="replace"))


def prompt_rows(env, max_tasks: int) -> list:
    """The environment's tasks as prompt rows: {"prompt": text or messages (its system prompt first), "label": the
    task's index}. A task without a prompt (its environment opens the conversation) gets a line naming it."""
    rows = []
    for i, task in enumerate(tasks(env, max_tasks)):
        prompt, system = task.data.prompt, getattr(task.data, "system_prompt", None)
        if not prompt:
            prompt = f"{task.data.name or task.data.id or f'task {i}'} (the environment opens the conversation)"
        if not isinstance(prompt, str):
            prompt = [_message(m) for m in prompt]
        if system:
            prompt = [{"role": "system", "content": system}] + (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        rows.append({"prompt": prompt, "label": str(i)})
    return rows


def episode_failure(episode):
    """verifiers' own error (one line) when an episode is no result: its env's run() or finalize() raised, it ran
    no agent, or a trace failed on the environment's side (ENVIRONMENT_ERRORS). None when its rewards are the
    environment's judgement: a seat that failed on the model's side (a request refused past the token budget) keeps
    the outcome the environment gave it, e.g. a forfeit."""
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors if _not_the_models(e))]
    if errors:
        lines = [line.strip() for line in (errors[0].message or "").splitlines() if line.strip()]
        return f"{errors[0].type}: {lines[0] if lines else 'no message'}"
    return None if episode.traces else "the environment ran no agent"


def episode_result(episode, seat_order: list) -> StepResult:
    """The episode's rewards as verifiers computed them: each trainable trace's own (`sessions`: its id, which its
    model calls carried, -> (its seat, its reward)), and as the episode's reward (what the dynamic filter and the
    logs read) the last trace of the first seat that played. Its traces' numeric metrics and turns are logged."""
    trainable = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
    order = {name: i for i, name in enumerate(seat_order)}
    first = min((t.agent.name for t in trainable), key=lambda name: order.get(name, len(order)))
    own = [t for t in trainable if t.agent.name == first][-1]
    extra = {key: value for key, value in (own.metrics or {}).items() if isinstance(value, (int, float))}
    extra["turns"] = float(episode.num_turns)
    if len(seat_order) > 1:  # each seat's mean reward, logged as rollout/extra/reward_<seat>
        for name in {t.agent.name for t in trainable}:
            mine = [float(t.reward) for t in trainable if t.agent.name == name]
            extra[f"reward_{name}"] = sum(mine) / len(mine)
    reward = float(own.reward)
    sessions = {t.id: (t.agent.name, float(t.reward)) for t in episode.traces if t.agent.trainable}
    return StepResult(reward, "", True, extra, reward, sessions=sessions)


class VerifiersAgent:
    """An OpenAI-API agent (rollout/endpoint.py: run_openai_episode) whose run is one verifiers episode of the task
    its label names: each trace's calls train on that trace's reward (episode_result); an episode that failed fails
    with verifiers' own error (episode_failure)."""

    kind = "openai"
    needs_network = True  # the endpoint must listen: verifiers' proxy forwards over HTTP

    def __init__(self, spec: str, args: str = "{}", max_tasks: int = 1000, sandbox: str = "bwrap",
                 command_timeout: float = 60.0):
        from openrlhf_async.agent.verifiers_runtime import install

        install(sandbox, command_timeout)
        self.path, self.env = spec, load_env(spec, args, sandbox)
        self.tasks = tasks(self.env, max_tasks)
        self.seats = list(seats(type(self.env.config)))
        self._serving = None

    async def run(self, client, model: str, prompt, label, episode: str = None, base_url: str = None,
                  **info) -> StepResult:
        import contextlib

        import verifiers.v1 as vf

        index = int(label) if str(label).isdigit() else -1
        if not 0 <= index < len(self.tasks):
            raise ValueError(f"label {label!r} names no task of --agent.verifiers_env (its first {len(self.tasks)} "
                             "were read, --agent.verifiers_max_tasks): a label is a task's index")
        if self._serving is None:  # verifiers' proxy and shared tools, for the engine's life
            self._serving = contextlib.AsyncExitStack()
            await self._serving.enter_async_context(self.env.serving())
        os.environ.setdefault(KEY_VAR, "EMPTY")
        engine_url = base_url.split("/episodes/")[0] + "/v1"
        ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=engine_url, api_key_var=KEY_VAR),
                              sampling=vf.Sampling(**{EPISODE_FIELD: episode}))
        result = await self.env.run_episode(self.tasks[index], ctx)
        failure = episode_failure(result)
        if failure:
            raise RuntimeError(f"the verifiers episode failed: {failure}")
        return episode_result(result, self.seats)

    def close(self):
        pass
