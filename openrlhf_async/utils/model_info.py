"""What the config's checks learn about a model path without loading or converting the model: whether it is a GGUF
file, a GGUF file's context length (from its metadata), the embedded tiny model's positions. Building the tiny model
and converting a GGUF file are models/'s (tiny.py, gguf.py), which read these too."""

import functools
import json
import os

TINY_MAX_POSITIONS = 256  # the embedded tiny model's max_position_embeddings (models/tiny.py builds it)
# Shipped models --actor.model_name_or_path takes by name (models/tiny.py): the tiny mixture of experts.
EMBEDDED_MODELS = ("tiny-qwen3-moe",)
EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "embedded")


# The most a model's config.json may declare of each size; the largest published models stay far below (Llama 3.1
# 405B: hidden 16384, 126 layers, 128 heads, MLP 53248; DeepSeek-V3: 256 experts; Gemma 3: 262144 tokens). A size
# past it is a broken or hostile config, which the memory plan and transformers' config classes (a list per layer)
# would otherwise take as is.
SIZE_MAX = {"hidden_size": 1 << 17, "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12,
            "num_key_value_heads": 1 << 12, "head_dim": 1 << 14, "intermediate_size": 1 << 20, "vocab_size": 1 << 24,
            "num_experts": 1 << 14, "num_local_experts": 1 << 14,
            "n_routed_experts": 1 << 14, "num_experts_per_tok": 1 << 14, "moe_intermediate_size": 1 << 20,
            "shared_expert_intermediate_size": 1 << 20, "decoder_sparse_step": 1 << 12}
# Sizes every decoder has above 0; the others may be 0 (unset: a default, or none of that part).
POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def check_sizes(config, where: str) -> None:
    """ConfigError naming where and the field for a declared size (SIZE_MAX) that is no whole number from 1 (0 for
    an optional one) to its bound; a multimodal config's text_config too. A missing size is left to the reader."""
    from openrlhf_async.errors import ConfigError

    text = config.get("text_config") if isinstance(config, dict) else None
    for part in [c for c in (config, text) if isinstance(c, dict)]:
        for field, most in SIZE_MAX.items():
            value, least = part.get(field), 1 if field in POSITIVE else 0
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not least <= value <= most):
                raise ConfigError(f"{where}: {field} {json.dumps(value)[:40]} is no size from {least} to {most:,}; "
                                  "give the model's own config.json")


def is_embedded(model: str) -> bool:
    """Whether --actor.model_name_or_path names a shipped model: nothing (the tiny Qwen2), one by name, or its
    folder."""
    folder = os.path.abspath(model or "")
    return not model or model in EMBEDDED_MODELS or (
        os.path.dirname(folder) == EMBEDDED_DIR and os.path.basename(folder) in ("tiny-qwen2", *EMBEDDED_MODELS))


def is_gguf(path: str) -> bool:
    return bool(path) and path.lower().endswith(".gguf")


def gguf_context_length(path: str) -> int:
    """The model's context length, from the file's metadata ("<architecture>.context_length")."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch = bytes(gguf_value(fields["general.architecture"])).decode()
    return int(gguf_value(fields[f"{arch}.context_length"])[0])


def gguf_value(field):
    """A GGUF metadata field's value (as the reader's array: one number, or a string's bytes)."""
    return field.parts[field.data[0]]


@functools.lru_cache(maxsize=8)
def linear_layers(model):
    """The dotted names of the model's linear layers (what LoRA adapts), from its config built on the meta device
    (no weights read); None where the config cannot be read or built."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = model_config(model)
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    except Exception:  # an offline hub, a model type transformers lacks: the names are checked when it loads
        return None
    return tuple(name for name, module in net.named_modules() if isinstance(module, torch.nn.Linear))


def model_config(model) -> dict:
    """The model's config.json as a dict: the embedded tiny model's, a folder's, a GGUF file's or a hub id's."""
    if not model or model in EMBEDDED_MODELS:  # a shipped model: its folder
        model = os.path.join(EMBEDDED_DIR, model or "tiny-qwen2")
    if os.path.isdir(model):
        from openrlhf_async.utils.json_text import loads

        with open(os.path.join(model, "config.json"), "rb") as f:
            config = loads(f.read(), f"{model}: config.json")
        check_sizes(config, f"{model}: config.json")
        return config
    from transformers import AutoConfig

    if is_gguf(model):
        return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(model)),
                                          gguf_file=os.path.basename(model)).to_dict()
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True).to_dict()
    except OSError:
        if os.environ.get("HF_HUB_OFFLINE", "").strip() not in ("", "0"):
            raise
        import socket

        socket.create_connection(("huggingface.co", 443), timeout=3).close()  # an offline login node fails fast
        return AutoConfig.from_pretrained(model).to_dict()


# Mixtures of experts whose fused experts (transformers 5: experts.gate_up_proj [experts, 2 x size, hidden], gate
# rows first; experts.down_proj [experts, hidden, size]) vLLM loads as experts.{e}.gate_proj/up_proj/down_proj.
MOE_TYPES = ("qwen2_moe", "qwen3_moe")


def _text_config(model) -> dict:
    """The model's config (a multimodal one's text_config), {} where it cannot be read here (an offline hub id: read
    again, with a clear error, where the model is needed)."""
    try:
        config = model_config(model)
    except Exception:
        return {}
    return config.get("text_config") or config


def model_config_type(model) -> str:
    return _text_config(model).get("model_type", "")


def model_experts(model) -> int:
    """The experts per layer of a mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral: num_experts or
    num_local_experts in its config), 0 for a dense model or one whose config cannot be read here."""
    config = _text_config(model)
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)
