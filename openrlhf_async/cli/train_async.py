"""Train a policy with RL from the command line: `python -m openrlhf_async.cli.train_async --help`."""

import contextlib
import json
import os
import sys
import tempfile

from openrlhf_async.cli import missing_package
from openrlhf_async.errors import ConfigError, notice
from openrlhf_async.utils.cache_dir import default_cache_dir
from openrlhf_async.utils.config_record import to_dict
from openrlhf_async.utils.model_info import is_embedded, is_gguf


def prepare(cfg):
    """Resolve the model, agent, reward, datasets and the checkpoint to resume from, and check them and the folders
    the run writes, all before any actor starts; a real start takes the run folder's lock (utils/run_folder.py). A
    dry run writes nothing and builds nothing. The settings the start fills in are config/resolve.py's, in this order.
    Returns (model path, train rows, eval rows, resume: None or (checkpoint folder, trainer state))."""
    from openrlhf_async.config import check_local_cores, openrlhf_differences, refuse_together, validate
    from openrlhf_async.config.probes import check_vllm_release, vllm_release
    from openrlhf_async.config.resolve import builtin_task_in_its_template, resolve_steps, score_tasks_by_their_scorers
    from openrlhf_async.trainer import memory_plan
    from openrlhf_async.trainer.checkpoint import check_resume_data

    # On cpu without a Ray cluster, the ranks need this machine's cores; their refusals come with the flags' own.
    refuse_together(lambda: validate(cfg), lambda: check_local_cores(cfg), lambda: check_vllm_release(vllm_release()))
    differences = openrlhf_differences(cfg)  # said once everything is checked, so that an error stands alone
    resume = claim_run_folder(cfg)
    check_parsers(cfg)
    score_tasks_by_their_scorers(cfg)
    verifiers_env = check_user_files(cfg)
    builtin_task_in_its_template(cfg)
    train_rows, eval_rows = read_datasets(cfg, verifiers_env)
    resolve_steps(cfg, len(train_rows))
    check_resume_data(cfg, resume, len(train_rows))
    memory_plan.for_config(cfg)  # a run whose trainer ranks or engines cannot fit is refused here
    for message in differences:
        notice(message)
    if cfg.dry_run:
        return (cfg.actor.model_name_or_path or "embedded tiny model (shipped, sha256-checked)", train_rows, eval_rows,
                resume)
    write_run_config(cfg)
    model_path = local_model(cfg)
    tokenizer_here = not os.path.isdir(model_path) or any(os.path.isfile(os.path.join(model_path, name))
                                                          for name in TOKENIZER_FILES)
    if cfg.data.apply_chat_template and tokenizer_here:  # here, before Ray starts its threads: the check forks
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=not cfg.data.disable_fast_tokenizer)
        check_chat_template(cfg, tokenizer, train_rows)
    check_observation_turn(cfg, model_path)
    return model_path, train_rows, eval_rows, resume


def claim_run_folder(cfg):
    """Check the folders the run writes and take its run folder (a dry run only checks that no live run holds it);
    the checkpoint to resume from, or None (an earlier run's records without --ckpt.load_enable or --overwrite are
    refused)."""
    from openrlhf_async.trainer.checkpoint import find_resume
    from openrlhf_async.utils import run_folder

    run_folder.check_folders(cfg)  # a folder the run cannot write fails now, not after training
    run_folder.check_build_locks()  # a killed op build's lock would stall the trainer ranks for ever
    # One run per run folder: a real start holds its lock from here (before its records are read or deleted) to the
    # end of the process; a dry run only checks that no live run holds it.
    if cfg.dry_run:
        run_folder.check_free(cfg)
    else:
        run_folder.hold(cfg)
    return find_resume(cfg)


def check_user_files(cfg):
    """Import and check the user's files (agent, reward_func, verifiers environment), so that a broken one fails
    before any engine starts; --agent.verifiers_env's environment, loaded once (its tasks may be the prompts), or
    None."""
    from openrlhf_async.agent import CONTRACT, AgentFileError, load_agent
    from openrlhf_async.reward.sources import FUNC_CONTRACT, RewardFileError, make_reward
    from openrlhf_async.utils.user_files import check_user_file

    verifiers_env = None
    try:
        if cfg.agent.func_path:
            check_user_file(cfg.agent.func_path, "--train.agent_func_path", CONTRACT, AgentFileError,
                            "openrlhf_async_agent")
        if (cfg.reward.remote_url or "").endswith(".py"):
            check_user_file(cfg.reward.remote_url, "--reward.remote_url", FUNC_CONTRACT, RewardFileError,
                            "openrlhf_async_reward")
        if cfg.agent.verifiers_env:
            if cfg.agent.func_path:
                raise AgentFileError("--agent.verifiers_env and --train.agent_func_path both give the agent; pass one")
            from openrlhf_async.agent.verifiers_env import load_env, tasks

            verifiers_env = load_env(cfg.agent.verifiers_env, cfg.agent.verifiers_args, cfg.agent.sandbox)
            tasks(verifiers_env, cfg.agent.verifiers_max_tasks)  # as the engines will: a broken taskset fails here
        else:
            load_agent(cfg.agent.func_path, cfg.agent.workers).close()
        make_reward(**cfg.reward.source())
    except (AgentFileError, RewardFileError) as e:
        raise ConfigError(str(e)) from None
    return verifiers_env


