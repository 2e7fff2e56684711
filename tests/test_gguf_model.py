"""A model published as a GGUF file becomes an ordinary HF folder once, cached by the file's content, and a run
takes the file itself. The file is the real SmolLM2-135M-Instruct from the PyPI wheel that `make test` fetches."""

import os

import pytest

from openrlhf_async.config import ConfigError, default_cache_dir, preset_config, validate
from openrlhf_async.models.gguf import DONE, _parsed_once, hf_folder, special_token_ids


def test_the_converted_folder_is_the_pretrained_chat_model_and_is_converted_once(smollm2, smollm2_gguf):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.vocab_size) == (
        30, 576, 3, 49152)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in chat
    assert chat.endswith("<|im_start|>assistant\n")
    # De-quantised right, the pretrained model answers; a wrong conversion makes noise.
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    ids = tokenizer(chat, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])

    weights = [os.path.join(smollm2, f) for f in os.listdir(smollm2) if f.endswith(".safetensors")]
    stamps = [os.path.getmtime(f) for f in weights]
    assert hf_folder(smollm2_gguf, default_cache_dir()) == smollm2
    assert [os.path.getmtime(f) for f in weights] == stamps  # not converted again
    assert os.path.isfile(os.path.join(smollm2, DONE))


def test_a_run_takes_the_gguf_file_and_reads_its_context_length(smollm2_gguf, tmp_path, capsys):
    cfg = validate(preset_config("tiny_cpu", "--actor.model_name_or_path", smollm2_gguf, "--data.max_len", "4096"))
    assert cfg.data.max_len == 4096  # SmolLM2's 8192 positions, read from the file: nothing capped
    cfg = validate(preset_config("tiny_cpu", "--actor.model_name_or_path", smollm2_gguf, "--data.max_len", "10000"))
    assert cfg.data.max_len == 8192 and "capped at 8192" in capsys.readouterr().err

    broken = tmp_path / "broken.gguf"
    broken.write_text("not a model")
    cfg = preset_config("tiny_cpu", "--actor.model_name_or_path", str(broken))
    with pytest.raises(ConfigError, match=f"--actor.model_name_or_path {broken}: not a readable GGUF model"):
        validate(cfg)


def test_a_conversion_parses_the_file_once_however_often_transformers_asks(tmp_path, monkeypatch):
    """transformers parses a GGUF file for the config, the tokenizer and the weights: 5 parses of 4 s each for
    SmolLM2. Within a conversion the first parse serves them all (the converted folder is the same: tested above)."""
    import gguf

    path = str(tmp_path / "small.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("tokenizer.ggml.eos_token_id", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    parsed = []

    class Counted(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parsed.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    with _parsed_once():
        same_file = os.path.join(str(tmp_path), ".", "small.gguf")  # another spelling of the path
        assert special_token_ids(path) == {"eos": 7} == special_token_ids(same_file)
        assert gguf.GGUFReader(path) is gguf.GGUFReader(path)
    assert len(parsed) == 1
    assert gguf.GGUFReader is Counted and special_token_ids(path) == {"eos": 7} and len(parsed) == 2
