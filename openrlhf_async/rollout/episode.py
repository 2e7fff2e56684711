"""Agent episodes, independent of vLLM: generate, step, append the observation, until done or out of budget.

Token in, token out: the model's tokens are kept exactly as generated, with their rollout logprobs; only the
environment's new observation text is tokenised. `action_mask` marks the tokens the model wrote (1) and the
observation tokens (0), which the loss ignores. `token_versions` gives the weight version each response token
was generated with (an observation token takes the version of the action before it), so an episode that
outlived a weight sync shows both versions.

As in OpenRLHF, an episode carries two figures: its score, which the dynamic-sampling filter reads, and its reward,
which the advantages use (see Episode)."""

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from openrlhf_async.reward.sources import RewardError, RewardTimeout, check_reward, log_number
from openrlhf_async.rollout.filter import GroupFilter
from openrlhf_async.rollout.seeds import derive_seed, seeded

# An observation is cut to this many characters per token of budget left before it is tokenised: far more than
# tokens of real text hold, so the tokens kept are the same, and a huge observation is never tokenised whole.
OBSERVATION_CHARS_PER_TOKEN = 64


async def run_group(episode, n: int, screen: int = 0, group_filter: GroupFilter = GroupFilter()) -> list:
    """A prompt's n episodes, run concurrently; episode(i) returns the i-th one's coroutine.
    With screen M (0 < M < n) the first M run alone, and the other n - M start only if the group filter keeps the
    M scores. A group whose first M samples fail the filter most likely would with all n, so it comes back with
    those M alone and no more tokens are spent on it (SPEED-RL's screening). The M are a fixed subset, not the
    first to finish, so a group is not judged by its shortest answers."""
    if not 0 < screen < n:
        return list(await asyncio.gather(*(episode(i) for i in range(n))))
    first = list(await asyncio.gather(*(episode(i) for i in range(screen))))
    if any(ep.aborted for ep in first) or not group_filter.keep([ep.score for ep in first]):
        return first
    return first + list(await asyncio.gather(*(episode(i) for i in range(screen, n))))


class EpisodeAborted(Exception):
    """The episode's group was aborted (early stop) before or while it generated."""


@dataclass
class Episode:
    """One agent episode's record, from the engine to the trainer. The response holds the model's tokens and the
    observations' alike; logprobs, action_mask and token_versions have one entry per response token."""
    request_id: str
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # the rollout's logprob per token, 0.0 for observation tokens
    action_mask: list = field(default_factory=list)  # 1: the model wrote the token, 0: the environment did
    token_versions: list = field(default_factory=list)  # the weight version each token was generated with
    finish_reason: Optional[str] = None  # vLLM's for the last generation ("stop", "length", "abort"), or "length"
    # What the dynamic-sampling filter reads: the reward source's score, or the agent's (its last step's "scores"),
    # else the same as raw_reward; 0.0 after an error.
    score: float = 0.0
    # The reward source's reward, or the agent's step rewards summed, before shaping; 0.0 after an error. None: the
    # same as score (an engine that gives one figure).
    raw_reward: Optional[float] = None
    reward: Optional[float] = None  # what the advantages use: raw_reward plus overlong shaping (set by shape_rewards)
    turns: int = 0  # generations made
    error: Optional[tuple] = None  # (kind, message); kind is a key of batch.ERROR_KINDS
    aborted: bool = False  # its group was aborted (early stop) while it ran
    extra_info: dict = field(default_factory=dict)  # the agent's or reward source's extra logs (e.g. accuracy)
    # Earlier segments of an episode whose turns are not one token sequence (an OpenAI-API agent whose chat template
    # rewrites history: rollout/endpoint.py), each a dict of the token lists above; each trains as a sample of its
    # own with the episode's reward. The fields above hold the last segment.
    segments: list = field(default_factory=list)
    # The seat whose conversation this segment is and its reward, where an agent scores its conversations apart (a
    # verifiers environment's traces: each seat on its own payoff, rollout/endpoint.py); None: the episode's reward.
    seat: Optional[str] = None
    seat_reward: Optional[float] = None
    prompt_key: Optional[int] = None  # the dataset prompt it answers (utils/samples.py: prompt_key), for its label
    # A mixture of experts': the experts vLLM routed each of its tokens to ([tokens, layers, top_k] int16 numpy,
    # -1 where unknown: rollout/routes.py), which routing replay trains with; None: none recorded.
    routes: Optional[object] = None