def read_datasets(cfg, verifiers_env) -> tuple:
    """(train rows, eval rows), the built-in task written where the run keeps it (a dry run's copy goes with its
    temporary folder, and a dry run checks the prompts' token lengths as the start would)."""
    with (tempfile.TemporaryDirectory() if cfg.dry_run else
          contextlib.nullcontext(os.path.join(cfg.run_dir, "data"))) as builtin_dir:
        train_rows, eval_rows = load_datasets(cfg, builtin_dir, verifiers_env)
    if cfg.dry_run:  # the start tokenises every prompt and refuses a dataset none of which fits --data.max_len
        check_prompt_lengths(cfg, train_rows, eval_rows)
    return train_rows, eval_rows


def write_run_config(cfg) -> None:
    """The run folder made (an earlier run's records deleted first with --overwrite) and the config written in it."""
    from openrlhf_async.trainer.checkpoint import remove_records

    if cfg.overwrite:
        remove_records(cfg)
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f, indent=2)


def local_model(cfg) -> str:
    """The HF model folder or id the ranks and engines load: the embedded tiny model built, or a GGUF file converted
    (both cached), else --actor.model_name_or_path."""
    model_path = cfg.actor.model_name_or_path
    if not model_path:
        from openrlhf_async.models.tiny import build_tiny_model

        return build_tiny_model(default_cache_dir(cfg))
    if is_embedded(model_path):  # a shipped one named (tiny-qwen3-moe): its bytes checked
        from openrlhf_async.models.tiny import embedded_model

        return embedded_model(os.path.basename(os.path.normpath(model_path)))
    if is_gguf(model_path):
        from openrlhf_async.models.gguf import hf_folder

        print(f"converting {model_path} to an HF folder (cached after the first run) ...", flush=True)
        return hf_folder(model_path, default_cache_dir(cfg))
    return model_path


def check_observation_turn(cfg, model_path: str) -> None:
    """--agent.observation_turn's chat turn, which the engines build for an agent file: checked before them."""
    if not cfg.agent.func_path or cfg.agent.observation_turn == "raw":
        return
    from transformers import AutoTokenizer

    from openrlhf_async.rollout.episode import ChatTurn

    tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=not cfg.data.disable_fast_tokenizer)
    try:
        ChatTurn.of(tokenizer, cfg.agent.observation_turn)
    except Exception as e:
        raise ConfigError(f"--agent.observation_turn {cfg.agent.observation_turn}: {e}") from None


def check_parsers(cfg) -> None:
    """--agent.tool_call_parser and --agent.reasoning_parser name parsers vLLM has (ConfigError otherwise): the
    engines build their OpenAI endpoint only when an agent first uses it."""
    for flag, name, module, manager in (
            ("--agent.tool_call_parser", cfg.agent.tool_call_parser, "vllm.tool_parsers", "ToolParserManager"),
            ("--agent.reasoning_parser", cfg.agent.reasoning_parser, "vllm.reasoning", "ReasoningParserManager")):
        if name:
            import importlib

            known = getattr(importlib.import_module(module), manager).list_registered()
            if name not in known:
                raise ConfigError(f"{flag} {name}: vLLM has no such parser; choose from {', '.join(sorted(known))}")


