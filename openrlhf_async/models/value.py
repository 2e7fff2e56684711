"""A value model as OpenRLHF defines its critic and reward models: a causal LM's body with a linear head of one output.

Its files are OpenRLHF's: the body's weights under its own prefix (`model.`), the head's under --ds.value_head_prefix
(`score.weight`), and for a reward model trained with normalisation its `normalize_reward`, `mean` and `std` in
config.json."""

import json
import os

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ValueModel(torch.nn.Module):
    """body (a transformers base model: the causal LM without its output layer) and a linear head of one output
    named head_prefix: one value per position."""

    def __init__(self, body, head_prefix: str = "score"):
        super().__init__()
        self.body_prefix, self.head_prefix, self.config = body.base_model_prefix, head_prefix, body.config
        setattr(self, self.body_prefix, body)
        dtype = next(body.parameters()).dtype
        setattr(self, head_prefix, torch.nn.Linear(body.config.hidden_size, 1, bias=False, dtype=dtype))

    @property
    def body(self):
        return getattr(self, self.body_prefix)

    @property
    def head(self):
        return getattr(self, self.head_prefix)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        """kwargs: on to the body's attention (trainer/sequence_parallel.py's segments)."""
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=use_cache, **kwargs).last_hidden_state
        return self.head(hidden).squeeze(-1)

    def save(self, path: str, state: dict) -> None:
        """The model in OpenRLHF's format (state: the full weights by name, gathered)."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        self.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})


def _stored_head(model_path, name: str):
    """The head's weight stored in the model's folder (a critic's or a reward model's), or None (a causal LM)."""
    from safetensors import safe_open

    if not isinstance(model_path, str) or not os.path.isdir(model_path):
        return None
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            file = json.load(f)["weight_map"].get(name)
    else:
        file = "model.safetensors" if os.path.isfile(os.path.join(model_path, "model.safetensors")) else None
    if file is None:
        return None
    with safe_open(os.path.join(model_path, file), "pt") as f:
        return f.get_tensor(name) if name in f.keys() else None


def build_value_model(model_path, load: dict, head_prefix: str = "score") -> ValueModel:
    """The value model from a folder (a causal LM's: its head starts at random, normal with std 1 / (hidden + 1) as
    OpenRLHF's; a critic's or reward model's: its stored head), or a transformers config's shape at random."""
    from transformers import AutoModel, PretrainedConfig

    if isinstance(model_path, PretrainedConfig):
        body = AutoModel.from_config(model_path, **load)
    else:
        body = AutoModel.from_pretrained(model_path, **load)
    model = ValueModel(body, head_prefix)
    stored = _stored_head(model_path, f"{head_prefix}.weight")
    with torch.no_grad():
        if stored is not None:
            model.head.weight.copy_(stored.reshape(model.head.weight.shape))
        else:
            model.head.weight.normal_(mean=0.0, std=1 / (body.config.hidden_size + 1))
    return model
