"""LLMRayActorAsync: one vLLM engine (AsyncLLM) inside a Ray actor.

It runs each prompt's n agent episodes concurrently under an asyncio semaphore, scores them inline, and
supports abort by request id or by group, pause/resume and receiving weights from the trainer."""

import asyncio
import os

from openrlhf_async.utils.ray_utils import get_all


class LLMRayActorAsync:
    def __init__(self, model_path: str, engine_index: int, *, max_model_len: int, dtype: str, seed: int,
                 tensor_parallel_size: int = 1, enforce_eager: bool = True, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_concurrency: int = 256, agent_path: str = "", agent_workers: int = 0,
                 agent_max_steps: int = 1, agent_step_timeout: float = 30.0, reward: dict, reward_workers: int):
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from openrlhf_async.agent import load_agent
        from openrlhf_async.reward.math_verify_reward import configure_math_verify
        from openrlhf_async.reward.sources import make_reward
        from openrlhf_async.utils.timeline import Timeline

        self.timeline = Timeline(f"engine {engine_index}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        args = AsyncEngineArgs(
            model=model_path,
            dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
            seed=seed + engine_index,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="ray" if tensor_parallel_size > 1 else None,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled from
            worker_extension_cls="openrlhf_async.rollout.weight_receiver.WeightReceiver",
            disable_log_stats=True,
        )
        self.engine = AsyncLLM.from_engine_args(args)
        # OPENRLHF_ASYNC_NUM_TASKS, as in OpenRLHF, overrides the number of requests in flight per engine.
        self.semaphore = asyncio.Semaphore(int(os.environ.get("OPENRLHF_ASYNC_NUM_TASKS", max_concurrency)))
        self.in_flight: dict = {}  # request id -> group id
        self.groups: dict = {}  # group id -> request ids in flight
        self.aborted_groups: set = set()
        self.weight_version = 0
        self.agent_workers = agent_workers
        self.agent_path = agent_path  # the run's own agent file ("": the built-in math agent)
        self.agents = {agent_path: load_agent(agent_path, agent_workers)}  # path -> agent, loaded once each
        self.agent_max_steps, self.agent_step_timeout = agent_max_steps, agent_step_timeout
        # The built-in math-verify reward (the default agent's) runs in this many processes of this engine.
        configure_math_verify(reward_workers, reward["timeout"], reward["max_concurrency"])
        self.reward = make_reward(**reward)  # None: the agent's own step rewards stand

    def ready(self) -> bool:
        return True

    def load(self) -> int:
        """Requests admitted and not yet finished."""
        return len(self.in_flight)

    def unfinished(self) -> dict:
        """Requests vLLM itself still tracks, and requests this actor has in flight."""
        return {"vllm": self.engine.output_processor.get_num_unfinished_requests(), "actor": len(self.in_flight)}

    def get_weight_version(self) -> int:
        return self.weight_version

    def take_spans(self) -> list:
        """Spans since the last call: "generate" while any request is in flight, "sync" while loading weights."""
        return self.timeline.take()

    async def _request(self, prompt_ids: list, params, request_id: str, group_id: str = ""):
        """One vLLM request under the semaphore: (final RequestOutput, the weight version of each token).
        A token's version is the one loaded when its output arrived: weights change only while generation is
        paused, and pausing delivers the outputs already computed first.
        Raises EpisodeAborted if its group was aborted before the request reached vLLM."""
        from openrlhf_async.rollout.episode import EpisodeAborted

        async with self.semaphore:
            if group_id in self.aborted_groups:
                raise EpisodeAborted(request_id)
            self.in_flight[request_id] = group_id
            self.timeline.begin("generate")
            self.groups.setdefault(group_id, set()).add(request_id)
            versions = []
            try:
                final = None
                async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id):
                    final = out
                    versions += [self.weight_version] * (len(out.outputs[0].token_ids) - len(versions))
            finally:
                self.in_flight.pop(request_id, None)
                if not self.in_flight:
                    self.timeline.end("generate")
                self.groups.get(group_id, set()).discard(request_id)
        return final, versions

    async def generate(self, prompt_ids: list, sampling: dict, request_id: str, group_id: str = "") -> dict:
        """One completion: token ids, per-token logprobs of the sampled tokens and weight versions, finish reason."""
        from vllm import SamplingParams

        from openrlhf_async.rollout.episode import EpisodeAborted

        try:
            final, versions = await self._request(prompt_ids, SamplingParams(logprobs=0, **sampling), request_id,
                                                  group_id)
        except EpisodeAborted:
            return {"request_id": request_id, "prompt_ids": list(prompt_ids), "response_ids": [], "logprobs": [],
                    "token_versions": [], "finish_reason": "abort"}
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [entry[tok].logprob for tok, entry in zip(token_ids, completion.logprobs or [])]
        return {
            "request_id": request_id,
            "prompt_ids": list(prompt_ids),
            "response_ids": token_ids,
            "logprobs": logprobs,
            "token_versions": versions[: len(token_ids)],
            "finish_reason": completion.finish_reason,
        }

    async def generate_group(self, prompt_ids: list, label, n: int, sampling: dict, group_id: str,
                             budget, agent_path: str = None, screen: int = 0, screen_eps: float = 1e-6) -> list:
        """A prompt's n agent episodes, run concurrently; each is scored by the agent the moment it ends.
        budget: response tokens per episode (the model's and the environment's), or a list of n budgets.
        agent_path: the agent file (None: the run's own); another one is loaded once, then kept.
        screen: run this many episodes first and the rest only if their scores vary (fewer than n come back
        when they do not; see episode.run_group); 0: all n at once."""
        from vllm import SamplingParams

        from openrlhf_async.agent import load_agent
        from openrlhf_async.rollout.episode import run_episode, run_executor_episode, run_group

        agent_path = self.agent_path if agent_path is None else agent_path
        if agent_path not in self.agents:
            self.agents[agent_path] = load_agent(agent_path, self.agent_workers)
        agent = self.agents[agent_path]
        budgets = list(budget) if isinstance(budget, (list, tuple)) else [budget] * n
        prompt_text = self.tokenizer.decode(prompt_ids) if self.reward is not None else None

        def episode(i: int):
            if agent.kind == "executor":
                ep = run_executor_episode(
                    lambda ids, params, rid: self._request(ids, params, rid, group_id), agent, self.tokenizer,
                    prompt_ids, label, SamplingParams(logprobs=0, **sampling), budgets[i], f"{group_id}-{i}")
            else:
                ep = run_episode(lambda ids, smp, rid: self.generate(ids, smp, rid, group_id), agent,
                                 self.tokenizer, prompt_ids, label, sampling, budgets[i], self.agent_max_steps,
                                 self.agent_step_timeout, f"{group_id}-{i}")
            return ep if self.reward is None else self._rescored(ep, prompt_text, label)

        self.groups.setdefault(group_id, set())
        try:
            return await run_group(episode, n, screen, screen_eps)
        finally:
            self.groups.pop(group_id, None)
            self.aborted_groups.discard(group_id)

    async def _rescored(self, episode, prompt_text: str, label) -> dict:
        """Run an episode, then score it with the run's reward source (reward_func file or service) on its whole
        text, as OpenRLHF does; the agent's own reward is kept in extra_info. A failed reward scores 0, counted."""
        from openrlhf_async.reward.sources import RewardTimeout

        ep = await episode
        if ep["aborted"] or ep["error"]:
            return ep
        query = self.tokenizer.decode(ep["prompt_ids"] + ep["response_ids"])
        try:
            (result,) = await self.reward.score([query], [prompt_text], [label])
        except Exception as e:  # the user's reward code or a remote service: contain it, count it
            kind = "reward_timeout" if isinstance(e, (RewardTimeout, asyncio.TimeoutError)) else "reward_error"
            ep.update(score=0.0, error=(kind, f"{type(e).__name__}: {e}"))
            return ep
        ep["extra_info"] = {**ep["extra_info"], **result["extra"], "agent_reward": ep["score"]}
        ep["score"] = result["reward"]
        return ep

    async def abort_groups(self, group_ids: list) -> int:
        """Stop these groups: no new request starts for them and vLLM aborts those running. Returns how many
        requests were aborted."""
        request_ids = []
        for group_id in group_ids:
            self.aborted_groups.add(group_id)  # also stops a group whose call has not started yet
            request_ids += list(self.groups.get(group_id, ()))
        if request_ids:
            await self.engine.abort(request_ids)
        return len(request_ids)

    async def abort(self, request_ids: list) -> None:
        await self.engine.abort(list(request_ids))

    async def pause(self, mode: str = "keep") -> None:
        await self.engine.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def init_weight_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str):
        await self.engine.collective_rpc("init_weight_sync_group", args=(host, port, rank_offset, world_size, backend))

    async def receive_weights(self, buckets: list, version: int, pause_mode: str = "wait") -> int:
        """Load weights broadcast by trainer rank 0 (the call blocks until every bucket arrived), with generation
        paused. pause_mode "wait" lets running requests finish on the old weights first; "keep" freezes them
        (partial rollout): their cached keys and values are dropped, so they continue wholly on the new weights,
        and the tokens they generate from here on carry the new version."""
        with self.timeline.span("sync"):
            await self.engine.pause_generation(mode=pause_mode, clear_cache=False)
            try:
                await self.engine.collective_rpc("receive_weights", args=(buckets,))
                await self.engine.reset_prefix_cache(reset_running_requests=True)
                self.weight_version = version
            finally:
                await self.engine.resume_generation()
        return version

    async def read_weight(self, name: str):
        import torch

        return torch.as_tensor((await self.engine.collective_rpc("read_weight", args=(name,)))[0])


