"""Runs inside each vLLM worker process (vLLM's worker_extension_cls). Importing it registers this project's
weight-transfer engine (weight_transfer.py) with vLLM's factory in the worker, before the worker builds the engine
its `weight_transfer_config` names; the weights then come through vLLM's own update API."""

from openrlhf_async.rollout.weight_transfer import register

register()


class WeightReceiver:
    def read_weight(self, name: str) -> list:
        """A parameter as vLLM holds it (tests compare it with the trainer's)."""
        return dict(self.model_runner.model.named_parameters())[name].detach().float().cpu().tolist()
