"""Where the project keeps what it builds once and reuses across runs: the embedded tiny model, GGUF files converted
to HF folders, the reward models the tests build."""

import os


def default_cache_dir(cfg=None) -> str:
    """The run's --cache_dir, else env OPENRLHF_ASYNC_CACHE, else ~/.cache/openrlhf_async."""
    if cfg is not None and cfg.cache_dir:
        return cfg.cache_dir
    return os.environ.get("OPENRLHF_ASYNC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "openrlhf_async"))
