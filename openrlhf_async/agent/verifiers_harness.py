"""A verifiers (v1) harness that runs in the engine's process: a chat loop that sends the task's prompt, and on a
resumed episode (a multi-turn env's next user turn) the conversation so far, to the model through verifiers'
endpoint, and returns when the model has answered. verifiers' built-in `bash` and `null` harnesses install their
programs with `uv` from the network, which a training node may not reach; --agent.verifiers_env uses this one for a
seat that has no harness of the environment's own. Tasks with tool servers (MCP toolsets) need a harness of their own:
--agent.verifiers_env refuses them at start (agent/verifiers_env.py: verifiers' pairing check)."""

import verifiers.v1 as vf

__all__ = ["InProcessChatHarness"]


class InProcessChatHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt as a system message
    SUPPORTS_RESUME = True  # verifiers replays the accumulated conversation for a multi-turn env's next turn
    SUPPORTS_MCP = False
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        import openai

        from verifiers.v1.dialects.chat import message_to_wire

        if mcp_urls:
            return vf.ProgramResult(exit_code=1, stdout="", stderr="the in-process chat harness has no tools; the "
                                    "task's toolsets need a harness of the environment's own")
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        except openai.APIError as e:  # e.g. verifiers' proxy ending the rollout (its max_turns)
            return vf.ProgramResult(exit_code=1, stdout="", stderr=str(e))
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
