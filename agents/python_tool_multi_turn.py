"""Multi-turn math with a Python tool: the model may run code before it answers.

Use: --train.agent_func_path agents/python_tool_multi_turn.py --agent.max_steps 4 --agent.step_timeout 30
(with prompts that say e.g. "Use Python when it helps (write a ```python block); put your final answer within
\\boxed{}.").

Each turn the model writes an action; `step(state, action, label)` then either
- runs the last fenced ```python block of the action in the sandbox (openrlhf_async/agent/sandbox.py: bubblewrap,
  an unprivileged uid, no network, sees only its own processes, writes only in its own small tmpfs, bounded
  time, memory and processes; --agent.sandbox unsafe runs it without isolation) and returns its output as
  the observation, "\\n```output\\n...\\n```\\n" (stderr and tracebacks included, cut at MAX_OUTPUT characters,
  a timeout said in words), with reward 0 and done False, so the model continues after the output; or
- when the action has no code block (a final \\boxed{} answer, or nothing to run), or on the last turn, scores
  the action's answer with math-verify and ends the episode: reward 1.0 when it equals the label, else 0.0.

next_state is always state + action + observation: only the observation's tokens are appended to the episode,
masked out of the loss, and the model's own tokens keep their logprobs. The step keeps no state between calls:
everything it needs (the number of tool calls so far) is read back from the episode text.

Adapting it: change the observation format, the limits below, or the scoring; keep MAX_TURNS equal to
--agent.max_steps (the engine ends the episode there itself, and a turn that ran code would then end unscored),
and CODE_TIMEOUT well below --agent.step_timeout."""

import re

from openrlhf_async.agent.sandbox import run_python_async
from openrlhf_async.reward.math_verify_reward import math_verify

MAX_TURNS = 4  # = --agent.max_steps: the last turn is scored, not run
CODE_TIMEOUT = 5.0  # seconds of wall-clock time per code block
CODE_MEMORY_MB = 256  # enough for numpy and sympy
MAX_OUTPUT = 1024  # characters of output shown to the model

CODE_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)
OUTPUT_OPEN = "\n```output\n"


def tool_calls(state: str) -> int:
    """Code blocks run so far in this episode: each left an output block in the episode text (a prompt that
    shows output blocks itself would count too: change OUTPUT_OPEN then)."""
    return state.count(OUTPUT_OPEN)


def observation(result: dict) -> str:
    lines = [(result["stdout"] + result["stderr"]).strip("\n")]
    if result["truncated"]:
        lines.append("... (output truncated)")
    if result["timed_out"]:
        lines.append(f"TimeoutError: the code ran longer than {CODE_TIMEOUT:g} s and was stopped")
    elif result["exit_code"] is not None and result["exit_code"] < 0:
        lines.append(f"Killed by signal {-result['exit_code']} (a resource limit)")
    text = "\n".join(line for line in lines if line) or "(no output; print what you want to see)"
    return f"{OUTPUT_OPEN}{text}\n```\n"


async def step(state, action, label):
    calls = tool_calls(state)
    blocks = CODE_BLOCK.findall(action)
    if blocks and calls + 1 < MAX_TURNS:
        result = await run_python_async(blocks[-1], timeout=CODE_TIMEOUT, memory_mb=CODE_MEMORY_MB,
                                        max_output=MAX_OUTPUT)
        return 0.0, state + action + observation(result), False, {"tool_calls": calls + 1}
    scored = await math_verify(action, label)
    return scored["score"], state + action, True, {"accuracy": scored["accuracy"], "pred": scored["pred"],
                                                   "tool_calls": calls}