def engine_env(cfg) -> dict:
    """Environment of an engine actor: small KV cache and quiet logs on CPU."""
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), "TOKENIZERS_PARALLELISM": "false",
           "OPENRLHF_ASYNC_SANDBOX": cfg.agent.sandbox}  # read by agent/sandbox.py in the engine and its workers
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.cpu_kvcache_space_gib)
    return env


def create_engines(cfg, model_path: str, wait: bool = True) -> list:
    import ray

    actor_cls = ray.remote(LLMRayActorAsync)
    engines = []
    for i in range(cfg.vllm.num_engines):
        # On CPU the engines take no Ray CPU slot: vLLM runs its own processes and a 2-core box must fit them all.
        resources = {"num_gpus": 1 if cfg.device == "cuda" and cfg.vllm.tensor_parallel_size == 1 else 0,
                     "num_cpus": 0}
        engines.append(
            actor_cls.options(**resources, runtime_env={"env_vars": engine_env(cfg)}).remote(
                model_path,
                i,
                max_model_len=cfg.data.max_len,
                dtype=cfg.dtype,
                seed=cfg.train.seed,
                tensor_parallel_size=cfg.vllm.tensor_parallel_size,
                enforce_eager=cfg.vllm.enforce_eager,
                gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
                max_num_seqs=cfg.vllm.max_num_seqs,
                max_concurrency=cfg.vllm.max_concurrency,
                agent_path=cfg.agent.func_path,
                agent_workers=cfg.agent.workers,
                agent_max_steps=cfg.agent.max_steps,
                agent_step_timeout=cfg.agent.step_timeout,
                reward=cfg.reward.source(),
                reward_workers=cfg.reward.workers,
            )
        )
    if wait:
        get_all([e.ready.remote() for e in engines])
    return engines
