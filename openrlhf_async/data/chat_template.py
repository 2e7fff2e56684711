"""The chat template's first render, bounded. A model folder's template is a program (Jinja in transformers' sandbox,
which stops escapes and range(10**9) but not nested loops or output without end), so before the prompts are
rendered with it, the first one is rendered in a forked child under a time and memory limit, and what the template
adds to it is measured."""

import os
import resource
import select
import signal

RENDER_TIMEOUT_S = 5.0
RENDER_MEMORY = 1 << 28  # address space the child may add to what it was forked with (one prompt needs KBs)
TEMPLATE_MAX_CHARS = 1 << 20  # what the template may add to the prompt's own text (roles, a system prompt)


def check_first_render(tokenizer, prompt, where: str) -> None:
    """ConfigError, one line naming where, when the template does not render prompt (text or messages) within
    RENDER_TIMEOUT_S and RENDER_MEMORY, fails to, or adds more than TEMPLATE_MAX_CHARS characters to it."""
    from openrlhf_async.errors import ConfigError

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    own = sum(len(m["content"]) for m in messages)
    result = _in_child(lambda: len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)))
    if result is None:
        raise ConfigError(f"{where}: the chat template rendered no first prompt within {RENDER_TIMEOUT_S:g} s; it "
                          "loops without end? Fix its chat_template, or leave --data.apply_chat_template off")
    if isinstance(result, str):
        raise ConfigError(f"{where}: the chat template fails to render the first prompt ({result}); fix its "
                          "chat_template, or leave --data.apply_chat_template off")
    if result - own > TEMPLATE_MAX_CHARS:
        raise ConfigError(f"{where}: the chat template adds {result - own:,} characters to the first prompt, more "
                          f"than the {TEMPLATE_MAX_CHARS:,} a template may; fix its chat_template, or leave "
                          "--data.apply_chat_template off")


def _in_child(render):
    """render()'s number from a forked child; the first line of what it raised, as text; None past the time bound."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's is flushed or cleaned up on the way out (os._exit)
        os.close(read_end)
        try:
            _limit_memory(RENDER_MEMORY)
            answer = str(render())
        except MemoryError:
            answer = f"!it needs more than {RENDER_MEMORY >> 20} MiB"
        except BaseException as e:
            answer = f"!{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        os.write(write_end, answer.encode())
        os._exit(0)
    os.close(write_end)
    try:
        if not select.select([read_end], [], [], RENDER_TIMEOUT_S)[0]:
            os.kill(pid, signal.SIGKILL)
            return None
        answer = os.read(read_end, 4096).decode() or "!the render died"  # killed by the kernel, say
        return answer[1:] if answer.startswith("!") else int(answer)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


def _limit_memory(extra: int) -> None:
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
