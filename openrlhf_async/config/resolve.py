"""The settings a run fills in itself once its flags are checked, in the order the start meets them: the reward
models' actor names (at the end of `validate`), the scorer of reasoning-gym's tasks, the chat template of the
embedded model's built-in task, the prompt files written for the built-in tasks, and the number of steps. Each is
written here and nowhere else; the roles read the resolved config and change none of it."""

from openrlhf_async.errors import notice


def name_reward_models(cfg) -> None:
    """--reward.model_name_or_path's actors named before they start, so that the engines (which find them by name)
    can start first: --reward.models, per model."""
    cfg.reward.models = ()
    if cfg.reward.model_name_or_path:
        from openrlhf_async.reward.model import reward_model_names

        cfg.reward.models = reward_model_names(cfg)


def score_tasks_by_their_scorers(cfg) -> None:
    """--data.reasoning_gym without an agent or a reward source: the tasks' own scorers judge the answers."""
    if cfg.data.reasoning_gym and not cfg.agent.func_path and not cfg.reward.remote_url:
        from openrlhf_async.reward import reasoning_gym_reward

        cfg.reward.remote_url = reasoning_gym_reward.__file__


def builtin_task_in_its_template(cfg) -> None:
    """The built-in task on an embedded model: its prompts in the chat template the model was trained on."""
    from openrlhf_async.utils.model_info import is_embedded

    builtin_task = not (cfg.data.prompt_dataset or cfg.data.reasoning_gym or cfg.agent.verifiers_env)
    if builtin_task and is_embedded(cfg.actor.model_name_or_path) and not cfg.data.apply_chat_template:
        # OpenRLHF's default (off) is for datasets of raw prompts; the embedded model only answers in its template.
        cfg.data.apply_chat_template = True
        notice("--data.apply_chat_template is off (OpenRLHF's default), but the embedded tiny models were trained on "
               "its chat template: the built-in task's prompts are formatted with it")


def written_datasets(cfg, prompt_dataset: str, eval_dataset) -> None:
    """The prompt files the run reads (those the start wrote for a built-in task, reasoning-gym's tasks or a verifiers
    environment, else the flags'), recorded as the run's datasets. A dry run keeps the flags: its files are gone when it
    reports."""
    if not cfg.dry_run:
        cfg.data.prompt_dataset, cfg.eval.dataset = prompt_dataset, eval_dataset


def resolve_steps(cfg, num_prompts: int) -> None:
    """--train.max_steps -1: the steps of --train.num_episodes passes over the prompts, as OpenRLHF counts them."""
    if cfg.train.max_steps == -1:
        per_step = cfg.rollout.batch_size * (cfg.train.require_batches if cfg.mode == "fully_async" else 1)
        cfg.train.max_steps = max(1, cfg.train.num_episodes * num_prompts // per_step)