def extra_log_means(groups: list) -> dict:
    """`rollout/extra/<key>`: the mean of each number the agents and reward sources logged (Episode.extra_info)
    over the episodes that logged it; a value that is not a finite number (text, a list) is left out."""
    sums, counts = {}, {}
    for ep in (ep for group in groups for ep in group):
        for key, value in ep.extra_info.items():
            number = log_number(value)
            if number is not None:
                sums[key] = sums.get(key, 0.0) + number
                counts[key] = counts.get(key, 0) + 1
    return {f"rollout/extra/{key}": sums[key] / counts[key] for key in sums}


def _append_action(ep: Episode, out: dict) -> None:
    ep.response_ids += out["response_ids"]
    ep.logprobs += out["logprobs"]
    ep.action_mask += [1] * len(out["response_ids"])
    ep.token_versions += out["token_versions"]
    ep.finish_reason = out["finish_reason"]
    ep.turns += 1


class ChatTurn:
    """An observation as a turn of the model's chat template: the text that closes the assistant's turn (less the
    end-of-turn token when the action ended with it: the model's own token stays as generated), opens a turn of
    `role` holding the observation, and opens the next assistant turn. Taken from the template itself, by
    rendering a conversation with and without the extra turn."""

    _MARK = "\u2063OBSERVATION\u2063"

    def __init__(self, tokenizer, role: str):
        base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": self._MARK}]
        closed = tokenizer.apply_chat_template(base, tokenize=False)
        full = tokenizer.apply_chat_template(base + [{"role": role, "content": self._MARK}], tokenize=False,
                                             add_generation_prompt=True)
        if not full.startswith(closed) or closed.count(self._MARK) != 1:
            raise ValueError(f"the chat template does not add a {role} turn after an assistant turn by appending "
                             "text; use --agent.observation_turn raw and write the turn markers in the agent")
        self.close = closed[closed.index(self._MARK) + len(self._MARK):]  # e.g. "<|im_end|>\n"
        self.open, self.after = full[len(closed):].split(self._MARK)  # "<|im_start|>user\n", "<|im_end|>\n<|..."
        self.eos_text = tokenizer.eos_token or ""
        self.eos_id = tokenizer.eos_token_id

    @classmethod
    def of(cls, tokenizer, role: str) -> Optional["ChatTurn"]:
        """The turn for --agent.observation_turn `role`; None (observations raw) for raw or a tokenizer without a
        chat template. Raises ValueError for a template that cannot append the turn."""
        if role == "raw" or not getattr(tokenizer, "chat_template", None):
            return None
        return cls(tokenizer, role)

    def text(self, observation: str, action_ids: list) -> str:
        close = self.close
        if action_ids and action_ids[-1] == self.eos_id and close.startswith(self.eos_text):
            close = close[len(self.eos_text):]
        return close + self.open + observation + self.after


async def _agent_step(agent, ep: Episode, state: str, action: str, label, step_timeout: float):
    """The agent's step on `action`: (its result, the reward summed over the turns, the score), or None with
    ep.error set and the episode's reward 0 when the step raised, timed out or gave a reward that is not a number
    (the user's code: contained, counted, and the run goes on)."""
    try:
        result = await agent.step(state, action, label, step_timeout)
        reward = check_reward(ep.raw_reward + check_reward(result.reward, f"turn {ep.turns} reward"),
                              f"the reward summed over {ep.turns} turns")
        # As OpenRLHF: the last step's score if it gives one, else the reward so far.
        score = reward if result.score is None else check_reward(result.score, f"turn {ep.turns} score")
        return result, reward, score
    except RewardTimeout as e:  # the step's reward call (e.g. the built-in math-verify) ran out of time
        ep.error = ("reward_timeout", f"{type(e).__name__}: {e}")
    except RewardError as e:
        ep.error = ("reward_error", f"{type(e).__name__}: {e}")
    except (asyncio.TimeoutError, TimeoutError):
        ep.error = ("timeout", f"agent step timed out after {step_timeout:g} s")
    except Exception as e:
        ep.error = ("error", f"{type(e).__name__}: {e}")
    ep.score = ep.raw_reward = 0.0
    return None


