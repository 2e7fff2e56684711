"""A prompt group's agent episodes on one engine, each scored the moment it ends.

The runner holds what plays and scores episodes: agents (loaded once per file), reward sources (made once per
settings) and the built-in math-verify pool's settings. It reaches vLLM only through the engine it is given:
`engine.tokenizer`, `engine.generate(prompt_ids, sampling, request_id, group_id)` (one completion) and
`engine.request(prompt_ids, sampling_params, request_id, group_id)` (one raw vLLM request, for OpenRLHF
AgentExecutor files) and `engine.endpoint()` (its OpenAI-compatible endpoint, for agents written against the OpenAI
API)."""

import asyncio

from openrlhf_async.rollout.episode import ChatTurn, Episode, run_episode, run_executor_episode, run_group
from openrlhf_async.rollout.filter import GroupFilter
from openrlhf_async.rollout.seeds import seeded


class GroupRunner:
    def __init__(self, agent, reward, tokenizer=None):
        """agent, reward: the run's AgentConfig and RewardConfig sections. The run's own agent and reward source
        are loaded now, so that a broken file fails the engine's start rather than its first group.
        tokenizer: the engine's; with --agent.observation_turn user or tool, observations become turns of its chat
        template."""
        from openrlhf_async.reward.math_verify_reward import configure_math_verify

        self.chat_turn = ChatTurn.of(tokenizer, agent.observation_turn)

        self.agent_path, self.agent_workers = agent.func_path, agent.workers  # "": the built-in math agent
        self.verifiers = (agent.verifiers_env, agent.verifiers_args, agent.verifiers_max_tasks, agent.sandbox,
                          agent.step_timeout) if agent.verifiers_env else None
        self.agent_max_steps, self.agent_step_timeout = agent.max_steps, agent.step_timeout
        self.agents = {}  # path -> agent
        self.agent(self.agent_path)
        # The built-in math-verify reward (the default agent's) runs in this many processes of this engine, for
        # every group: it is one pool per process, whatever reward source a call picks.
        configure_math_verify(reward.workers, reward.timeout)
        self.reward_settings = reward.source()
        self.rewards = {}  # make_reward's settings -> reward source (None: the agent's own step rewards stand)
        self.reward_source(self.reward_settings)

    def agent(self, path: str = None):
        """The agent of this file (None: the run's own), loaded on first use."""
        from openrlhf_async.agent import load_agent

        path = self.agent_path if path is None else path
        if path not in self.agents:
            if self.verifiers and path == self.agent_path:  # the run's agent is a verifiers environment
                from openrlhf_async.agent.verifiers_env import VerifiersAgent

                self.agents[path] = VerifiersAgent(*self.verifiers)
            else:
                self.agents[path] = load_agent(path, self.agent_workers)
        return self.agents[path]

    def reward_source(self, settings: dict = None):
        """The reward source of these make_reward settings (None: the run's own), made on first use."""
        from openrlhf_async.reward.sources import make_reward

        settings = self.reward_settings if settings is None else settings
        key = tuple(sorted(settings.items()))
        if key not in self.rewards:
            self.rewards[key] = make_reward(**settings)
        return self.rewards[key]

    async def run(self, engine, prompt_ids: list, label, n: int, sampling: dict, group_id: str, budget,
                  agent_path: str = None, screen: int = 0, group_filter: GroupFilter = GroupFilter(),
                  reward_source: dict = None, prompt=None, info: dict = None):
        """See LLMRayActorAsync.generate_group."""
        from openrlhf_async.utils.samples import prompt_key

        agent, reward = self.agent(agent_path), self.reward_source(reward_source)
        key = prompt_key(prompt_ids)

        async def keyed(episode):  # which prompt it answers, whatever prompt its first call sent
            ep = await episode
            ep.prompt_key = key
            return ep
        tokenizer = engine.tokenizer
        budgets = list(budget) if isinstance(budget, (list, tuple)) else [budget] * n
        prompt_text = tokenizer.decode(prompt_ids) if reward is not None else None

        endpoint = await engine.endpoint(getattr(agent, "needs_network", False)) if agent.kind == "openai" else None

        def episode(i: int):
            sampling_i = seeded(sampling, "sample", i)
            if agent.kind == "openai":
                from openrlhf_async.rollout.endpoint import run_openai_episode

                ep = run_openai_episode(endpoint, agent, tokenizer.decode(prompt_ids) if prompt is None else prompt,
                                        label, sampling_i, budgets[i], self.agent_step_timeout * self.agent_max_steps,
                                        f"{group_id}-{i}", group_id)
            elif agent.kind == "executor":
                from vllm import SamplingParams

                ep = run_executor_episode(
                    lambda ids, params, rid: engine.request(ids, params, rid, group_id), agent, tokenizer,
                    prompt_ids, label, SamplingParams(logprobs=0, **sampling_i), budgets[i], f"{group_id}-{i}",
                    getattr(engine, "weight_version", 0))
            else:
                ep = run_episode(lambda ids, smp, rid: engine.generate(ids, smp, rid, group_id), agent, tokenizer,
                                 prompt_ids, label, sampling_i, budgets[i], self.agent_max_steps,
                                 self.agent_step_timeout, f"{group_id}-{i}", self.chat_turn)
            return keyed(ep if reward is None else rescored(ep, reward, tokenizer, prompt_text, label, info))

        return await run_group(episode, n, screen, group_filter)


async def rescored(episode, reward, tokenizer, prompt_text: str, label, info: dict = None) -> Episode:
    """Run an episode, then score it with a reward source (reward_func file or service) on its whole text, as
    OpenRLHF does: the source's reward and score replace the agent's, whose reward is kept in extra_info. A failed
    reward scores 0, counted. A source that reads_info (veRL's compute_score) also gets the response text and the
    row's info (its data_source and extra_info)."""
    from openrlhf_async.reward.sources import RewardTimeout

    ep = await episode
    if ep.aborted or ep.error:
        return ep
    query = tokenizer.decode(ep.prompt_ids + ep.response_ids)
    context = {}
    if getattr(reward, "reads_info", False):
        context = {"responses": [tokenizer.decode(ep.response_ids, skip_special_tokens=True)], "infos": [info]}
    try:
        (result,) = await reward.score([query], [prompt_text], [label], **context)
    except Exception as e:  # the user's reward code or a remote service: contain it, count it
        kind = "reward_timeout" if isinstance(e, (RewardTimeout, asyncio.TimeoutError)) else "reward_error"
        ep.score, ep.raw_reward, ep.error = 0.0, 0.0, (kind, f"{type(e).__name__}: {e}")
        return ep
    ep.extra_info = {**ep.extra_info, **result["extra"], "agent_reward": ep.raw_reward}
    ep.score, ep.raw_reward = result["score"], result["reward"]
    return ep
