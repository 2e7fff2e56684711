"""Evaluation on held-out problems: mean@k and pass@k over k samples per problem."""

import copy

import pytest

from openrlhf_async.data.prompts import tokenize_prompts
from openrlhf_async.data.synthetic import make_arithmetic_rows
from openrlhf_async.trainer.evaluate import eval_scores, evaluate


def test_mean_and_pass_at_k():
    scores = eval_scores([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert scores == {"eval/mean@4": pytest.approx(5 / 12), "eval/pass@4": pytest.approx(2 / 3),
                      "eval/accuracy": pytest.approx(5 / 12)}
    assert eval_scores([[1], [0]])["eval/pass@1"] == 0.5


def test_sampled_evaluation_on_the_engines(engines, stack_cfg, tiny_model_path):
    from transformers import AutoTokenizer

    rows = make_arithmetic_rows(24, seed=5, split="eval")
    prompts = tokenize_prompts(AutoTokenizer.from_pretrained(tiny_model_path), rows, apply_chat_template=True)
    greedy, groups = evaluate(stack_cfg, engines, prompts)
    assert [len(g) for g in groups] == [1] * len(prompts)
    assert greedy["eval/mean@1"] == greedy["eval/pass@1"] == greedy["eval/accuracy"]
    cfg = copy.deepcopy(stack_cfg)
    cfg.eval.n_samples_per_prompt, cfg.eval.temperature = 8, 1.0
    sampled, _ = evaluate(cfg, engines, prompts)
    # The warm-started model answers about half right greedily and samples the right answer often: drawing 8
    # samples solves more problems than one greedy answer, and each sample is right less often than pass@8.
    assert sampled["eval/mean@8"] < sampled["eval/pass@8"]
    assert sampled["eval/pass@8"] > greedy["eval/pass@1"]
