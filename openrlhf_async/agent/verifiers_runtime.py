"""verifiers' subprocess runtime, sandboxed. A verifiers environment runs programs in its seats' runtimes: a checker's
`python3 solution.py` on the model's answer, a harness's program. verifiers' own subprocess runtime runs them on the
host as the engine's user; here every command it runs goes through this project's bubblewrap sandbox
(agent/sandbox.py: run_command_async), with the runtime's working folder bound in as the command's one writable
place. Commands run as one process each (the sandbox's filter refuses new processes: `sh -c` pipelines and
`timeout` wrappers cannot fork), without network, under a wall-clock limit, a memory limit and the sandbox's other
limits. Live processes and background servers (tool servers placed in the runtime) are not offered: they would
outlive one command's sandbox.

install(mode) makes verifiers build this runtime wherever it provisions a subprocess one in this process (verifiers
has no registry of runtime types: its factory reads the class by name from its runtimes package)."""

import os

import verifiers.v1.runtimes as runtimes
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import ProgramResult, Runtime
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

from openrlhf_async.agent.sandbox import run_command_async

COMMAND_MEMORY_MB = 1024  # address space per command (an interpreter and a test's data)


class SandboxedRuntime(SubprocessRuntime):
    """SubprocessRuntime whose commands run in the sandbox; its file reads and writes stay inside its working folder
    (a link the model's program left there pointing outside is refused, not followed)."""

    timeout_s = 60.0  # a command's wall-clock limit (install sets it from --agent.step_timeout)
    mode = "bwrap"
    open_process = Runtime.open_process  # refused (NotImplementedError), and supports_live_processes says so
    run_background = Runtime.run_background

    async def start(self) -> None:
        await super().start()
        os.chmod(self.workdir, 0o777)  # an engine run by root runs each command as an unprivileged uid of its own

    async def run(self, argv: list, env: dict) -> ProgramResult:
        result = await run_command_async(argv, str(self.workdir), self.process_env(env), self.timeout_s,
                                         COMMAND_MEMORY_MB, mode=self.mode)
        stderr = result["stderr"]
        if result["timed_out"]:
            stderr += f"\nsandbox: the command ran past its {self.timeout_s:g} s (--agent.step_timeout)\n"
        return ProgramResult(exit_code=result["exit_code"] or 0, stdout=result["stdout"], stderr=stderr)

    async def alive(self) -> bool:
        # verifiers probes a runtime after a harness fails (e.g. on a request refused past the token budget); the host
        # folder is the runtime, with or without a sandbox to run `true` in.
        return self.workdir is not None and self.workdir.is_dir()

    def _inside(self, path: str) -> None:
        root = os.path.realpath(self.workdir)
        real = os.path.realpath(os.path.join(root, path))
        if real != root and not real.startswith(root + "/"):
            raise SandboxError(f"{path!r} resolves outside the runtime's working folder (to {real}); refused")

    async def _read(self, path: str, max_bytes: int = None) -> bytes:
        self._inside(path)
        return await super()._read(path, max_bytes)

    async def write(self, path: str, data: bytes) -> None:
        self._inside(path)
        await super().write(path, data)


def install(mode: str, timeout_s: float) -> None:
    """Every subprocess runtime verifiers makes in this process from now on: sandboxed (mode bwrap), or verifiers' own
    on the host (unsafe: the run accepted the risk with --agent.sandbox unsafe)."""
    SandboxedRuntime.timeout_s, SandboxedRuntime.mode = timeout_s, mode
    runtimes.SubprocessRuntime = SubprocessRuntime if mode == "unsafe" else SandboxedRuntime
