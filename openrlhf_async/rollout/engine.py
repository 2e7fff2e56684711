"""LLMRayActorAsync: one vLLM engine (AsyncLLM) inside a Ray actor.

It generates each prompt's n samples concurrently under an asyncio semaphore, scores them inline, and
supports abort by request id, pause/resume and receiving weights from the trainer."""

import asyncio
import os

from openrlhf_async.utils.ray_utils import get_all


class LLMRayActorAsync:
    def __init__(self, model_path: str, engine_index: int, *, max_model_len: int, dtype: str, seed: int,
                 tensor_parallel_size: int = 1, enforce_eager: bool = True, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_concurrency: int = 256):
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

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
        self.semaphore = asyncio.Semaphore(max_concurrency)
        self.in_flight: set = set()
        self.weight_version = 0

    def ready(self) -> bool:
        return True

    def load(self) -> int:
        """Requests admitted and not yet finished."""
        return len(self.in_flight)

    def get_weight_version(self) -> int:
        return self.weight_version

    async def generate(self, prompt_ids: list, sampling: dict, request_id: str) -> dict:
        """One completion: token ids, per-token logprobs of the sampled tokens, finish reason, weight version."""
        from vllm import SamplingParams

        params = SamplingParams(logprobs=0, **sampling)
        async with self.semaphore:
            self.in_flight.add(request_id)
            version = self.weight_version
            try:
                final = None
                async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id):
                    final = out
            finally:
                self.in_flight.discard(request_id)
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [entry[tok].logprob for tok, entry in zip(token_ids, completion.logprobs or [])]
        return {
            "request_id": request_id,
            "prompt_ids": list(prompt_ids),
            "response_ids": token_ids,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "weight_version": version,
            "text": self.tokenizer.decode(token_ids, skip_special_tokens=True),
        }

    async def generate_group(self, prompt_ids: list, label: str, n: int, sampling: dict, group_id: str) -> list:
        """A prompt's n samples, generated concurrently and scored the moment each finishes."""
        from openrlhf_async.reward.math_verify_reward import math_reward

        async def sample(i):
            result = await self.generate(prompt_ids, sampling, f"{group_id}-{i}")
            result["reward"] = math_reward(result["text"], label)
            return result

        return list(await asyncio.gather(*(sample(i) for i in range(n))))

    async def abort(self, request_ids: list) -> None:
        await self.engine.abort(list(request_ids))

    async def pause(self, mode: str = "keep") -> None:
        await self.engine.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def init_weight_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str):
        await self.engine.collective_rpc("init_weight_sync_group", args=(host, port, rank_offset, world_size, backend))

    async def receive_weights(self, buckets: list, version: int) -> int:
        """Load weights broadcast by trainer rank 0 (the call blocks until every bucket arrived)."""
        await self.engine.collective_rpc("receive_weights", args=(buckets,))
        await self.engine.reset_prefix_cache()
        self.weight_version = version
        return version

    async def read_weight(self, name: str):
        import torch

        return torch.as_tensor((await self.engine.collective_rpc("read_weight", args=(name,)))[0])


def engine_env(cfg) -> dict:
    """Environment of an engine actor: small KV cache and quiet logs on CPU."""
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), "TOKENIZERS_PARALLELISM": "false"}
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
            )
        )
    if wait:
        get_all([e.ready.remote() for e in engines])
    return engines
