"""Train a policy with RL from the command line: `python -m openrlhf_async.cli.train_async --help`."""

import json
import os
import sys


def prepare(cfg):
    """Resolve the model and datasets and check them, all before any actor starts."""
    from openrlhf_async.agent import AgentFileError, load_agent
    from openrlhf_async.config import ConfigError, default_cache_dir, to_dict, validate
    from openrlhf_async.data.prompts import load_prompts

    validate(cfg)
    try:  # import and check the agent file here, so a broken one fails before any engine starts
        load_agent(cfg.agent.func_path, cfg.agent.workers).close()
    except AgentFileError as e:
        raise ConfigError(str(e)) from None
    if not cfg.data.prompt_dataset:
        from openrlhf_async.data.synthetic import write_arithmetic_dataset

        cfg.data.prompt_dataset, eval_path = write_arithmetic_dataset(os.path.join(cfg.run_dir, "data"))
        cfg.eval.dataset = cfg.eval.dataset or eval_path
    train_rows = load_prompts(cfg.data.prompt_dataset, cfg.data.input_key, cfg.data.label_key,
                              "--data.prompt_dataset", cfg.data.max_samples)
    eval_rows = []  # a user dataset without --eval.dataset trains without evaluation
    if cfg.eval.dataset:
        eval_rows = load_prompts(cfg.eval.dataset, cfg.data.input_key, cfg.data.label_key, "--eval.dataset",
                                 cfg.eval.max_samples)
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f, indent=2)
    model_path = cfg.actor.model_name_or_path
    if not model_path:
        from openrlhf_async.models.tiny import build_tiny_model

        print("building the embedded tiny model (cached after the first run) ...", flush=True)
        model_path = build_tiny_model(default_cache_dir(cfg))
    return model_path, train_rows, eval_rows


def main(argv=None) -> int:
    from openrlhf_async.config import ConfigError, parse_config

    cfg = parse_config(argv)
    try:
        model_path, train_rows, eval_rows = prepare(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import ray

    from openrlhf_async.trainer.ppo_trainer import train
    from openrlhf_async.utils.ray_utils import root_cause

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # CPU actors need no device masking
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # the run reports its first failure itself
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False)
    try:
        summary = train(cfg, model_path, train_rows, eval_rows)
    except KeyboardInterrupt:
        print("interrupted: shutting down", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"error: {root_cause(e)}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    accuracy = ("no eval set" if summary["eval_accuracy_start"] is None else
                f"eval accuracy {summary['eval_accuracy_start']:.3f} -> {summary['eval_accuracy_end']:.3f}")
    print(f"{accuracy} after {summary['steps']} steps in {summary['wall_s']:.0f} s; "
          f"metrics in {cfg.run_dir}/metrics.jsonl, model in {summary['checkpoint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