def load_datasets(cfg, builtin_dir: str, verifiers_env=None):
    """(train rows, eval rows); without --data.prompt_dataset, the built-in task (or reasoning-gym's, or the verifiers
    environment's tasks) written into builtin_dir, read with its own field names whatever --data.input_key /
    --data.label_key say."""
    from openrlhf_async.config.resolve import written_datasets
    from openrlhf_async.data.prompts import check_input_template, load_prompts

    check_input_template(cfg.data.input_template)
    train_keys = eval_keys = cfg.data.input_key, cfg.data.label_key
    prompt_dataset, eval_dataset = cfg.data.prompt_dataset, cfg.eval.dataset
    written = write_builtin_prompts(cfg, builtin_dir, verifiers_env)
    if written:
        prompt_dataset, train_keys = written[0], ("prompt", "label")
        if written[1] and not eval_dataset:
            eval_dataset, eval_keys = written[1], train_keys
    written_datasets(cfg, prompt_dataset, eval_dataset)
    train_rows = load_prompts(prompt_dataset, *train_keys, "--data.prompt_dataset", cfg.data.max_samples,
                              split=cfg.data.prompt_split, probs=cfg.data.prompt_probs, seed=cfg.train.seed,
                              max_len=cfg.data.max_len)
    eval_rows = []  # a user dataset without --eval.dataset trains without evaluation
    if eval_dataset:
        eval_rows = load_prompts(eval_dataset, *eval_keys, "--eval.dataset", cfg.eval.max_samples,
                                 split=cfg.eval.split, max_len=cfg.data.max_len)
    return train_rows, eval_rows


def write_builtin_prompts(cfg, builtin_dir: str, verifiers_env=None):
    """(train file, eval file or None) of the prompts written into builtin_dir when no --data.prompt_dataset gives
    them: reasoning-gym's tasks, the verifiers environment's or the built-in task's; None when it gives them."""
    if cfg.data.reasoning_gym:
        from openrlhf_async.data.reasoning_gym_tasks import write_tasks

        if cfg.data.prompt_dataset:
            raise ConfigError("--data.reasoning_gym and --data.prompt_dataset both give the prompts; pass one")
        try:
            return write_tasks(cfg.data.reasoning_gym, cfg.data.reasoning_gym_size, cfg.train.seed, builtin_dir,
                               cfg.data.reasoning_gym_args)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.data.prompt_dataset:
        return None
    if verifiers_env is not None:  # the environment's tasks are the prompts
        from openrlhf_async.agent.verifiers_env import prompt_rows

        os.makedirs(builtin_dir, exist_ok=True)
        path = os.path.join(builtin_dir, "verifiers_tasks.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in prompt_rows(verifiers_env, cfg.agent.verifiers_max_tasks))
        return path, None
    from openrlhf_async.data.synthetic import write_builtin_task

    return write_builtin_task(cfg.data.builtin_task, builtin_dir)


def check_prompt_lengths(cfg, train_rows: list, eval_rows: list) -> None:
    """A dry run's check of what the start says of the prompts' token lengths, on a sample of each dataset tokenised
    as the start tokenises them (ConfigError when none fits --data.max_len)."""
    from transformers.utils import logging

    from openrlhf_async.data.prompts import check_sample_lengths, dry_run_sample, tokenize_prompts

    tokenizer = dry_run_tokenizer(cfg)
    if tokenizer is None:
        return
    if cfg.data.apply_chat_template:
        check_chat_template(cfg, tokenizer, train_rows)
    level = logging.get_verbosity()
    logging.set_verbosity_error()  # its warning of a prompt longer than the model's is said below, in one line
    try:
        for rows, where in ((train_rows, "--data.prompt_dataset"), (eval_rows, "--eval.dataset")):
            picked = dry_run_sample(len(rows))
            prompts = tokenize_prompts(tokenizer, [rows[i] for i in picked], cfg.data.apply_chat_template,
                                       cfg.data.input_template, cfg.data.parse_special_tokens, where)
            check_sample_lengths(prompts, picked, len(rows), cfg.data.max_len, where)
    finally:
        logging.set_verbosity(level)


def check_chat_template(cfg, tokenizer, rows: list) -> None:
    """The model has a chat template, and its first render (of the first prompt) is bounded (data/chat_template.py)."""
    from openrlhf_async.data.chat_template import check_first_render

    where = f"--actor.model_name_or_path {cfg.actor.model_name_or_path or 'embedded tiny model'}"
    if not tokenizer.chat_template:
        raise ConfigError(f"--data.apply_chat_template: the tokenizer of {cfg.actor.model_name_or_path} has no chat "
                          "template; leave the flag off (prompts go in as text, through --data.input_template)")
    if rows:
        check_first_render(tokenizer, rows[0]["prompt"], where)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def dry_run_tokenizer(cfg):
    """The tokenizer the start would use, as it lies on this machine (None, with a notice, when it is not here)."""
    from transformers import AutoTokenizer

    model, use_fast = cfg.actor.model_name_or_path, not cfg.data.disable_fast_tokenizer
    if not model:
        from openrlhf_async.models.tiny import embedded_model

        return AutoTokenizer.from_pretrained(embedded_model("tiny-qwen2"), use_fast=use_fast)
    if is_gguf(model):  # the start converts the file, keeping this tokenizer
        from openrlhf_async.models.gguf import gguf_tokenizer

        return gguf_tokenizer(model, default_cache_dir(cfg))
    why = "is not in its folder"  # transformers makes an empty one of a folder without tokenizer files
    if not os.path.isdir(model) or any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
        try:
            return AutoTokenizer.from_pretrained(model, use_fast=use_fast, local_files_only=True)
        except Exception as e:  # tokenizers raises a bare Exception for a tokenizer.json of a model type it lacks
            if os.path.isdir(model):  # the start would fail the same way, after starting the cluster
                raise ConfigError(f"--actor.model_name_or_path {model}: its tokenizer does not load "
                                  f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); give the model's own "
                                  "tokenizer files") from None
            why = "is not on this machine"  # a Hub model not downloaded yet: left to the start
    notice(f"--actor.model_name_or_path {model}: its tokenizer {why}, so the dry run did not count the prompts' "
           "tokens against --data.max_len")
    return None


