import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from openrlhf_async.data.synthetic import (
    carry_slip_answer,
    make_arithmetic_rows,
    split_size,
    write_arithmetic_dataset,
)
from openrlhf_async.models.tiny import _teacher_rows, build_tiny_model, prompt_text

SMALL = dict(warm_steps=40)  # enough to make greedy outputs non-degenerate, fast to build
PROMPTS = ["12+3=", "57-8=", "90+9=", "33-0="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("cache")), **SMALL)


def _hf_greedy(path, prompts, max_new_tokens=8):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = tok(prompt_text(tok, p), return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def test_tokenizer_and_model_round_trip(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.eos_token_id != tok.pad_token_id
    text = prompt_text(tok, "12+34=")
    ids = tok.encode(text)
    assert len(ids) == 8  # <|user|> + 6 chars + <|assistant|>
    assert tok.decode(ids) == text
    answer = tok.encode("46") + [tok.eos_token_id]
    assert tok.decode(answer, skip_special_tokens=True) == "46"
    full = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}], tokenize=False
    )
    assert tok.encode(full) == ids + answer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    assert model.dtype == torch.float32
    assert all(len(o) > 0 for o in _hf_greedy(model_dir, PROMPTS[:2]))


def test_dataset_splits(tmp_path):
    train_path, eval_path = write_arithmetic_dataset(str(tmp_path), n_train=500, n_eval=100, seed=3)
    train = [json.loads(line) for line in open(train_path)]
    evals = [json.loads(line) for line in open(eval_path)]
    assert len(train) == 500 and len(evals) == 100
    for row in train + evals:
        assert set(row) == {"prompt", "label"}
        a, op, b = row["prompt"][:2], row["prompt"][2], row["prompt"][3:-1]
        assert str(int(a) + int(b) if op == "+" else int(a) - int(b)) == row["label"]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    # held-out pool is seed-independent: eval never meets train from any seed
    other = make_arithmetic_rows(1000, seed=7, split="train")
    assert not {r["prompt"] for r in other} & {r["prompt"] for r in evals}
    before = open(train_path).read() + open(eval_path).read()
    write_arithmetic_dataset(str(tmp_path), n_train=500, n_eval=100, seed=3)
    assert open(train_path).read() + open(eval_path).read() == before


def test_dataset_defaults_use_whole_splits(tmp_path):
    train_path, eval_path = write_arithmetic_dataset(str(tmp_path))
    train = [json.loads(line) for line in open(train_path)]
    evals = [json.loads(line) for line in open(eval_path)]
    assert len(train) == split_size("train") and len(evals) == split_size("eval")
    assert 150 <= len(evals) <= 220 and len(train) + len(evals) == 1800
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}


def test_carry_slip_teacher():
    assert carry_slip_answer("57+8=") == "55"  # forgot the carry (right: 65)
    assert carry_slip_answer("52-8=") == "54"  # forgot the borrow (right: 44)
    assert carry_slip_answer("95+7=") == "92"
    assert carry_slip_answer("12+3=") is None and carry_slip_answer("33-0=") is None
    rows = make_arithmetic_rows(1000, seed=0)
    carry = [r for r in rows if carry_slip_answer(r["prompt"]) is not None]
    assert 0.35 < len(carry) / len(rows) < 0.55
    noisy = _teacher_rows(carry, 0.65, random.Random(0))
    slipped = sum(n["label"] != r["label"] for n, r in zip(noisy, carry)) / len(carry)
    assert 0.55 < slipped < 0.75
    assert all(r["label"] == str(eval(r["prompt"][:-1])) for r in carry)  # source rows stay correct
    easy = [r for r in rows if carry_slip_answer(r["prompt"]) is None]
    assert _teacher_rows(easy, 1.0, random.Random(0)) == easy


def test_the_embedded_tokenizers_keep_every_printable_character_spaces_included():
    from openrlhf_async.models.tiny import embedded_model

    # AutoTokenizer loads a qwen2 folder as Qwen2Tokenizer (byte-level): text tasks must reach the model intact.
    text = "How many 'a' in \"a b\"? {x: [1, 2]} ~`|\\"
    for name in ("tiny-qwen2", "tiny-qwen2-rm"):
        tok = AutoTokenizer.from_pretrained(embedded_model(name))
        ids = tok.encode(text)
        assert len(ids) == len(text) and tok.unk_token_id not in ids, name
        assert tok.decode(ids) == text
        assert tok.encode("12+34=") == [tok.convert_tokens_to_ids(c) for c in "12+34="]  # the trained ids


