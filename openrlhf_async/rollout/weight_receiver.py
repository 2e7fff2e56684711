"""Runs inside each vLLM worker process (vLLM's worker_extension_cls): joins the weight-sync group and loads
the weights the trainer broadcasts."""

import math

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def unflatten(buffer: torch.Tensor, bucket: list):
    """Split a flat bucket into (name, tensor) views; bucket is [(name, dtype, shape), ...]."""
    offset = 0
    for name, _, shape in bucket:
        numel = math.prod(shape)
        yield name, buffer[offset : offset + numel].view(shape)
        offset += numel


class WeightReceiver:
    def init_weight_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        rank = rank_offset + self.rank  # self.rank: this worker's rank inside its engine (tensor parallel)
        self._weight_sync_group = stateless_init_torch_distributed_process_group(
            host, port, rank, world_size, backend=backend
        )

    def receive_weights(self, buckets: list):
        """Receive the broadcast buckets in order, streaming them into vLLM's weight loader."""

        def stream():
            for bucket in buckets:
                numel = sum(math.prod(shape) for _, _, shape in bucket)
                buffer = torch.empty(numel, dtype=DTYPES[bucket[0][1]], device=self.device)
                self._weight_sync_group.broadcast(buffer, root=0).wait()
                yield from unflatten(buffer, bucket)

        self.reload_weights(weights_iterator=stream())
        self._retie_word_embeddings()

    def read_weight(self, name: str) -> list:
        """A parameter as vLLM holds it (tests compare it with the trainer's)."""
        return dict(self.model_runner.model.named_parameters())[name].detach().float().cpu().tolist()

    def _retie_word_embeddings(self):
        # A tied lm_head gets no weights of its own in a reload, so nothing refreshes the copy the head's kernel
        # was prepared from (vLLM-CPU packs it after loading): re-tie it and prepare it again.
        model = self.model_runner.model
        config = getattr(model, "config", None)
        if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head") and hasattr(model, "model"):
            head, embed = model.lm_head, model.model.embed_tokens
            if head.weight is not embed.weight:
                head.weight = embed.weight
            head.quant_method.process_weights_after_loading(head)