def resources(cfg) -> dict:
    """What the run occupies: vLLM engines (each tensor_parallel_size GPUs on cuda), DeepSpeed ranks, with gae the
    critic's ranks, and the reward models' actors (a GPU each), less what shares another's GPUs (cfg.placement)."""
    engine_gpus = cfg.num_engines * cfg.vllm.tensor_parallel_size
    critic = cfg.critic.world_size if cfg.algo.advantage_estimator == "gae" else 0
    r = cfg.reward
    reward_models = len([p for p in (r.model_name_or_path or "").split(",") if p.strip()]) * r.num_nodes * \
        r.num_gpus_per_node
    # The hybrid engine's engines share the trainer's GPUs (validate checked that they cover them exactly).
    gpus = max(engine_gpus, cfg.actor.world_size) if cfg.hybrid else engine_gpus + cfg.actor.world_size
    own = {role: cfg.placement[role] == "own" for role in ("critic", "rewards")}
    return {"device": cfg.device, "vllm_engines": cfg.num_engines,
            "tensor_parallel_size": cfg.vllm.tensor_parallel_size, "trainer_ranks": cfg.actor.world_size,
            "critic_ranks": critic, "reward_model_actors": reward_models, "hybrid": cfg.hybrid,
            "placement": cfg.placement,
            "gpus": gpus + critic * own["critic"] + reward_models * own["rewards"] if cfg.device == "cuda" else 0}


def check_cluster(cfg) -> None:
    """On cuda, the Ray cluster must hold the GPUs the run needs (raises ConfigError)."""
    import ray

    need, have = resources(cfg)["gpus"], int(ray.cluster_resources().get("GPU", 0))
    if need > have:
        shared = " sharing the GPUs of" if cfg.hybrid else " +"
        raise ConfigError(f"--device cuda: the run needs {need} GPUs ({cfg.num_engines} engines x "
                          f"--vllm.tensor_parallel_size {cfg.vllm.tensor_parallel_size}{shared} "
                          f"{cfg.actor.world_size} trainer ranks"
                          + (f" + {cfg.critic.world_size} critic ranks" if cfg.placement["critic"] == "own" else "")
                          + (f" + {resources(cfg)['reward_model_actors']} reward-model actors"
                             if cfg.placement["rewards"] == "own" else "")
                          + f") and the Ray cluster has {have}; lower them or use "
                          "--device cpu")


def dry_run_report(cfg, model_path: str, train_rows: list, eval_rows: list, resume) -> dict:
    from openrlhf_async.trainer import memory_plan
    from openrlhf_async.trainer.staleness import StalenessPolicy

    return {"config": to_dict(cfg), "model": model_path, "resources": resources(cfg),
            "memory_plan": memory_plan.for_config(cfg),
            "datasets": {"train_rows": len(train_rows), "eval_rows": len(eval_rows)},
            "resume_from": resume and {"path": resume[0], "step": resume[1]["step"]},
            "staleness_limit": StalenessPolicy.from_config(cfg).limit, "queue_size": cfg.queue_size}


