"""A math agent written against the OpenAI API: the model answers, and when its answer has no \\boxed{} it is asked
once more, in a second user turn. The training sample is the two replies exactly as vLLM sampled them, with the
reminder between them masked out.

Use: --train.agent_func_path agents/openai_chat_math.py --data.apply_chat_template

The contract (openrlhf_async/agent/__init__.py): `async def run(client, model, prompt, label, **info)`, where client
is an openai.AsyncOpenAI bound to this episode on the engine's OpenAI endpoint, model the name to pass it, prompt the
dataset's prompt (text or chat messages) and label its label; it returns the reward, or a dict with "reward" and
optionally "scores" and "extra_logs". An exception, or a run longer than --agent.step_timeout x --agent.max_steps,
scores the episode 0 and is counted."""

from openrlhf_async.reward.math_verify_reward import math_verify

REMINDER = "Put your final answer within \\boxed{}."


async def run(client, model, prompt, label, **info):
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    reply = (await client.chat.completions.create(model=model, messages=messages)).choices[0].message.content or ""
    asked_again = "\\boxed{" not in reply
    if asked_again:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": REMINDER}]
        reply = (await client.chat.completions.create(model=model, messages=messages)).choices[0].message.content or ""
    result = await math_verify(reply, label)  # in worker processes, timed out rather than hanging the engine
    return {"reward": result["score"], "extra_logs": {"accuracy": result["accuracy"], "asked_again": float(asked_again)}}
