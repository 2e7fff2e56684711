"""A vLLM engine actor killed mid-rollout on the real stack: its groups rerun on the surviving engine and the batch
completes. The victim is an engine of its own (the session's engines are shared with other tests); the survivor is
one of the session's."""

import copy
import itertools
import threading
import time

import ray

from conftest import unfinished
from openrlhf_async.config import config_with
from openrlhf_async.data.prompts import tokenize_prompts
from openrlhf_async.data.synthetic import make_arithmetic_rows
from openrlhf_async.rollout.controller import RolloutController
from openrlhf_async.rollout.engine import create_engines


def test_killing_an_engine_mid_rollout_reroutes_its_groups(ray_cluster, stack_cfg, tiny_model_path, engines):
    from transformers import AutoTokenizer

    cfg = copy.deepcopy(stack_cfg)
    cfg.vllm.num_engines = 1
    engines = [engines[0], create_engines(cfg, tiny_model_path)[0]]
    rows = make_arithmetic_rows(16, seed=5, split="train")
    prompts = itertools.cycle(tokenize_prompts(AutoTokenizer.from_pretrained(tiny_model_path), rows,
                                               apply_chat_template=True))
    cfg = config_with(cfg, rollout={"n_samples_per_prompt": 4, "max_new_tokens": 150},
                      algo={"dynamic_filtering_enable": False})
    controller = RolloutController(cfg, engines, sampling={"temperature": 1.0, "ignore_eos": True})
    result = {}

    def rollout():
        try:
            result["out"] = controller.run(lambda: next(prompts), target=8)
        except BaseException as e:  # reraised below, in the test's thread
            result["error"] = e

    thread = threading.Thread(target=rollout)
    try:
        thread.start()
        deadline = time.monotonic() + 120
        while unfinished(engines[1])["actor"] == 0:  # wait until groups are generating on the victim
            assert time.monotonic() < deadline, "no group reached the second engine"
            time.sleep(0.05)
        ray.kill(engines[1])
        thread.join(timeout=300)
        assert not thread.is_alive(), "the rollout hung after an engine died"
        if "error" in result:
            raise result["error"]
        groups, m = result["out"]
        assert len(groups) == 8 and all(len(g) == 4 for g in groups)
        assert m["rollout/engine_failures"] == 1 and m["rollout/groups_rerouted"] >= 1
        assert controller.dead_engines == {1} and list(controller.balancer.loads.values()) == [0, 0]
        assert unfinished(engines[0]) == {"vllm": 0, "actor": 0}
    finally:
        thread.join(timeout=300)
        ray.kill(engines[1])  # a second kill is a no-op