def _memory_summary(plan) -> str:
    if not plan:
        return "; no memory plan (the model's config could not be read)"
    from openrlhf_async.trainer.memory_plan import GB

    device, host = plan["device_memory"], plan.get("host")
    shared = f", {plan['hybrid']['peak'] / GB:.1f} GB per device shared with an engine" if plan.get("hybrid") else ""
    if host and not plan["checked"]:  # on cpu, all on this machine: the ranks and engines together
        return (f"; memory plan: {plan['trainer_rank']['total'] / GB:.1f} GB per trainer rank, "
                f"{host['total'] / GB:.1f} GB with the engines, of {host['memory'] / GB:.1f} GB host memory")
    unchecked = " (not checked: the Ray cluster's nodes hold the ranks)" if plan["setup"]["device"] == "cpu" else \
        " (not checked)"
    return (f"; memory plan: {plan['trainer_rank']['total'] / GB:.1f} GB per trainer rank{shared}"
            + (f" of {device / GB:.1f} GB" if device else "") + ("" if plan["checked"] else unchecked))


def main(argv=None) -> int:
    try:
        from openrlhf_async.config import parse_config
    except ModuleNotFoundError as e:
        return missing_package(e)
    try:
        cfg = parse_config(argv)
        model_path, train_rows, eval_rows, resume = prepare(cfg)
    except ConfigError as e:
        print("\n".join(f"error: {line}" for line in str(e).splitlines()), file=sys.stderr)  # a refusal a line
        return 2
    except ModuleNotFoundError as e:  # this environment lacks a package the project needs
        return missing_package(e)
    if cfg.dry_run:
        print_dry_run(cfg, model_path, train_rows, eval_rows, resume)
        return 0
    return run(cfg, model_path, train_rows, eval_rows, resume)


def print_dry_run(cfg, model_path: str, train_rows: list, eval_rows: list, resume) -> None:
    """The dry run's report as JSON on stdout; its memory plan and a one-line summary on stderr."""
    report = dry_run_report(cfg, model_path, train_rows, eval_rows, resume)
    print(json.dumps(report, indent=2))
    if report["memory_plan"]:  # for a person: on stderr, beside the notices, so stdout stays the report
        from openrlhf_async.trainer.memory_plan import table

        print(table(report["memory_plan"]), file=sys.stderr)
    r = report["resources"]
    print(f"dry run: configuration valid; would start {r['vllm_engines']} vLLM engine(s) x tensor parallel "
          f"{r['tensor_parallel_size']} and {r['trainer_ranks']} trainer rank(s) on {r['device']}"
          + (f" ({r['gpus']} GPUs)" if r["gpus"] else "") + f", {len(train_rows)} train and "
          f"{len(eval_rows)} eval prompts, --mode {cfg.mode}" + _memory_summary(report["memory_plan"]))


def run(cfg, model_path: str, train_rows: list, eval_rows: list, resume) -> int:
    """Train on the Ray cluster at RAY_ADDRESS (or one of the run's own); the exit status, the run's one-line summary
    printed."""
    import faulthandler
    import signal

    import ray

    from openrlhf_async.trainer.run import train
    from openrlhf_async.utils.cluster import connect
    from openrlhf_async.utils.ray_utils import catch_interrupts, root_cause

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: a stuck run's stacks on stderr
    catch_interrupts()

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # CPU actors need no device masking
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # the run reports its first failure itself
    # A Ray cluster this run starts kills a dead worker's whole process group: an engine actor killed outright
    # (SIGKILL, the OOM killer) must not leave its vLLM processes holding the device.
    os.environ.setdefault("RAY_process_group_cleanup_enabled", "1")
    connect()  # the Ray cluster at RAY_ADDRESS, or one of its own
    try:
        check_cluster(cfg)
        summary = train(cfg, model_path, train_rows, eval_rows, resume)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: shutting down", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"error: {root_cause(e)}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(summary_line(cfg, summary))
    return 0


def summary_line(cfg, summary: dict) -> str:
    """What the run did, in one line: eval accuracy (and pass@k) from start to end, steps, time, where its records
    and model are."""
    k = cfg.eval.n_samples_per_prompt
    accuracy = ("no eval set" if summary["eval_accuracy_start"] is None else
                f"eval {'accuracy' if k == 1 else f'mean@{k}'} {summary['eval_accuracy_start']:.3f} -> "
                f"{summary['eval_accuracy_end']:.3f}"
                + ("" if k == 1 else f", pass@{k} {summary['eval_start'][f'eval/pass@{k}']:.3f} -> "
                                     f"{summary['eval_end'][f'eval/pass@{k}']:.3f}"))
    early = summary["stopped_early"] and f" of {cfg.train.max_steps} ({summary['stopped_early']['reason']})"
    return (f"{accuracy} after {summary['steps']} steps{early or ''} in {summary['wall_s']:.0f} s; "
            + ", ".join(["metrics.jsonl"] + [os.path.basename(p) for p in summary["pictures"]])
            + f" in {cfg.run_dir}; model in {summary['checkpoint']}")


if __name__ == "__main__":
    sys.exit(main())