async def run_episode(generate, agent, tokenizer, prompt_ids: list, label, sampling: dict, budget: int,
                      max_steps: int, step_timeout: float, request_id: str, chat_turn: Optional[ChatTurn] = None
                      ) -> Episode:
    """generate(prompt_ids, sampling, request_id) -> {"response_ids", "logprobs", "token_versions", "finish_reason"}.
    budget: response tokens (the model's and the observations') an episode may use in all.
    A step's sampling_params override `sampling` key by key from the next turn on; max_tokens is capped by the budget.
    chat_turn: observations become turns of the chat template (None: appended raw, as the agent wrote them)."""
    ep = Episode(request_id, list(prompt_ids), raw_reward=0.0)
    state = tokenizer.decode(prompt_ids)
    while True:
        remaining = budget - len(ep.response_ids)
        if remaining <= 0:
            ep.finish_reason = "length"
            break
        max_tokens = min(sampling.get("max_tokens", remaining), remaining)
        out = await generate(ep.prompt_ids + ep.response_ids,
                             {**seeded(sampling, "turn", ep.turns), "max_tokens": max_tokens}, f"{request_id}-t{ep.turns}")
        _append_action(ep, out)
        if out["finish_reason"] == "abort":
            ep.aborted = True
            break
        action = tokenizer.decode(out["response_ids"], skip_special_tokens=True)
        stepped = await _agent_step(agent, ep, state, action, label, step_timeout)
        if stepped is None:
            break
        result, ep.raw_reward, ep.score = stepped
        ep.extra_info = result.extra_info
        if result.sampling_params:
            sampling = {**sampling, **result.sampling_params}
        if result.done or ep.turns >= max_steps:
            break
        prefix = state + action
        if not result.next_state.startswith(prefix):
            ep.error = ("error", "AgentStepError: next_state must be state + action + observation")
            ep.score = ep.raw_reward = 0.0
            break
        remaining = budget - len(ep.response_ids)
        text = result.next_state[len(prefix) : len(prefix) + remaining * OBSERVATION_CHARS_PER_TOKEN]
        if chat_turn is not None:
            text = chat_turn.text(text, out["response_ids"])
        observation = tokenizer.encode(text, add_special_tokens=False)[:remaining]
        ep.response_ids += observation
        ep.logprobs += [0.0] * len(observation)
        ep.action_mask += [0] * len(observation)
        ep.token_versions += ep.token_versions[-1:] * len(observation)
        state = result.next_state
    return ep


def sampled_logprobs(completion) -> list:
    """The log-prob of each sampled token: vLLM's flat arrays as they are when they hold one entry per token
    (logprobs=0, flat_logprobs), else read token by token."""
    logprobs = completion.logprobs
    if logprobs is None:
        return []
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and len(flat) == len(completion.token_ids):
        return list(flat)
    return [entry[tok].logprob for tok, entry in zip(completion.token_ids, logprobs)]


@dataclass
class GeneratedTurn:
    """What vLLM gave an executor in one call: the behaviour policy's record of the turn."""
    finish_reason: Optional[str]
    versions: list
    token_ids: list
    logprobs: list


def behaviour_logprobs(tokens: list, ranges: list, calls: list, start: int, given) -> list:
    """The rollout log-prob of every response token (observations 0.0): the executor's own (`rollout_log_probs`) when
    it returned one per token, else the engine's record of each turn, which holds exactly when the executor kept the
    tokens vLLM generated. Raises ValueError when neither can be had: a 0.0 in their place would give TIS and ICEPOP
    the wrong weights without a word."""
    if given is not None and len(given) == len(tokens):
        return [float(x) for x in given[start:]]
    logprobs = [0.0] * (len(tokens) - start)
    for (a, b), call in zip(ranges, calls):
        if tokens[a:b] != call.token_ids[: b - a] or len(call.logprobs) < b - a:
            raise ValueError(f"the executor returned {'no' if given is None else len(given)} rollout_log_probs for "
                             f"{len(tokens)} tokens, and its action {a}:{b} is not the tokens vLLM generated; return "
                             "rollout_log_probs as OpenRLHF's MultiTurnAgentExecutor does")
        logprobs[a - start : b - start] = call.logprobs[: b - a]
    return logprobs


