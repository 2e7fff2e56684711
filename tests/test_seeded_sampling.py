"""Seeded sampling on the real engines: a request with a seed samples the same tokens whichever engine takes it and
whatever shares its batch, and many seeded requests at once (more prompt tokens than one engine step takes, which
vLLM would split into prefill chunks) keep the engine alive."""

import ray

from openrlhf_async.rollout.seeds import derive_seed

SAMPLED = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}


def _prompt(i: int) -> list:
    return [3] + [20 + (i + j) % 60 for j in range(6)] + [4]


def test_a_seeded_request_samples_the_same_tokens_on_any_engine_in_any_company(engines):
    alone = [ray.get(engine.generate.remote(_prompt(1), {**SAMPLED, "seed": 11}, f"alone-{k}"))
             for k, engine in enumerate(engines)]
    assert alone[0]["response_ids"] == alone[1]["response_ids"]  # two engines, two engine seeds: the same tokens
    # The same request among 40 others, sent to the first engine at once.
    crowd = [engines[0].generate.remote(_prompt(i), {**SAMPLED, "seed": derive_seed(5, i)}, f"crowd-{i}")
             for i in range(40)]
    crowded = engines[0].generate.remote(_prompt(1), {**SAMPLED, "seed": 11}, "crowded")
    others = ray.get(crowd)
    assert ray.get(crowded)["response_ids"] == alone[0]["response_ids"]
    # Other seeds sample other answers: the seed is used, not ignored.
    assert len({tuple(o["response_ids"]) for o in others}) > 30
    # Requests without a seed are not given one seed: eight of the same prompt do not all sample the same 24 tokens.
    # Two may (past its end token the tiny model can be near-certain: two matched once in a combined run); eight
    # match only with that chance to the 7th power, or when every request gets the same seed.
    unseeded = ray.get([engines[0].generate.remote(_prompt(1), SAMPLED, f"free-{k}") for k in range(8)])
    assert len({tuple(o["response_ids"]) for o in unseeded}) > 1


def test_seeded_requests_whose_prompts_overflow_an_engine_step_keep_the_engine_alive(engines):
    # 96 prompts of 200 tokens: 19,200 prompt tokens arrive together, far more than one step schedules (2,048). With
    # prefills split into chunks, vLLM rewinds a seeded request's generator after a discarded chunk, which a CPU
    # generator cannot do: the engine died ("CPU Generator does not use offset").
    prompts = [[3] + [20 + (i * 7 + j) % 60 for j in range(198)] + [4] for i in range(96)]
    refs = [engines[1].generate.remote(p, {**SAMPLED, "max_tokens": 8, "seed": derive_seed(9, i)}, f"long-{i}")
            for i, p in enumerate(prompts)]
    outs = ray.get(refs)
    assert all(len(o["response_ids"]) == 8 and o["finish_reason"] == "length" for o in outs)
    again = ray.get(engines[1].generate.remote(prompts[0], {**SAMPLED, "max_tokens": 8, "seed": derive_seed(9, 0)},
                                               "long-again"))
    assert again["response_ids"] == outs[0]["response_ids"]