def test_cache_reuses_folder(model_dir):
    cache_dir = os.path.dirname(model_dir)
    mtime = os.path.getmtime(os.path.join(model_dir, "model.safetensors"))
    assert build_tiny_model(cache_dir, **SMALL) == model_dir
    assert os.path.getmtime(os.path.join(model_dir, "model.safetensors")) == mtime
    assert build_tiny_model(cache_dir, warm_steps=0) != model_dir  # settings are part of the key
    assert build_tiny_model(cache_dir, warm_steps=0, teacher_carry_error=0.0) != build_tiny_model(
        cache_dir, warm_steps=0
    )
    assert not [d for d in os.listdir(cache_dir) if d.startswith(".tmp")]


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    path, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=8))
    print("RESULT" + json.dumps([[list(o.outputs[0].token_ids), o.outputs[0].text] for o in outs]))
    """
)


@pytest.mark.long  # 60 s; the weight-sync tests hold vLLM's log-probs to the trainer's on the same model in make test
def test_vllm_greedy_matches_hf(model_dir):
    """Starts a vLLM-CPU engine in a subprocess (vLLM spawns its own workers): text in, same tokens as HF."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, model_dir, json.dumps(PROMPTS)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    vllm_out = json.loads(lines[-1][len("RESULT"):])
    tok = AutoTokenizer.from_pretrained(model_dir)
    for (ids, text), hf_ids in zip(vllm_out, _hf_greedy(model_dir, PROMPTS)):
        hf_ids = hf_ids[: hf_ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in hf_ids else hf_ids
        assert ids == hf_ids
        assert text == tok.decode(ids, skip_special_tokens=True)


def test_the_embedded_models_are_the_shipped_bytes_and_a_changed_copy_is_refused(tmp_path, monkeypatch):
    from openrlhf_async.errors import ConfigError
    from openrlhf_async.models import tiny
    from openrlhf_async.models.tiny import EMBEDDED_DIGESTS, build_tiny_reward_model, folder_digest

    # The defaults are the shipped files, whatever the cache: nothing is trained on this machine.
    assert build_tiny_model(str(tmp_path / "cache")) == os.path.join(tiny.EMBEDDED_DIR, "tiny-qwen2")
    assert build_tiny_reward_model(str(tmp_path / "cache")) == os.path.join(tiny.EMBEDDED_DIR, "tiny-qwen2-rm")
    assert not (tmp_path / "cache").exists()
    assert EMBEDDED_DIGESTS == {
        "tiny-qwen2": "4dff33713594ff4e0fb7ad1c66135c3a75e5e890fa2343d9807473024525d8ed",
        "tiny-qwen2-rm": "7ec8d169aa1120f1bfdf38590785f65392e9bf050b3ad514383ab9643bb93326",
        "tiny-qwen3-moe": "6233b0067f3bb7b1228560c14d3213c93556ebe4ea7247fb24e7c453a6dfcbf7"}
    for name, digest in EMBEDDED_DIGESTS.items():
        assert folder_digest(os.path.join(tiny.EMBEDDED_DIR, name)) == digest
    # A copy whose weights changed by one byte is refused in one line naming the folder and the fix.
    import shutil

    copy = tmp_path / "embedded"
    shutil.copytree(tiny.EMBEDDED_DIR, copy)
    weights = copy / "tiny-qwen2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(tiny, "EMBEDDED_DIR", str(copy))
    with pytest.raises(ConfigError) as refused:
        build_tiny_model(str(tmp_path / "cache"))
    message = str(refused.value)
    assert "\n" not in message and str(copy / "tiny-qwen2") in message and "git checkout" in message
    assert build_tiny_reward_model(str(tmp_path / "cache")) == str(copy / "tiny-qwen2-rm")  # untouched: still used


def test_a_request_seed_depends_on_its_place_alone():
    from openrlhf_async.rollout.seeds import derive_seed, seeded

    # The same in every process (no salted hash) and on every machine: fixed values.
    assert derive_seed(42, "position", 0) == 8301616619757517336
    seeds = {derive_seed(s, "position", p) for s in (42, 43) for p in range(1000)}
    assert len(seeds) == 2000
    base = {"temperature": 1.0, "seed": 7}
    assert seeded(base, "sample", 1) == {"temperature": 1.0, "seed": derive_seed(7, "sample", 1)}
    assert seeded(base, "sample", 1) != seeded(base, "sample", 2) and base["seed"] == 7
    assert seeded({"temperature": 1.0}, "sample", 1) == {"temperature": 1.0}  # no seed: vLLM's own