class EngineAdapter:
    """What an OpenRLHF AgentExecutor calls `llm_engine`: generate(prompt_token_ids, sampling_params) returning
    vLLM's RequestOutput, routed through the engine actor's request path (semaphore, load, abort). A call from
    another event loop (OpenRLHF's OpenAI-server executor serves its app with uvicorn in a thread of its own) is run
    on the engine's loop."""

    def __init__(self, request, request_id: str, seed: Optional[int] = None):
        self._request, self._request_id, self.calls, self._seed = request, request_id, [], seed
        self._loop = asyncio.get_running_loop()

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None, **kwargs):
        if asyncio.get_running_loop() is not self._loop:
            future = asyncio.run_coroutine_threadsafe(self.generate(prompt_token_ids, sampling_params), self._loop)
            return await asyncio.wrap_future(future)
        sampling_params.logprobs = 0 if sampling_params.logprobs is None else sampling_params.logprobs
        if self._seed is not None:  # the executor's params may be one object for every turn: each turn's seed apart
            sampling_params = sampling_params.clone()
            sampling_params.seed = derive_seed(self._seed, "turn", len(self.calls))
        output, versions = await self._request(list(prompt_token_ids), sampling_params,
                                               f"{self._request_id}-t{len(self.calls)}")
        completion = output.outputs[0]
        logprobs = sampled_logprobs(completion)
        self.calls.append(GeneratedTurn(completion.finish_reason, versions, list(completion.token_ids), logprobs))
        if completion.finish_reason == "abort":
            raise EpisodeAborted(self._request_id)
        return output


async def run_executor_episode(request, agent, tokenizer, prompt_ids: list, label, sampling_params,
                               budget: int, request_id: str, version: int = 0) -> Episode:
    """An OpenRLHF 0.11 AgentExecutor episode, converted to this project's episode record. The model's tokens are
    the executor's action ranges. Their weight versions are the engine's record of each call where the calls came
    through this episode's engine adapter; an executor that keeps the adapter of its first episode for all (OpenRLHF's
    OpenAI-server executor starts its server once) gives the others' tokens `version`, the engine's at the start."""
    ep = Episode(request_id, list(prompt_ids))
    engine = EngineAdapter(request, request_id, getattr(sampling_params, "seed", None))
    prompt = tokenizer.decode(prompt_ids)
    try:
        out = await agent.executor.execute(prompt, label, sampling_params, len(prompt_ids) + budget, tokenizer, engine)
    except EpisodeAborted:
        ep.aborted, ep.finish_reason, ep.turns = True, "abort", len(engine.calls)
        return ep
    except Exception as e:
        ep.error, ep.turns = ("error", f"{type(e).__name__}: {e}"), len(engine.calls)
        return ep
    tokens, ranges = list(out["observation_tokens"]), [tuple(r) for r in out["action_ranges"]]
    start = ranges[0][0] if ranges else len(tokens)
    try:
        logprobs = behaviour_logprobs(tokens, ranges, engine.calls, start, out.get("rollout_log_probs"))
    except ValueError as e:
        ep.error, ep.turns = ("error", f"MissingLogprobs: {e}"), len(engine.calls)
        return ep
    mask = [0] * (len(tokens) - start)
    versions = [version] * (len(tokens) - start)
    for a, b in ranges:
        mask[a - start : b - start] = [1] * (b - a)
    for (a, b), call in zip(ranges, engine.calls if len(engine.calls) == len(ranges) else ()):
        versions[a - start : b - start] = (call.versions + call.versions[-1:] * (b - a))[: b - a]
    for i in range(1, len(versions)):  # observation tokens take the version of the action before them
        if not mask[i]:
            versions[i] = versions[i - 1]
    reward, score, error = out.get("reward"), out.get("scores"), None
    try:  # no reward: the executor left it to a reward source, 0 until then
        reward = 0.0 if reward is None else check_reward(reward, "the executor's reward")
        score = reward if score is None else check_reward(score, "the executor's score")
    except RewardError as e:
        reward, score, error = 0.0, 0.0, ("reward_error", f"{type(e).__name__}: {e}")
    return Episode(request_id, tokens[:start], response_ids=tokens[start:], logprobs=logprobs,
                   action_mask=mask, token_versions=versions, turns=len(ranges),
                   finish_reason="length" if out.get("truncated") else (
                       engine.calls[-1].finish_reason if engine.calls else "stop"),
                   score=score, raw_reward=reward, error=error, extra_info=dict(out.get("extra_logs") or {}))
