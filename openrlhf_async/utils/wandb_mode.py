"""Where W&B's mode and credentials come from: read by the config's checks at start and by the metrics log."""

import os


def wandb_api_key_available() -> bool:
    """Whether W&B finds credentials: env WANDB_API_KEY or a netrc entry for api.wandb.ai."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(requested: str) -> str:
    """--logger.wandb_mode, else env WANDB_MODE, else online with an API key and offline without."""
    env = os.environ.get("WANDB_MODE", "")
    env = {"dryrun": "offline", "run": "online"}.get(env, env)  # wandb's legacy names
    return requested or env or ("online" if wandb_api_key_available() else "offline")
