"""The run's config as a plain dict: what config.json, the dry-run report and the loggers record."""

import copy
import dataclasses


def to_dict(cfg) -> dict:
    """The config as written to config.json, the dry-run report and the loggers: its settings (not the fields the
    resolution fills in for the roles, such as the reward models' actor names), secrets (the W&B key) hidden."""
    data = _settings_of(cfg)
    if data["logger"]["wandb_key"]:
        data["logger"]["wandb_key"] = "<hidden>"
    return data


def _settings_of(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _settings_of(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("resolved")}
    return copy.deepcopy(value)
