"""bernoulli_agent.py written against the OpenAI API: one text completion through the engine's endpoint, as long as
the episode's budget (EOS ignored, as the workload's direct requests), and a coin with the prompt's pass rate."""

import random


async def run(client, model, prompt, label, budget=None, **info):
    await client.completions.create(model=model, prompt=prompt, max_tokens=budget, extra_body={"ignore_eos": True})
    return float(random.random() < float(label))
