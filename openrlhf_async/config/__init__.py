"""One typed config for a run, built from OpenRLHF-style dotted flags and resolved once at start.

- setting.py: what a setting is (`setting(...)`: default, help, choices, range, bound, flag, OpenRLHF support);
- schema.py: the sections and `Config`, every setting declared once;
- command_line.py: the parser, `--help SECTION`, flags files and presets, generated from the schema;
- checks.py: `validate`, every refusal of a setting or of settings together, one line each;
- probes.py: what the checks ask outside the config (the device, a model's context length, the hub);
- resolve.py: the settings the run fills in itself once the flags are checked.

A flag is refused by its setting's choices or range (checks.py: _validate_setting), by a rule between settings
(checks.py), by the start's checks of files, datasets and resources (cli/train_async.prepare), or, for an older
OpenRLHF spelling, translated with a notice first (compat.py)."""

from openrlhf_async.config.checks import (StopChecks, check_local_cores, local_cpu_run, openrlhf_differences,
                                          refuse_together, validate)
from openrlhf_async.config.command_line import (SECTIONS, build_parser, expand_preset_files, parse_config,
                                                preset_config, preset_path)
from openrlhf_async.config.probes import attn_implementation, is_hub_id, resolve_device
from openrlhf_async.config.resolve import resolve_steps
from openrlhf_async.config.schema import (ActorConfig, AgentConfig, AlgoConfig, CkptConfig, Config, CriticConfig,
                                          DataConfig, DSConfig, EvalConfig, LoggerConfig, PlanConfig, RefConfig,
                                          RewardConfig, RolloutConfig, TrainConfig, VLLMConfig, config_with,
                                          float_flags, settings)
from openrlhf_async.config.setting import (FLOAT_LIMIT, INT_LIMIT, NODES_MAX, PER_NODE_MAX, SEED_MAX, WEEK_S,
                                           env_int, setting, support)
from openrlhf_async.errors import ConfigError, notice
from openrlhf_async.utils.cache_dir import default_cache_dir
from openrlhf_async.utils.config_record import to_dict
